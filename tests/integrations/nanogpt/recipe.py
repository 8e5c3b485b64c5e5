"""README's nanoGPT recipe applied to ``train.py``.

The recipe block (``# readme-recipe: nanogpt``) lists groups of lines, each under a comment
quoting the ``train.py`` line it goes after. A quoted line is matched by its text up to the
first ``(`` (the fixture's CPU ``DDP(model)`` call matches nanoGPT's
``DDP(model, device_ids=[ddp_local_rank])``); the first line of ``train.py`` that starts with
it, stripped, gets the group after it, indentation kept.
"""

import re
from pathlib import Path

__all__ = ["recipe", "apply", "TRAIN"]

TRAIN = Path(__file__).with_name("train.py")
_BLOCK = re.compile(r"```python\n# readme-recipe: nanogpt\n(.*?)```", re.S)


def recipe(readme: Path) -> list[tuple[str, list[str]]]:
    """``[(quoted line, lines to add), ...]`` of README's nanoGPT block."""
    m = _BLOCK.search(readme.read_text())
    assert m, "README has no '# readme-recipe: nanogpt' block"
    groups: list[tuple[str, list[str]]] = []
    for line in m.group(1).splitlines():
        if line.startswith("# "):
            groups.append((line[2:], []))
        elif line.strip():
            assert groups, f"recipe line before any quoted anchor: {line!r}"
            groups[-1][1].append(line)
    return groups


def apply(groups, source: str, drop: str | None = None) -> str:
    """``source`` with each group inserted after its anchor; lines containing ``drop`` (and
    an ``if`` line whose body they were) are left out."""
    lines = source.splitlines()
    for quoted, add in groups:
        key = quoted.split("(", 1)[0].strip()
        at = next((i for i, l in enumerate(lines) if l.strip().startswith(key)), None)
        assert at is not None, f"train.py has no line starting with {key!r}"
        if drop is not None:
            kept = [l for l in add if drop not in l]
            add = [l for i, l in enumerate(kept) if not (l.strip().startswith("if ") and
                   (i + 1 == len(kept) or _indent(kept[i + 1]) <= _indent(l)))]
        lines[at + 1:at + 1] = add
    return "\n".join(lines) + "\n"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())

"""Every relative link in the user-facing docs resolves: files exist, and ``#anchors`` into a
markdown file name one of its headings.

Checked: README.md, docs/**/*.md, comms/ARCHITECTURE.md, csrc/README.md,
bench/results/README.md. Web links (``http(s)://``, ``mailto:``) are not fetched.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: ``[text](target)`` and ``![alt](target)``; target up to whitespace or ")"
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~)")


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "comms" / "ARCHITECTURE.md", ROOT / "csrc" / "README.md",
             ROOT / "bench" / "results" / "README.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    return files


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = re.sub(r"[`*_]", "", heading.strip().lower())
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    out, inside = set(), False
    for line in md.read_text().splitlines():
        if _FENCE.match(line):
            inside = not inside
        elif not inside and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


def links(md: Path) -> list[tuple[int, str]]:
    """``(line, target)`` of every link outside fenced code blocks."""
    out, inside = [], False
    for n, line in enumerate(md.read_text().splitlines(), 1):
        if _FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            out += [(n, m.group(1)) for m in _LINK.finditer(re.sub(r"`[^`]*`", "", line))]
    return out


def dead_links(md: Path) -> list[str]:
    """``"file:line: target (why)"`` for every relative link of ``md`` that does not resolve."""
    dead = []
    for n, target in links(md):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        where = f"{md.relative_to(ROOT) if md.is_relative_to(ROOT) else md}:{n}: {target}"
        if not dest.exists():
            dead.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            dead.append(f"{where} (no heading #{anchor})")
    return dead


@pytest.mark.parametrize("md", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(md):
    assert md.exists(), f"{md} is missing"
    assert dead_links(md) == []


def test_a_dead_link_is_caught(tmp_path):
    (tmp_path / "there.md").write_text("# A heading\n")
    md = tmp_path / "doc.md"
    md.write_text("[ok](there.md) [ok](there.md#a-heading) [web](https://example.org/x)\n"
                  "[gone](missing.md) ![img](pics/none.png) [bad anchor](there.md#nope)\n"
                  "```\n[in code](ignored.md)\n```\n")
    dead = dead_links(md)
    assert [d.split(": ", 1)[1] for d in dead] == [
        "missing.md (no such file)", "pics/none.png (no such file)", "there.md#nope (no heading #nope)"]

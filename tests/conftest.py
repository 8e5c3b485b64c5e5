import os
import sys

# pytest runs with --import-mode=importlib (test files in different folders may share a
# basename), so put the project root (comms/, compressors/), tests/ (for `dist.ranks` etc.)
# and the folders whose helper modules tests import by plain name on the path ourselves
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
for p in (*(os.path.join(TESTS, d) for d in ("unit", "gpu", "mpi", "netsim", "emu")), TESTS, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ.setdefault("PYTHONPATH", ROOT)


# markers whose tests run only when selected with -m: longrun (500-step soak; CI's second
# pytest call selects it) and stuck_matrix (every algorithm x phase x stop/kill, minutes)
OPT_IN = {"longrun": "longrun soak test: run with `pytest -m longrun` (CI does)",
          "stuck_matrix": "stuck-rank matrix: run with `pytest -m stuck_matrix` (bench/stuck_rank.py prints it as a table)"}


def pytest_collection_modifyitems(config, items):
    """Opt-in markers (:data:`OPT_IN`) run only when ``-m`` names them."""
    import pytest

    selected = config.getoption("-m") or ""
    for marker, why in OPT_IN.items():
        if marker in selected:
            continue
        skip = pytest.mark.skip(reason=why)
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)

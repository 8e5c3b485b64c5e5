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


def pytest_collection_modifyitems(config, items):
    """``longrun`` soak tests run only when asked for (``pytest -m longrun``, as CI does)."""
    import pytest

    if "longrun" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="longrun soak test: run with `pytest -m longrun` (CI does)")
    for item in items:
        if "longrun" in item.keywords:
            item.add_marker(skip)

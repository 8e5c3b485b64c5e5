"""The bench harness: the one implementation of launching, netsim, locks, tables and machine
facts that every script in ``bench/`` uses.

Importing it puts the repository root *first* on ``sys.path``: ``bench/`` (a script's
directory, ``sys.path[0]``) must never shadow the packages ``comms`` and ``compressors`` — a
module named like them in ``bench/`` once did. Scripts therefore import it before anything
of the project::

    import harness  # noqa: E402  (the repository root first on sys.path)
    from harness import launching, tables

Modules, one job each:

* :mod:`harness.locks`     ``/tmp/bench.lock`` and ``/tmp/netsim.lock`` (one bench / one netsim at a time);
* :mod:`harness.machine`   CPU model, cores, threads per rank, the ``Machine:`` line of results;
* :mod:`harness.tables`    text/markdown tables, CSV and text files, progress bars;
* :mod:`harness.netsim`    bring netsim hosts up, run rank processes in them, tear them down;
* :mod:`harness.launching` run a DDP bench's rank body under torchrun, MPI, self-spawn or netsim;
* :mod:`harness.hooks`     the hook configurations the DDP benches compare;
* :mod:`harness.wire`      bytes per step of a configuration (the ``wire_MB`` columns).
"""

from __future__ import annotations

import os
import sys

__all__ = ["ROOT", "RESULTS"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "bench", "results")

if sys.path[:1] != [ROOT]:
    while ROOT in sys.path:
        sys.path.remove(ROOT)
    sys.path.insert(0, ROOT)

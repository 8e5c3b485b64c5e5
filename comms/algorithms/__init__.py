"""Aggregation algorithms: one file each, registered by name in ``ALGORITHMS``.

An algorithm is a callable ``alg(comm, compressor, x, ctx, store) -> Future[(sum, own)]``:
``x`` is this rank's (already averaged-by-world, error-fed) flat bucket, ``sum`` the
aggregate every rank receives bit-identically, ``own`` this rank's decoded contribution for
error feedback, ``store`` a per-bucket dict the algorithm may keep tensors in (persisted
with the hook state). Each carries ``.family`` (the compressor family it needs) and
``.wire_bytes(compressor, numel, dtype, world)`` (bytes sent per rank).
"""

import logging

from .allreduce import allreduce
from .allgather import allgather
from .two_phase import two_phase
from .shared_scale import shared_scale

__all__ = ["ALGORITHMS", "register_algorithm", "get_algorithm", "allreduce", "allgather", "two_phase",
           "shared_scale"]

logger = logging.getLogger(__name__)

ALGORITHMS = {}


def register_algorithm(fn):
    ALGORITHMS[fn.name] = fn
    return fn


def get_algorithm(name: str):
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; known: {sorted(ALGORITHMS)}") from None


for _fn in (allreduce, allgather, two_phase, shared_scale):
    register_algorithm(_fn)

# hierarchical forms (hier_allreduce, ...) of the flat algorithms registered above; the auto
# planner also registers any added later (comms.algorithms.hierarchical.register_missing)
from .hierarchical import hierarchical_variants  # noqa: E402

for _h in hierarchical_variants(ALGORITHMS):
    register_algorithm(_h)

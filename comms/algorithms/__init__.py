"""Aggregation algorithms: one file each, one :class:`~comms.algorithms.base.Algorithm`
instance each, registered by name in ``ALGORITHMS``.

Adding an algorithm: write ``comms/algorithms/<name>.py`` with an ``Algorithm`` subclass
(collective, ``wire_bytes``, ``wire_ops``, ``cost``, ``flush_residual_``) and register its
instance with :func:`register_algorithm` (here, or from your own code before training);
its hierarchical form ``hier_<name>`` is derived by composition. The cost model, planner,
autotuner and hook loop over this registry and never name an algorithm.
"""

import logging

from .base import DENSE, Algorithm
from .allreduce import allreduce
from .allgather import allgather
from .two_phase import two_phase
from .shared_scale import shared_scale
from .hierarchical import Hierarchical

__all__ = ["ALGORITHMS", "Algorithm", "DENSE", "PREFERENCE", "default_algorithm", "register_algorithm",
           "get_algorithm", "allreduce",
           "allgather", "two_phase", "shared_scale", "Hierarchical"]

logger = logging.getLogger(__name__)

ALGORITHMS: dict[str, Algorithm] = {}


def register_algorithm(alg: Algorithm) -> Algorithm:
    """Register ``alg`` and, when it is flat, its hierarchical form ``hier_<name>``."""
    if not isinstance(alg, Algorithm):
        raise TypeError(f"register_algorithm needs an Algorithm instance, got {type(alg).__name__}")
    if not alg.name or alg.name == DENSE:
        raise ValueError(f"an algorithm needs a name other than {DENSE!r}, got {alg.name!r}")
    ALGORITHMS[alg.name] = alg
    if not alg.hierarchical:
        h = Hierarchical(alg)
        ALGORITHMS[h.name] = h
    return alg


#: the algorithm a compressor travels with when none is named: the first it supports (a linear
#: one keeps the cost independent of the world size)
PREFERENCE = ("allreduce", "allgather", "two_phase")


def default_algorithm(compressor) -> str:
    """The first of :data:`PREFERENCE` that ``compressor`` supports; raises naming it when none."""
    name = next((a for a in PREFERENCE if compressor.supports(a) and a in ALGORITHMS), None)
    if name is None:
        raise ValueError(f"compressor {compressor.spec()!r} supports none of the available "
                         f"algorithms {sorted(ALGORITHMS)}")
    return name


def get_algorithm(name: str) -> Algorithm:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; known: {sorted(ALGORITHMS)}") from None


# the built-ins: flat forms first, then their hierarchical forms (the planner's candidate order)
for _alg in (allreduce, allgather, two_phase, shared_scale):
    ALGORITHMS[_alg.name] = _alg
for _alg in (allreduce, allgather, two_phase, shared_scale):
    register_algorithm(_alg)

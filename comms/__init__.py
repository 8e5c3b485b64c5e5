"""commpress comms: how compressed gradients travel (backends, algorithms, DDP hooks).

Example::

    >>> import comms
    >>> state = comms.register(ddp_model, "topk:density=0.01")
    >>> print(state.report())
"""

import logging

from .transport.communicator import Communicator, TorchCommunicator
from .algorithms import ALGORITHMS, get_algorithm
from .ddp.state import BucketStats, CompressionState
from .ddp.hook import compression_hook, dense_allreduce
from .core.pairing import check_optimizer, take_over_momentum
from .ddp.registration import make_hook, register
from .core.replicas import ReplicaMismatchError, check_replicas
from .transport.errors import CollectiveTimeout

__all__ = [
    "Communicator", "TorchCommunicator", "ALGORITHMS", "get_algorithm", "BucketStats",
    "CompressionState", "compression_hook", "dense_allreduce", "make_hook", "register", "check_optimizer", "take_over_momentum",
]
__all__ += ["check_replicas", "ReplicaMismatchError", "CollectiveTimeout"]

from .cluster.topology import Topology, TieredCommunicator  # noqa: E402
from .tuning.cost_model import CostModel  # noqa: E402
from .tuning.planner import Planner  # noqa: E402
from .tuning.bucket_sizes import suggest_bucket_cap_mb, suggest_bucket_cap_mb_list  # noqa: E402

__all__ += ["Topology", "TieredCommunicator", "CostModel", "Planner", "suggest_bucket_cap_mb",
            "suggest_bucket_cap_mb_list"]

from . import fsdp  # noqa: E402  (comms.fsdp.register: FSDP2 / HSDP)

__all__ += ["fsdp"]

logger = logging.getLogger(__name__)

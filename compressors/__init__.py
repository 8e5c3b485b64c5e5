"""commpress compressors: what goes on the wire (pure tensor transforms, no communication).

Example::

    >>> import compressors
    >>> c = compressors.from_spec("topk:density=0.01")
    >>> c.families
    ('allgather', 'two_phase')
"""

import logging

from .base import FAMILIES, Compressor
from .context import ALIGNS, Context, check_align, check_chunk, check_density, check_input
from .memory import PayloadPool, Workspace, block_elems, chunk_pieces, fresh_empty, numpy_view
from .deferred import Deferred, SparseOwn, materialized, same_flat
from .scaled_codes import ScaledCodesDecoder
from .registry import REGISTRY, available, from_spec, get, parse_spec, register
from .error_feedback import ErrorFeedback
from .identity import Identity
from .fp16 import FP16
from .bf16 import BF16
from .topk import TopK
from .randomk import RandomK
from .qsgd import QSGD
from .sign import ScaledSign
from .powersgd import PowerSGD

__all__ = [
    "FAMILIES", "Compressor", "Context", "ALIGNS", "check_align", "check_chunk", "check_density",
    "check_input", "PayloadPool", "Workspace", "block_elems", "chunk_pieces", "fresh_empty",
    "numpy_view", "Deferred", "SparseOwn", "materialized", "same_flat", "ScaledCodesDecoder",
    "REGISTRY", "available", "from_spec", "get",
    "parse_spec", "register", "ErrorFeedback", "Identity", "FP16", "BF16", "TopK", "RandomK",
    "QSGD", "ScaledSign", "PowerSGD",
]

logger = logging.getLogger(__name__)

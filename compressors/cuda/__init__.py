"""GPU kernels for the compressors (``csrc/*.cu`` through CuPy), optional and lazy.

Nothing here imports CuPy at import time: :func:`available` answers False without CuPy, without
CUDA, or for CPU tensors, and the compressors then run their torch reference. Kernel outputs
are bit-identical to that reference (``tests/gpu``).

Example::

    >>> import compressors.cuda as ccuda
    >>> ccuda.available("cpu")
    False
"""

import logging

from .loader import available, kernel_files, source_root

__all__ = ["available", "kernel_files", "source_root"]

logger = logging.getLogger(__name__)

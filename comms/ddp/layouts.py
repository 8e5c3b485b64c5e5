"""Bucket layouts: which parameters a bucket holds, so residuals survive rebuilds and restarts.

Residuals and algorithm stores belong to a bucket *layout* (its parameters in order, keyed by
name once the model is bound). When DDP rebuilds its buckets each parameter's residual moves
with it to its new position (the algorithm store starts afresh). When a freshly started
process sees DDP's first-iteration buckets after ``load_state_dict``, each saved bucket is
cut out of the current one and compressed exactly as before, so a resumed run is bitwise
identical to an uninterrupted one.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

__all__ = ["LayoutTracker", "cut"]

logger = logging.getLogger(__name__)


def cut(keys: Sequence, t: torch.Tensor, sizes: dict) -> dict | None:
    """``{key: view}``: flat ``t`` laid out as the parameters ``keys`` in order, ``sizes[key]``
    elements each, cut into views of ``t``; ``None`` when ``keys`` is empty, a size is unknown
    or the sizes do not add up to ``t``."""
    if not keys or not all(k in sizes for k in keys) or sum(sizes[k] for k in keys) != t.numel():
        return None
    pieces, off = {}, 0
    for k in keys:
        pieces[k] = t[off: off + sizes[k]]
        off += sizes[k]
    return pieces


class LayoutTracker:
    """The known bucket layouts (persisted) and the residual pieces between two layouts.

    Attributes:
        layouts: bucket index -> tuple of parameter keys (saved in the hook state).
        restored: True from ``load_state_dict`` to the end of the next step.
    """

    __slots__ = ("layouts", "restored", "_loose", "_numels")

    def __init__(self):
        self.layouts: dict[int, tuple] = {}
        self.restored = False
        self._loose: dict = {}   # parameter key -> residual piece between two layouts
        self._numels: dict = {}  # parameter key -> numel

    def end_step(self) -> None:
        self.restored = False
        self._loose.clear()

    def plan(self, index: int, keys: Sequence, numels: Sequence[int], buf: torch.Tensor,
             residuals: dict, reset_bucket: Callable[[int], None],
             error_feedback: bool) -> list:
        """``[(sub_index, segments)]``: how to compress bucket ``index`` (parameters ``keys``
        of ``numels`` elements, flat buffer ``buf``) given the known layouts.

        ``segments`` is ``None`` for the whole bucket, else the ``(offset, numel)`` slices of
        ``buf`` that form saved bucket ``sub_index`` (first step after a restore). A new
        layout takes over the residuals (``residuals``: bucket -> tensor, updated in place)
        of the layouts it overlaps, moved to the parameters' new positions (``residuals`` may be a
        list of such dicts: residuals and velocities move alike); ``reset_bucket``
        clears a bucket's residual and store.
        """
        keys = tuple(keys)
        if self.layouts.get(index) == keys:
            return [(index, None)]
        kset = set(keys)
        if self.restored:
            covered = sorted(j for j, lay in self.layouts.items() if lay and set(lay) <= kset)
            if covered and set().union(*(self.layouts[j] for j in covered)) == kset \
                    and sum(numels) == buf.numel():
                offsets, off = {}, 0
                for k, n in zip(keys, numels):
                    offsets[k] = (off, n)
                    off += n
                logger.info("bucket %d holds saved buckets %s: compressing them as saved", index, covered)
                return [(j, [offsets[k] for k in self.layouts[j]]) for j in covered]
        # a new layout: cut the residuals (and momentum-correction velocities) of the layouts
        # it overlaps into per-parameter pieces (later buckets of this step may claim the
        # rest), then assemble this bucket's
        memories = residuals if isinstance(residuals, (list, tuple)) else (residuals,)
        sizes = self._numels
        sizes.update(zip(keys, numels))
        for j, lay in list(self.layouts.items()):
            if j == index or kset & set(lay):
                for m, mem in enumerate(memories):
                    pieces = cut(lay, mem[j], sizes) if mem.get(j) is not None else None
                    for k, piece in (pieces or {}).items():
                        self._loose[(m, k)] = piece
                del self.layouts[j]
                reset_bucket(j)
        reset_bucket(index)
        self.layouts[index] = keys
        for m, mem in enumerate(memories):
            if error_feedback and any((m, k) in self._loose for k in keys) and sum(numels) == buf.numel():
                r = torch.zeros_like(buf)
                off = 0
                for k, n in zip(keys, numels):
                    piece = self._loose.pop((m, k), None)
                    if piece is not None and piece.numel() == n and piece.dtype == buf.dtype:
                        r[off: off + n].copy_(piece)
                    off += n
                mem[index] = r
        return [(index, None)]

    def __getstate__(self):
        return {"layouts": self.layouts}

    def __setstate__(self, st):
        self.__init__()
        self.layouts = st.get("layouts", {})

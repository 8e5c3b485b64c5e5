"""``GradientState``: what every entry point keeps per flat gradient between steps.

A flat gradient is a DDP bucket or an FSDP/HSDP module's gradient; both states
(:class:`comms.ddp.state.CompressionState`, :class:`comms.fsdp.state.FSDPCompressionState`) are
this plus what their adapter needs. Per gradient index: the error-feedback residual and the
momentum-correction velocity (``memory``, a :class:`~comms.core.memory.LocalMemory`), the
algorithm's store, the call statistics, the route it ran last; and what decides the compressed
steps (the options, Adam's momentum space). The engine (:mod:`comms.core.engine`) reads and
writes exactly these.
"""

from __future__ import annotations

import torch

from compressors import Compressor

from .memory import LocalMemory
from .options import OptionsView, PipelineOptions

__all__ = ["GradientState"]


class GradientState(OptionsView):
    """Per-gradient memory and the compressed-step schedule (see the module docstring).

    Args:
        options: the validated :class:`~comms.core.options.PipelineOptions`.
    """

    __slots__ = ("options", "memory", "algo_store", "stats", "adam", "replica_guard", "routes",
                 "_nonfinite")

    #: attributes a pickled state leaves out (process groups, communicators, hooks on live
    #: objects); :meth:`_reset_transient` makes them anew
    _TRANSIENT = ("replica_guard", "adam", "routes")

    def __init__(self, options: PipelineOptions):
        self.options = options
        self.memory = LocalMemory()           # index -> residual, velocity, drain
        self.algo_store: dict[int, dict] = {}  # index -> the algorithm's store (persisted)
        self.stats: dict = {}                 # index -> BucketStats of its last call
        self.adam = None                      # comms.core.adam.FrozenVarianceAdam, set by register()
        self.replica_guard = None             # comms.core.replicas.ReplicaGuard, set by register()
        self.routes: dict[int, str] = {}      # index -> the route it ran last (transient)
        self._nonfinite = 0                   # flagged (index, step) calls: an int or a tensor

    # -- the compressed-step schedule -----------------------------------------------------
    def first_step(self, step: int) -> int:
        """The first compressed step: ``start_iter``, or later while Adam's variance settles."""
        return self.start_iter if self.adam is None else self.adam.start(step, self.start_iter)

    def compressor_for(self, step: int) -> Compressor:
        """The compressor of a compressed call at ``step``: the warm-up ramp from the first
        compressed step (in Adam's momentum space, from the freeze)."""
        return self.compressor_at(step - self.first_step(step) + self.start_iter)

    def store(self, index: int) -> dict:
        return self.algo_store.setdefault(index, {})

    def forget(self, index: int) -> None:
        """Drop gradient ``index``'s residual, velocity and algorithm store (a layout change, a
        non-finite call)."""
        self.memory.reset(index)
        self.algo_store.pop(index, None)

    # -- non-finite calls -----------------------------------------------------------------
    def reset_flagged_(self, index: int, flagged) -> None:
        """A non-finite call of gradient ``index``: its residual, velocity and store forgotten.
        ``flagged``: ``True`` (known on the host: dropped) or a 0-d bool tensor (no host read:
        zeroed where it is set)."""
        if isinstance(flagged, bool):
            if flagged:
                self.forget(index)
                self._nonfinite = self._nonfinite + 1
            return
        for t in (self.memory.residuals.get(index), self.memory.velocities.get(index)):
            if t is not None:
                t.masked_fill_(flagged, 0.0)
        for t in self.algo_store.get(index, {}).values():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.masked_fill_(flagged, 0.0)
        f = flagged.reshape(()).to(torch.int64)
        n = self._nonfinite
        self._nonfinite = f if isinstance(n, int) and n == 0 else (f + n if isinstance(n, int)
                                                                   else n.add(f.to(n.device)))

    @property
    def nonfinite_calls(self) -> int:
        """How many (gradient, step) calls were non-finite (reads the device when counted there)."""
        n = self._nonfinite
        return int(n.item()) if isinstance(n, torch.Tensor) else int(n)

    def wire_bytes_per_step(self) -> int:
        """Bytes this rank sent on its gradients' last calls (one step)."""
        return sum(s.wire_bytes for s in self.stats.values())

    def dense_bytes_per_step(self) -> int:
        """What those calls would have sent dense."""
        return sum(s.dense_bytes for s in self.stats.values())

    def residual_bytes(self) -> int:
        """Bytes of error-feedback memory this rank holds (residuals and algorithm stores)."""
        n = sum(r.numel() * r.element_size() for r in self.memory.residuals.values())
        return n + sum(t.numel() * t.element_size() for d in self.algo_store.values()
                       for t in d.values() if isinstance(t, torch.Tensor))

    # -- pickling (like torch's PowerSGDState: without process groups) -----------------------
    def _reset_transient(self) -> None:
        """Make the transient attributes anew (after construction and unpickling)."""
        self.replica_guard, self.adam, self.routes = None, None, {}

    def __getstate__(self):
        slots = [k for cls in type(self).__mro__ for k in getattr(cls, "__slots__", ())]
        held = {k: getattr(self, k) for k in slots if k != "__weakref__" and hasattr(self, k)}
        held |= getattr(self, "__dict__", {})
        return {k: v for k, v in held.items() if k not in self._TRANSIENT}

    def __setstate__(self, st):
        self._reset_transient()
        for k, v in st.items():
            setattr(self, k, v)

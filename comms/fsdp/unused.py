"""Parameters without a gradient under FSDP2/HSDP: trained exactly as plain FSDP2 trains them.

Plain FSDP2 leaves a parameter that got no gradient in a backward out of the reduce-scatter:
its gradient stays ``None`` and the optimizer skips it (AdamW's decay and momentum do not move
it). It requires every rank of the group to leave the same parameters out (the
reduce-scatters would not match otherwise). commpress keeps the layout of every module's
reduce-scatter fixed instead (``set_reduce_scatter_unused_params(True)``: zeros travel in an
unused parameter's place), because its per-module memory — residuals, velocities — is laid
out over that gradient; so, to train as plain FSDP2 does, :class:`UnusedParams`

* records, when FSDP's post-backward of a module starts, which of its parameters got no
  gradient in this backward (this rank's view: plain FSDP2's contract makes it everyone's);
* keeps the module's memory over those parameters untouched through the call (saved before,
  written back after: their residual and velocity survive the step) and writes exact zeros
  into the module's result there;
* drops their gradient again when backward ends (an autograd final callback, after FSDP has
  assigned every sharded gradient) — unless it held a gradient before this backward (an
  accumulation across backwards), which then stays as it was (``+ 0``).

A user who turned ``set_reduce_scatter_unused_params(True)`` on before :func:`comms.fsdp.register`
asked FSDP2 for zero gradients: that module is left as FSDP2 would leave it. Cost: nothing on
a step where every parameter got a gradient; otherwise one copy of the unused parameters'
memory, a few elementwise writes, one list walk after backward.
"""

from __future__ import annotations

import torch

__all__ = ["UnusedParams", "Shield"]


class Shield:
    """One call's protection of the unused parameters' regions (see the module docstring).

    ``spans``: ``(offset, numel)`` of each unused parameter inside one shard-sized chunk;
    ``chunks``: how many such chunks the call's flat gradient holds (FSDP's reduce-scatter
    input: the shard group's size; HSDP's shard: 1)."""

    def __init__(self, memory, index: int, spans: list[tuple[int, int]], chunk: int, chunks: int):
        self.spans, self.chunk, self.chunks = spans, chunk, chunks
        self._saved = []
        for store in (memory.residuals, memory.velocities):
            t = store.get(index)
            if t is not None and t.numel() == chunk * chunks:
                self._saved.append((t, [t[a:a + n].clone() for a, n in self._slices(chunks)]))

    def _slices(self, chunks: int):
        return [(j * self.chunk + off, n) for j in range(chunks) for off, n in self.spans]

    def restore_memory(self) -> None:
        """The saved residual and velocity regions written back (they survive the call)."""
        for t, parts in self._saved:
            for (a, n), part in zip(self._slices(self.chunks), parts):
                t[a:a + n].copy_(part)

    def zero_(self, result: torch.Tensor) -> None:
        """Exact zeros where the unused parameters sit in ``result`` (one chunk: the shard)."""
        chunks = result.numel() // self.chunk
        for a, n in self._slices(chunks):
            result[a:a + n].zero_()


class UnusedParams:
    """Which parameters of each module got no gradient in the current backward, and the
    after-backward drop of their gradients (see the module docstring). One per state."""

    def __init__(self):
        self.spans: dict[int, list[tuple[int, int]]] = {}  # module index -> unused spans
        self.dropped = 0  # gradients dropped so far (report)

    def track(self, state, index: int, group) -> None:
        """Wrap FSDP's post-backward of ``group`` (module ``index``) to record its unused
        parameters before FSDP reduce-scatters them as zeros."""
        post_backward = group.post_backward

        def recording_post_backward(*args, **kwargs):
            if group.reduce_grads:
                self._record(state, index, group)
            return post_backward(*args, **kwargs)

        group.post_backward = recording_post_backward

    def _record(self, state, index: int, group) -> None:
        spans, drop, off = [], [], 0
        for fp in group.fsdp_params:
            if not hasattr(fp, "_unsharded_param") or not fp.unsharded_param.requires_grad:
                continue  # FSDP leaves it out of the reduce-scatter: no place in the layout
            n = fp.padded_sharded_param_size.numel()
            if fp.unsharded_accumulated_grad is None and fp.unsharded_param.grad is None:
                spans.append((off, n))
                if fp.sharded_param.grad is None:
                    drop.append(fp.sharded_param)
            off += n
        if not spans:
            self.spans.pop(index, None)
            return
        self.spans[index] = spans
        if drop:
            state.backward_end.add(lambda: self._drop(index, drop))

    def _drop(self, index: int, params) -> None:
        self.spans.pop(index, None)
        for p in params:
            p.grad = None
        self.dropped += len(params)

    def shield(self, memory, index: int, chunk: int, chunks: int) -> Shield | None:
        """The protection of module ``index``'s current call, or ``None`` when every parameter
        got a gradient (the usual step: nothing to do)."""
        spans = self.spans.get(index)
        return None if not spans else Shield(memory, index, spans, chunk, chunks)

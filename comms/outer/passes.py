"""The outer sync's own passes over a fragment's parameters: the send (what this rank holds,
its pseudo-gradient) and the landing (the synced parameters' step, each parameter's move).

Each runs as one compiled pass per parameter (``csrc/cpu/codec.cpp``: ``cp_outer_sync_send``,
``cp_outer_sync_land``) for fp32 CPU tensors, else as torch operations — the twin that gives
the same bits (the oracle of ``tests/unit/test_outer_passes.py``). On the 25M MLP the torch
form took five passes of a 12.5M-element fragment where the compiled form takes two; the send
also takes this rank's share and the largest ``|d|``, which spares the engine its division and
its non-finite flag's passes (docs/design-notes.md, "Outer sync").

Layout: ``anchor`` (and ``d``, ``local``, ``avg``) are flat over the fragment's parameters in
order; parameter ``i`` of the fragment is the slice ``[off, off + numel)``.
"""

from __future__ import annotations

import ctypes

import torch

from compressors import cpu_kernels

__all__ = ["send_pass", "land_pass"]


def _compiled(*tensors: torch.Tensor):
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        return None
    return cpu_kernels.lib(*tensors)


def _slices(params: list[torch.Tensor]):
    off = 0
    for p in params:
        n = p.numel()
        yield p, off, n
        off += n


def send_pass(anchor: torch.Tensor, params: list[torch.Tensor], d: torch.Tensor,
              local: torch.Tensor | None, div: int = 1) -> int | None:
    """``d <- (anchor - params) / div`` (this rank's share of the pseudo-gradient) and, where
    ``local`` is given, ``local <- params``.

    Returns:
        The fp32 bits of the largest ``|d|`` written (NaN above inf: the engine's non-finite
        flag without another pass, :func:`comms.core.stages.nonfinite_flag`), or ``None``
        where the torch twin ran for some parameter.
    """
    amax: int | None = 0
    for p, off, n in _slices(params):
        x = p.detach()
        a, dd = anchor[off:off + n], d[off:off + n]
        ll = None if local is None else local[off:off + n]
        c = _compiled(*(t for t in (a, x, dd, ll) if t is not None))
        if c is not None:
            bits = ctypes.c_uint32(0)
            c.cp_outer_sync_send(a.data_ptr(), x.data_ptr(), dd.data_ptr(), 0 if ll is None else ll.data_ptr(),
                                 n, float(div), ctypes.addressof(bits), cpu_kernels.threads())
            amax = None if amax is None else max(amax, bits.value)
            continue
        amax = None
        if ll is not None:
            ll.copy_(x.reshape(-1))
        torch.sub(a, x.reshape(-1), out=dd)
        if div != 1:
            dd.div_(div)
    return amax


def land_pass(anchor: torch.Tensor, avg: torch.Tensor | None, local: torch.Tensor | None,
              params: list[torch.Tensor]) -> None:
    """Where ``avg`` is given, the plain average's step ``anchor <- anchor - avg`` (else the
    caller stepped ``anchor`` already); then each parameter ``p <- p + (anchor - local)``
    (``local``: what it held at the send) or ``p <- anchor`` (``local`` None). ``local`` is
    left as it was or overwritten (it is spent)."""
    for p, off, n in _slices(params):
        x = p.detach()
        a = anchor[off:off + n]
        v = None if avg is None else avg[off:off + n]
        ll = None if local is None else local[off:off + n]
        c = _compiled(*(t for t in (a, x, v, ll) if t is not None))
        if c is not None:
            c.cp_outer_sync_land(a.data_ptr(), 0 if v is None else v.data_ptr(),
                                 0 if ll is None else ll.data_ptr(), x.data_ptr(), n, cpu_kernels.threads())
            continue
        if v is not None:
            a.sub_(v)
        with torch.no_grad():
            if ll is None:
                x.copy_(a.view_as(x))
            else:
                x.add_(torch.sub(a, ll, out=ll).view_as(x))

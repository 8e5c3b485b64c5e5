"""``TopK``: keep the k largest-magnitude elements (values + int32 indices on the wire)."""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from .base import Compressor
from .deferred import SparseOwn
from .context import check_density, check_input
from .memory import fresh_empty, numpy_view
from .hashrng import stream_key, lowbias32_int
from . import cpu_kernels
from .cuda import dispatch as cuda_dispatch
from .registry import register

__all__ = ["TopK"]

logger = logging.getLogger(__name__)


_last_exact_path = 0  # which path the last compiled exact top-k took (tests): 1 sampled, 3 radix


@register("topk")
class TopK(Compressor):
    """Top-k sparsification by magnitude.

    Args:
        density: fraction of elements kept, in (0, 1]; ``k = ceil(density * numel)``.
        exact: ``True``: exactly the k largest magnitudes; with ties at the k-th magnitude,
            the lowest indices among the tied (magnitudes compare as ``|x|``'s bits, so NaN
            ranks above inf, as in ``torch.topk``); indices ascending. Without ties the kept
            set is ``torch.topk(x.abs(), k)``'s. CPU: the compiled kernel (csrc/cpu) estimates a
            threshold from a sample, gathers the candidates above it in one pass (a lower
            threshold when fewer than k), and selects among them; elsewhere, or without the
            kernel, ``torch.topk`` of ``(|x| bits << 32) | ~index``, which has no ties (the
            same payload bits). ``False`` estimates the k-th magnitude from a
            strided sample (DGC style), keeps the candidates above it, and trims them to at
            most k with a small top-k. The payload always has exactly k slots (unused slots
            are index 0, value 0 and decode to nothing), so sizes match on every rank.
        sample: sample size for ``exact=False`` as a fraction of numel.

    Payload: ``[values (k, input dtype), indices (k, int32)]``. Biased: use error feedback.
    """

    name = "topk"
    families = ("allgather", "two_phase")
    sparsifies = True
    # DGC's warm-up over 5 steps (the hook sends its 46% and 22% steps dense, then 10%, 4.6%,
    # 2.2%): on the momentum task (oddconv, 4 seeds) allgather 1.059 -> 1.047x dense's loss,
    # two_phase 1.091 -> 1.070
    default_warmup_steps = 5

    example_configs = ({"density": 0.05},)
    # the sampled threshold; lossless at density 1
    edge_configs = ({"density": 0.01}, {"density": 0.05, "exact": False, "sample": 0.02},
                    {"density": 1.0})

    def __init__(self, density: float = 0.01, exact: bool = True, sample: float = 0.01):
        self.density = check_density(density)
        if not isinstance(exact, bool):
            raise TypeError(f"exact must be a bool, got {exact!r}")
        self.exact = exact
        self.sample = check_density(sample)

    def warmup(self, fraction):
        """Density ``density ** fraction``: exponential ramp from dense to the target (DGC)."""
        return type(self)(**{**self.config(), "density": self.density ** float(fraction)})

    def config(self):
        cfg = {"density": self.density, "exact": self.exact}
        if not self.exact:
            cfg["sample"] = self.sample
        return cfg

    def k_for(self, numel: int) -> int:
        return max(1, min(numel, math.ceil(self.density * numel))) if numel else 0

    def wire_bytes(self, numel, dtype=torch.float32):
        return self.k_for(numel) * (dtype.itemsize + 4)

    def compress(self, x, ctx):
        check_input(x)
        # CUDA tensors take the csrc/ kernels when CuPy is there (same bits as this path)
        if x.is_cuda and (out := cuda_dispatch.topk_compress(self, x.detach(), ctx)) is not None:
            return out
        x = x.detach().reshape(-1)
        n = x.numel()
        k = self.k_for(n)
        if k == 0:
            return [x.new_empty(0), torch.empty(0, dtype=torch.int32, device=x.device)]
        if self.exact:
            idx, vals = self._exact(x, k)
            return [vals, idx]
        if k * 8 >= n:
            a = self.workspace().get("abs", n, x.dtype, x.device)
            idx = torch.topk(torch.abs(x, out=a), k, sorted=False).indices
            vals = x[idx]
        else:
            idx, vals = self._approx_indices(x, k, ctx)
        if idx.numel() < k:  # rare: the sampled threshold was too high; pad with no-ops
            pad = k - idx.numel()
            idx = torch.cat([idx, idx.new_zeros(pad)])
            vals = torch.cat([vals, vals.new_zeros(pad)])
        return [vals, idx.to(torch.int32)]

    def deferred_own(self, x, payload, ctx):
        """A :class:`~compressors.deferred.SparseOwn` for the exact top-k of a flat fp32/fp64
        bucket (distinct indices; the approximate path may pad with repeats), else None."""
        vals, idx = payload
        if not self.exact or x.is_cuda or x.dtype not in (torch.float32, torch.float64) or ctx.dtype != x.dtype:
            return None
        # the decode adds into zeros: 0 + v (a -0 value decodes to +0)
        return SparseOwn(x.reshape(-1), idx.long(), torch.zeros_like(vals, dtype=x.dtype).add_(vals))

    def _exact(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 indices ascending, values) of the exact top-k (ties: lowest indices)."""
        n = x.numel()
        dt = cpu_kernels.dtype_code(x.dtype)
        ck = cpu_kernels.lib(x)
        if ck is not None and dt is not None and x.is_contiguous() and n < (1 << 31):
            nth = cpu_kernels.threads()
            # per-thread candidate room; a thread never holds more than its range
            cap = min(2 * k + 65536, n // max(1, min(nth, -(-n // 65536))) + 65536, n)
            ws = self.workspace()
            cidx = ws.get("cand.idx", nth * cap, torch.int32, x.device)
            craw = ws.get("cand.raw", nth * cap, torch.int32, x.device)
            comp = ws.get("cand.comp", nth * cap, torch.int64, x.device)
            idx = torch.empty(k, dtype=torch.int32)
            vals = torch.empty(k, dtype=x.dtype)
            global _last_exact_path
            _last_exact_path = ck.cp_topk_exact(x.data_ptr(), dt, n, k, idx.data_ptr(),
                                                vals.data_ptr(), cidx.data_ptr(), craw.data_ptr(),
                                                comp.data_ptr(), cap, nth)
            return idx, vals
        # any device, no host sync: the composite key has no ties, so torch.topk's set is
        # exactly "largest |x| bits, then lowest index"
        if x.element_size() == 8:  # no room for the index beside a 63-bit key: a stable sort
            key = x.view(torch.int64).bitwise_and(0x7FFFFFFFFFFFFFFF)
            sel = torch.sort(key, descending=True, stable=True).indices[:k]
            idx = torch.sort(sel).values
            return idx.to(torch.int32), x[idx]
        if x.element_size() == 4:
            key = x.view(torch.int32).bitwise_and(0x7FFFFFFF).to(torch.int64)
        else:
            key = x.view(torch.int16).to(torch.int64).bitwise_and(0x7FFF)
        ar = torch.arange(n, dtype=torch.int64, device=x.device)
        comp = key.bitwise_left_shift_(32).bitwise_or_(ar.neg_().add_(0xFFFFFFFF))
        sel = torch.topk(comp, k, sorted=False).indices
        idx = torch.sort(sel).values
        return idx.to(torch.int32), x[idx]

    def _approx_indices(self, x: torch.Tensor, k: int, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values) of at most k elements: the candidates above a sampled threshold,
        trimmed to the k largest by a small top-k."""
        n = x.numel()
        s = max(min(n, 2048), math.ceil(self.sample * n))
        stride = max(1, n // s)
        offset = lowbias32_int(stream_key(ctx.seed, ctx.step, ctx.bucket, ctx.rank)) % stride
        sample = x[offset::stride].abs()
        # aim 10% above k so the trim below usually has enough candidates
        ks = min(sample.numel(), max(1, math.ceil(1.1 * k * sample.numel() / n)))
        thr = torch.topk(sample, ks, sorted=False).values.min()
        cand, cand_abs, cand_x = self._candidates(x, thr)
        if cand.numel() > k:
            sel = torch.topk(cand_abs, k, sorted=False).indices
            cand, cand_x = cand[sel], cand_x[sel]
        return cand, cand_x

    def _candidates(self, x: torch.Tensor, thr: torch.Tensor):
        """Ascending indices ``i`` with ``|x[i]| >= thr`` (``nonzero(x.abs() >= thr)``), with
        their ``|x[i]|`` and ``x[i]``.

        CPU: block-wise in numpy on the same memory (|x|, the mask and its nonzero stay in
        cache, and numpy's compare/nonzero are much faster than torch's there; nonzero has to
        size its output, a host sync that costs nothing on CPU). Values are gathered from the
        cached block rather than from x afterwards (random reads of a 100 MB tensor).
        Elsewhere (and for bfloat16, which numpy lacks): whole-tensor torch ops, one sync.
        """
        n = x.numel()
        dev = x.device
        ws = self.workspace()
        xn = numpy_view(x)
        if xn is None:
            a = torch.abs(x, out=ws.get("abs", n, x.dtype, dev))
            cand = torch.nonzero(a >= thr).squeeze(1)
            return cand, a[cand], x[cand]
        B = self.block_for(dev)
        cap = min(B, n)
        a = numpy_view(ws.get("abs", cap, x.dtype, dev))
        mask = numpy_view(ws.get("mask", cap, torch.bool, dev))
        t = xn.dtype.type(thr.item())  # exact: thr is one of the |x| values
        idx_parts, abs_parts, x_parts = [], [], []
        for b0 in range(0, n, B):
            b1 = min(n, b0 + B)
            L = b1 - b0
            ab, mb, xb = a[:L], mask[:L], xn[b0:b1]
            np.abs(xb, out=ab)
            np.greater_equal(ab, t, out=mb)
            idx = np.flatnonzero(mb)
            abs_parts.append(ab[idx])
            x_parts.append(xb[idx])
            idx_parts.append(idx + b0 if b0 else idx)
        cat = np.concatenate
        return (torch.from_numpy(cat(idx_parts).astype(np.int64, copy=False)),
                torch.from_numpy(cat(abs_parts)), torch.from_numpy(cat(x_parts)))

    def decompress(self, payload, ctx):
        out = fresh_empty(ctx.numel, ctx.dtype, payload[0].device).zero_()
        return self.decompress_add_(payload, ctx, out)

    def decompress_into(self, payload, ctx, out):
        if out.dtype != ctx.dtype or not out.is_contiguous():
            return super().decompress_into(payload, ctx, out)
        self.decompress_add_(payload, ctx, out.view(-1).zero_())
        return out

    def decompress_add_(self, payload, ctx, acc):
        if acc.is_cuda and (out := cuda_dispatch.topk_decompress_add_(self, payload, ctx, acc)) is not None:
            return out
        vals, idx = payload
        return acc.index_add_(0, idx.long(), vals.to(acc.dtype))

    def error_bound(self, x):
        # dropped elements are below the k-th magnitude; kept ones are exact
        return x.abs()

"""Straightforward reference implementations: the oracles the fast paths must match bit for bit.

These are the original whole-tensor versions of the compressors' encoders (one torch op per
step of the documented formats), a bit-by-bit packer, and an independent numpy uint32 version
of the hash RNG. The CUDA kernels in csrc/ are held to the same bits.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from compressors.hashrng import lowbias32_int, stream_key

# -- hash RNG (numpy uint32: wrapping multiplies, logical shifts) ---------------------------


def np_lowbias32(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint32, copy=True)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def np_stream_key(seed: int, step: int, bucket: int, rank: int) -> int:
    def mix(v: int) -> int:
        return int(np_lowbias32(np.array([v & 0xFFFFFFFF], dtype=np.uint64).astype(np.uint32))[0])

    k = mix(seed ^ 0x5BD1E995)
    k = mix(k ^ (step & 0xFFFFFFFF))
    k = mix(k ^ ((step >> 32) & 0xFFFFFFFF) ^ 0x27D4EB2F)
    k = mix(k ^ (bucket & 0xFFFFFFFF))
    k = mix(k ^ ((rank + 1) & 0xFFFFFFFF))
    return k


def np_hash(start: int, n: int, key: int) -> np.ndarray:
    i = np.arange(start, start + n, dtype=np.uint64).astype(np.uint32)
    return np_lowbias32(i ^ np.uint32(key & 0xFFFFFFFF))


def np_uniform(start: int, n: int, key: int) -> np.ndarray:
    """u = fl(fl(float(h >> 8)) + 0.5) * 2**-24 in float32, one rounded op at a time."""
    h24 = (np_hash(start, n, key) >> np.uint32(8)).astype(np.float32)
    return (h24 + np.float32(0.5)) * np.float32(2.0 ** -24)


def lowbias32_inverse(y: int) -> int:
    """x with lowbias32(x) == y (each step is a bijection on uint32)."""
    m = 0xFFFFFFFF
    y ^= y >> 16
    y = (y * pow(0x846CA68B, -1, 1 << 32)) & m
    y ^= (y >> 15) ^ (y >> 30)
    y = (y * pow(0x7FEB352D, -1, 1 << 32)) & m
    y ^= y >> 16
    return y


# -- bit packing ---------------------------------------------------------------------------


def ref_pack(codes: list[int], bits: int) -> bytes:
    out = bytearray((len(codes) * bits + 7) // 8)
    for i, c in enumerate(codes):
        pos = i * bits
        out[pos // 8] |= c << (pos % 8)
    return bytes(out)


# -- QSGD (the original whole-tensor encoder/decoder) ---------------------------------------


def _chunk_absmax(x: torch.Tensor, chunk: int) -> torch.Tensor:
    n = x.numel()
    nfull = n // chunk
    nch = -(-n // chunk)
    out = torch.empty(nch, dtype=torch.float32, device=x.device)
    if nfull:
        torch.amax(x[: nfull * chunk].view(nfull, chunk).abs(), dim=1, out=out[:nfull])
    if nch > nfull:
        out[nfull] = x[nfull * chunk:].abs().max()
    return out


def _bitloop_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The original shift-or packer (column by column)."""
    n = codes.numel()
    out = torch.zeros((n * bits + 7) // 8, dtype=torch.uint8)
    if bits == 8:
        return out.copy_(codes)
    per = 8 // bits
    full = n // per
    if full:
        body = codes[: full * per].view(full, per)
        acc = out[:full]
        acc.copy_(body[:, 0])
        for j in range(1, per):
            acc.bitwise_or_(body[:, j] << (j * bits))
    rem = n - full * per
    if rem:
        v = 0
        for j in range(rem):
            v |= int(codes[full * per + j]) << (j * bits)
        out[full] = v
    return out


def _bitloop_unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    out = torch.empty(n, dtype=torch.uint8)
    if bits == 8:
        return out.copy_(packed[:n])
    idx = torch.arange(n)
    byte = packed[(idx * bits) // 8].to(torch.int32)
    return ((byte >> ((idx * bits) % 8).to(torch.int32)) & ((1 << bits) - 1)).to(torch.uint8)


def qsgd_compress(x: torch.Tensor, bits: int, chunk: int, step=0, bucket=0, rank=0, seed=0):
    n = x.numel()
    xf = x.reshape(-1).float()
    M = (1 << bits) - 1
    half = torch.tensor(M * 0.5, dtype=torch.float32)
    s = _chunk_absmax(xf, chunk)
    r = torch.where(s > 0, half / s, torch.zeros_like(s))
    t = xf * r.repeat_interleave(chunk)[:n]
    t.add_(half)
    key = stream_key(seed, step, bucket, rank)
    u = torch.from_numpy(np_uniform(0, n, key))
    t.add_(u).floor_().clamp_(0, M)
    codes = t.to(torch.uint8)
    return [s, _bitloop_pack(codes, bits)]


def qsgd_decompress(payload, bits: int, chunk: int, n: int, dtype=torch.float32):
    s, packed = payload
    q = _bitloop_unpack(packed, bits, n).float()
    w = (2 * s) / float((1 << bits) - 1)
    out = q.mul_(w.repeat_interleave(chunk)[:n]).sub_(s.repeat_interleave(chunk)[:n])
    return out.to(dtype)


# -- scaled sign ---------------------------------------------------------------------------


def sign_compress(x: torch.Tensor, chunk: int):
    xf = x.reshape(-1).float()
    n = xf.numel()
    nfull = n // chunk
    nch = -(-n // chunk)
    s = torch.empty(nch, dtype=torch.float32)
    if nfull:
        torch.mean(xf[: nfull * chunk].view(nfull, chunk).abs(), dim=1, out=s[:nfull])
    if nch > nfull:
        s[nfull] = xf[nfull * chunk:].abs().mean()
    return [s, _bitloop_pack((xf >= 0).to(torch.uint8), 1)]


def sign_decompress(payload, chunk: int, n: int, dtype=torch.float32):
    s, packed = payload
    b = _bitloop_unpack(packed, 1, n).float()
    return b.mul_(2).sub_(1).mul_(s.repeat_interleave(chunk)[:n]).to(dtype)


# -- top-k (exact and the sampled-threshold approximation) -----------------------------------


def topk_compress(x: torch.Tensor, density: float, exact: bool, sample: float,
                  step=0, bucket=0, rank=0, seed=0):
    x = x.reshape(-1)
    n = x.numel()
    k = max(1, min(n, math.ceil(density * n))) if n else 0
    if k == 0:
        return [x.new_empty(0), torch.empty(0, dtype=torch.int32)]
    a = x.abs()
    if exact or k * 8 >= n:
        idx = torch.topk(a, k, sorted=False).indices
    else:
        s = max(min(n, 2048), math.ceil(sample * n))
        stride = max(1, n // s)
        offset = lowbias32_int(stream_key(seed, step, bucket, rank)) % stride
        smp = a[offset::stride]
        ks = min(smp.numel(), max(1, math.ceil(1.1 * k * smp.numel() / n)))
        thr = torch.topk(smp, ks, sorted=False).values.min()
        idx = torch.nonzero(a >= thr).squeeze(1)
        if idx.numel() > k:
            idx = idx[torch.topk(a[idx], k, sorted=False).indices]
    vals = x[idx]
    if idx.numel() < k:
        pad = k - idx.numel()
        idx = torch.cat([idx, idx.new_zeros(pad)])
        vals = torch.cat([vals, vals.new_zeros(pad)])
    return [vals, idx.to(torch.int32)]


def topk_exact_compress(x: torch.Tensor, density: float):
    """Exact top-k contract: the k largest |x| compared as |x|'s bits (NaN above
    inf), ties at the k-th magnitude broken toward the lowest indices; indices ascending."""
    x = x.reshape(-1)
    n = x.numel()
    k = max(1, min(n, math.ceil(density * n))) if n else 0
    if k == 0:
        return [x.new_empty(0), torch.empty(0, dtype=torch.int32)]
    if x.element_size() == 8:
        key = x.view(torch.int64).numpy() & 0x7FFFFFFFFFFFFFFF
    elif x.element_size() == 4:
        key = x.view(torch.int32).numpy().astype(np.int64) & 0x7FFFFFFF
    else:
        key = x.view(torch.int16).numpy().astype(np.int64) & 0x7FFF
    order = np.lexsort((np.arange(n), -key))[:k]  # by -key, then index
    idx = torch.from_numpy(np.sort(order))
    return [x[idx], idx.to(torch.int32)]

"""Kernel bench: every csrc kernel against its roofline (the bytes it must move at the measured
device copy bandwidth), and the speed-up against torch ops (torch.topk, the torch reference
quantization, naive torch 8-bit).

Usage (one GPU)::

    python bench/kernels.py                       # 25M and 100M fp32 elements
    python bench/kernels.py --sizes 25e6 --reps 50 --json bench/results/kernels.json

Bytes counted per kernel are the bytes it must read plus write (payload, scales, outputs), the
bytes-per-element model stated in each kernel's comment in csrc/. ``roof_us`` is those bytes
over the bandwidth of ``dst.copy_(src)`` on fp32 of the same size (8 bytes per element moved),
measured in the same run: the time the kernel would take at copy speed; ``%copy`` is
``roof_us / time_us``. Times are CUDA-event medians after warm-up.

Targets (the ``target`` column: met / MISSED): qsgd quantize and dequantize, sign encode and
decode, shared-scale encode and decode >= 60 %copy; the two-phase owner step >= 40 %copy;
approximate top-k 1% >= 2x faster than torch.topk, its scatter-add decode >= 30 %copy.

Without CUDA, CuPy or an NVRTC library it prints why and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import platform
import sys

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # for harness; last, so that
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/*.py never shadow packages
import harness  # noqa: E402  (puts the repository root first on sys.path)

ROOT = harness.ROOT

import torch  # noqa: E402

__all__ = ["main", "run"]

logger = logging.getLogger(__name__)


def _time_us_cuda(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


def run(sizes, reps: int, device=None, timer=None):
    """The rows of every kernel at every size. ``device`` (default cuda:0) and ``timer``
    (default CUDA events: ``timer(fn, reps, warmup=...) -> microseconds``) exist so that the
    emulator suite can run this script's code on the CPU before a GPU ever sees it."""
    import compressors
    tp = importlib.import_module("comms.algorithms.two_phase")  # the package exports an instance of this name
    from comms.algorithms.wire import to_bytes
    from compressors.cuda import dispatch, kernels
    from comms.algorithms import cuda_kernels as alg_cuda
    from compressors.hashrng import stream_key

    dev = torch.device("cuda", 0) if device is None else torch.device(device)
    _time_us = timer or _time_us_cuda
    rows = []

    def row(name, n, us, nbytes, copy_gbs, torch_us=None, note="", pct=None, speedup=None):
        """One result; ``pct`` / ``speedup``: the target (%copy at least, or times torch)."""
        gbs = nbytes / (us * 1e-6) / 1e9
        roof_us = nbytes / (copy_gbs * 1e9) * 1e6 if copy_gbs else None
        r = {"kernel": name, "n": n, "time_us": round(us, 2), "bytes": nbytes,
             "bytes_per_elt": round(nbytes / n, 3), "roof_us": round(roof_us, 2) if roof_us else None,
             "GB/s": round(gbs, 1), "pct_copy": round(100 * gbs / copy_gbs, 1) if copy_gbs else None,
             "torch_us": round(torch_us, 1) if torch_us else None,
             "speedup": round(torch_us / us, 2) if torch_us else None, "target": None, "note": note}
        if pct is not None:
            r["target"] = f">={pct}%copy " + ("met" if r["pct_copy"] >= pct else "MISSED")
        elif speedup is not None:
            r["target"] = f">={speedup}x torch " + ("met" if (r["speedup"] or 0) >= speedup else "MISSED")
        rows.append(r)
        print(f"{name:<28} {n:>11} {r['bytes_per_elt']:>7.3f} {us:>10.1f} {(roof_us or 0):>9.1f} {r['pct_copy'] or 0:>7.1f} "
              f"{(r['torch_us'] or 0):>10.1f} {(r['speedup'] or 0):>7.2f}  {r['target'] or '':<22} {note}", flush=True)

    print(f"{'kernel':<28} {'n':>11} {'B/elt':>7} {'time_us':>10} {'roof_us':>9} {'%copy':>7} {'torch_us':>10} "
          f"{'speedup':>7}  {'target':<22} note")
    for n in sizes:
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(n, device=dev, generator=g)
        dst = torch.empty_like(x)
        copy_us = _time_us(lambda: dst.copy_(x), reps)
        copy_gbs = 8 * n / (copy_us * 1e-6) / 1e9
        row("copy fp32 (reference)", n, copy_us, 8 * n, copy_gbs)
        ctx = compressors.Context(numel=n, dtype=torch.float32, device=dev, step=1, bucket=0, rank=0, seed=0)
        key = stream_key(0, 1, 0, 0)

        for bits in (1, 2, 4, 8):
            q = compressors.QSGD(bits=bits, chunk=2048)
            nch = q.nchunks(n)
            pb = (n * bits + 7) // 8
            us = _time_us(lambda: kernels.qsgd_compress(x, bits, 2048, key), reps)
            os.environ["COMMPRESS_CUDA_KERNELS"] = "0"
            t_us = _time_us(lambda: q.compress(x, ctx), max(3, reps // 5), warmup=1)
            os.environ["COMMPRESS_CUDA_KERNELS"] = "1"
            row(f"qsgd quantize {bits}b", n, us, 4 * n + pb + 4 * nch, copy_gbs, t_us, "torch: reference path", pct=60)
            s, packed = kernels.qsgd_compress(x, bits, 2048, key)
            us = _time_us(lambda: kernels.qsgd_decompress(s, packed, bits, 2048, n, torch.float32), reps)
            os.environ["COMMPRESS_CUDA_KERNELS"] = "0"
            t_us = _time_us(lambda: q.decompress([s, packed], ctx), max(3, reps // 5), warmup=1)
            os.environ["COMMPRESS_CUDA_KERNELS"] = "1"
            row(f"qsgd dequantize {bits}b", n, us, pb + 4 * nch + 4 * n, copy_gbs, t_us, pct=60)
            acc = torch.zeros(n, device=dev)
            us = _time_us(lambda: kernels.qsgd_decompress(s, packed, bits, 2048, n, torch.float32, acc=acc), reps)
            row(f"qsgd dequantize-add {bits}b", n, us, pb + 4 * nch + 8 * n, copy_gbs, None, "acc += decode")
            if bits < 8:
                codes = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8, device=dev)
                us = _time_us(lambda: kernels.pack(codes, bits), reps)
                row(f"pack {bits}b", n, us, n + pb, copy_gbs)
                us = _time_us(lambda: kernels.unpack(packed, bits, n), reps)
                row(f"unpack {bits}b", n, us, pb + n, copy_gbs)

        # 4 bits at its default chunk (256: one-warp blocks)
        q4 = compressors.QSGD(bits=4, chunk=256)
        pb4, nch4 = (n * 4 + 7) // 8, q4.nchunks(n)
        us = _time_us(lambda: kernels.qsgd_compress(x, 4, 256, key), reps)
        row("qsgd quantize 4b chunk 256", n, us, 4 * n + pb4 + 4 * nch4, copy_gbs, None, "default 4-bit chunk", pct=60)
        s4, p4 = kernels.qsgd_compress(x, 4, 256, key)
        us = _time_us(lambda: kernels.qsgd_decompress(s4, p4, 4, 256, n, torch.float32), reps)
        row("qsgd dequantize 4b chunk 256", n, us, pb4 + 4 * nch4 + 4 * n, copy_gbs, None, "", pct=60)

        # naive torch 8-bit stochastic quantization (the published baseline style)
        def naive8():  # one global scale, rand_like: what a plain torch port does
            s = x.abs().max()
            return (x / s * 127.5 + 127.5 + torch.rand_like(x)).floor_().clamp_(0, 255).to(torch.uint8)
        t_us = _time_us(naive8, max(3, reps // 5), warmup=1)
        us = _time_us(lambda: kernels.qsgd_compress(x, 8, 2048, key), reps)
        row("qsgd 8b vs naive torch", n, us, 4 * n + n + 4 * math.ceil(n / 2048), copy_gbs, t_us, "torch: naive rand_like")

        us = _time_us(lambda: kernels.sign_pack(x), reps)
        row("sign pack", n, us, 4 * n + (n + 7) // 8, copy_gbs, pct=60)
        sc = torch.ones(math.ceil(n / 2048), device=dev)
        sp = kernels.sign_pack(x)
        us = _time_us(lambda: kernels.sign_decompress(sc, sp, 2048, n, torch.float32), reps)
        row("sign decode", n, us, (n + 7) // 8 + 4 * math.ceil(n / 2048) + 4 * n, copy_gbs, pct=60)

        # approximate top-k 1% vs torch.topk of |x|
        tk = compressors.TopK(density=0.01, exact=False)
        k = tk.k_for(n)
        us = _time_us(lambda: dispatch.topk_compress(tk, x, ctx), reps)
        t_us = _time_us(lambda: torch.topk(x.abs(), k, sorted=False), max(3, reps // 5), warmup=1)
        vals, idx = dispatch.topk_compress(tk, x, ctx)
        density = int((vals != 0).sum()) / n
        row("topk approx 1% (+select)", n, us, 4 * n + 8 * k, copy_gbs, t_us,
            f"torch.topk; achieved density {density:.5f} (target 0.01)", speedup=2)
        acc = torch.zeros(n, device=dev)
        us = _time_us(lambda: kernels.scatter_add_(acc, idx, vals), reps)
        row("topk scatter-add decode", n, us, 16 * k, copy_gbs, None, "random 4B updates", pct=30)

        # fused two-phase owner step: 8 ranks' QSGD chunks of n/8 elements each
        world, bits = 8, 8
        q = compressors.QSGD(bits=bits, chunk=2048)
        m = n // world
        payloads = [kernels.qsgd_compress(torch.randn(m, device=dev, generator=g), bits, 2048, key) for _ in range(world)]
        recv = torch.cat([to_bytes(p) for p in payloads])
        ctx2 = tp.chunk_context(ctx, world, 2, 0, 0).with_(numel=m)
        res = torch.zeros(m, device=dev)
        us = _time_us(lambda: alg_cuda.two_phase_qsgd_owner(q, recv, world, m, ctx2, None, None), reps)
        out_b = 4 * q.nchunks(m) + (m * bits + 7) // 8
        row("two-phase owner 8b w=8", n, us, recv.numel() + out_b, copy_gbs, None, "decode-sum-requantize", pct=40)
        us = _time_us(lambda: alg_cuda.two_phase_qsgd_owner(q, recv, world, m, ctx2, res, res), reps)
        row("two-phase owner +residual", n, us, recv.numel() + out_b + 8 * m, copy_gbs, pct=40)

        # shared-scale int8 encode (with own) and decode
        scales = kernels.chunk_absmax(x, 2048)
        us = _time_us(lambda: alg_cuda.shared_scale_quantize(x, 2048, scales, 63, torch.int8, key, torch.float32), reps)
        row("shared-scale encode int8", n, us, 4 * n + n + 4 * n + 8 * math.ceil(n / 2048), copy_gbs, None, "q + own",
            pct=60)
        qs, _, step = alg_cuda.shared_scale_quantize(x, 2048, scales, 63, torch.int8, key, None)
        us = _time_us(lambda: alg_cuda.shared_scale_decode(qs, 2048, step, torch.float32), reps)
        row("shared-scale decode int8", n, us, n + 4 * n + 4 * math.ceil(n / 2048), copy_gbs, pct=60)
        del x, dst, acc, recv, payloads
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="25e6,100e6", help="comma-separated element counts")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "kernels.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernels.py: no CUDA device here (torch.cuda.is_available() is False); "
              "this bench measures GPU kernels and has nothing to run on CPU.", file=sys.stderr)
        return 2
    from compressors.cuda import loader

    if not loader.available(torch.device("cuda", 0)):
        print("bench/kernels.py: CUDA is present but the kernels are unavailable (install cupy-cuda12x "
              "or cupy-cuda13x matching the driver, with NVRTC); see the warning above.", file=sys.stderr)
        return 2
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    import cupy

    props = torch.cuda.get_device_properties(0)
    facts = {"gpu": props.name, "sms": props.multi_processor_count, "memory_GiB": round(props.total_memory / 2**30, 1),
             "torch": torch.__version__, "cuda": torch.version.cuda, "cupy": cupy.__version__,
             "python": platform.python_version(), "command": " ".join([sys.executable] + sys.argv)}
    print("# " + ", ".join(f"{k}={v}" for k, v in facts.items()))
    rows = run(sizes, args.reps)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"facts": facts, "rows": rows}, f, indent=1)
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

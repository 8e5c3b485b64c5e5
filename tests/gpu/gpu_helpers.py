"""Bit-exact comparison helpers for the GPU tests, and whether they can run here."""

import torch

__all__ = ["kernel_status", "bits_of", "assert_same_bits", "assert_same_bits_nan"]


def kernel_status(index: int = 0) -> tuple[str, str]:
    """``("ok", "")``, ``("skip", why)`` (no CUDA device, no CuPy, kernels switched off) or
    ``("fail", why)``: CUDA and CuPy are there but the csrc kernels do not compile or load. A
    compile error on a real GPU must fail the GPU tests, not skip them (they would look green)."""
    from compressors.cuda import loader

    if not torch.cuda.is_available():
        return "skip", "no CUDA device"
    if not loader._enabled():
        return "skip", "COMMPRESS_CUDA_KERNELS=0"
    try:
        loader._cupy()
    except Exception as e:  # ImportError, or a CuPy built for another CUDA
        return "skip", f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        loader._module(index)
    except RuntimeError as e:
        cause = e.__cause__ if e.__cause__ is not None else e
        return "fail", f"CUDA and CuPy are present but the csrc kernels failed on cuda:{index}: {type(cause).__name__}: {cause}"
    return "ok", ""


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """Raw bit patterns (so -0.0 != 0.0 and NaNs compare by payload)."""
    t = t.detach().contiguous().cpu()
    view = {4: torch.int32, 2: torch.int16, 1: torch.uint8, 8: torch.int64}[t.element_size()]
    return t.view(view)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    ba, bb = bits_of(a), bits_of(b)
    bad = (ba != bb).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.numel()} elements differ, first at {bad[:5].flatten().tolist()}: "
                              f"{a.flatten()[bad[:5].flatten()].tolist()} vs {b.flatten()[bad[:5].flatten()].tolist()}")


def assert_same_bits_nan(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """The NaN contract of the kernels (csrc/README.md): NaN exactly where the reference has
    NaN, with any sign and payload; the same bits everywhere else."""
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    na, nb = torch.isnan(a.detach().cpu().float()), torch.isnan(b.detach().cpu().float())
    assert torch.equal(na, nb), (f"{what}: NaN at {na.nonzero()[:5].flatten().tolist()} "
                                 f"vs {nb.nonzero()[:5].flatten().tolist()}")
    assert_same_bits(a.detach().cpu()[~na], b.detach().cpu()[~nb], what)

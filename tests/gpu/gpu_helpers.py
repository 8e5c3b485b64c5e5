"""Bit-exact comparison helpers for the GPU tests."""

import torch


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

"""ErrorFeedback: residual == (x + r) - decoded exactly; nothing is lost over many steps."""

import numpy as np
import pytest
import torch

from comms.core.memory import LocalMemory
from compressors import (BF16, FP16, QSGD, Context, ErrorFeedback, Identity, RandomK,
                         ScaledSign, TopK)

EXACT = [Identity(), TopK(0.01), TopK(0.02, exact=False), RandomK(0.05), FP16(), BF16()]
QUANTIZERS = [QSGD(1), QSGD(2), QSGD(4), QSGD(8, chunk=100), ScaledSign(), ScaledSign(7)]


def _grad(n, step):
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 + step)) * 0.1


@pytest.mark.parametrize("c", EXACT + QUANTIZERS, ids=repr)
def test_residual_identity(c):
    n, bucket = 10_007, 3
    ef = ErrorFeedback()
    for step in range(3):
        g = _grad(n, step)
        g_before = g.clone()
        r = ef.residuals.get(bucket)
        x_plus_r = g.clone() if r is None else g + r
        ctx = Context.of(g, step=step, bucket=bucket, rank=1)
        payload, decoded = ef.compress(c, g, ctx)
        assert torch.equal(g, g_before)  # the input is not modified
        assert torch.equal(decoded, c.decompress(payload, ctx))
        res = ef.residuals[bucket]
        assert torch.equal(res, x_plus_r - decoded)
        back = decoded + res
        if c in EXACT:  # kept values are exact, x - fl(x) is exact (Sterbenz) for the casts
            assert torch.equal(back, x_plus_r)
        else:
            # decoded + fl(x - decoded) is x up to the rounding of the subtraction (half an
            # ulp of the residual) and of the addition (half an ulp of x): one ulp of the
            # larger of the two. For 1-bit codes |residual| can exceed |x|.
            big = torch.maximum(x_plus_r.abs(), res.abs())
            ulp = torch.from_numpy(np.spacing(big.numpy()))
            assert bool(((back - x_plus_r).abs() <= ulp).all())


@pytest.mark.parametrize("c", EXACT + QUANTIZERS, ids=repr)
def test_nothing_is_lost_over_steps(c):
    """sum_t decoded_t + final residual == sum_t g_t: EF only delays, never drops."""
    n, T = 5003, 25
    ef = ErrorFeedback()
    sum_g = torch.zeros(n, dtype=torch.float64)
    sum_dec = torch.zeros(n, dtype=torch.float64)
    for step in range(T):
        g = _grad(n, step)
        _, dec = ef.compress(c, g, Context.of(g, step=step, bucket=0))
        sum_g += g.double()
        sum_dec += dec.double()
    total = sum_dec + ef.residuals[0].double()
    # fp32 rounding of the running residual only: a few ulps of its size per step
    tol = T * 4 * 2 ** -24 * (sum_g.abs().max() + ef.residuals[0].abs().max().double() + 1)
    assert float((total - sum_g).abs().max()) <= float(tol)
    if c not in (Identity(), FP16(), BF16()):
        assert float(ef.residuals[0].abs().max()) > 0  # lossy: something was carried


def test_residual_reset_on_layout_change_and_state_dict():
    ef = ErrorFeedback()
    c = TopK(0.01)
    g = _grad(1000, 0)
    ef.compress(c, g, Context.of(g, bucket=1))
    assert ef.residuals[1].numel() == 1000
    g2 = _grad(500, 1)
    x_plus_r = g2.clone()  # new layout: the old residual is dropped, not added
    _, dec = ef.compress(c, g2, Context.of(g2, bucket=1))
    assert torch.equal(ef.residuals[1], x_plus_r - dec)
    sd = ef.state_dict()
    ef2 = ErrorFeedback()
    ef2.load_state_dict(sd)
    assert torch.equal(ef2.residuals[1], ef.residuals[1])
    ef.reset(1)
    assert 1 not in ef.residuals


def test_momentum_residual_fused_equals_momentum_then_residual():
    # the hook's fused local step: x <- (m u + x) + r in one write, the same bits as
    # momentum_ then add_residual_, on the first call (no velocity yet) and after
    g = torch.Generator().manual_seed(7)
    a, b = LocalMemory(), LocalMemory()
    for step in range(3):
        x = torch.randn(1001, generator=g) * 10.0 ** (step - 1)
        x[::97] = -0.0
        xa, xb = x.clone(), x.clone()
        a.momentum_(0, xa, 0.9)
        a.add_residual_(0, xa)
        b.momentum_residual_(0, xb, 0.9)
        assert torch.equal(xa, xb) and torch.equal(xa.signbit(), xb.signbit())
        assert torch.equal(a.velocities[0], b.velocities[0])
        own = torch.where(xa.abs() > xa.abs().median(), xa, torch.zeros_like(xa))
        a.update_(0, xa, own)
        b.update_(0, xb, own)


def test_drain_adds_equal_shares_and_survives_a_checkpoint():
    """A residual drained over n dense steps: every step adds r0 / n (the last empties it and
    drops it), the count is checkpointed, and compressing again stops the drain."""
    g = torch.Generator().manual_seed(3)
    r0 = torch.randn(1000, generator=g)
    ef = LocalMemory()
    ef.residuals[0] = r0.clone()
    ef.start_drain(0, 4)
    ef.start_drain(1, 4)  # no residual for bucket 1: nothing to drain
    assert ef.draining == {0: 4}
    added = []
    for i in range(4):
        if i == 2:  # a checkpoint half-way resumes the same drain
            sd = ef.state_dict()
            ef = LocalMemory()
            ef.load_state_dict(sd)
            assert ef.draining == {0: 2}
        x = torch.zeros(1000)
        added.append(ef.drain_step_(0, x).clone())
    for a in added:
        torch.testing.assert_close(a, r0 / 4, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sum(added), r0, rtol=1e-5, atol=1e-6)
    assert 0 not in ef.residuals and ef.draining == {}
    x = torch.ones(3)
    assert ef.drain_step_(0, x) is x and torch.equal(x, torch.ones(3))  # nothing left: no-op
    ef.residuals[2] = torch.ones(3)
    ef.start_drain(2, 3)
    ef.reset(2)
    assert ef.draining == {}

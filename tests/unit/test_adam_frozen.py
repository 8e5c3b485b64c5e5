"""The optimizer side of Adam's momentum space (comms.core.adam): which compressors go there, the
layouts it refuses, and the frozen-variance update against its closed form."""

import pytest
import torch

from comms.core.adam import FrozenVarianceAdam, momentum_space
from compressors import from_spec


@pytest.mark.parametrize("spec,ef,expected", [
    ("sign", True, True), ("topk:density=0.01", True, True), ("randomk:density=0.01", True, True),
    ("qsgd:bits=4", False, False), ("fp16", True, False), ("identity", False, False),
    ("powersgd:rank=1", True, False), ("sign", False, False)])
def test_which_compressors_go_to_momentum_space(spec, ef, expected):
    assert momentum_space(from_spec(spec), ef) is expected


@pytest.mark.parametrize("make,match", [
    (lambda ps: torch.optim.Adam(ps, amsgrad=True), "amsgrad"),
    (lambda ps: torch.optim.Adam(ps, weight_decay=0.1), "AdamW"),
    (lambda ps: torch.optim.AdamW([{"params": ps[:1]}, {"params": ps[1:], "betas": (0.8, 0.99)}]), "beta"),
    (lambda ps: torch.optim.AdamW(ps, maximize=True), "maximize"),
])
def test_refused_layouts_name_the_reason(make, match):
    ps = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match=match):
        FrozenVarianceAdam(make(ps))
    with pytest.raises(TypeError, match="Adam or AdamW"):
        FrozenVarianceAdam(torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(ValueError, match="adam_freeze"):
        FrozenVarianceAdam(torch.optim.AdamW(ps), freeze=0)


@pytest.mark.parametrize("mode", ["shared", "local"])
def test_frozen_update_is_adamw_with_the_frozen_variance(mode):
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(50, generator=g))
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    adam = FrozenVarianceAdam(opt, mode=mode, freeze=3)
    for _ in range(3):  # plain AdamW steps, then the variance freezes
        p.grad = torch.randn(50, generator=g)
        opt.step()
    adam._freeze(3)
    v = opt.state[p]["exp_avg_sq"].clone()
    before = p.detach().clone()
    agg = torch.randn(50, generator=g)
    p.grad = agg.clone()
    opt.step()
    m = agg if mode == "shared" else agg * (1 - 0.9)
    t = 4.0
    want = before * (1 - 1e-2 * 0.1)
    want = want - m / ((v / (1 - 0.99 ** 3)).sqrt() + 1e-8) * (1e-2 / (1 - 0.9 ** t))
    torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)
    assert torch.equal(opt.state[p]["exp_avg_sq"], v)  # frozen
    assert torch.equal(opt.state[p]["exp_avg"], m) and p.grad is None
    adam.remove()


def test_a_closure_runs_before_the_frozen_update():
    # Lightning calls optimizer.step(closure): backward happens inside step
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.0)
    adam = FrozenVarianceAdam(opt, freeze=1)
    p.grad = torch.ones(4)
    opt.step()
    adam._freeze(1)
    before = p.detach().clone()

    def closure():
        opt.zero_grad()
        loss = (p * 2.0).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert float(loss.detach()) == float((before * 2.0).sum())
    v = opt.state[p]["exp_avg_sq"]
    want = before - 2.0 / ((v / (1 - 0.999)).sqrt() + 1e-8) * (0.1 / (1 - 0.9 ** 2))
    torch.testing.assert_close(p.detach(), want)
    adam.remove()

"""The optimizer side of Adam's momentum space (comms.core.adam, adam_steps,
adam_policy): which compressors go there, the layouts it refuses, the frozen-variance,
refresh and thaw steps against their closed forms and torch.optim.AdamW's bits, the factor
the loop applies to ``.grad``, and the freeze and refresh decisions."""

import copy

import pytest
import torch

from comms.core.adam import FrozenVarianceAdam, momentum_space
from comms.core.adam_share import Share
from comms.core.adam_policy import VariancePolicy
from comms.core.adam_steps import variance_change
from compressors import from_spec

B1, B2, EPS, LR, WD = 0.9, 0.99, 1e-8, 1e-2, 0.1


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
    for bad, match in ((dict(freeze=0), "adam_freeze"), (dict(mode="gradient"), "mode"),
                       (dict(freeze_tol=1.5), "freeze_tol"), (dict(refresh_ratio=-1), "refresh_ratio"),
                       (dict(patience=0), "patience")):
        with pytest.raises(ValueError, match=match):
            FrozenVarianceAdam(torch.optim.AdamW(ps), **bad)


class _Run:
    """One parameter, AdamW, a FrozenVarianceAdam driven by hand: ``dense(n)`` plain steps
    (each ending one hook step), ``freeze()``, ``frozen(m)`` a marked step whose ``.grad`` is
    the delivered momentum ``m``."""

    def __init__(self, mode="shared", n=50, **kw):
        self.g = torch.Generator().manual_seed(0)
        self.p = torch.nn.Parameter(torch.randn(n, generator=self.g))
        self.opt = torch.optim.AdamW([self.p], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
        self.adam = FrozenVarianceAdam(self.opt, mode=mode, delivers=True, freeze=10 ** 6, **kw)
        self.it = 0
        self.adam.iter_fn = lambda: self.it

    def grad(self):
        return torch.randn(self.p.numel(), generator=self.g)

    def dense(self, n=1):
        for _ in range(n):
            self.it += 1
            self.p.grad = self.grad()
            self.opt.step()

    def freeze(self):
        self.adam.policy.freeze_iter = self.it
        self.adam.policy.next_refresh = self.adam.policy._after(self.it)

    def frozen(self, m, factor=1.0):
        self.adam.mark([self.p], self.it)
        self.adam.loop.probe([self.p], m, self.it)
        self.it += 1
        self.p.grad = m.clone() * factor
        self.opt.step()

    @property
    def state(self):
        return self.opt.state[self.p]


@pytest.mark.parametrize("factor", [1.0, 0.25])
def test_frozen_step_is_adamw_with_the_frozen_variance(factor):
    # the delivered momentum becomes exp_avg; the loop's factor on .grad (clip_grad_norm_) is
    # divided out; the variance is the one of the last dense step
    r = _Run(refresh_ratio=0)
    r.dense(3)
    r.freeze()
    v = r.state["exp_avg_sq"].clone()
    for t in (4.0, 5.0):
        before = r.p.detach().clone()
        m = torch.randn(50, generator=r.g)
        r.frozen(m, factor)
        want = before * (1 - LR * WD) - m / ((v / (1 - B2 ** 3)).sqrt() + EPS) * (LR / (1 - B1 ** t))
        torch.testing.assert_close(r.p.detach(), want, rtol=1e-6, atol=1e-7)
        assert torch.equal(r.state["exp_avg_sq"], v)  # frozen, its bits untouched
        torch.testing.assert_close(r.state["exp_avg"], m, rtol=1e-6, atol=0)
        assert r.p.grad is None and float(r.state["step"]) == t
    r.adam.remove()


def test_a_dense_step_after_the_freeze_is_torch_adamw_from_a_thawed_state():
    # a parameter the exchange sent dense (auto, a ramp step, a small bucket) takes AdamW's own
    # step; its variance is first rescaled so that vhat is continuous: v (1 - b2^t) / (1 - b2^s)
    r = _Run(refresh_ratio=0)
    r.dense(3)
    r.freeze()
    r.frozen(torch.randn(50, generator=r.g))
    r.frozen(torch.randn(50, generator=r.g))
    t, s = 5.0, 3.0
    ref_p = torch.nn.Parameter(r.p.detach().clone())
    ref = torch.optim.AdamW([ref_p], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    ref.load_state_dict(copy.deepcopy(r.opt.state_dict()))
    ref.state[ref_p]["exp_avg_sq"].mul_((1 - B2 ** t) / (1 - B2 ** s))
    vhat = r.state["exp_avg_sq"] / (1 - B2 ** s)
    for _ in range(3):  # unmarked: dense gradients
        g = torch.randn(50, generator=r.g)
        r.it += 1
        r.p.grad, ref_p.grad = g.clone(), g.clone()
        r.opt.step()
        ref.step()
        assert torch.equal(r.p, ref_p) and torch.equal(r.state["exp_avg_sq"], ref.state[ref_p]["exp_avg_sq"])
    # continuity: the first thawed step moved vhat by one sample's weight only
    r2 = _Run(refresh_ratio=0)
    r2.dense(3)
    r2.freeze()
    r2.frozen(torch.randn(50, generator=r2.g))
    r2.frozen(torch.randn(50, generator=r2.g))
    r2.p.grad = torch.zeros(50)
    r2.it += 1
    r2.opt.step()
    torch.testing.assert_close(r2.state["exp_avg_sq"] / (1 - B2 ** 6), vhat * B2 * (1 - B2 ** 5) / (1 - B2 ** 6))
    r.adam.remove()
    r2.adam.remove()


def test_a_refresh_weighs_its_gradient_for_every_step_since_the_last_update():
    r = _Run()
    r.dense(20)
    r.freeze()  # refresh at 20 + 5 = 25
    assert r.adam.policy.next_refresh == 25
    v20, m = r.state["exp_avg_sq"].clone(), None
    while r.it < 25:
        r.frozen(torch.randn(50, generator=r.g))
    m = r.state["exp_avg"].clone()
    before = r.p.detach().clone()
    g = torch.randn(50, generator=r.g)
    assert r.adam.policy.refreshing(r.it) and not r.adam.active(r.it)
    r.it += 1
    r.p.grad = g.clone()
    r.opt.step()
    k, t = 6.0, 26.0
    v = v20 * B2 ** k + (1 - B2 ** k) * g * g
    torch.testing.assert_close(r.state["exp_avg_sq"], v, rtol=1e-6, atol=0)
    m = B1 * m + (1 - B1) * g
    want = before * (1 - LR * WD) - m / ((v / (1 - B2 ** t)).sqrt() + EPS) * (LR / (1 - B1 ** t))
    torch.testing.assert_close(r.p.detach(), want, rtol=1e-6, atol=1e-7)
    assert r.adam.policy.next_refresh == 26 + 7 and r.adam.policy.refreshes == 1


def test_a_closure_runs_before_the_frozen_update():
    # Lightning calls optimizer.step(closure): backward happens inside step
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.0)
    adam = FrozenVarianceAdam(opt, delivers=True, freeze=1)
    it = [1]
    adam.iter_fn = lambda: it[0]
    p.grad = torch.ones(4)
    opt.step()
    adam.policy.freeze_iter = 1
    before = p.detach().clone()

    def closure():
        opt.zero_grad()
        loss = (p * 2.0).sum()
        loss.backward()
        adam.mark([p], 1)
        it[0] = 2
        return loss

    loss = opt.step(closure)
    assert float(loss.detach()) == float((before * 2.0).sum())
    v = opt.state[p]["exp_avg_sq"]
    want = before - 2.0 / ((v / (1 - 0.999)).sqrt() + 1e-8) * (0.1 / (1 - 0.9 ** 2))
    torch.testing.assert_close(p.detach(), want)
    adam.remove()


def test_the_share_travels_preconditioned_and_scaled_and_arrives_as_the_momentum():
    r = _Run(precondition=True, rho=0.5, refresh_ratio=0)
    r.dense(3)
    r.freeze()
    r.adam.loop.scale = torch.tensor(0.5)  # the loop clipped the last dense step's gradients by 1/2
    share = r.adam.share([r.p])
    d = (r.state["exp_avg_sq"] / (1 - B2 ** 3)).sqrt() + EPS
    torch.testing.assert_close(share.pre, 1 / d)
    torch.testing.assert_close(share.momentum, r.state["exp_avg"] / d)
    g = torch.randn(50, generator=r.g)
    x = r.adam.momentum_(None, 0, g.clone(), share, 2, 2)
    torch.testing.assert_close(x, (1 - B1) * 0.5 * g / 2 / d + (B1 - 0.5) * r.state["exp_avg"] / d / 2)
    # with every rank's share summed (here: twice this one) the delivered momentum is
    # rho m + (1 - beta1) c g + (beta1 - rho) m: Adam's momentum of the scaled gradient
    out = share.deliver_(x * 2)
    torch.testing.assert_close(out, B1 * r.state["exp_avg"] + (1 - B1) * 0.5 * g, rtol=1e-5, atol=1e-7)
    assert Share(torch.arange(6.0), None).cut([(0, 2), (4, 2)]).momentum.tolist() == [0, 1, 4, 5]


def test_the_loops_factor_at_a_dense_step_becomes_the_scale():
    r = _Run()
    r.adam.loop.probe([r.p], torch.ones(50) * 3.0, r.it)  # what the exchange delivered
    r.it += 1
    r.p.grad = torch.ones(50) * 0.75  # clip_grad_norm_ scaled it by 1/4
    r.opt.step()
    assert float(r.adam.loop.scale) == 0.25
    r.adam.loop.probe([r.p], torch.zeros(50), r.it)  # nothing to compare with: unknown, kept
    r.it += 1
    r.p.grad = torch.zeros(50)
    r.opt.step()
    assert float(r.adam.loop.scale) == 0.25


def test_the_freeze_statistic_is_blind_to_clipping_where_the_total_is_not():
    # gradients clipped to norm 1: the variance's total is pinned (changes by 0), its elements
    # are not, until enough steps averaged them
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(400))
    opt = torch.optim.AdamW([p], lr=1e-3)
    totals, rel = [], []
    for _ in range(60):
        raw = torch.randn(400, generator=g) * torch.linspace(0.1, 3.0, 400)
        p.grad = raw / raw.norm()
        change, total = variance_change(opt, 0.999)
        rel.append(change / total)
        opt.step()
        st = opt.state[p]
        totals.append(float(st["exp_avg_sq"].sum()) / (1 - 0.999 ** float(st["step"])))
    assert max(abs(a - b) / b for a, b in zip(totals[1:], totals[2:])) < 1e-5  # the total's trap
    assert min(rel[:10]) > 0.05 and rel[-1] < 0.05 and rel[1] > 3 * rel[-1]


def test_the_policy_freezes_once_settled_and_refreshes_geometrically():
    pol = VariancePolicy(min_steps=10, patience=3, freeze_tol=0.02, refresh_ratio=0.25)
    for it, d in enumerate([1.0, 0.5, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01], start=1):
        assert not pol.observe(it, d)  # settled from step 3, but not before min_steps
    assert pol.observe(10, 0.01) and pol.freeze_iter == 10 and pol.next_refresh == 13
    steps = []
    for step in range(10, 60):
        if pol.refreshing(step):
            steps.append(step)
            pol.refreshed(step)
    assert steps == [13, 18, 24, 32, 42, 54]
    late = VariancePolicy(min_steps=2, max_steps=6, patience=2)
    assert [late.observe(i, 0.5) for i in range(1, 7)] == [False] * 5 + [True]  # max_steps
    fixed = VariancePolicy(freeze=4, refresh_ratio=0)
    assert [fixed.observe(i, 1.0) for i in range(1, 5)] == [False, False, False, True]
    assert fixed.next_refresh is None
    sd = pol.state_dict()
    again = VariancePolicy()
    again.load_state_dict(sd)
    assert again.state_dict() == sd

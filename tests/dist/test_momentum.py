"""SGD momentum 0.9 with a biased compressor must not diverge when used the default
way — ``comms.register(ddp, spec, optimizer=opt)``, which moves the optimizer's momentum into
the hook (Deep Gradient Compression's momentum correction).

Without momentum correction the same model and optimizer with ``register(ddp, spec)`` reached 6.7x (top-k
1% + EF), 745x (sign + EF) and 2e5x (random-k 1% + EF, diverged) dense's loss. The bounds
below are loose multiples of what was measured with fixed seeds (bench/results/
convergence.md, momentum task): top-k 1.7x, sign 1.1x, random-k 4.4x at 200 steps with DGC's
masking rule; with the default ``"held"`` masking (nothing masked on allgather/allreduce) top-k
2.43x and random-k 4.6x at 200 steps — and random-k no longer diverges later (test below).
"""

import math

import pytest
import torch

from comms.cluster.launch import spawn
from dist import momentum_ranks

pytestmark = [pytest.mark.dist]

TOPK = "topk:density=0.01,exact=false"
CASES = [
    (None, None, "dense", {}),
    (TOPK, "allgather", "optimizer", {}),
    ("sign", "allgather", "optimizer", {}),
    ("randomk:density=0.01", "allreduce", "optimizer", {}),
    ("identity", "allreduce", "hook", {}),   # momentum correction without loss == SGD momentum
    ("powersgd:rank=1", "allreduce", "optimizer", {}),  # the optimizer keeps its momentum
]
PSGD_BOUND = 2.5  # measured 1.95x (optimizer momentum); 2.18x with momentum correction
# top-k: 2.43x measured with "held" masking (1.68x with DGC's rule) — 3.0 leaves room for
# another CPU's rounding; divergence (6.7x without momentum correction) still fails it
BOUND = {TOPK: 3.0, "sign": 1.5, "randomk:density=0.01": 6.0}


def _body(rank, world, cases, steps):
    torch.set_num_threads(1)
    return [momentum_ranks.train_final(rank, world, s, a, steps, m, **kw) for s, a, m, kw in cases]


@pytest.mark.timeout(400)
def test_biased_compressors_with_sgd_momentum_do_not_diverge():
    reports = spawn(_body, 2, CASES, 200, timeout=380)
    assert reports[0] == reports[1]  # the same final loss on both ranks (replicas checked too)
    res = {c[0]: r for c, r in zip(CASES, reports[0])}
    dense = res[None]["loss"]
    assert 0.05 < dense < 0.5, dense  # the task learns
    for spec, bound in BOUND.items():
        r = res[spec]
        assert r["compressed_calls"] > 0, spec
        assert r["momentum"] == 0.9 and r["opt_momentum"] == 0.0, r  # taken over from SGD
        assert r["loss"] == r["loss"] and r["loss"] <= bound * dense, (spec, r["loss"], dense)
    # PowerSGD leaves SGD its momentum (applied to the decoded average, as torch's hook does)
    psgd = res["powersgd:rank=1"]
    assert psgd["compressed_calls"] > 0 and psgd["momentum"] is None and psgd["opt_momentum"] == 0.9, psgd
    assert psgd["loss"] <= PSGD_BOUND * dense, (psgd["loss"], dense)
    # the lossless compressor with the hook's momentum is SGD momentum up to rounding
    assert abs(res["identity"]["loss"] - dense) <= 0.02 * dense, (res["identity"]["loss"], dense)


REPLICA_CASES = [
    (TOPK, "allgather", "optimizer", {"warmup_steps": 3}),
    (TOPK, "two_phase", "optimizer", {"clip_norm": 1.0}),
    ("sign", "two_phase", "optimizer", {}),
    ("qsgd:bits=4,chunk=16", "allgather", "optimizer", {"warmup_steps": 4}),
    ("randomk:density=0.05", "allreduce", "optimizer", {"warmup_steps": 2}),
    ("qsgd:bits=8", "shared_scale", "hook", {}),
]


@pytest.mark.timeout(300)
def test_momentum_correction_keeps_replicas_equal():
    """Momentum correction, masking, clipping, warm-up and tensor-aligned scales at 3 ranks:
    ``comms.check_replicas`` after 20 steps (inside ``train_final``) and equal losses."""
    reports = spawn(_body, 3, REPLICA_CASES, 20, timeout=280)
    assert reports[0] == reports[1] == reports[2]
    for case, r in zip(REPLICA_CASES, reports[0]):
        assert r["compressed_calls"] > 0 and r["momentum"] == 0.9, (case, r)


@pytest.mark.timeout(200)
def test_randomk_with_momentum_does_not_diverge_over_600_steps():
    """Random-k 1% on allreduce the default way. With DGC's masking rule (zero the velocity
    wherever a value was sent; the default before ``"held"``) the same run climbed from 0.66
    (step 250) to 1e6 (step 600) and 6e18 (step 1000); without it, 0.34 at step 600, falling."""
    reports = spawn(_body, 2, [("randomk:density=0.01", "allreduce", "optimizer", {})], 600,
                    timeout=180)
    assert reports[0] == reports[1]
    r = reports[0][0]
    assert r["compressed_calls"] > 0 and r["momentum"] == 0.9
    assert r["loss"] < 0.6, r  # the first evaluation (step 50) is 1.31; dense 0.0006 at 600


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", ["allgather", "two_phase"])
def test_masking_only_where_the_aggregate_held_back(algorithm):
    """The default masking (``"held"``) without error feedback: with allgather every sent value
    lands in the same step's aggregate and no velocity is masked; with two_phase the velocity
    is zeroed exactly where this rank sent a value and the aggregate is 0 (the owner's
    re-compression kept it), and kept where what was sent arrived."""
    out = spawn(momentum_ranks.masking_calls, 2, algorithm, 4, False, timeout=100)
    for calls in out:
        assert calls["sent"] == 0 and calls["returned"] == {}  # DGC's rule never runs by default
        if algorithm == "allgather":
            assert calls["held"] == []
            continue
        assert calls["held"]
        n_held = n_kept = 0
        for before, sent, agg, after in calls["held"]:
            if before is None:
                continue
            held = (sent != 0) & (agg == 0)
            assert torch.equal(after, before.masked_fill(held, 0))
            n_held += int((held & (before != 0)).sum())
            n_kept += int(((sent != 0) & (agg != 0) & (after != 0)).sum())
        assert n_held > 0 and n_kept > 0, (n_held, n_kept)
        assert sum(b is not None for b, *_ in calls["held"]) >= 4  # every step's buckets, fused too


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_two_phase_sparsifier_gives_back_what_the_owner_left_out(world):
    """Top-k with error feedback on two_phase (the default way, momentum from the optimizer):
    the owner keeps no residual; each rank's residual is ``x - sent`` where the aggregate came
    back nonzero and ``x`` where the owner's re-compression left the coordinate out, and no
    velocity is masked (such a value waits like an unsent one). Summed over ranks, what left
    the residuals is the aggregate: no mass is lost or counted twice."""
    out = spawn(momentum_ranks.masking_calls, world, "two_phase", 4, True, timeout=100)
    for calls in out:
        assert calls["held"] == [] and calls["sent"] == 0 and calls["owner_residuals"] == 0
        assert len(calls["returned"]) >= 4
    n_returned = 0
    keys = sorted(out[0]["returned"], key=str)
    for calls in out:  # every rank ran the same buckets the same number of times
        assert sorted(calls["returned"], key=str) == keys
    for k in keys:
        per_rank = [calls["returned"][k] for calls in out]
        agg = per_rank[0][2]
        delivered = torch.zeros_like(agg, dtype=torch.float64)
        for x, sent, agg_r, r, before, after in per_rank:
            assert torch.equal(agg_r, agg), k  # every rank decoded the same aggregate
            left_out = (sent != 0) & (agg == 0)
            assert torch.equal(r, torch.where(agg != 0, x - sent, x)), k
            assert before is None or torch.equal(after, before), k  # no velocity masked
            n_returned += int(left_out.sum())
            delivered += (x.double() - r.double())
        assert torch.allclose(delivered, agg.double(), rtol=1e-5, atol=1e-7), k
        assert torch.equal(delivered[agg == 0], torch.zeros_like(delivered[agg == 0])), k
    assert n_returned > 0  # the owners did leave values out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 3])
def test_the_near_dense_warm_up_steps_go_dense(world):
    # top-k's default ramp keeps 0.01 ** ((k + 1) / 6) at step k: 46%, 22%, 10%...; a variant
    # above 15% density goes dense (residual included), the 10% step is top-k at 2 and 3 ranks
    # (its allgather bytes, 0.1 * world of a dense step's, stay under half)
    reports = spawn(momentum_ranks.warmup_steps_taken, world, timeout=180)
    for r in reports[1:]:  # the same averaged gradient on every rank, every step
        assert all(torch.equal(a[2], b[2]) for a, b in zip(reports[0], r))
    dense_calls = [step[0] for step in reports[0]]
    residuals = [step[1] for step in reports[0]]
    n_dense = 2
    assert dense_calls == [min(k + 1, n_dense) for k in range(3)], dense_calls
    assert residuals == [[] if k < n_dense else [0] for k in range(3)], residuals
    # step 0 went dense: the exact average of the ranks' own gradients (no residual yet)
    mean = sum(r[0][3] for r in reports) / world
    assert torch.allclose(reports[0][0][2], mean, rtol=1e-6, atol=1e-7)
    # state.stats counts each step's own variant: allgather sends k values + k int32 indices
    n = 64 * 64 + 64
    sent = [(world - 1) * math.ceil(0.01 ** ((k + 1) / 6) * n) * 8 for k in range(3)]
    dense = 2 * (world - 1) * n * 4 // world
    assert [step[4] for step in reports[0]] == [dense if k < n_dense else sent[k] for k in range(3)]


def test_register_refuses_a_foreign_optimizer_and_an_inapplicable_adam_freeze():
    r = spawn(momentum_ranks.pairing_errors, 1, timeout=120)[0]
    e = r["errs"]
    assert e["foreign"].startswith("ValueError") and "holds none of the model's 4 trainable" in e["foreign"]
    assert e["part"] is None  # several optimizers may share a model (register_paired pairs them all)
    assert "adam_freeze=10 does not apply" in e["sgd"] and "SGD" in e["sgd"]
    assert "adam_freeze='auto' does not apply" in e["qsgd"] and "gradient path" in e["qsgd"]
    assert "no optimizer" in e["none"]
    assert e["explicit_off"] is None and r["hooked"]  # None (the gradient path) always applies
    assert r["momenta"][0] == 0.9  # refused: nothing taken
    assert r["momenta"][2] == 0.0  # the registration that succeeded took it over

"""FSDP2 / HSDP compressed gradient sync on gloo ranks: identity is bitwise plain
FSDP2 / native HSDP, compressed runs are deterministic and keep HSDP replicas bitwise equal,
the module reduce-scatter matches closed forms, resume is bitwise, bad input changes nothing."""

import pytest
import torch

from comms.cluster.launch import spawn
from dist import fsdp_ranks as F

pytestmark = [pytest.mark.dist]


def test_identity_is_bitwise_plain_fsdp2_after_20_steps():
    res = spawn(F.identity_vs_plain, 2, timeout=600)
    for plain, ident in res:
        assert torch.equal(plain["full"], ident["full"])
        assert torch.equal(plain["local"], ident["local"])
        assert plain["losses"] == ident["losses"]
    assert torch.equal(res[0][0]["full"], res[1][0]["full"])  # full_tensor agrees across ranks


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [3, 4], ids=["fsdp-3-ranks", "hsdp-2x2"])
def test_identity_with_defaults_is_bitwise_plain_fsdp2_and_native_hsdp_after_100_steps(world):
    # 3 ranks: a sum of three is not commutative in floating point, so only the same
    # collective in the same order gives the same bits; 4 ranks: HSDP 2 replicas x 2 shards
    for plain, ident in spawn(F.identity_defaults_vs_plain, world, 100, timeout=360):
        assert torch.equal(plain["local"], ident["local"])
        assert plain["losses"] == ident["losses"]


def test_compressed_runs_deterministic_with_stated_residual_memory():
    res = spawn(F.compressed_runs, 2, F.SPECS, timeout=900)
    padded_numel = (64 * 32 + 64) + (64 * 64 + 64) + (10 * 64 + 10)  # no padding at 2 shards
    for spec in F.SPECS:
        for rank in range(2):
            a, b = res[rank][spec]
            assert torch.equal(a["local"], b["local"]), spec  # same bits on a rerun
            assert torch.equal(a["full"], res[1 - rank][spec][0]["full"]), spec
            assert all(map(lambda v: v == v and v < 10, a["losses"])), (spec, a["losses"])
            assert a["nonfinite"] == 0
            # error feedback for biased compressors: one unsharded gradient per rank (fp32)
            ef = not spec.startswith("qsgd")
            assert a["residual_bytes"] == (4 * padded_numel if ef else 0), spec
        assert res[0][spec][0]["full"].isfinite().all()


def test_module_reduce_scatter_values_ef_and_nonfinite():
    res = spawn(F.direct_calls, 2, timeout=300)
    xs, m = res[0]["xs"], 37
    for rank in range(2):
        own = slice(rank * m, (rank + 1) * m)
        r = res[rank]
        # identity: rank-order sum, and AVG divides once
        ref = torch.zeros(m) + xs[0][own] + xs[1][own]
        assert torch.equal(r["identity"]["out"], ref)
        assert torch.equal(r["identity"]["avg"], ref / 2)
        assert r["identity"]["residual"] is None  # unbiased: no error feedback
        # fp16: every other rank's chunk rounded once, the owner's own chunk exact (it never
        # leaves the rank), summed in fp32 in rank order
        ref16 = torch.zeros(m)
        for i in range(2):
            ref16 += xs[i][own] if i == rank else xs[i][own].half().float()
        assert torch.equal(r["fp16"]["out"], ref16)
        x2 = r["fp16"]["ef_input"]  # second call's input after the residual was added
        want = x2 - x2.half().float()
        want[own] = 0.0  # nothing of the own chunk was lost
        assert torch.equal(r["fp16"]["residual"], want)  # EF identity, bitwise
        # top-k: the residual is exactly the unsent part of its input
        xt, rt = r["topk:density=0.2"]["ef_input"], r["topk:density=0.2"]["residual"]
        assert bool(((rt == 0) | (rt == xt)).all())
        assert int((rt == 0).sum()) >= 2 * 8  # k = ceil(0.2 * 37) = 8 sent per chunk
        # a non-finite input on rank 1 at call 1: NaN on every rank, residual zeroed, counted once
        outs = r["nan"]["outs"]
        assert outs[0][0].isfinite().all() and outs[2][0].isfinite().all()
        assert outs[1][0].isnan().all()
        assert torch.equal(outs[1][1], torch.zeros_like(outs[1][1]))
        assert r["nan"]["count"] == 1


def test_resume_from_state_dict_is_bitwise(tmp_path):
    res = spawn(F.resume_run, 2, "topk:density=0.1", str(tmp_path), timeout=600)
    for r in res:
        assert torch.equal(r["straight"], r["resumed"])
        assert r["residual_modules"] == [0, 1, 2]
        assert r["steps"] == {0: 5, 1: 5, 2: 5}


def test_bad_input_raises_before_anything_changes():
    res = spawn(F.error_cases, 2, timeout=300)[0]
    e = res["errs"]
    assert e["powersgd"].startswith("ValueError") and "powersgd" in e["powersgd"]
    assert e["bad_spec"].startswith("ValueError") and "density" in e["bad_spec"]
    assert e["algorithm_in_fsdp_mode"].startswith("ValueError")
    assert e["mesh_as_group"].startswith("TypeError") and "mesh.get_group" in e["mesh_as_group"]
    assert e["plain_module"].startswith("TypeError") and "fully_shard" in e["plain_module"]
    assert e["fsdp1"].startswith("TypeError") and "FSDP1" in e["fsdp1"]
    assert e["groups"] == 2
    assert e["multi_group"].startswith("ValueError") and "2 parameter groups" in e["multi_group"]
    assert e["twice"].startswith("ValueError") and "already" in e["twice"]
    assert e["foreign_optimizer"].startswith("ValueError") and "holds none of the model's" \
        in e["foreign_optimizer"] and e["foreign_momentum"] == 0.9
    assert "adam_freeze=20 does not apply" in e["adam_freeze_sgd"] and "SGD" in e["adam_freeze_sgd"]
    assert e["sgd_momentum"] == 0.9
    assert "adam_freeze='auto' does not apply" in e["adam_freeze_qsgd"] and "gradient path" in e["adam_freeze_qsgd"]
    assert "no optimizer" in e["adam_freeze_no_optimizer"]
    assert e["hsdp_powersgd"].startswith("ValueError") and "HSDP shard" in e["hsdp_powersgd"] \
        and "supports" not in e["hsdp_powersgd"]
    assert res["before"] == res["after"] == ["DefaultReduceScatter"] * 3
    assert res["multi_first"] == "DefaultReduceScatter"  # the failed register changed no child
    assert res["final"] == ["CompressedReduceScatter"] * 3


@pytest.mark.slow
def test_hsdp_replicas_bitwise_equal_at_4_ranks():
    res = spawn(F.hsdp_cases, 4, ["sign", "qsgd:bits=4", "topk:density=0.1"], timeout=900)
    for case in res[0]:
        by_shard = {}
        for r in res:
            by_shard.setdefault(r[case]["shard_rank"], []).append(r[case]["local"])
        assert sorted(by_shard) == [0, 1]
        for shard, replicas in by_shard.items():
            assert len(replicas) == 2 and torch.equal(replicas[0], replicas[1]), (case, shard)
        assert all(map(lambda v: v == v and v < 10, res[0][case]["losses"])), case
    for r in res:  # identity through our replicate all-reduce == torch's native HSDP, bitwise
        assert torch.equal(r["native"]["local"], r["identity"]["local"])
        assert r["sign"]["residual_bytes"] > 0 and r["qsgd:bits=4"]["residual_bytes"] == 0


def test_config_mismatch_raises_on_every_rank_before_data_moves():
    res = spawn(F.config_mismatch, 2, timeout=300)
    for r in res:
        assert r["error"] is not None and "seed" in r["error"], r
        assert r["steps"] == {} and r["residuals"] == 0  # nothing applied


# final held-out loss (mean of the last 3 evaluations) / native HSDP dense, 60 steps, fixed
# seeds. Measured at 60 steps (4 gloo ranks, 2 x 2): qsgd4 1.000, topk 10% + EF 1.00, sign + EF
# 1.08. The bounds are the FSDP/HSDP quality targets for QSGD 4-bit and top-k; sign + EF gets 1.15 here
# (1.02 at 100 steps on the char transformer, measured by bench/fsdp_convergence.py):
# 60 steps of sign on a small task still oscillate (its last evals: 0.77, 0.87, 0.79).
HSDP_CONVERGENCE_BOUNDS = {"qsgd:bits=4": 1.02, "topk:density=0.1": 1.03, "sign": 1.15}


@pytest.mark.timeout(540)
def test_hsdp_compressed_trains_within_bound_of_native_hsdp():
    # 55 s on a quiet machine, 130 s at load 10; the spawn timeout fires before pytest's
    res = spawn(F.hsdp_convergence, 4, list(HSDP_CONVERGENCE_BOUNDS), 60, timeout=480)

    def final(evals):
        return sum(evals[-3:]) / 3

    dense = res[0]["dense"]["evals"]
    assert final(dense) < 0.7 * dense[0], dense  # the task is learnt: a bound on a flat loss says nothing
    for spec, bound in HSDP_CONVERGENCE_BOUNDS.items():
        ratio = final(res[0][spec]["evals"]) / final(dense)
        assert ratio <= bound, (spec, ratio, res[0][spec]["evals"], dense)
        by_shard = {}
        for r in res:  # every rank evaluated the same full model; replicas hold the same bits
            assert r[spec]["evals"] == res[0][spec]["evals"] and r[spec]["nonfinite"] == 0
            by_shard.setdefault(r[spec]["shard_rank"], []).append(r[spec]["local"])
        for replicas in by_shard.values():
            assert torch.equal(replicas[0], replicas[1]), spec

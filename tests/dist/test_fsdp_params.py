"""The quantized parameter all-gather on gloo ranks: every rank computes with the same
unsharded parameters (bitwise, after 200 steps), close to the fp32 masters by the codec's
bound; resume is bitwise; quality at equal steps within a bound of plain FSDP2."""

import functools

import pytest
import torch

from comms.cluster.launch import spawn
from compressors.blockquant import BlockQuantizer
from dist import fsdp_param_ranks as P, fsdp_ranks as F

pytestmark = [pytest.mark.dist]


@pytest.mark.parametrize("world,params", [(2, "int8"), (3, "int4")])
def test_every_rank_computes_with_the_same_parameters_after_200_steps(world, params):
    res = spawn(P.int8_after_steps, world, "sign", 200, params, timeout=600)
    levels = 127 if params == "int8" else 7
    for r in res:
        used, master = r["used"][0], r["master"]
        for other in r["used"][1:]:
            assert all(torch.equal(a, b) for a, b in zip(used, other))  # bitwise, every rank
        # what a forward uses is the master quantized: within half a step of its block's
        # scale (a block may span parameters of one module: bounded by the largest master)
        top = max(float(m.abs().max()) for m in master)
        for u, m in zip(used, master):
            bound = top / levels / 2 * (1 + 1e-5)
            assert (u - m).abs().max() <= bound
            assert not torch.equal(u, m) or m.numel() < 4
        assert all(v == v for v in r["losses"])
        # every call sends the codec's payload (codes + a scale per 256 elements) to each peer
        codec = BlockQuantizer(int(params[3:]))
        for wire, dense, calls in r["wire"].values():
            n = dense // (calls * (world - 1) * 4)
            assert calls > 0 and wire == calls * (world - 1) * codec.payload_bytes(n)
    assert torch.equal(res[0]["master"][0], res[-1]["master"][0])


def test_resume_with_quantized_parameters_is_bitwise(tmp_path):
    res = spawn(functools.partial(F.resume_run, params="int8"), 2, "topk:density=0.1", str(tmp_path), timeout=600)
    for r in res:
        assert r["params"] == "int8"
        assert torch.equal(r["straight"], r["resumed"])


def test_int8_parameters_alone_keep_the_loss_of_plain_fsdp2():
    plain = spawn(P.teacher_losses, 2, None, 150, timeout=600)[0]
    int8 = spawn(P.teacher_losses, 2, "identity", 150, "int8", timeout=600)[0]
    assert plain[-1] < 0.8 * plain[0]  # the task is learned
    assert int8[-1] <= 1.02 * plain[-1], (int8[-1], plain[-1])


def test_bad_params_value_changes_nothing():
    for r in spawn(P.bad_params, 2, timeout=120):
        assert r["error"] is not None and "'int3'" in r["error"] and "params" in r["error"]
        assert set(r["gathers"]) == {"DefaultAllGather"}
        assert set(r["scatters"]) == {"DefaultReduceScatter"}


def test_reduce_scatter_overlapping_backward_is_bitwise_the_synchronous_one():
    for r in spawn(P.overlap_vs_synchronous, 2, "qsgd:bits=4", 6, timeout=300):
        assert r["overlap"]["deferred"] == 6 * 3 and r["sync"]["deferred"] == 0  # 3 modules
        assert torch.equal(r["overlap"]["local"], r["sync"]["local"])


def test_accumulating_into_existing_gradients_stays_synchronous_and_exact():
    # the second backward of a step adds into the first one's gradients: FSDP reads the
    # output at once, so only the first backward's reduce-scatters may overlap
    for r in spawn(P.overlap_vs_synchronous, 2, "qsgd:bits=4", 4, 2, timeout=300):
        assert r["overlap"]["deferred"] == 4 * 3
        assert torch.equal(r["overlap"]["local"], r["sync"]["local"])


def test_bf16_parameters_gather_int8_codes_into_bf16():
    res = spawn(P.bf16_parameters, 2, 20, timeout=300)
    for r in res:
        used = r["used"]
        assert all(t.dtype == torch.bfloat16 for t in used[0])
        assert all(torch.equal(a, b) for a, b in zip(used[0], used[1]))
        assert all(v == v for v in r["losses"]) and sum(r["losses"][-5:]) < sum(r["losses"][:5])
        assert r["calls"] > 0


def test_auto_params_forward_and_backward_see_the_same_parameters_every_step():
    # the default path (params="auto", algorithm="auto") tunes full vs int8 per module: each
    # step's forward and backward all-gathers take the same route (a decision applies from
    # the next step), so both compute with the same parameters, on every rank
    res = spawn(P.forward_backward_parameters, 2, "qsgd:bits=4", 14, timeout=300)
    for r in res:
        assert r["params"] == "tuned"
        assert r["differ"] == [0] * 14, r["differ"]
        # the tuning steps used both routes: some forwards on the masters, some on int8 codes
        routes = [x for step in r["full_route"] for x in step]
        assert any(routes) and not all(routes), r["full_route"]
        assert r["decision"], r  # every module decided within the 14 steps
    assert res[0]["digests"][0] == res[0]["digests"][1]

"""End to end on one GPU: the hook runs the kernels (launches counted), NCCL at world size 1
gives the torch path's bits where the formats are device-independent, and 2 gloo ranks sharing
the GPU with CUDA tensors keep bitwise-identical replicas."""

import pytest
import torch

from comms.launch import spawn
from ranks_gpu import gloo_ranks_on_one_gpu, nccl_world1

pytestmark = [pytest.mark.timeout(300)]

# (spec, algorithm, kernels that must have run)
CASES = [
    ("qsgd:bits=4", "allgather", {"qsgd_quantize_fused", "qsgd_dequantize"}),
    ("qsgd:bits=8", "two_phase", {"qsgd_quantize_fused", "two_phase_qsgd_owner"}),
    ("sign", "allgather", {"sign_pack", "sign_decode"}),
    ("topk:density=0.01,exact=false", "allgather", {"topk_compact", "topk_scatter_add"}),
    ("qsgd:bits=8", "shared_scale", {"shared_scale_encode", "shared_scale_decode"}),
]


@pytest.mark.parametrize("spec,alg,expected", CASES, ids=[f"{s}-{a}" for s, a, _ in CASES])
def test_nccl_world1_runs_the_kernels(spec, alg, expected):
    if not torch.distributed.is_nccl_available():
        pytest.skip("torch built without NCCL")
    got = nccl_world1(spec, alg, kernels=True)
    missing = expected - set(got["launches"])
    assert not missing, f"kernels not launched: {sorted(missing)} (launched {got['launches']}); " \
                        "are the compressors/algorithms wired to compressors.cuda.dispatch?"
    assert torch.isfinite(got["params"]).all()
    ref = nccl_world1(spec, alg, kernels=False)
    assert not ref["launches"]
    # bit-identity is the contract: the kernels give the torch path's bits on the same device
    # (QSGD's reference divides by a tensor, so torch on CUDA divides truly like the kernels)
    assert torch.equal(got["params"], ref["params"]), f"{spec}/{alg}: kernels and torch path differ"


def test_two_gloo_ranks_sharing_the_gpu_keep_replicas_identical():
    cases = [(s, a) for s, a, _ in CASES if a != "shared_scale"] + [("qsgd:bits=8", "shared_scale")]
    out = spawn(gloo_ranks_on_one_gpu, 2, cases, timeout=280)
    ref = spawn(gloo_ranks_on_one_gpu, 2, cases, False, timeout=280)  # the torch path, same setup
    for i, (spec, alg) in enumerate(cases):
        r0, r1 = out[0][i], out[1][i]
        assert r0["launches"], f"{spec}/{alg}: no kernel ran"
        assert not ref[0][i]["launches"], f"{spec}/{alg}: the torch-path run launched kernels"
        assert torch.equal(r0["params"], r1["params"]), f"{spec}/{alg}: replicas differ"
        # and the replicas are the reference's, not merely equal to each other
        assert torch.equal(r0["params"], ref[0][i]["params"]), f"{spec}/{alg}: kernels differ from the torch path"
        assert torch.isfinite(r0["params"]).all()

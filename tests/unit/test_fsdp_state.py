"""FSDPCompressionState without process groups: option validation, weights_only state_dict,
load validation."""

import io

import pytest
import torch

from comms.fsdp import FSDPCompressionState


@pytest.mark.parametrize("spec", ["identity", "fp16", "bf16", "qsgd:bits=4", "sign", "topk:density=0.1",
                                  "randomk:density=0.1"])
def test_supported_compressors_and_default_error_feedback(spec):
    st = FSDPCompressionState(spec)
    assert st.mode == "fsdp" and st.algorithm == "auto"
    # the default parameter all-gather: full or int8 by measured calls for a lossy compressor;
    # the identity stays full precision (bitwise plain FSDP2)
    assert st.params == ("full" if spec == "identity" else "tuned")
    assert FSDPCompressionState(spec, algorithm="scatter_reduce").params == ("full" if spec == "identity" else "int8")
    assert st.error_feedback == (spec not in ("identity", "qsgd:bits=4"))
    assert FSDPCompressionState(spec, error_feedback=False).error_feedback is False


@pytest.mark.parametrize("kw, err, words", [
    (dict(compressor="powersgd:rank=1"), ValueError, "cannot compress the FSDP reduce-scatter"),
    (dict(compressor="topk:density=0"), ValueError, "density"),
    (dict(compressor=3), TypeError, "compressor"),
    (dict(compressor="sign", seed=1.5), TypeError, "seed"),
    (dict(compressor="sign", start_iter=-1), ValueError, "start_iter"),
    (dict(compressor="sign", error_feedback="yes"), TypeError, "error_feedback"),
    (dict(compressor="sign", algorithm="two_phase"), ValueError, "HSDP"),
    (dict(compressor="sign", replicate_group=object()), TypeError, "replicate_group"),
    (dict(compressor="sign", params="int3"), ValueError, "params must be one of"),
    (dict(compressor="sign", params=8), ValueError, "params must be one of"),
])
def test_bad_options_name_the_value(kw, err, words):
    with pytest.raises(err, match=words):
        FSDPCompressionState(**kw)


def test_state_dict_is_weights_only_and_round_trips():
    st = FSDPCompressionState("topk:density=0.1", seed=3)
    st.modules = ["", "layers.0"]
    st.steps = {0: 4, 1: 4}
    st.memory.update_(0, torch.arange(6.0), torch.zeros(6))
    buf = io.BytesIO()
    torch.save(st.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    new = FSDPCompressionState("topk:density=0.1")
    new.modules = ["", "layers.0"]
    new.load_state_dict(sd)
    assert new.seed == 3 and new.steps == {0: 4, 1: 4}
    assert torch.equal(new.memory.residuals[0], torch.arange(6.0))
    assert new.residual_bytes() == 24


@pytest.mark.parametrize("change, words", [
    (dict(compressor="sign"), "compressor"), (dict(modules=["other"]), "modules"),
    (dict(error_feedback=False), "error_feedback"), (dict(params="int4"), "params")])
def test_load_refuses_another_configuration_before_changing_anything(change, words):
    st = FSDPCompressionState("topk:density=0.1")
    st.modules = ["a"]
    st.steps = {0: 2}
    sd = st.state_dict()
    other = FSDPCompressionState(change.get("compressor", "topk:density=0.1"),
                                 error_feedback=change.get("error_feedback"), params=change.get("params"))
    other.modules = change.get("modules", ["a"])
    with pytest.raises(ValueError, match=words):
        other.load_state_dict(sd)
    assert other.steps == {} and other.memory.residuals == {}
    with pytest.raises(TypeError):
        other.load_state_dict({"iter": 0})

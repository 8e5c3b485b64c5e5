"""Bad input: each a ValueError/TypeError naming the value, raised before
any communication; world size 1 and empty buckets need no communication at all."""

import pickle

import pytest
import torch

import comms
from comms import CompressionState, compression_hook


class RecordingComm(comms.Communicator):
    """A communicator that records every call and never communicates."""

    backend = "fake"

    def __init__(self, world=2, rank=0):
        self.rank, self.world_size, self.calls = rank, world, []

    def _call(self, name, t):
        self.calls.append(name)
        raise AssertionError(f"{name} called: communication was not expected")

    def all_reduce(self, t):
        return self._call("all_reduce", t)

    def all_gather(self, t):
        return self._call("all_gather", t)

    def all_to_all(self, t):
        return self._call("all_to_all", t)

    def reduce_scatter(self, t):
        return self._call("reduce_scatter", t)

    def broadcast(self, t, src=0):
        return self._call("broadcast", t)


class FakeBucket:
    """Duck-typed ``dist.GradBucket``."""

    def __init__(self, buf, index=0, last=True):
        self._buf, self._index, self._last = buf, index, last
        self._params = [torch.nn.Parameter(torch.zeros(buf.numel()))] if buf.is_floating_point() else []

    def buffer(self):
        return self._buf

    def index(self):
        return self._index

    def is_last(self):
        return self._last

    def parameters(self):
        return self._params


CTOR_CASES = [
    # (kwargs for CompressionState, exception, text the message must name)
    ({"compressor": "nosuch"}, ValueError, "nosuch"),
    ({"compressor": "topk:density"}, ValueError, "density"),
    ({"compressor": "topk:density=0"}, ValueError, "0"),
    ({"compressor": "topk:density=1.5"}, ValueError, "1.5"),
    ({"compressor": "randomk:density=-0.1"}, ValueError, "-0.1"),
    ({"compressor": "qsgd:bits=3"}, ValueError, "3"),
    ({"compressor": "qsgd:chunk=0"}, ValueError, "0"),
    ({"compressor": "sign:chunk=0"}, ValueError, "0"),
    ({"compressor": "topk:dens=0.1"}, ValueError, "dens"),
    ({"compressor": "topk:density=0.1,density=0.2"}, ValueError, "density"),
    ({"compressor": 123}, TypeError, "123"),
    ({"compressor": "topk:density=0.1", "algorithm": "allreduce"}, ValueError, "allreduce"),
    ({"compressor": "qsgd:bits=4", "algorithm": "allreduce"}, ValueError, "allreduce"),
    ({"compressor": "sign", "algorithm": "warp"}, ValueError, "warp"),
    ({"compressor": "sign", "algorithm": 3}, TypeError, "3"),
    ({"compressor": "sign", "start_iter": -1}, ValueError, "-1"),
    ({"compressor": "sign", "start_iter": 1.5}, TypeError, "1.5"),
    ({"compressor": "sign", "start_iter": True}, TypeError, "True"),
    ({"compressor": "sign", "seed": 1.5}, TypeError, "1.5"),
    ({"compressor": "sign", "seed": "7"}, TypeError, "'7'"),
    ({"compressor": "sign", "process_group": "world"}, TypeError, "str"),
    ({"compressor": "sign", "process_group": 0}, TypeError, "int"),
    ({"compressor": "sign", "communicator": object()}, TypeError, "object"),
    ({"compressor": "sign", "error_feedback": "yes"}, TypeError, "yes"),
    ({"compressor": "sign", "min_compress_numel": -5}, ValueError, "-5"),
    ({"compressor": "sign", "min_compress_numel": 2.5}, TypeError, "2.5"),
]


@pytest.mark.parametrize("kwargs,exc,text", CTOR_CASES, ids=[str(c[0]) for c in CTOR_CASES])
def test_bad_option_raises_naming_the_value(kwargs, exc, text):
    kwargs = dict(kwargs)
    with pytest.raises(exc) as info:
        CompressionState(kwargs.pop("compressor"), **kwargs)
    assert text in str(info.value)


def test_both_group_and_communicator_refused():
    import torch.distributed as dist

    class PG(dist.ProcessGroup):
        def __init__(self):
            super().__init__(0, 1)

    with pytest.raises(ValueError, match="either process_group or communicator"):
        CompressionState("sign", PG(), communicator=RecordingComm())


def test_make_hook_unknown_option_named():
    with pytest.raises(TypeError, match="bogus"):
        comms.make_hook("sign", bogus=1)


def test_register_needs_a_ddp_model():
    with pytest.raises(TypeError, match="Linear"):
        comms.register(torch.nn.Linear(4, 4), "sign")


def test_check_replicas_needs_a_module():
    with pytest.raises(TypeError, match="list"):
        comms.check_replicas([torch.zeros(3)])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
def test_integer_gradients_refused_before_communication(dtype):
    comm = RecordingComm(world=2)
    state = CompressionState("topk:density=0.5", communicator=comm, start_iter=0)
    with pytest.raises(TypeError, match=str(dtype).replace("torch.", "")):
        compression_hook(state, FakeBucket(torch.arange(8, dtype=dtype)))
    assert comm.calls == [] and state.iter == 0


def test_world_size_one_needs_no_communication():
    comm = RecordingComm(world=1)
    state = CompressionState("topk:density=0.25", communicator=comm, start_iter=0)
    g = torch.randn(64)
    buf = g.clone()
    out = compression_hook(state, FakeBucket(buf)).wait()
    assert comm.calls == [] and torch.equal(out, g)  # the average over one rank is exact
    assert state.iter == 1 and state.memory.residuals == {}


def test_empty_bucket_needs_no_communication():
    comm = RecordingComm(world=2)
    state = CompressionState("topk:density=0.25", communicator=comm, start_iter=0)
    out = compression_hook(state, FakeBucket(torch.empty(0))).wait()
    assert comm.calls == [] and out.numel() == 0 and state.iter == 1


def test_load_state_dict_validates_before_changing_anything():
    state = CompressionState("topk:density=0.1", start_iter=0)
    sd = CompressionState("topk:density=0.2").state_dict()
    sd["iter"] = 99
    with pytest.raises(ValueError, match="density=0.2"):
        state.load_state_dict(sd)
    assert state.iter == 0
    with pytest.raises(TypeError, match="list"):
        state.load_state_dict([1, 2])


def test_state_dict_refuses_what_weights_only_cannot_load():
    state = CompressionState("sign")
    state.store(3)["gen"] = torch.Generator()
    with pytest.raises(TypeError, match=r"algo_store\[3\]\['gen'\]"):
        state.state_dict()


def test_state_dict_round_trip_weights_only(tmp_path):
    state = CompressionState("topk:density=0.1", start_iter=0, seed=5)
    state.iter = 7
    state.memory.residuals[0] = torch.arange(6, dtype=torch.float32)
    state.store(0).update({"owner_residual": torch.ones(3), "rank": 2, "shape": (2, 3)})
    state.layouts[0] = ("0.weight", "0.bias")
    torch.save(state.state_dict(), tmp_path / "s.pt")
    fresh = CompressionState("topk:density=0.1", start_iter=0, seed=5)
    fresh.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert fresh.iter == 7 and torch.equal(fresh.memory.residuals[0], torch.arange(6.0))
    assert torch.equal(fresh.algo_store[0]["owner_residual"], torch.ones(3))
    assert fresh.algo_store[0]["shape"] == (2, 3) and fresh.layouts[0] == ("0.weight", "0.bias")


def test_state_pickles_without_its_process_group():
    state = CompressionState("sign", communicator=RecordingComm())
    state.iter = 4
    back = pickle.loads(pickle.dumps(state))
    assert back.communicator is None and back.process_group is None
    assert back.iter == 4 and back.compressor == state.compressor and back.flags.pending == []

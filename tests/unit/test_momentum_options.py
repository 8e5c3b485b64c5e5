"""The training options: momentum correction, masking, clipping, the residual bound, the optimizer
pairing — validation before any communication, the local arithmetic, and the checkpoint."""

import io
import warnings

import pytest
import torch

import comms
from comms import CompressionState
from comms.core.memory import LocalMemory


@pytest.mark.parametrize("kw, exc", [
    ({"momentum": 1.0}, ValueError), ({"momentum": -0.1}, ValueError),
    ({"momentum": "0.9"}, TypeError), ({"momentum": True}, TypeError),
    ({"clip_norm": 0.0}, ValueError), ({"clip_norm": float("inf")}, ValueError),
    ({"clip_norm": "1"}, TypeError), ({"momentum_masking": 1}, TypeError),
    ({"momentum_masking": "always"}, TypeError),
    ({"residual_bound": 0.5}, ValueError), ({"residual_bound": "big"}, ValueError),
])
def test_bad_options_name_the_value(kw, exc):
    name = next(iter(kw))
    with pytest.raises(exc, match=name):
        CompressionState("topk:density=0.01", None, algorithm="allgather", **kw)


def test_residual_bound_defaults():
    assert CompressionState("randomk:density=0.01", None, algorithm="allreduce").residual_bound == 5.0
    assert CompressionState("topk:density=0.01", None, algorithm="allgather").residual_bound is None
    assert CompressionState("randomk", None, algorithm="allreduce", residual_bound=None).residual_bound is None


def test_momentum_correction_and_masking_arithmetic():
    mem = LocalMemory()
    g1, g2 = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 0.5, 0.5])
    x = g1.clone()
    mem.momentum_(0, x, 0.9)
    assert torch.equal(x, g1)  # first step: u = g, like SGD's first momentum buffer
    mem.mask_velocity_(0, torch.tensor([0.0, 7.0, 0.0]))  # coordinate 1 was sent
    x = g2.clone()
    mem.momentum_(0, x, 0.9)
    want = torch.tensor([1.0, 0.0, 3.0]).mul_(0.9).add_(g2)
    assert torch.equal(x, want) and torch.equal(mem.velocities[0], want)
    mem.reset(0)
    assert 0 not in mem.velocities


def test_mask_velocity_with_aggregate_zeroes_only_what_it_left_out():
    mem = LocalMemory()
    mem.velocities[0] = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    sent = torch.tensor([0.0, 7.0, 7.0, -0.0, 7.0])  # -0.0 is not a sent value
    aggregate = torch.tensor([0.0, 9.0, 0.0, 0.0, -0.0])  # coordinates 2 and 4 held back
    mem.mask_velocity_(0, sent, aggregate)
    assert torch.equal(mem.velocities[0], torch.tensor([1.0, 2.0, 0.0, 4.0, 0.0]))
    mem.mask_velocity_(0, sent[:4], aggregate[:4])  # another layout: left alone
    assert torch.equal(mem.velocities[0], torch.tensor([1.0, 2.0, 0.0, 4.0, 0.0]))


def test_update_returned_keeps_what_the_aggregate_left_out():
    mem = LocalMemory()
    x = torch.tensor([1.5, -2.0, 3.0, -0.0, 0.25, float("nan")])
    sent = torch.tensor([1.5, -2.0, 0.0, 0.0, 0.125, 0.0])
    aggregate = torch.tensor([3.0, 0.0, 1.0, -0.0, 0.5, 7.0])  # coordinate 1 left out; 3 is -0
    r = mem.update_returned_(0, x, sent, aggregate)
    want = torch.tensor([0.0, -2.0, 3.0, -0.0, 0.125, float("nan")])
    assert r is mem.residuals[0] and torch.equal(r.isnan(), want.isnan())
    assert torch.equal(r[:5], want[:5])
    assert torch.equal(torch.signbit(r[:5]), torch.signbit(want[:5]))  # x itself where left out
    # delivered coordinates: the bits of update_ (x - sent); the buffer is reused
    y = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    s2 = torch.where(torch.arange(1000) % 7 == 0, y, torch.zeros(()))
    agg = torch.where(torch.arange(1000) % 14 == 0, s2 * 3, torch.zeros(()))
    r2 = mem.update_returned_(1, y, s2, agg)
    assert torch.equal(r2, torch.where(agg != 0, y - s2, y))
    assert mem.update_returned_(1, y, s2, agg).data_ptr() == r2.data_ptr()
    assert torch.equal(r2[agg == 0], y[agg == 0]) and (r2[agg != 0] == 0).all()


@pytest.mark.parametrize("value, mode", [("held", "held"), ("sent", "sent"), ("off", "off"),
                                         (True, "sent"), (False, "off")])
def test_momentum_masking_modes(value, mode):
    st = CompressionState("topk:density=0.01", None, algorithm="allgather", momentum_masking=value)
    assert st.momentum_masking == mode
    assert CompressionState("topk", None, algorithm="allgather").momentum_masking == "held"


def test_checkpoint_with_a_bool_masking_loads_as_its_mode():
    sd = CompressionState("topk:density=0.01", None, algorithm="allgather", momentum=0.9,
                          momentum_masking="sent").state_dict()
    sd["momentum_masking"] = True  # what checkpoints held before the modes existed
    CompressionState("topk:density=0.01", None, algorithm="allgather", momentum=0.9,
                     momentum_masking="sent").load_state_dict(sd)
    with pytest.raises(ValueError, match="momentum_masking='sent'"):
        CompressionState("topk:density=0.01", None, algorithm="allgather",
                         momentum=0.9).load_state_dict(sd)


def test_which_warm_up_steps_go_dense():
    # a variant above 15% density, or one whose bytes exceed half a dense step's, goes dense
    from comms.algorithms import get_algorithm
    from comms.algorithms.dense import dense_allreduce
    from comms.core.stages import WARM_DENSE_DENSITY, warm_step_goes_dense
    from compressors import TopK

    def _warm_step_goes_dense(alg, c, x, world):  # the engine's rule on a DDP bucket
        n, dt = x.numel(), x.dtype
        return warm_step_goes_dense(c, alg.wire_bytes(c, n, dt, world), dense_allreduce.wire_bytes(None, n, dt, world))

    x = torch.zeros(10_000)
    ag, tp = get_algorithm("allgather"), get_algorithm("two_phase")
    assert WARM_DENSE_DENSITY == 0.15
    assert _warm_step_goes_dense(ag, TopK(0.2), x, 2) and not _warm_step_goes_dense(ag, TopK(0.1), x, 2)
    # allgather: (world - 1) * 8 * d * n bytes against 8 (world - 1) / world * n: d * world dense steps
    assert not _warm_step_goes_dense(ag, TopK(0.1), x, 4) and _warm_step_goes_dense(ag, TopK(0.1), x, 6)
    assert not _warm_step_goes_dense(tp, TopK(0.1), x, 8)  # two_phase's bytes do not grow so
    q = CompressionState("qsgd:bits=4", None, warmup_steps=4).compressor_at(2)  # 8 bits: no density
    assert q.bits == 8 and not _warm_step_goes_dense(ag, q, x, 2)


def test_a_checkpoint_from_before_the_default_warm_up_loads_once_the_ramps_are_over():
    # saved without a warm-up (the default before top-k's 5 steps): a mismatch while either
    # ramp still has steps to run is an error; past both it changes nothing and loads
    old = CompressionState("topk:density=0.01", None, algorithm="allgather", warmup_steps=0)
    new = CompressionState("topk:density=0.01", None, algorithm="allgather")  # start_iter 2, W 5
    for it, loads in ((6, False), (7, True), (100, True)):
        old.iter = it
        sd = old.state_dict()
        fresh = CompressionState("topk:density=0.01", None, algorithm="allgather")
        if loads:
            fresh.load_state_dict(sd)
            assert fresh.iter == it and fresh.warmup_steps == new.warmup_steps == 5
        else:
            with pytest.raises(ValueError, match="warmup_steps=0"):
                fresh.load_state_dict(sd)


def test_state_dict_holds_velocities_and_options():
    st = CompressionState("topk:density=0.01", None, algorithm="allgather", momentum=0.9, clip_norm=2.0)
    st.memory.velocities[3] = torch.arange(4.0)
    sd = st.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert torch.equal(back["memory"]["velocities"][3], torch.arange(4.0))
    assert (back["momentum"], back["clip_norm"], back["momentum_masking"]) == (0.9, 2.0, "held")
    fresh = CompressionState("topk:density=0.01", None, algorithm="allgather", momentum=0.9, clip_norm=2.0)
    fresh.load_state_dict(back)
    assert torch.equal(fresh.memory.velocities[3], torch.arange(4.0))
    other = CompressionState("topk:density=0.01", None, algorithm="allgather", momentum=0.5, clip_norm=2.0)
    with pytest.raises(ValueError, match="momentum"):
        other.load_state_dict(back)


def _sgd(**kw):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, **kw)


def test_take_over_momentum_and_check_optimizer():
    opt = _sgd(momentum=0.9)
    assert comms.take_over_momentum(opt) == 0.9 and opt.param_groups[0]["momentum"] == 0.0
    assert comms.take_over_momentum(_sgd()) is None
    for bad in (_sgd(momentum=0.9, nesterov=True), _sgd(momentum=0.9, dampening=0.1)):
        with pytest.raises(ValueError, match="nesterov|dampening"):
            comms.take_over_momentum(bad)
        assert bad.param_groups[0]["momentum"] == 0.9  # unchanged
    with pytest.raises(TypeError, match="Optimizer"):
        comms.take_over_momentum("sgd")
    hooked = CompressionState("sign", None, algorithm="allgather", momentum=0.9)
    with pytest.raises(ValueError, match="twice"):
        comms.check_optimizer(hooked, _sgd(momentum=0.9))
    comms.check_optimizer(hooked, _sgd())
    plain = CompressionState("sign", None, algorithm="allgather")
    with pytest.warns(UserWarning, match="can diverge"):
        comms.check_optimizer(plain, _sgd(momentum=0.9))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        comms.check_optimizer(CompressionState("qsgd:bits=4", None, algorithm="allgather"),
                              _sgd(momentum=0.9))  # no error feedback: nothing to warn about
        # PowerSGD keeps error feedback but pairs with the optimizer's momentum (on the average)
        psgd = CompressionState("powersgd:rank=1", None, algorithm="allreduce")
        assert psgd.error_feedback and not psgd.compressor.momentum_correction
        comms.check_optimizer(psgd, _sgd(momentum=0.9))


def test_warmup_ramps_density_then_keeps_the_compressor():
    st = CompressionState("topk:density=0.01", None, algorithm="allgather", start_iter=2, warmup_steps=4)
    dens = [st.compressor_at(s).density for s in range(2, 8)]
    want = [0.01 ** (k / 5) for k in (1, 2, 3, 4)]
    assert dens[:4] == pytest.approx(want) and dens[4:] == [0.01, 0.01]
    assert st.compressor_at(7) is st.compressor and not st._warm
    q = CompressionState("qsgd:bits=4", None, algorithm="allgather", start_iter=0, warmup_steps=4)
    assert [q.compressor_at(s).bits for s in range(5)] == [8, 8, 4, 4, 4]
    with pytest.raises(ValueError, match="warmup_steps"):
        CompressionState("sign", None, algorithm="allgather", warmup_steps=-1)


def test_warmup_auto_is_the_compressors_default():
    # top-k ramps over 5 compressed steps by default (DGC); the others have no default ramp
    st = CompressionState("topk:density=0.01", None, algorithm="allgather")
    assert st.warmup_steps == 5 and st.compressor_at(st.start_iter).density == pytest.approx(0.01 ** (1 / 6))
    assert st.compressor_at(st.start_iter + 5) is st.compressor
    for spec in ("sign", "qsgd:bits=4", "randomk:density=0.01", "powersgd:rank=1", "fp16"):
        assert CompressionState(spec, None).warmup_steps == 0, spec
    assert CompressionState("topk:density=0.01", None, warmup_steps=0).warmup_steps == 0
    with pytest.raises(ValueError, match="warmup_steps must be 'auto' or an int >= 0, got 'fast'"):
        CompressionState("topk:density=0.01", None, warmup_steps="fast")


def test_only_two_phase_holds_back():
    """The default masking acts only where an algorithm can leave out what a rank sent: flat
    two_phase (its owner's re-compression). The hierarchical forms' own contribution is
    dense, so masking by the aggregate there would zero nearly every velocity."""
    from comms.algorithms import ALGORITHMS

    held = sorted(name for name, alg in ALGORITHMS.items() if alg.holds_back)
    assert held == ["two_phase"], held
    assert {"allgather", "allreduce", "shared_scale", "hier_two_phase"} <= set(ALGORITHMS)


def _build(**kw):
    return CompressionState("topk:density=0.01", None, algorithm="allgather", **kw)


def test_a_restored_optimizer_keeps_the_take_over_and_reports_a_state_not_loaded(caplog):
    from comms.core.checkpoint import settle
    from comms.core.pairing import PAIRED_KEY, give_back_momentum, pair_optimizer

    opt = _sgd(momentum=0.9)
    state, taken = pair_optimizer(opt, _build, {})
    assert state.momentum == 0.9 and opt.param_groups[0]["momentum"] == 0.0
    assert opt.param_groups[0][PAIRED_KEY] == 0.9
    saved = opt.state_dict()
    with caplog.at_level("WARNING"):
        opt.step()  # a fresh optimizer: nothing to report
    assert not caplog.records

    for load in (False, True):  # a resumed run, its commpress state loaded or not
        again = _sgd(momentum=0.9)
        again.load_state_dict(saved)  # momentum 0, marked 0.9
        resumed, _ = pair_optimizer(again, _build, {})
        assert resumed.momentum == 0.9  # the take-over, from the mark
        if load:
            resumed.load_state_dict(state.state_dict())
        caplog.clear()
        with caplog.at_level("WARNING"):
            again.step()
            again.step()
        msgs = [r.getMessage() for r in caplog.records]
        assert len(msgs) == (0 if load else 1), msgs
        assert load or "was not loaded before the first step" in msgs[0]

    for saved_by, warns in ((saved, 1), (_sgd(momentum=0.9).state_dict(), 0)):
        # README's order: register, then load the optimizer (a commpress run's, or a plain run's)
        later = _sgd(momentum=0.9)
        kept, _ = pair_optimizer(later, _build, {})  # DDP holds the state; here the test does
        later.load_state_dict(saved_by)
        assert later.param_groups[0][PAIRED_KEY] == 0.9  # a plain run's groups get the mark back
        caplog.clear()
        with caplog.at_level("WARNING"):
            later.step()
        assert len(caplog.records) == warns, [r.getMessage() for r in caplog.records]
        assert kept.momentum == 0.9

    opt = _sgd(momentum=0.9)  # a registration that fails afterwards leaves nothing behind
    _, taken = pair_optimizer(opt, _build, {})
    give_back_momentum(opt, taken)
    assert opt.param_groups[0]["momentum"] == 0.9 and PAIRED_KEY not in opt.param_groups[0]
    settle(state)


def test_a_state_saved_by_another_rank_is_refused():
    state = _build()
    sd = state.state_dict()
    assert (sd["rank"], sd["world"]) == (0, 1)
    _build().load_state_dict(sd)
    for rank, world in ((1, 2), (0, 2)):
        with pytest.raises(ValueError, match=f"saved by rank {rank} of {world}; this process is rank 0 of 1"):
            _build().load_state_dict({**sd, "rank": rank, "world": world})
    legacy = {k: v for k, v in sd.items() if k not in ("rank", "world")}
    _build().load_state_dict(legacy)  # a checkpoint from before the stamp


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "later"])
def test_adam_freeze_is_checked_up_front(bad):
    from comms.integrations.pairing import check_options
    from comms.core.pairing import check_adam_freeze

    with pytest.raises(ValueError, match=f"adam_freeze must be .*got {bad!r}"):
        check_adam_freeze(bad)
    with pytest.raises(ValueError, match="adam_freeze"):
        check_options("sign", {"adam_freeze": bad})
    for good in ("auto", None, 1, 40):
        check_adam_freeze(good)

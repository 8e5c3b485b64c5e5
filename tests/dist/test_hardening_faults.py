"""Faults on gloo ranks: an injected NaN, a killed rank, a stopped rank,
configurations that differ between ranks, a second registration."""

import logging
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import comms
from comms.cluster.launch import spawn
from dist.ranks import batch, flat_params, make_model

pytestmark = [pytest.mark.dist]

NAN_STEPS = (3, 5)


class _Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _nan_run(rank, spec, alg, extra=None):
    torch.manual_seed(0)
    model = DDP(make_model(), bucket_cap_mb=0.01)
    opts = {"start_iter": 1, **(extra or {})}
    state = comms.register(model, spec, algorithm=alg, **opts) if spec else None
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    first = model.module[0].weight
    log = _Count()
    logging.getLogger("comms.ddp.hook").addHandler(log)
    steps = []
    for step in range(8):
        x, y = batch(rank, step)
        opt.zero_grad()
        handle = None
        if rank == 1 and step in NAN_STEPS:  # one NaN in one gradient element of one rank
            handle = first.register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])),
                                                               torch.tensor(float("nan"))))
        before = flat_params(model.module)
        scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
        if handle:
            handle.remove()
        finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        keys = None if state is None else sorted(state.memory.residuals)
        steps.append({"finite": finite, "skipped": torch.equal(before, flat_params(model.module)),
                      "scale_dropped": scaler.get_scale() < scale, "residuals": keys})
    logging.getLogger("comms.ddp.hook").removeHandler(log)
    comms.check_replicas(model)
    return {"steps": steps, "params": flat_params(model.module),
            "warnings": [m for m in log.messages if "non-finite" in m],
            "nonfinite": state.nonfinite_buckets if state else None,
            "residual_finite": state is None or all(torch.isfinite(r).all() for r in state.memory.residuals.values())}


NAN_CASES = [(None, None), ("topk:density=0.05", "allgather"), ("randomk:density=0.1", "allreduce"),
             ("topk:density=0.05,exact=false", "allgather"), ("qsgd:bits=4", "allgather"),
             ("sign", "allgather"), ("fp16", "allreduce"),
             # dense steps with the hook's momentum (every step before start_iter): a NaN that
             # reached the velocity would keep every later step NaN unless flagged and reset
             ("topk:density=0.05", "allgather")]
NAN_EXTRA = {7: {"momentum": 0.9, "start_iter": 100}}


def _nan_body(rank, world):
    return [_nan_run(rank, spec, alg, NAN_EXTRA.get(i)) for i, (spec, alg) in enumerate(NAN_CASES)]


@pytest.mark.timeout(180)
def test_nan_reaches_every_rank_and_never_poisons_error_feedback():
    res = spawn(_nan_body, 2, timeout=160)
    plain = res[0][0]
    for i, (spec, alg) in enumerate(NAN_CASES):
        for r in range(2):
            out = res[r][i]
            for step, s in enumerate(out["steps"]):
                # the same outcome as plain allreduce: every rank sees the NaN, GradScaler skips
                assert s["finite"] == (step not in NAN_STEPS) == plain["steps"][step]["finite"], (spec, r, step)
                assert s["skipped"] == (step in NAN_STEPS), (spec, r, step)
                assert s["scale_dropped"] == (step in NAN_STEPS), (spec, r, step)
            assert torch.isfinite(out["params"]).all(), spec
            assert torch.equal(out["params"], res[0][i]["params"]), (spec, r)  # replicas
            if spec is None:
                continue
            assert out["residual_finite"], spec
            assert out["nonfinite"] >= len(NAN_STEPS), spec
            assert len(out["warnings"]) == 1, (spec, out["warnings"])  # logged once
            before_nan = out["steps"][NAN_STEPS[0] - 1]["residuals"]
            for step in NAN_STEPS:  # the poisoned bucket's residual was reset on every rank
                if before_nan:  # error feedback on: a bucket lost its residual at the NaN step
                    assert len(out["steps"][step]["residuals"]) < len(before_nan), (spec, step)
                    assert out["steps"][step + 1]["residuals"] == before_nan, (spec, step)
        # training went on: the steps after a NaN changed the parameters
        assert res[0][i]["steps"][-1]["skipped"] is False


# -- a killed rank and a stopped rank ------------------------------------------------------
def _fault_body(rank, world, how, victim, at_step):
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    torch.manual_seed(0)
    model = DDP(make_model(), bucket_cap_mb=0.01)
    comms.register(model, "topk:density=0.05", start_iter=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(20):
        x, y = batch(rank, step)
        opt.zero_grad()
        if rank == victim and step == at_step:
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            nn.functional.cross_entropy(model(x), y).backward()
        except Exception as exc:  # noqa: BLE001 - the expected outcome on the survivors
            took = time.monotonic() - t0
            if how == "stop" and rank == 0:
                os.kill(pids[victim], signal.SIGKILL)  # bound the test: end the stopped rank
            return {"step": step, "type": type(exc).__name__, "msg": str(exc), "seconds": took}
        opt.step()
    return {"step": None}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how,pg_timeout", [("kill", 10), ("stop", 6)])
def test_dead_or_stuck_rank_raises_within_timeout(how, pg_timeout):
    t0 = time.monotonic()
    res = spawn(_fault_body, 3, how, 2, 3, timeout=90, pg_timeout=pg_timeout, allow_dead=(2,))
    assert res[2] is None
    for r in (0, 1):
        out = res[r]
        assert out["step"] == 3, out
        assert out["type"] in ("RuntimeError", "CollectiveTimeout"), out  # CollectiveTimeout is one
        msg = out["msg"]
        # a bucket's collective, or the tuner's timing agreement (auto is tuning at step 3)
        assert "commpress:" in msg and ("bucket" in msg or "autotune" in msg) and "step 3" in msg, msg
        assert "collective" in msg or "allreduce" in msg or "allgather" in msg, msg
        assert out["seconds"] < pg_timeout + 10, out
    assert time.monotonic() - t0 < 80


# -- configuration mismatch, second registration ------------------------------------------
MISMATCH = [
    ("compressor", {"spec": ("topk:density=0.05", "topk:density=0.1")}, "density=0.1"),
    ("seed", {"seed": (0, 7)}, "7"),
    ("start_iter", {"start_iter": (1, 2)}, "start_iter"),
    ("algorithm", {"spec": ("randomk:density=0.1", "randomk:density=0.1"),
                   "algorithm": ("allreduce", "allgather")}, "allgather"),
    ("error_feedback", {"error_feedback": (True, False)}, "error_feedback"),
]


def _mismatch_body(rank, world):
    out = []
    for field, opts, _ in MISMATCH:
        torch.manual_seed(0)
        model = DDP(make_model(), bucket_cap_mb=0.01)
        kw = {"start_iter": 1}
        spec = "topk:density=0.05"
        for k, pair in opts.items():
            if k == "spec":
                spec = pair[rank]
            else:
                kw[k] = pair[rank]
        comms.register(model, spec, **kw)
        x, y = batch(rank, 0)
        try:
            nn.functional.cross_entropy(model(x), y).backward()
            out.append(None)
        except Exception as exc:  # noqa: BLE001
            out.append((type(exc).__name__, str(exc)))
    # registering twice on one model: refused before any communication, nothing changed
    model = DDP(make_model(), bucket_cap_mb=0.01)
    first = comms.register(model, "sign")
    try:
        comms.register(model, "topk:density=0.1")
        twice = None
    except ValueError as exc:
        twice = str(exc)
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(model(x), y).backward()  # still works with the first hook
    return {"mismatch": out, "twice": twice, "first_iter": first.iter}


@pytest.mark.timeout(120)
def test_config_mismatch_raises_on_every_rank_and_double_register():
    res = spawn(_mismatch_body, 2, timeout=100)
    for r in range(2):
        for (field, _, value), got in zip(MISMATCH, res[r]["mismatch"]):
            assert got is not None, f"{field}: rank {r} did not raise"
            typ, msg = got
            assert typ == "ValueError", (field, got)
            assert f"{field} is" in msg and "differs between ranks" in msg, (field, msg)
            if r == 1:
                assert value in msg, (field, msg)
        assert "already has a commpress hook" in res[r]["twice"]
        assert res[r]["first_iter"] == 1

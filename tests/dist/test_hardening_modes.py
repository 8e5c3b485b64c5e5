"""DDP modes with the compression hook on gloo ranks.

Every mode: replicas bitwise equal (``comms.check_replicas`` inside the ranks), and where the
math is exact (identity compressor) the hooked run equals DDP without a hook, bitwise.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import comms
from comms.cluster.launch import spawn
from dist.ranks import batch, flat_params, make_model

pytestmark = [pytest.mark.dist]

# algorithm=None: the compressor's own family, so every bucket of these tiny models is
# compressed (the default "auto" planner sends small buckets dense)


class WithUnused(nn.Module):
    """An MLP with a branch that never runs (find_unused_parameters)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.body = make_model(dtype=dtype)
        self.unused = nn.Linear(32, 10).to(dtype)

    def forward(self, x):
        return self.body(x)


def _run(rank, mode, spec, steps=6, dtype=torch.float32, start_iter=1, seed=0):
    """Train one model in ``mode``; return flat params, state iter and stats."""
    ddp_kw = {"bucket_cap_mb": 0.01}
    if mode == "find_unused":
        ddp_kw["find_unused_parameters"] = True
    elif mode == "static_graph":
        ddp_kw["static_graph"] = True
    elif mode == "bucket_view":
        ddp_kw["gradient_as_bucket_view"] = True
    torch.manual_seed(0)
    base = WithUnused(dtype) if mode == "find_unused" else make_model(seed, dtype)
    model = DDP(base, **ddp_kw)
    state = comms.register(model, spec, start_iter=start_iter, algorithm=None) if spec else None
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        if mode == "no_sync":  # accumulate two micro-batches, sync on the third
            with model.no_sync():
                for micro in range(2):
                    x, y = batch(rank, 10 * step + micro + 1, dtype)
                    nn.functional.cross_entropy(model(x).float(), y).backward()
        x, y = batch(rank, 10 * step, dtype)
        nn.functional.cross_entropy(model(x).float(), y).backward()
        opt.step()
    comms.check_replicas(model)  # raises on every rank if any parameter differs
    return {"params": flat_params(model.module), "iter": state.iter if state else None,
            "compressed": sum(s.calls for s in state.stats.values()) if state else 0}


MODES = ["no_sync", "find_unused", "static_graph", "bucket_view"]
DTYPES = [torch.float16, torch.bfloat16]


def _modes_body(rank, world):
    out = {}
    for mode in MODES:
        out[mode] = {"none": _run(rank, mode, None), "identity": _run(rank, mode, "identity"),
                     "topk": _run(rank, mode, "topk:density=0.05"),
                     "randomk": _run(rank, mode, "randomk:density=0.1")}
    for dt in DTYPES:
        name = str(dt)
        out[name] = {"none": _run(rank, "plain", None, dtype=dt),
                     "identity": _run(rank, "plain", "identity", dtype=dt),
                     "topk": _run(rank, "plain", "topk:density=0.05", dtype=dt),
                     "qsgd": _run(rank, "plain", "qsgd:bits=4", dtype=dt),
                     "cast": _run(rank, "plain", "bf16" if dt == torch.bfloat16 else "fp16", dtype=dt)}
    return out


@pytest.mark.timeout(240)
def test_ddp_modes_replicas_equal_and_identity_exact():
    res = spawn(_modes_body, 2, timeout=220)
    for key, runs in res[0].items():
        for name, r in runs.items():
            assert torch.isfinite(r["params"]).all(), (key, name)
            assert torch.equal(r["params"], res[1][key][name]["params"]), (key, name)  # replicas
            if name != "none":
                assert r["compressed"] > 0, f"{key}/{name}: the hook never compressed"
        # exact math: the identity compressor through our hook == DDP's own allreduce
        assert torch.equal(runs["identity"]["params"], runs["none"]["params"]), key
        assert not torch.equal(runs["topk"]["params"], runs["none"]["params"]), key
    # no_sync: the hook runs once per synchronised step, never inside no_sync()
    assert res[0]["no_sync"]["topk"]["iter"] == 6


# -- DP group inside a 2x2 mesh ------------------------------------------------------------
def _mesh_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    dp = mesh.get_group("dp")
    tp_coord = mesh.get_local_rank("tp")
    torch.manual_seed(0)
    # each DP group starts from its own weights: averaging over WORLD would mix them
    model = DDP(make_model(seed=tp_coord), bucket_cap_mb=0.01, process_group=dp)
    state = comms.register(model, "topk:density=0.05", process_group=dp, start_iter=1, algorithm=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(5):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    comms.check_replicas(model, dp)
    try:
        comms.check_replicas(model)  # across DP groups the replicas differ, and it says which
        across = None
    except comms.ReplicaMismatchError as exc:
        across = str(exc)
    return {"params": flat_params(model.module), "tp": tp_coord, "dp_ranks": dist.get_process_group_ranks(dp),
            "across": across, "compressed": sum(s.calls for s in state.stats.values())}


@pytest.mark.timeout(180)
def test_dp_group_of_2x2_mesh():
    res = spawn(_mesh_body, 4, timeout=160)
    by_group = {}
    for r in res:
        by_group.setdefault(tuple(r["dp_ranks"]), []).append(r)
        assert r["compressed"] > 0
        assert r["across"] is not None and "0.weight" in r["across"], r["across"]
    assert len(by_group) == 2
    groups = list(by_group.values())
    for members in groups:
        assert len(members) == 2 and torch.equal(members[0]["params"], members[1]["params"])
    assert not torch.equal(groups[0][0]["params"], groups[1][0]["params"])


# -- bucket rebuild after iteration 0 ------------------------------------------------------
def _rebuild_body(rank, world, start_iter):
    import compressors

    class Recorder(compressors.TopK):
        inputs = []

        def compress(self, x, ctx):
            Recorder.inputs.append((ctx.step, ctx.bucket, x.clone()))
            return super().compress(x, ctx)

    torch.manual_seed(0)
    # a cap large enough for one bucket: DDP's first-iteration bucket and its rebuilt bucket
    # then have the same numel but a different parameter order
    model = DDP(make_model(), bucket_cap_mb=25)
    # no warm-up ramp: its first step may go dense (more bytes than dense), and this test
    # needs a residual from the first compressed step
    state, _ = comms.make_hook(Recorder(density=0.05), start_iter=start_iter, algorithm=None, warmup_steps=0)
    state.bind(model)
    rec = []
    hook_state = _Holder(state, rec)
    model.register_comm_hook(hook_state, _holder_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(4):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    comms.check_replicas(model)
    return {"rec": rec, "inputs": [(s, b, x) for s, b, x in Recorder.inputs],
            "params": flat_params(model.module)}


class _Holder:
    __slots__ = ("state", "rec")

    def __init__(self, state, rec):
        self.state, self.rec = state, rec


def _holder_hook(holder, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state = holder.state
    i = bucket.index()
    res = state.memory.residuals.get(i)
    holder.rec.append({"step": state.iter, "bucket": i, "raw": bucket.buffer().clone(),
                       "residual": None if res is None else res.clone(),
                       "keys": tuple(state.param_key(p) for p in bucket.parameters()),
                       "numels": {state.param_key(p): p.numel() for p in bucket.parameters()}})
    return comms.compression_hook(state, bucket)


def _moved(residual, old_keys, new_keys, numels):
    """The residual of layout ``old_keys`` with each parameter's slice moved to ``new_keys``."""
    pieces, off = {}, 0
    for k in old_keys:
        pieces[k] = residual[off: off + numels[k]]
        off += numels[k]
    return torch.cat([pieces[k] for k in new_keys])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_iter", [0, 1])
def test_bucket_rebuild_rekeys_residuals(start_iter):
    res = spawn(_rebuild_body, 2, start_iter, timeout=100)
    assert torch.equal(res[0]["params"], res[1]["params"])
    for out in res:
        rec = {(r["step"], r["bucket"]): r for r in out["rec"]}
        inputs = {(s, b): x for s, b, x in out["inputs"]}
        assert len(rec) == 4 and all(b == 0 for _, b in rec)  # one bucket per step
        old, new = rec[(0, 0)]["keys"], rec[(1, 0)]["keys"]
        # DDP rebuilt its bucket after iteration 0: same size, another parameter order
        assert old != new and sorted(old) == sorted(new)
        assert rec[(0, 0)]["raw"].numel() == rec[(1, 0)]["raw"].numel()
        first = rec[(1, 0)]
        if start_iter == 0:
            # the old-layout residual fits by size but not by position: each parameter's
            # piece must move to where the rebuilt bucket holds that parameter
            assert first["residual"] is not None and first["residual"].abs().sum() > 0
            moved = _moved(first["residual"], old, new, first["numels"])
            assert not torch.equal(moved, first["residual"])
            assert torch.equal(inputs[(1, 0)], first["raw"] / 2 + moved)
        else:  # iteration 0 was dense: nothing to carry
            assert first["residual"] is None
            assert torch.equal(inputs[(1, 0)], first["raw"] / 2)
        # later steps keep the layout and apply the residual in place
        for step in (2, 3):
            r = rec[(step, 0)]
            assert r["keys"] == new and r["residual"] is not None and r["residual"].abs().sum() > 0
            assert torch.equal(inputs[(step, 0)], r["raw"] / 2 + r["residual"])


# -- two DDP models in one process --------------------------------------------------------
def _two_models_body(rank, world):
    torch.manual_seed(0)
    a = DDP(make_model(seed=1), bucket_cap_mb=0.01)
    b = DDP(make_model(seed=2), bucket_cap_mb=0.01)
    sa = comms.register(a, "topk:density=0.05", start_iter=1, algorithm=None)
    sb = comms.register(b, "qsgd:bits=4", start_iter=1, algorithm="allgather")
    oa = torch.optim.SGD(a.parameters(), lr=0.05)
    ob = torch.optim.SGD(b.parameters(), lr=0.05)
    for step in range(5):
        x, y = batch(rank, step)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
        if step == 2:  # b alone: its state advances, a's does not
            ob.zero_grad()
            nn.functional.cross_entropy(b(x), y).backward()
            ob.step()
    comms.check_replicas(a)
    comms.check_replicas(b)
    return {"a": flat_params(a.module), "b": flat_params(b.module), "iters": (sa.iter, sb.iter),
            "res_a": sorted(sa.memory.residuals), "res_b": sorted(sb.memory.residuals),
            "same_state": sa is sb}


@pytest.mark.timeout(120)
def test_two_ddp_models_own_states():
    res = spawn(_two_models_body, 2, timeout=100)
    for key in ("a", "b"):
        assert torch.equal(res[0][key], res[1][key])
    for r in res:
        assert r["iters"] == (5, 6) and not r["same_state"]
        assert r["res_a"] and r["res_b"] == []  # top-k keeps residuals; unbiased QSGD none


# -- world size 1 -------------------------------------------------------------------------
def _world1_body(rank, world):
    out = {}
    for spec in (None, "topk:density=0.01"):
        torch.manual_seed(0)
        model = DDP(make_model(), bucket_cap_mb=0.01)
        state = comms.register(model, spec, start_iter=0, algorithm=None) if spec else None
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(4):
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        out[spec] = (flat_params(model.module), state and state.stats)
    comms.check_replicas(model)
    return out


@pytest.mark.timeout(60)
def test_world_size_one_is_exact_and_silent():
    out = spawn(_world1_body, 1, timeout=50)[0]
    assert torch.equal(out[None][0], out["topk:density=0.01"][0])  # nothing compressed
    assert out["topk:density=0.01"][1] == {}

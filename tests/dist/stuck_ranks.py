"""Stuck and dead rank harness (issue 18): stop or kill one rank mid-training, time the survivors.

:func:`run_faults` spawns ``world`` gloo ranks that train a small MLP with a commpress hook.
At a seeded step, at a seeded point of that step (before the forward, or inside backward in
a gradient hook of a seeded parameter, i.e. between two buckets), the victim rank writes the
wall time and sends itself SIGSTOP (a hung process) or SIGKILL (a dead one). Every survivor
records when its ``backward()`` raises, and then **stays alive** without touching the process
group until the parent has heard from every survivor: a survivor must raise on its own, not
because another survivor exited and closed its sockets.

Each case runs in its own set of processes (a failed process group cannot be reused).
Outcomes per survivor: ``{"seconds": raise time - stop time, "step", "type", "msg"}`` or
``None`` when it did not raise before the harness deadline (a hang), with a ``py-spy dump``
of the hung rank when py-spy is installed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import random
import shutil
import signal
import subprocess
import tempfile
import time
import traceback
from datetime import timedelta

__all__ = ["CASES", "FAST_CASES", "Case", "run_faults", "format_table"]


class Case:
    """One configuration: ``spec`` with ``kw`` (register options), ``phase`` a label."""

    def __init__(self, label, spec, kw, phase, steps=20, at=None):
        self.label, self.spec, self.kw, self.phase = label, spec, dict(kw), phase
        self.steps = steps
        self.at = at  # (first, last) step range the victim stops in

    def __repr__(self):
        return f"{self.label}/{self.phase}"


# start_iter=1: step 0 is the dense warm-up; auto's phases: tuning starts at start_iter and
# lasts (trials + 1) * autotune_steps steps
CASES = [
    Case("fp16 allreduce", "fp16", {"algorithm": "allreduce", "start_iter": 1}, "compressed", at=(2, 8)),
    Case("powersgd allreduce", "powersgd:rank=2", {"algorithm": "allreduce", "start_iter": 1}, "compressed", at=(2, 8)),
    Case("qsgd:bits=4 allgather", "qsgd:bits=4", {"algorithm": "allgather", "start_iter": 1}, "compressed", at=(2, 8)),
    Case("topk allgather", "topk:density=0.05", {"algorithm": "allgather", "start_iter": 1}, "compressed", at=(2, 8)),
    Case("sign two_phase", "sign", {"algorithm": "two_phase", "start_iter": 1}, "compressed", at=(2, 8)),
    Case("qsgd:bits=4 shared_scale", "qsgd:bits=4", {"algorithm": "shared_scale", "start_iter": 1}, "compressed", at=(2, 8)),
    Case("topk auto", "topk:density=0.05", {"algorithm": "auto", "start_iter": 6, "autotune_steps": 2}, "before tuning", at=(1, 5)),
    Case("topk auto", "topk:density=0.05", {"algorithm": "auto", "start_iter": 2, "autotune_steps": 3}, "during trials", at=(3, 10)),
    Case("topk auto", "topk:density=0.05", {"algorithm": "auto", "start_iter": 1, "autotune_steps": 2}, "after lock", at=(14, 18)),
    Case("sign auto", "sign", {"algorithm": "auto", "start_iter": 2, "autotune_steps": 3}, "during trials", at=(3, 10)),
]

# the representative subset of the default test run
FAST_CASES = [CASES[2], CASES[4], CASES[7]]


def _body(rank, world, case, how, seed, stamp_dir):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import comms

    rng = random.Random(f"{seed}-{case!r}-{how}")
    victim = world - 1
    at_step = rng.randint(*case.at)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model = DDP(model, bucket_cap_mb=0.05)
    comms.register(model, case.spec, **case.kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    params = list(model.parameters())
    where_ = rng.randrange(len(params) + 1)  # 0: before the forward; k: in backward at param k-1

    def die():
        with open(os.path.join(stamp_dir, "stopped"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)

    for step in range(case.steps):
        gx = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(32, 64, generator=gx), torch.randint(0, 10, (32,), generator=gx)
        opt.zero_grad()
        handle = None
        if rank == victim and step == at_step:
            if where_ == 0:
                die()
            else:
                handle = params[where_ - 1].register_hook(lambda grad: (die(), grad)[1])
        try:
            nn.functional.cross_entropy(model(x), y).backward()
        except Exception as exc:  # noqa: BLE001 - the expected outcome on the survivors
            return {"t": time.time(), "step": step, "type": type(exc).__name__, "msg": str(exc),
                    "at_step": at_step, "where": where_}
        if handle is not None:
            handle.remove()
        opt.step()
    return {"t": None, "step": None, "at_step": at_step, "where": where_}


def _child(rank, world, port, pg_timeout, q, release, case, how, seed, stamp_dir):
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=pg_timeout))
        out = _body(rank, world, case, how, seed, stamp_dir)
        q.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, False, traceback.format_exc()))
    # stay alive, process group untouched, until every survivor has reported: a survivor
    # must raise on its own, not because another one exited and closed its sockets
    release.wait(300)
    os._exit(0)


def _spy(pid):
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(os.sys.executable), "py-spy")
    if not os.path.exists(exe):
        return "py-spy not installed"
    try:
        return subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=30).stdout
    except Exception as exc:  # noqa: BLE001
        return f"py-spy failed: {exc}"


def run_one(case: Case, how: str, *, world: int = 3, pg_timeout: float = 6.0, slack: float = 10.0,
            seed: int = 0, spy: bool = False) -> dict:
    """Run one case; returns ``{"survivors": {rank: outcome or None}, "hung": {rank: dump}}``."""
    from comms.launch import free_port

    ctx = mp.get_context("spawn")
    q, release = ctx.Queue(), ctx.Event()
    port = free_port()
    stamp_dir = tempfile.mkdtemp(prefix="commpress-stuck-")
    procs = [ctx.Process(target=_child, args=(r, world, port, pg_timeout, q, release, case, how,
                                              seed, stamp_dir), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    victim = world - 1
    got: dict[int, object] = {}
    stamp = os.path.join(stamp_dir, "stopped")
    deadline = None
    victim_out = None
    start = time.monotonic()
    try:
        while len(got) < world - 1:
            if deadline is None and os.path.exists(stamp):
                deadline = time.monotonic() + pg_timeout + slack
            limit = deadline if deadline is not None else start + 120
            if time.monotonic() > limit:
                break
            try:
                rank, ok, val = q.get(timeout=0.2)
            except queue.Empty:
                continue
            if rank == victim:
                victim_out = val if not ok else None  # the victim failed before its fault point
                continue
            got[rank] = pickle.loads(val) if ok else {"t": None, "error": val}
        stopped = float(open(stamp).read()) if os.path.exists(stamp) else None
        out = {"survivors": {}, "hung": {}, "stopped": stopped, "victim_error": victim_out}
        for r in range(world - 1):
            o = got.get(r)
            if o is None:
                out["survivors"][r] = None
                if spy:
                    out["hung"][r] = _spy(procs[r].pid)
                continue
            if o.get("t") is not None and stopped is not None:
                o["seconds"] = o["t"] - stopped
            out["survivors"][r] = o
        return out
    finally:
        release.set()
        for p in procs:
            if p.pid is not None and p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGKILL)  # the stopped victim too
                except ProcessLookupError:
                    pass
            p.join(timeout=5)
        shutil.rmtree(stamp_dir, ignore_errors=True)


def format_table(rows) -> str:
    """``rows``: ``[(case, how, outcome dict)]`` -> a markdown table."""
    lines = ["| spec / algorithm | phase | fault | victim step | rank 0 (s) | rank 1 (s) | first line of the error |",
             "|---|---|---|---|---|---|---|"]
    for case, how, out in rows:
        cells, first = [], ""
        at = "-"
        for r, o in sorted(out["survivors"].items()):
            if o is None:
                cells.append("**hung**")
            elif o.get("seconds") is None:
                cells.append("no raise" if "error" not in o else "error")
            else:
                cells.append(f"{o['seconds']:.1f}")
                first = first or o["msg"].split("\n")[0][:140]
            if o is not None and "at_step" in o:
                at = f"{o['at_step']} (pt {o['where']})"
        lines.append(f"| {case.label} | {case.phase} | {how} | {at} | " + " | ".join(cells) + f" | {first} |")
    return "\n".join(lines)

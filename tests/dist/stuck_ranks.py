"""Stuck and dead rank harness: stop or kill one rank mid-training, time the survivors.

:func:`run_one` spawns ``world`` gloo ranks that train a small MLP with a commpress hook.
At a seeded step, at a seeded point of that step (before the forward, or inside backward in
a gradient hook of a seeded parameter, i.e. between two buckets), the victim rank writes the
wall time and sends itself SIGSTOP (a hung process) or SIGKILL (a dead one). Every survivor
records when its ``backward()`` raises, and then **stays alive** without touching the process
group until the parent has heard from every survivor: a survivor must raise on its own, not
because another survivor exited and closed its sockets.

Set-up is not what is measured (a 5 s process-group timeout made DDP's
constructor time out, and a rank still importing ``torch._dynamo`` under load read as a
hang). So the ranks initialise the process group with a generous ``setup_timeout``, build
DDP, register and train the steps before the fault window at that timeout; at the first step
of the window every rank passes a barrier and then shortens the bound to ``pg_timeout``: the
gloo group's own timeout (torch's ``_set_pg_timeout``) and commpress's
(``state.timeout``, the communicator read the group's timeout at its first call) -- as if
the group had been created with ``init_process_group(timeout=pg_timeout)``. The clock starts
when the victim stops; a case whose victim never reached its fault point within
``setup_timeout`` is reported as ``setup``, never as a hang.

Each case runs in its own set of processes (a failed process group cannot be reused).
Outcomes per survivor: ``{"seconds": raise time - stop time, "step", "type", "msg"}`` or
``None`` when it did not raise before the harness deadline (a hang), with a ``py-spy dump``
of the hung rank when py-spy is installed. The victim records the step, the point of the
step and the phase it stopped in (``dense warm-up``, ``compressed``, ``auto: before
tuning``, ``auto: tuning``, ``auto: locked <rule>``) so each cell says what it measured.
"""

from __future__ import annotations

import json
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

__all__ = ["CASES", "FAST_CASES", "Case", "run_one", "format_table", "stamp_and_die", "shorten_groups"]


class Case:
    """One configuration: ``spec`` with ``kw`` (register options), ``phase`` a label.

    ``at``: the (first, last) step the victim stops in; steps before ``at[0]`` are set-up
    (long timeout). ``world``: ranks (the victim is the last); ``nodes``: per-rank
    ``COMMPRESS_NODE`` names (hierarchical algorithms)."""

    def __init__(self, label, spec, kw, phase, steps=20, at=None, world=3, nodes=None, tuner=None, body=None):
        self.label, self.spec, self.kw, self.phase = label, spec, dict(kw), phase
        self.body = body  # the rank body (default: DDP, this module's _body)
        self.tuner = dict(tuner or {})  # attributes of state.planner.tuner (max_steps)
        self.steps = steps
        self.at = at
        self.world, self.nodes = world, nodes

    def __repr__(self):
        return f"{self.label}/{self.phase}"


def _fixed(label, spec, algorithm, **extra):
    # start_iter=1: step 0 is the dense warm-up; faults in steps 2..8 (all compressed)
    return Case(label, spec, {"algorithm": algorithm, "start_iter": 1}, "compressed", at=(2, 8), **extra)


# auto's phases: steps < start_iter are dense (before tuning); tuning starts at start_iter and
# runs rounds of (trials + 1) * autotune_steps steps until decided (>= 4 rounds) or 40 steps;
# the victim records the phase it actually stopped in
CASES = [
    _fixed("fp16 allreduce", "fp16", "allreduce"),
    _fixed("powersgd allreduce", "powersgd:rank=2", "allreduce"),
    _fixed("randomk allreduce", "randomk:density=0.05", "allreduce"),
    _fixed("qsgd:bits=4 allgather", "qsgd:bits=4", "allgather"),
    _fixed("topk allgather", "topk:density=0.05", "allgather"),
    _fixed("sign two_phase", "sign", "two_phase"),
    _fixed("topk two_phase", "topk:density=0.05", "two_phase"),
    _fixed("qsgd:bits=8 shared_scale", "qsgd:bits=8", "shared_scale"),
    _fixed("fp16 hier_allreduce (4 ranks, 2 nodes)", "fp16", "hier_allreduce", world=4,
           nodes=["nodeA", "nodeA", "nodeB", "nodeB"]),
    Case("topk auto", "topk:density=0.05", {"algorithm": "auto", "start_iter": 7, "autotune_steps": 2}, "before tuning", at=(2, 6)),
    Case("topk auto", "topk:density=0.05", {"algorithm": "auto", "start_iter": 2, "autotune_steps": 3}, "during trials", at=(3, 12)),
    # tuning lasts until decided (>= 4 rounds) or 40 steps; a 12-step budget locks by step 13
    Case("topk auto", "topk:density=0.05", {"algorithm": "auto", "start_iter": 1, "autotune_steps": 2}, "after lock",
         steps=24, at=(16, 20), tuner={"max_steps": 12}),
    Case("sign auto", "sign", {"algorithm": "auto", "start_iter": 2, "autotune_steps": 3}, "during trials", at=(3, 12)),
]

# the default test run: each kind of wait -- a single-round collective DDP waits on (the
# watchdog), intermediate rounds waited in the hook's thread (two_phase, PowerSGD's P round,
# shared_scale's scale round), auto before and during tuning (timing allgathers, algorithm
# switches) -- stopped, and the main ones killed too
FAST_CASES = [CASES[4], CASES[5], CASES[1], CASES[7], CASES[9], CASES[10]]
FAST_RUNS = [(CASES[4], "stop"), (CASES[4], "kill"), (CASES[5], "stop"), (CASES[5], "kill"),
             (CASES[1], "stop"), (CASES[7], "stop"), (CASES[9], "stop"), (CASES[10], "stop"),
             (CASES[10], "kill")]


def _phase(state, step) -> str:
    """What the hook does at ``step`` (the victim's record of the phase it stopped in)."""
    planner = state.planner
    if step < state.start_iter:
        return "auto: before tuning" if planner is not None else "dense warm-up"
    tuner = getattr(planner, "tuner", None) if planner is not None else None
    if tuner is None:
        return "compressed"
    return f"auto: locked {tuner.decision!r}" if tuner.locked else "auto: tuning"


def _shorten(state, seconds: float) -> None:
    """The fault window's bound, as if ``init_process_group(timeout=seconds)``: gloo's own
    timeout and commpress's (its communicator read the group's long timeout at the first call)."""
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timedelta(seconds=seconds))
    except (ImportError, AttributeError, RuntimeError):  # private API moved: commpress's bound only
        pass
    state.timeout = seconds


def stamp_and_die(stamp_dir: str, how: str, stamp: dict) -> None:
    """The victim: write ``stamp`` (with the wall time) where the parent looks, then SIGSTOP
    (a hung process) or SIGKILL (a dead one) itself."""
    stamp = dict(stamp, t=time.time())
    tmp = os.path.join(stamp_dir, "stopped.tmp")
    with open(tmp, "w") as f:
        json.dump(stamp, f)
    os.replace(tmp, os.path.join(stamp_dir, "stopped"))
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)


def shorten_groups(seconds: float) -> None:
    """Every process group's timeout set to ``seconds`` (the default group and the sub-groups
    of a device mesh), as if each had been created with that timeout."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    for pg in list(_world.pg_map):
        if pg is not None and pg != dist.GroupMember.NON_GROUP_MEMBER:
            _set_pg_timeout(timedelta(seconds=seconds), group=pg)


def _body(rank, world, case, how, seed, stamp_dir, pg_timeout):
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
    state = comms.register(model, case.spec, **case.kw)
    for k, v in case.tuner.items():
        setattr(state.planner.tuner, k, v)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    params = list(model.parameters())
    where_ = rng.randrange(len(params) + 1)  # 0: before the forward; k: in backward at param k-1

    def die(step):
        stamp_and_die(stamp_dir, how, {"step": step, "where": where_, "phase": _phase(state, step)})

    for step in range(case.steps):
        if step == case.at[0]:
            # set-up is over on every rank (DDP, register, the first steps, auto's probe):
            # from here on the short bound applies and the victim may stop
            dist.barrier()
            _shorten(state, pg_timeout)
        gx = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(32, 64, generator=gx), torch.randint(0, 10, (32,), generator=gx)
        opt.zero_grad()
        handle = None
        if rank == victim and step == at_step:
            if where_ == 0:
                die(step)
            else:
                handle = params[where_ - 1].register_hook(lambda grad, s=step: (die(s), grad)[1])
        try:
            nn.functional.cross_entropy(model(x), y).backward()
        except Exception as exc:  # noqa: BLE001 - the expected outcome on the survivors
            return {"t": time.time(), "step": step, "type": type(exc).__name__, "msg": str(exc),
                    "armed": step >= case.at[0], "tb": traceback.format_exc()}
        if handle is not None:
            handle.remove()
        opt.step()
    return {"t": None, "step": None}


def _child(rank, world, port, setup_timeout, pg_timeout, q, release, case, how, seed, stamp_dir):
    try:
        if case.nodes is not None:
            os.environ["COMMPRESS_NODE"] = case.nodes[rank]
        import logging

        import torch
        import torch.distributed as dist

        logging.getLogger("comms").setLevel(logging.ERROR)  # the EF/momentum advice, per rank
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=setup_timeout))
        out = (case.body or _body)(rank, world, case, how, seed, stamp_dir, pg_timeout)
        q.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, False, traceback.format_exc()))
    # stay alive, process group untouched, until every survivor has reported: a survivor
    # must raise on its own, not because another one exited and closed its sockets
    release.wait(600)
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


def _context():
    """Ranks fork from :func:`comms.cluster.launch.rank_context`'s forkserver (torch imported once)
    instead of importing torch three times per case on a 2-core machine (set-up is not
    measured, but it was most of a case's wall time)."""
    from comms.cluster.launch import rank_context

    return rank_context()


def run_one(case: Case, how: str, *, pg_timeout: float = 5.0, slack: float = 10.0,
            setup_timeout: float = 240.0, seed: int = 0, spy: bool = False) -> dict:
    """Run one case. Returns ``{"survivors": {rank: outcome or None}, "hung": {rank: dump},
    "stopped": the victim's stamp or None, "setup": error text when set-up never finished}``.

    Before the victim stops, the ranks have ``setup_timeout`` s (spawn, imports, DDP, the
    first steps); after it, every survivor has ``pg_timeout + slack`` s to raise."""
    from comms.cluster.launch import free_port

    world = case.world
    ctx = _context()
    q, release = ctx.Queue(), ctx.Event()
    port = free_port()
    stamp_dir = tempfile.mkdtemp(prefix="commpress-stuck-")
    procs = [ctx.Process(target=_child, args=(r, world, port, setup_timeout, pg_timeout, q, release,
                                              case, how, seed, stamp_dir), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    victim = world - 1
    got: dict[int, object] = {}
    stamp_path = os.path.join(stamp_dir, "stopped")
    stamp, deadline, victim_out = None, None, None
    start = time.monotonic()
    try:
        while len(got) < world - 1:
            if stamp is None and os.path.exists(stamp_path):
                with open(stamp_path) as f:
                    stamp = json.load(f)
                deadline = time.monotonic() + pg_timeout + slack
            if time.monotonic() > (deadline if deadline is not None else start + setup_timeout):
                break
            try:
                rank, ok, val = q.get(timeout=0.2)
            except queue.Empty:
                continue
            if rank == victim:
                victim_out = val if not ok else None  # the victim failed before its fault point
                continue
            got[rank] = pickle.loads(val) if ok else {"t": None, "error": val}
        if stamp is None and os.path.exists(stamp_path):
            with open(stamp_path) as f:
                stamp = json.load(f)
        out = {"survivors": {}, "hung": {}, "stopped": stamp, "victim_error": victim_out,
               "setup": None}
        if stamp is None:  # the fault never happened: set-up (or a bug before it), not a hang
            out["setup"] = victim_out or next((o["error"] for o in got.values() if "error" in o), None) \
                or f"the victim did not reach its fault point within {setup_timeout:g} s"
        for r in range(world - 1):
            o = got.get(r)
            if o is None:
                out["survivors"][r] = None
                if spy and stamp is not None:
                    out["hung"][r] = _spy(procs[r].pid)
                continue
            if o.get("t") is not None and stamp is not None:
                o["seconds"] = o["t"] - stamp["t"]  # < 0: raised before the fault (a bug)
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


def cell(o) -> str:
    """One survivor's table cell."""
    if o is None:
        return "**hung**"
    if "error" in o:
        return "error"
    if o.get("seconds") is None:
        return "no raise" if o.get("t") is None else "?"
    return f"{o['seconds']:.1f}" if o["seconds"] >= 0 else f"**early** ({o['seconds']:.1f})"


def format_table(rows) -> str:
    """``rows``: ``[(case, how, outcome dict)]`` -> a markdown table (seconds from the
    victim's stop/kill to each survivor's ``backward()`` raising)."""
    lines = ["| spec / algorithm | phase (case) | fault | victim: step, point, phase | seconds to raise (rank 0 / 1 [/ 2]) | start of the error (rank 0) |",
             "|---|---|---|---|---|---|"]
    for case, how, out in rows:
        st = out.get("stopped")
        if out.get("setup"):
            first = "set-up did not finish: " + out["setup"].strip().splitlines()[-1][:100]
            lines.append(f"| {case.label} | {case.phase} | {how} | **setup** | - | {first} |")
            continue
        at = f"{st['step']}, pt {st['where']}, {st['phase']}"
        cells = " / ".join(cell(o) for _, o in sorted(out["survivors"].items()))
        first = next((o["msg"] for _, o in sorted(out["survivors"].items()) if o and o.get("msg")), "")
        first = first.split(" did not complete")[0].split(" returned")[0].split(" failed")[0][:110]
        lines.append(f"| {case.label} | {case.phase} | {how} | {at} | {cells} | {first} |")
    return "\n".join(lines)

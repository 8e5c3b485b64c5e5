"""Spawn gloo ranks on this machine and collect their results (tests, demo, benches).

Each rank runs ``fn(rank, world, *args)`` after ``init_process_group("gloo")`` on a free
local port; its return value (picklable) comes back in rank order. Any rank's exception, a
dead rank, or the overall ``timeout`` terminates every rank and raises ``RuntimeError`` —
never a hang.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

__all__ = ["free_port", "rank_context", "spawn", "init_from_env"]

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(backend: str = "gloo", timeout_s: float = 60.0):
    """``init_process_group`` from torchrun-style variables (RANK, WORLD_SIZE, MASTER_*)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


# what every rank imports anyway: the forkserver imports it once, ranks fork from it
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "comms"]


def rank_context():
    """The multiprocessing context ranks start from: a forkserver that imported :data:`PRELOAD`
    once per parent process (a rank then starts in ~0.1 s instead of importing torch again,
    2-4 s each on a loaded 2-core machine), or ``spawn`` where there is no forkserver.

    Forked ranks start from the server's imported modules and environment; :func:`spawn` hands
    them the parent's current ``os.environ``, so they see what a spawned rank would (nothing
    commpress or torch reads at import time depends on it).
    """
    try:
        ctx = mp.get_context("forkserver")
    except ValueError:  # no forkserver on this platform
        return mp.get_context("spawn")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _child(fn, rank, world, port, args, env, q, pg_timeout):
    try:
        # the parent's environment as of spawn(), not the forkserver's as of its start
        os.environ.clear()
        os.environ.update(env)
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                           "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port)})
        import torch
        import torch.distributed as dist

        torch.set_num_threads(max(1, int(env.get("COMMPRESS_THREADS", "1"))))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=pg_timeout))
        try:
            out = fn(rank, world, *args)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        # plain pickle bytes: the queue's torch reducers would pass tensors through shared
        # memory that vanishes when this process exits
        q.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, False, traceback.format_exc()))


def spawn(fn: Callable[..., Any], world: int, *args, timeout: float = 120.0,
          pg_timeout: float | None = None, env: dict | None = None,
          allow_dead: tuple = ()) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return results in rank order.

    Args:
        fn: a module-level (picklable) function.
        world: number of ranks.
        timeout: seconds for the whole run before every rank is killed.
        pg_timeout: process-group timeout inside the ranks (default ``timeout``).
        env: extra environment variables for the ranks.
        allow_dead: ranks that may die without reporting (fault-injection tests); their
            result is ``None``.
    """
    ctx = rank_context()
    q = ctx.Queue()
    port = free_port()
    child_env = {**os.environ, **(env or {})}
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, args, child_env, q,
                                               pg_timeout or timeout), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        _collect(procs, q, timeout, set(allow_dead), results, errors)
        if errors:
            r = min(errors)
            raise RuntimeError(f"spawn: rank {r} failed:\n{errors[r]}")
        return [pickle.loads(results[r]) if r in results else None for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _collect(procs: list, q, timeout: float, allowed: set, results: dict, errors: dict) -> None:
    """Fill ``results``/``errors`` (rank -> pickled result / traceback) from the ranks' queue
    until every rank has reported or died as allowed, or the first error arrives; raises on
    the timeout and on a rank that died without reporting (and is not in ``allowed``)."""
    world = len(procs)
    deadline = time.monotonic() + timeout

    def unreported_dead():
        return [r for r, p in enumerate(procs)
                if p.exitcode not in (None, 0) and r not in results and r not in errors]

    while len(results) + len(errors) + sum(1 for r in unreported_dead() if r in allowed) < world:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"spawn: timed out after {timeout:.0f}s; finished ranks "
                               f"{sorted(results)}, failed {sorted(errors)}")
        try:
            rank, ok, val = q.get(timeout=min(left, 1.0))
        except queue.Empty:
            if unreported_dead():
                time.sleep(0.5)  # let a traceback that is in flight arrive
                while not q.empty():
                    rank, ok, val = q.get()
                    (results if ok else errors)[rank] = val
                dead = [r for r in unreported_dead() if r not in allowed]
                if dead:
                    raise RuntimeError(f"spawn: rank(s) {dead} died with exit codes "
                                       f"{[procs[r].exitcode for r in dead]}") from None
            continue
        (results if ok else errors)[rank] = val
        if errors:
            return

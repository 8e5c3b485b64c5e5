"""DDP under ``mpirun`` with a hook that communicates through MPI (example and CI check).

torch wheels have no MPI process group, so DDP's own parameter broadcast runs on a gloo
group initialised from MPI's rank and size (:func:`comms.cluster.mpi.init_torch_from_mpi`); every
gradient bucket then travels through :class:`comms.cluster.mpi.MPICommunicator`. At the end every
rank gathers the parameters over MPI and checks they are bitwise identical.

Example::

    mpiexec -n 2 python bench/mpi_ddp.py --compressor qsgd:bits=8 --algorithm two_phase
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # for harness; last, so that
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/*.py never shadow packages
import harness  # noqa: E402,F401  (puts the repository root first on sys.path)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

__all__ = ["train_one"]

logger = logging.getLogger(__name__)


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def train_one(comm, spec, algorithm, steps=10):
    """Train a small MLP with the MPI-backed hook; returns (loss, params identical?, state)."""
    import comms

    rank = comm.rank
    model = DDP(_model(), bucket_cap_mb=0.01)  # several buckets
    state, hook = comms.make_hook(spec, algorithm=algorithm, communicator=comm)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = comm.all_gather(flat).wait().view(comm.world_size, -1)
    same = all(torch.equal(gathered[0], gathered[r]) for r in range(comm.world_size))
    return float(loss.detach()), same, state


def main(argv=None):
    from comms.cluster.mpi import MPICommunicator, init_torch_from_mpi

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compressor", action="append", default=None)
    p.add_argument("--algorithm", action="append", default=None)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args(argv)
    specs = a.compressor or ["qsgd:bits=8"]
    algs = a.algorithm or ["two_phase"]
    if len(algs) == 1:
        algs = algs * len(specs)
    if len(algs) != len(specs):
        p.error("give one --algorithm, or one per --compressor")
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    rank, world = init_torch_from_mpi()
    comm = MPICommunicator()
    ok = True
    for spec, alg in zip(specs, algs):
        loss, same, state = train_one(comm, spec, alg, a.steps)
        wire, dense = state.wire_bytes_per_step(), state.dense_bytes_per_step()
        ok &= same and loss == loss and wire < dense
        if rank == 0:
            print(f"mpi_ddp world={world} {spec} via {alg}: loss {loss:.4f} replicas "
                  f"{'identical' if same else 'DIFFER'} wire/step {wire} dense/step {dense}", flush=True)
    comm.close()
    import torch.distributed as dist
    dist.destroy_process_group()
    if rank == 0:
        print("mpi_ddp: OK" if ok else "mpi_ddp: FAILED", flush=True)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()

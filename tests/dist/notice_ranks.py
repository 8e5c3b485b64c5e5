"""Run under torchrun by test_notices.py, with no logging configured (a stock script):
the decisions commpress takes must print at Python's default level, once each.

1. DDP, ``qsgd:bits=8`` with ``algorithm="auto"``: the lock (rank 0).
2. DDP, AdamW with ``sign`` and ``adam_freeze=3``: the freeze and its step (rank 0).
3. The same AdamW restored from 2's optimizer state, its commpress state not loaded: a line
   per rank at the first step.
4. FSDP2 with ``auto``: each module's routes (rank 0).
"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import comms


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def train(model, opt, rank, steps):
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x[:, :4])
        opt.zero_grad()
        loss.backward()
        opt.step()


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ddp = DDP(mlp())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    state = comms.register(ddp, "qsgd:bits=8", optimizer=opt)
    train(ddp, opt, rank, 60)
    assert state.planner.tuner.locked

    ddp = DDP(mlp())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    state = comms.register(ddp, "sign", optimizer=opt, algorithm="allgather", adam_freeze=3)
    train(ddp, opt, rank, 6)
    assert state.adam.frozen
    saved = opt.state_dict()

    ddp = DDP(mlp())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    opt.load_state_dict(saved)
    comms.register(ddp, "sign", optimizer=opt, algorithm="allgather", adam_freeze=3)
    train(ddp, opt, rank, 2)

    net = mlp()
    for layer in (net[0], net[2], net):
        fully_shard(layer)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    comms.fsdp.register(net, "topk:density=0.1", optimizer=opt)
    train(net, opt, rank, 16)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

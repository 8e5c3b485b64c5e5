"""Rank body of the momentum tests: the odd embedding + conv + LayerNorm model,
SGD lr 0.05 momentum 0.9, tiny buckets, a learnable task (labels from a fixed teacher net of
the same architecture), the loss on a fixed evaluation set.

``train_final(rank, world, spec, algorithm, steps, mode, **hook)`` returns the final loss
(the same on every rank: replicas are equal). ``mode``:

* ``"dense"``: DDP's own allreduce, SGD momentum 0.9;
* ``"optimizer"``: ``comms.register(ddp, spec, optimizer=opt)`` with SGD momentum 0.9 — the
  default way (the hook takes the momentum over from the optimizer);
* ``"plain"``: ``comms.register(ddp, spec)`` and SGD momentum 0.9, the hook told nothing (the
  combination that diverges without momentum correction);
* ``"hook"``: ``comms.register(ddp, spec, momentum=0.9)`` and SGD momentum 0.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import comms

from .replica_ranks import OddNet

__all__ = ["dataset", "train_final", "masking_calls"]

LR, MOMENTUM = 0.05, 0.9


def dataset(n: int = 512, seed: int = 7):
    """``n`` token sequences (50 symbols, length 14) labelled by a fixed random teacher OddNet."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 50, (n, 14), generator=g)
    torch.manual_seed(seed + 1)
    teacher = OddNet()
    with torch.no_grad():
        for p in teacher.parameters():
            p.mul_(3.0)  # sharper logits: a less trivial target than the majority class
        y = teacher(x).argmax(1)
    return x, y


def train_final(rank: int, world: int, spec: str | None, algorithm: str | None, steps: int,
                mode: str, batch: int = 16, tail: int = 5, **hook) -> dict:
    x_all, y_all = dataset()
    torch.manual_seed(0)
    model = OddNet()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.0 if mode == "hook" else MOMENTUM)
    state = None
    if mode == "optimizer":
        state = comms.register(ddp, spec, algorithm=algorithm, optimizer=opt, **hook)
    elif mode == "plain":
        state = comms.register(ddp, spec, algorithm=algorithm, **hook)
    elif mode == "hook":
        state = comms.register(ddp, spec, algorithm=algorithm, momentum=MOMENTUM, **hook)
    elif mode != "dense":
        raise ValueError(f"unknown mode {mode!r}")
    losses = []
    n = x_all.shape[0]
    for s in range(steps):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(s))
        idx = perm[rank * batch: (rank + 1) * batch]
        loss = nn.functional.cross_entropy(ddp(x_all[idx]), y_all[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if s >= steps - tail:
            with torch.no_grad():
                losses.append(float(nn.functional.cross_entropy(model(x_all), y_all)))
    comms.check_replicas(ddp)
    compressed = 0 if state is None else sum(
        st.calls for st in state.stats.values() if st.algorithm not in ("dense",))
    return {"loss": sum(losses) / len(losses), "compressed_calls": compressed,
            "momentum": None if state is None else state.momentum,
            "opt_momentum": opt.param_groups[0]["momentum"]}


def masking_calls(rank: int, world: int, algorithm: str, steps: int = 4,
                  error_feedback: bool = True) -> dict:
    """Train ``steps`` steps the default way (``register(..., optimizer=opt)``, top-k 5% on
    ``algorithm``; without error feedback ``register(..., momentum=0.9)``) and record every velocity masking the hook does (``update_masked_`` and
    ``mask_velocity_``, compiled or torch): with an aggregate (the "held" rule) ``(u before,
    sent, aggregate, u after)`` under "held"; without one (DGC's rule) only a count under
    "sent". Every ``update_returned_`` goes under "returned", keyed by ``(bucket, n-th call for
    it)``, as ``(x, sent, aggregate, residual, u before, u after)``; "owner_residuals": buckets whose algorithm store holds an
    owner residual at the end."""
    from comms.core.memory import LocalMemory

    calls: dict = {"held": [], "sent": 0, "depth": 0, "returned": {}}
    update_masked, mask_velocity = LocalMemory.update_masked_, LocalMemory.mask_velocity_
    update_returned = LocalMemory.update_returned_

    def spy_update_returned(self, bucket, x, sent, aggregate):
        u = self.velocities.get(bucket)
        before = None if u is None else u.clone()
        x0 = x.clone()
        r = update_returned(self, bucket, x, sent, aggregate)
        # keyed by bucket and its n-th call: the buckets' callbacks run in whatever order their
        # collectives complete, which differs between ranks
        n = sum(1 for key in calls["returned"] if key[0] == bucket)
        calls["returned"][(bucket, n)] = (x0, sent.clone(), aggregate.clone(), r.clone(), before,
                                          None if u is None else u.clone())
        return r

    def recorded(call, self, bucket, sent, aggregate):
        u = self.velocities.get(bucket)
        before = None if u is None else u.clone()
        calls["depth"] += 1  # update_masked_'s torch steps call mask_velocity_: record once
        try:
            out = call()
        finally:
            calls["depth"] -= 1
        if calls["depth"] == 0:
            if aggregate is None:
                calls["sent"] += 1
            else:
                calls["held"].append((before, sent.clone(), aggregate.clone(),
                                      None if u is None else u.clone()))
        return out

    def spy_update_masked(self, bucket, x, sent, aggregate=None):
        return recorded(lambda: update_masked(self, bucket, x, sent, aggregate), self, bucket,
                        sent, aggregate)

    def spy_mask_velocity(self, bucket, sent, aggregate=None):
        return recorded(lambda: mask_velocity(self, bucket, sent, aggregate), self, bucket, sent,
                        aggregate)

    LocalMemory.update_masked_ = spy_update_masked  # this rank's process only
    LocalMemory.mask_velocity_ = spy_mask_velocity
    LocalMemory.update_returned_ = spy_update_returned
    x_all, y_all = dataset()
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(OddNet(), find_unused_parameters=True, bucket_cap_mb=0.01)
    # no warm-up ramp (top-k's default): its first step may go dense, and every step here
    # must be a compressed one
    if error_feedback:
        opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
        state = comms.register(ddp, "topk:density=0.05", algorithm=algorithm, optimizer=opt,
                               warmup_steps=0)
    else:  # the optimizer's momentum moves into the hook only with error feedback: say it
        opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.0)
        state = comms.register(ddp, "topk:density=0.05", algorithm=algorithm, momentum=MOMENTUM,
                               error_feedback=False, warmup_steps=0)
    for s in range(steps):
        idx = torch.arange(16) + 16 * (rank + world * s)
        loss = nn.functional.cross_entropy(ddp(x_all[idx]), y_all[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    calls.pop("depth")
    calls["owner_residuals"] = sum("two_phase_residual" in st for st in state.algo_store.values())
    return calls


def warmup_steps_taken(rank: int, world: int, steps: int = 3) -> list:
    """Top-k 1% on allgather, registered the default way (its 5-step warm-up) from step 0, on
    a 64x64 linear layer (one bucket): per step, (dense calls so far, buckets holding a
    residual, the averaged gradient, this rank's own gradient of the step, the bucket's
    ``state.stats`` wire bytes)."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=MOMENTUM)
    state = comms.register(ddp, "topk:density=0.01", algorithm="allgather", start_iter=0, optimizer=opt)
    out = []
    for s in range(steps):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * s + rank))
        with torch.no_grad():  # this rank's own gradient, from a copy outside DDP
            local = nn.Linear(64, 64)
            local.load_state_dict(model.state_dict())
        with torch.enable_grad():
            local(x).square().mean().backward()
        opt.zero_grad(set_to_none=True)
        ddp(x).square().mean().backward()
        out.append((state.dense_calls, sorted(state.memory.residuals),
                    torch.cat([p.grad.reshape(-1) for p in model.parameters()]),
                    torch.cat([p.grad.reshape(-1) for p in local.parameters()]),
                    state.stats[0].wire_bytes))
        opt.step()
    return out


def pairing_errors(rank: int, world: int) -> dict:
    """``register`` refuses, before anything changes, an optimizer that does not hold the model's
    parameters and an ``adam_freeze`` where no Adam pairing applies; returns each error and the
    optimizers' momenta afterwards (untouched)."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import comms

    errs = {}

    def expect(name, fn):
        try:
            fn()
            errs[name] = None
        except (TypeError, ValueError) as exc:
            errs[name] = f"{type(exc).__name__}: {exc}"

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    foreign = torch.optim.SGD(nn.Linear(3, 3).parameters(), lr=0.1, momentum=0.9)
    part = torch.optim.SGD(model.module[0].parameters(), lr=0.1, momentum=0.9)
    expect("foreign", lambda: comms.register(model, "topk:density=0.1", optimizer=foreign))
    expect("part", lambda: comms.register(model, "topk:density=0.1", optimizer=part))
    model = DDP(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))  # a fresh one: hooked above
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    adamw = torch.optim.AdamW(model.parameters())
    expect("sgd", lambda: comms.register(model, "topk:density=0.1", optimizer=sgd, adam_freeze=10))
    expect("qsgd", lambda: comms.register(model, "qsgd:bits=4", optimizer=adamw, adam_freeze="auto"))
    expect("none", lambda: comms.register(model, "sign", adam_freeze="auto"))
    expect("explicit_off", lambda: comms.register(model, "qsgd:bits=4", optimizer=sgd, adam_freeze=None))
    return {"errs": errs, "momenta": [o.param_groups[0]["momentum"] for o in (foreign, part, sgd)],
            "hooked": getattr(model, "_commpress_state", None) is not None}

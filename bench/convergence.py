"""Loss against step for every gradient hook next to dense allreduce, on two small real tasks.

* ``digits``: an MLP on scikit-learn's 8x8 digits (ships with scikit-learn; no download),
  SGD with momentum; the loss is the cross-entropy on the whole training split.
* ``oddconv`` (the momentum task): an embedding + conv + LayerNorm model of odd
  shapes (the replica tests' OddNet), SGD lr 0.05 **momentum 0.9**, tiny DDP buckets
  (0.01 MB), labels from a fixed random teacher of the same architecture (8192 training
  sequences); the loss is the cross-entropy on 1024 held-out sequences. Error feedback meeting SGD momentum left in
  the optimizer diverges here.
* ``charlm``: a small character-level transformer trained on the Python standard library's
  own ``.py`` files (read from ``sysconfig.get_paths()["stdlib"]``), AdamW; the loss is the
  cross-entropy on a fixed held-out set of sequences.

Our hooks are registered the default way, ``comms.register(ddp, spec, optimizer=opt)``: with
SGD momentum the hook takes the momentum over (momentum correction) and the optimizer runs
with momentum 0; ``--pairing none`` registers without the optimizer (the optimizer keeps its
momentum, so error feedback meets it). Every hook trains from the same initial weights on the same data in the same order (fixed
seeds; each rank takes its own slice of every global batch). The final loss is the mean of the
last ``--tail`` evaluations, and its ratio to dense is printed next to the targets.

    python bench/convergence.py                       # 2 gloo ranks, both tasks, all hooks
                                                      # (digits 1000 steps, charlm 300)
    python bench/convergence.py -n 4 --steps 600 --tasks charlm --hooks topk,qsgd8
    torchrun --nproc-per-node 2 bench/convergence.py

Writes ``bench/results/convergence.{md,csv}`` (final losses),
``bench/results/convergence_curves.csv`` and ``bench/results/convergence_<task>.png``.
"""

from __future__ import annotations

import argparse
import glob
import logging
import math
import os
import statistics
import subprocess
import sys
import sysconfig

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # for harness; last, so that
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/*.py never shadow packages
import harness  # noqa: E402  (puts the repository root first on sys.path)
from harness import hooks, launching, machine, tables  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

__all__ = ["TASKS", "TARGETS", "target_for", "load_stdlib_text", "task_floor", "main"]

logger = logging.getLogger(__name__)

# every compressor also on its defaults (algorithm "auto")
AUTO_SPECS = ("qsgd:bits=8", "qsgd:bits=4", "powersgd:rank=1", "topk:density=0.01,exact=false",
              "sign", "randomk:density=0.01")

# final-loss ratio to dense that each kind of hook should stay within
TARGETS = (("topk", 1.03), ("qsgd8", 1.01), ("qsgd4", 1.02), ("sign", 1.05))
# the targets on the momentum task (>= 500 steps, SGD momentum 0.9)
TARGETS_ODDCONV = (("topk", 1.05), ("qsgd4", 1.02), ("sign", 1.05), ("randomk", 1.3))


def target_for(hook: str, task: str | None = None) -> float | None:
    name = hook[5:] if hook.startswith("auto(") else hook
    for prefix, ratio in (TARGETS_ODDCONV if task == "oddconv" else TARGETS):
        if name.startswith(prefix):
            return ratio
    return None


# -- tasks ----------------------------------------------------------------------------------
# --seed S offsets every batch-order generator by S * SEED_STRIDE (S = 0: the recorded runs)
SEED_STRIDE = 100_003


class DigitsTask:
    """MLP 64-256-256-10 on scikit-learn's digits, SGD(momentum); loss on the whole train split."""

    name = "digits"
    # a fixed step count long enough for EF to catch up: at 300 steps top-k 1% + EF was 2.4x
    # dense's loss and below it at 1000 (bench/results/convergence.md); ~4 s per hook
    default_steps = 1000

    def __init__(self, args):
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.tensor(d.data, dtype=torch.float32) / 16.0
        y = torch.tensor(d.target, dtype=torch.long)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        self.x, self.y = x[perm], y[perm]
        self.batch = args.batch or 32
        self.lr = args.lr or 0.05
        self.seed = getattr(args, "seed", 0)  # callers without --seed (fsdp_convergence.py): 0

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, 10))

    def optimizer(self, params):
        return torch.optim.SGD(params, lr=self.lr, momentum=0.9)

    def batch_at(self, step: int, rank: int, world: int):
        n = len(self.x)
        g = self.batch * world
        epoch_len = n // g
        epoch, i = divmod(step, epoch_len)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(1000 + epoch + SEED_STRIDE * self.seed))
        idx = perm[i * g + rank * self.batch: i * g + (rank + 1) * self.batch]
        return self.x[idx], self.y[idx]

    def loss(self, out, y):
        return nn.functional.cross_entropy(out, y)

    @torch.no_grad()
    def evaluate(self, model) -> float:
        return float(nn.functional.cross_entropy(model(self.x), self.y))


def load_stdlib_text(max_bytes: int = 4_000_000) -> bytes:
    """The standard library's ``.py`` sources (sorted paths, so the text is reproducible)."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    if not files:
        raise FileNotFoundError(f"no .py files under the stdlib path {root!r}")
    out = bytearray()
    for f in files:
        with open(f, "rb") as fh:
            out += fh.read()
        if len(out) >= max_bytes:
            break
    return bytes(out[:max_bytes])


class CharLMTask:
    """A 2-layer causal transformer over ASCII characters of the stdlib's source, AdamW."""

    name = "charlm"
    vocab = 128
    default_steps = 300  # ~10x the digits step cost: the whole bench stays near 10 minutes

    def __init__(self, args):
        raw = torch.frombuffer(bytearray(load_stdlib_text()), dtype=torch.uint8).long()
        raw = torch.where(raw < self.vocab, raw, torch.full_like(raw, ord("?")))
        cut = int(0.95 * raw.numel())
        self.train, self.held = raw[:cut], raw[cut:]
        self.seq = 64
        self.batch = args.batch or 16
        self.lr = args.lr or 2e-3
        g = torch.Generator().manual_seed(1)
        starts = torch.randint(0, self.held.numel() - self.seq - 1, (64,), generator=g)
        self.eval_tokens = torch.stack([self.held[s: s + self.seq + 1] for s in starts.tolist()])
        self.seed = getattr(args, "seed", 0)  # callers without --seed (fsdp_convergence.py): 0

    def model(self) -> nn.Module:
        from ddp_step import TinyLM

        torch.manual_seed(self.seed)
        return TinyLM(width=128, depth=2, vocab=self.vocab, seq=self.seq, heads=4)

    def optimizer(self, params):
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0)

    def batch_at(self, step: int, rank: int, world: int):
        # the same global batch for every hook
        g = torch.Generator().manual_seed(10_000 * step + 1 + SEED_STRIDE * self.seed)
        starts = torch.randint(0, self.train.numel() - self.seq - 1, (self.batch * world,), generator=g)
        mine = starts[rank * self.batch: (rank + 1) * self.batch].tolist()
        toks = torch.stack([self.train[s: s + self.seq + 1] for s in mine])
        return toks[:, :-1], toks[:, 1:]

    def loss(self, out, y):
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model) -> float:
        t = self.eval_tokens
        return float(self.loss(model(t[:, :-1]), t[:, 1:]))


class OddNet(nn.Module):
    """Embedding -> Conv1d -> LayerNorm -> 384 x 5 -> 5 x 384 -> 3x3 conv -> 2 x 9 -> 5 logits
    (tests/dist/replica_ranks.py's model without its unused layer)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.conv = nn.Conv1d(16, 32, 3)
        self.ln = nn.LayerNorm(32)
        self.down = nn.Linear(384, 5)
        self.up = nn.Linear(5, 384)
        self.conv2 = nn.Conv2d(1, 2, 3)
        self.thin = nn.Linear(9, 2, bias=False)
        self.head = nn.Linear(2 * 2 * 18 + 2, 5)

    def forward(self, t):
        b = t.shape[0]
        h = self.conv(self.emb(t).transpose(1, 2)).transpose(1, 2)
        h = self.ln(h).reshape(b, -1)
        z = self.down(h)
        h = torch.tanh(self.up(z)).view(b, 1, 4, 96)
        c = self.conv2(h[..., :20])
        s = self.thin(h[:, 0, 0, :9])
        return self.head(torch.cat([c.reshape(b, -1), s], 1)) + z


class OddConvTask:
    """OddNet on teacher-labelled token sequences, SGD lr 0.05 momentum 0.9, 0.01 MB buckets."""

    name = "oddconv"
    default_steps = 500
    n_train, n_eval = 8192, 1024  # ~2 epochs in 500 steps: the loss stays well above zero
    bucket_cap_mb = 0.01  # tiny buckets: many small, odd-shaped ones

    def __init__(self, args):
        g = torch.Generator().manual_seed(7)
        x = torch.randint(0, 50, (self.n_train + self.n_eval, 14), generator=g)
        torch.manual_seed(8)
        teacher = OddNet()
        with torch.no_grad():
            for p in teacher.parameters():
                p.mul_(3.0)  # sharper teacher logits: a target less trivial than one class
            y = teacher(x).argmax(1)
        self.x, self.y = x[:self.n_train], y[:self.n_train]
        self.ex, self.ey = x[self.n_train:], y[self.n_train:]
        self.batch = args.batch or 16
        self.lr = args.lr or 0.05
        self.seed = getattr(args, "seed", 0)  # callers without --seed (fsdp_convergence.py): 0

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return OddNet()

    def optimizer(self, params):
        return torch.optim.SGD(params, lr=self.lr, momentum=0.9)

    def batch_at(self, step: int, rank: int, world: int):
        perm = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(step + SEED_STRIDE * self.seed))
        idx = perm[rank * self.batch: (rank + 1) * self.batch]
        return self.x[idx], self.y[idx]

    def loss(self, out, y):
        return nn.functional.cross_entropy(out, y)

    @torch.no_grad()
    def evaluate(self, model) -> float:
        return float(nn.functional.cross_entropy(model(self.ex), self.ey))


class Digits25MTask(DigitsTask):
    """ddp_step's 25M residual MLP (its ``resmlp``: 6 x Linear(2048), pre-norm residual
    blocks, a 10-way head) on digits, each 64-pixel image linearly interpolated to 2048 features
    (standardised). SGD lr 0.003 momentum 0.9, batch 16 per rank, one DDP bucket for every hook
    (torch's powerSGD_hook needs it on gloo). The loss is the cross-entropy on 256 fixed
    training samples, split across the ranks. Big enough that the link matters: at 1 Gb/s a
    dense step moves 100 MB per rank (~1 s) against ~0.3 s of compute (the time-to-quality
    task)."""

    name = "digits25m"
    # the plain 6 x Linear(2048) MLP (2048 logits for 10 classes) was chaotic under SGD momentum:
    # dense's own loss went 4.5 -> 7.1 between steps 20 and 30 at lr 0.015, and lr 0.007 or a
    # 25-step lr warm-up still spiked; the residual form at lr 0.003 falls from 2.3 to ~0.3 in 20
    # steps, then keeps falling (one process, 300 steps: ~0.03)
    default_steps = 200
    floor_model = "resmlp"
    n_eval = 256

    def __init__(self, args):
        import torch.nn.functional as F

        super().__init__(args)
        self.width = args.width or 2048
        self.depth = args.depth or 6
        x = F.interpolate(self.x.view(-1, 1, 64), size=self.width, mode="linear", align_corners=False)
        x = x.reshape(len(self.x), self.width)
        self.x = (x - x.mean()) / x.std()
        self.batch = args.batch or 16
        self.lr = args.lr or 0.003
        self.eval_idx = torch.arange(0, len(self.x), max(1, len(self.x) // self.n_eval))[:self.n_eval]
        numel = sum(p.numel() for p in self.model().parameters())
        self.bucket_cap_mb = math.ceil(numel * 4 / 2 ** 20 * 1.1) + 1  # the whole model: one bucket

    def model(self) -> nn.Module:
        from ddp_step import build_model

        return build_model(self.floor_model, self.width, self.depth, seed=self.seed)

    @torch.no_grad()
    def evaluate(self, model) -> float:
        import torch.distributed as dist

        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        idx = self.eval_idx[rank::world]  # each rank evaluates its share, then one tiny allreduce
        t = torch.tensor([float(nn.functional.cross_entropy(model(self.x[idx]), self.y[idx],
                                                            reduction="sum")), float(len(idx))],
                         dtype=torch.float64)
        if world > 1:
            dist.all_reduce(t)
        return float(t[0] / t[1])


class CharLM12MTask(CharLMTask):
    """``charlm``'s text and evaluation with ddp_step's TinyLM at width 512, depth 4 (4 heads,
    128 characters, sequences of 64: 12.7M parameters), AdamW lr 1e-3, batch 8 per rank, one
    DDP bucket for every hook (torch's powerSGD_hook needs it on gloo). Big enough that the
    link matters: at 1 Gb/s a dense step moves 51 MB per rank (~0.43 s) against ~0.43 s of
    compute on two shared cores (the time-to-quality transformer with AdamW)."""

    name = "charlm12m"
    default_steps = 150
    # torch's fp16 and PowerSGD hooks next to our default path, one row per compressor the
    # momentum-space scheme (sign, top-k) or the gradient path (QSGD, fp16) serves
    ttq_hooks = ("torch-psgd-r1,torch-fp16,default(sign),default(topk1%),default(qsgd4),"
                 "default(qsgd8),default(fp16),outer(")

    def __init__(self, args):
        super().__init__(args)
        self.width = getattr(args, "width", None) or 512
        self.depth = getattr(args, "depth", None) or 4
        self.batch = args.batch or 8
        self.lr = args.lr or 1e-3
        numel = sum(p.numel() for p in self.model().parameters())
        self.bucket_cap_mb = math.ceil(numel * 4 / 2 ** 20 * 1.1) + 1  # the whole model: one bucket

    def model(self) -> nn.Module:
        from ddp_step import TinyLM

        torch.manual_seed(self.seed)
        return TinyLM(width=self.width, depth=self.depth, vocab=self.vocab, seq=self.seq, heads=4)


TASKS = {"digits": DigitsTask, "charlm": CharLMTask, "oddconv": OddConvTask,
         "digits25m": Digits25MTask, "charlm12m": CharLM12MTask}


# -- training -------------------------------------------------------------------------------
def steps_for(task, args) -> int:
    """``--steps`` if given, else the task's own fixed step count."""
    return args.steps if args.steps is not None else task.default_steps


def train(task, cfg, args, rank: int, world: int, *, target: float | None = None,
          budget_s: float | None = None, max_steps: int | None = None) -> dict:
    """Train ``task`` with hook ``cfg``. Returns ``{"curve": [(step, eval loss)], "times": [s],
    ...}``: ``times[i]`` is the training wall clock (seconds, max over ranks) when ``curve[i]``
    was evaluated: registering the hook plus every step (batch, forward, backward, optimizer;
    an auto hook's probing and tuning happen inside steps, so they count); evaluations are
    off the clock (a barrier after each restarts the ranks together).

    With ``budget_s`` (time to quality): train up to ``max_steps`` steps, and stop at the first
    evaluation whose smoothed loss is <= ``target`` (``"stop": "reached"``) or once the clock
    (max over ranks, agreed at each evaluation) has reached ``budget_s`` (``"budget"``)."""
    import time

    import torch.distributed as dist

    from harness import wire

    steps = max_steps if budget_s is not None else steps_for(task, args)
    model = task.model()
    cap = getattr(task, "bucket_cap_mb", None) or args.bucket_cap_mb
    if cfg.kind == "torch-powersgd":
        cap = max(cap, args.bucket_cap_mb)  # torch's powerSGD_hook fails on gloo with > 1 bucket
    ddp = DDP(model, bucket_cap_mb=cap)
    opt = task.optimizer(ddp.parameters())
    curve = [(0, task.evaluate(model))]
    dist.barrier()
    t0 = time.perf_counter()
    state = hooks.attach_hook(ddp, cfg, start_iter=args.start_iter,
                                optimizer=opt if args.pairing == "optimizer" else None,
                                **_hook_options(args))
    clock = time.perf_counter() - t0
    stamps, step_s = [clock], []  # stamps[k]: the clock after step k (k = 0: registration)
    stop = None
    warm = args.lr_warmup or 0
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        x, y = task.batch_at(step - 1, rank, world)
        opt.zero_grad(set_to_none=False)
        loss = task.loss(ddp(x), y)
        loss.backward()
        if warm:  # linear lr warm-up (the same schedule for every hook)
            for g in opt.param_groups:
                g["lr"] = task.lr * min(1.0, step / warm)
        opt.step()
        dt = time.perf_counter() - t0
        clock += dt
        stamps.append(clock)
        step_s.append(dt)
        if step % args.eval_every == 0 or step == steps:
            curve.append((step, task.evaluate(model)))
            if budget_s is not None:  # one verdict on every rank: the slowest clock, the worst loss
                agreed = torch.tensor([clock, smoothed(curve, len(curve) - 1, args.tail)],
                                      dtype=torch.float64)
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
                if target is not None and agreed[1].item() <= target:
                    stop = "reached"
                elif agreed[0].item() >= budget_s:
                    stop = "budget"
                if stop:
                    break
            dist.barrier()
    steps = len(step_s)
    t = torch.tensor(stamps + step_s, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # as slow as the slowest rank
    stamps, step_s = t[:steps + 1].tolist(), sorted(t[steps + 1:].tolist())
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    tuner = getattr(getattr(state, "planner", None), "tuner", None) if getattr(state, "outer", None) is None else None
    run = {"curve": curve, "times": [stamps[s] for s, _ in curve], "wall_s": stamps[-1],
           "step_ms": 1e3 * statistics.median(step_s) if step_s else None, "steps": steps,
           "wire_bytes": wire.config_wire_bytes(cfg, state, params, world),
           "algorithm": wire.config_algorithm(cfg, state, wire.dense_wire_bytes(numel, world)),
           "tuned": (f"{tuner.tuning_steps}" + ("" if tuner.locked else " (not locked)"))
           if tuner is not None else None, "stop": stop or "steps"}
    del state
    return run


def _hook_options(args) -> dict:
    """``--warmup-steps`` and ``--hook-opt key=value`` as ``comms.register`` keywords."""
    from compressors.registry import _parse_value

    opts = {"warmup_steps": args.warmup_steps} if args.warmup_steps is not None else {}
    for item in args.hook_opt or ():
        key, _, value = item.partition("=")
        opts[key.strip()] = None if value.strip() == "None" else _parse_value(value)
    return opts


def rank_main(rank: int, world: int, args):
    configs, skipped = hooks.hook_configs(auto_specs=AUTO_SPECS)
    configs = hooks.filter_configs(configs, args.hooks)
    if args.specs:  # dense plus exactly these "spec@algorithm" hooks (e.g. a chunk sweep)
        configs = [configs[0]] + [
            hooks.HookConfig(item, "ours", item.rpartition("@")[0], item.rpartition("@")[2] or None)
            for item in args.specs.split(";") if item.strip()]
    for item in args.outer or ():  # "spec@sync_every=4,sync_fragments=2,sync_delay=1"
        spec, _, kv = item.partition("@")
        from compressors.registry import _parse_value

        sync = {k.strip(): _parse_value(v) for k, _, v in (p.partition("=") for p in kv.split(",") if p)}
        configs.append(hooks.outer_config(spec, sync))
    if args.time_to_quality:
        return ttq_main(rank, world, args, configs, skipped)
    if rank == 0:
        print(f"# convergence: tasks={args.tasks} world={world} steps={args.steps or 'task default'} "
              f"eval every {args.eval_every}, final = mean of last {args.tail} evals", flush=True)
        for what, why in skipped:
            print(f"# skipped {what}: {why}", flush=True)
    curves, rows = [], []
    for tname in args.tasks.split(","):
        task = TASKS[tname](args)
        res = {}
        it = tables.progress(configs, total=len(configs), desc=tname,
                              enable=rank == 0 and args.progress)
        for cfg in it:
            res[cfg.name] = train(task, cfg, args, rank, world)["curve"]
        dense_final = _final(res["dense"], args.tail)
        for name, curve in res.items():
            final = _final(curve, args.tail)
            tgt = target_for(name, tname)
            ratio = final / dense_final
            rows.append({"task": tname, "hook": name, "final_loss": final, "ratio": ratio,
                         "target": tgt, "ok": None if tgt is None else ("yes" if ratio <= tgt else "NO")})
            curves += [{"task": tname, "hook": name, "step": s, "loss": v} for s, v in curve]
    if rank != 0:
        return None
    cols = ["task", "hook", "final_loss", "ratio", "target", "ok"]
    print(tables.format_table(rows, cols), flush=True)
    if args.out:
        _write(args, rows, curves, cols, skipped, world,
               {t: steps_for(TASKS[t], args) for t in args.tasks.split(",")})
    return rows


# -- time to quality (the headline measure) ---------------------------------------------------
# the run's default hooks: dense, torch's two, every default(...) row, two labelled pinned rows
TTQ_HOOKS = "torch-psgd-r1,torch-fp16,default(,outer(,topk1%+ef@allgather,sign+ef@allgather"
TTQ_COLUMNS = ["hook", "path", "algorithm", "tuned", "steps", "stop", "wall_s", "step_ms", "loss_ratio",
               "ttq_step", "ttq_s", "speedup", "vs_psgd_r1", "wire_MB", "raw_ms"]
PSGD = "torch-psgd-r1"


def smoothed(curve: list, i: int, tail: int) -> float:
    """Mean of the evaluations ``curve[i - tail + 1 .. i]`` (fewer at the start)."""
    vals = [v for _, v in curve[max(0, i - tail + 1): i + 1]]
    return sum(vals) / len(vals)


def time_to_quality(run: dict, target: float, tail: int) -> tuple[int | None, float | None]:
    """(step, clock seconds) of the first evaluation whose smoothed loss (:func:`smoothed`) is
    at most ``target``; ``(None, None)`` if none is. With ``target`` = dense's final loss
    (:func:`_final`, the same mean) dense reaches it at its last evaluation at the latest."""
    for i, (step, _) in enumerate(run["curve"]):
        if smoothed(run["curve"], i, tail) <= target:
            return step, run["times"][i]
    return None, None


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average " + " ".join(f"{v:.2f}" for v in os.getloadavg())


def _path_of(cfg) -> str:
    if cfg.kind == "dense":
        return "dense"
    if cfg.kind.startswith("torch"):
        return "torch"
    return "default" if cfg.default else "pinned"


def ttq_main(rank: int, world: int, args, configs, skipped):
    """Time to quality: every hook trains the task; per hook the wall clock at which its
    smoothed loss first reaches dense's final loss, next to dense and torch's hooks, plus the
    floors measured in the same run (the step without communication, the raw wire time)."""
    import torch.distributed as dist

    from ddp_step import FLOOR, measure_floor, raw_transfer_ms

    task = TASKS[args.tasks](args)
    load_before = _uptime() if rank == 0 else None
    if rank == 0:
        print(f"# time to quality: task={task.name} link={args.link} world={world} "
              f"steps={steps_for(task, args)} eval every {args.eval_every} (off the clock), "
              f"smoothed = mean of the last {args.tail} evals; load before: {load_before}", flush=True)
        for what, why in skipped:
            print(f"# skipped {what}: {why}", flush=True)
    # warm the links once (connections, buffers) so that the first hook pays no one-off cost
    dist.all_reduce(torch.zeros(sum(p.numel() for p in task.model().parameters())))
    runs = {}
    target = budget = None
    cap = int(math.ceil(steps_for(task, args) * args.max_steps_factor))
    for cfg in tables.progress(configs, total=len(configs), desc=task.name,
                                enable=rank == 0 and args.progress):
        if cfg.kind == "dense" or budget is None:
            run = train(task, cfg, args, rank, world)
        else:  # every other hook: until it reaches dense's final loss, or for dense's wall time
            run = train(task, cfg, args, rank, world, target=target, budget_s=budget, max_steps=cap)
        runs[cfg.name] = run
        if cfg.kind == "dense":
            target, budget = _final(run["curve"], args.tail), run["wall_s"] * args.budget
        run["path"] = _path_of(cfg)
        run["raw_ms"] = raw_transfer_ms(run["wire_bytes"], world)
        if rank == 0:
            print(f"# {cfg.name}: {run['steps']} steps, {run['wall_s']:.1f} s, step "
                  f"{run['step_ms']:.0f} ms, final loss {_final(run['curve'], args.tail):.4g} "
                  f"({run['algorithm']})", flush=True)
    width, depth = getattr(task, "width", None), getattr(task, "depth", None)
    floor = None
    if not getattr(task, "floor_model", None):  # the task's own model and optimizer, no DDP
        floor = task_floor(task, args, rank, world) if width else None
    elif width:  # the same MLP without DDP on every rank at once (ddp_step's floor, reused)
        fa = argparse.Namespace(model=task.floor_model, width=width, depth=depth, seed=0, batch=task.batch,
                                warmup=3, steps=args.floor_steps)
        floor = measure_floor(fa, rank, world)
    load_after = _uptime() if rank == 0 else None
    if rank != 0:
        return None
    dense_final = _final(runs["dense"]["curve"], args.tail)
    rows = []
    for name, run in runs.items():
        step, secs = time_to_quality(run, dense_final, args.tail)
        rows.append({"hook": name, "path": run["path"], "algorithm": run["algorithm"],
                     "tuned": run["tuned"], "steps": run["steps"], "stop": run["stop"],
                     "wall_s": run["wall_s"],
                     "step_ms": run["step_ms"],
                     "final_loss": _final(run["curve"], args.tail),
                     "loss_ratio": _final(run["curve"], args.tail) / dense_final,
                     "ttq_step": step if step is not None else "not reached",
                     "ttq_s": secs if secs is not None else "not reached",
                     "wire_MB": run["wire_bytes"] / 1e6 if run["wire_bytes"] else None,
                     "raw_ms": run["raw_ms"], "_secs": secs})
    ref = {r["hook"]: r["_secs"] for r in rows}
    for r in rows:
        for col, base in (("speedup", ref["dense"]), ("vs_psgd_r1", ref.get(PSGD))):
            r[col] = base / r["_secs"] if base and r["_secs"] else None
    if floor is not None:
        for r, run in zip(rows, runs.values()):  # the floor against the mean step, tuning included
            r["util"] = floor["step_ms"] / (1e3 * run["wall_s"] / run["steps"]) if run["steps"] else None
        rows.append({"hook": FLOOR, "path": "no DDP", "algorithm": "none", "step_ms": floor["step_ms"]})
        for r in rows:
            r["vs_floor"] = r["step_ms"] / floor["step_ms"] if r["step_ms"] else None
    print(tables.format_table(rows, TTQ_COLUMNS), flush=True)
    print(f"# dense final loss {dense_final:.4g}; load after: {load_after}", flush=True)
    if args.out:
        _write_ttq(args, task, rows, runs, dense_final, skipped, world, floor,
                   load_before, load_after)
    return rows


def task_floor(task, args, rank: int, world: int) -> dict:
    """The compute floor of ``task``: its own model, optimizer and batches trained without DDP
    on every rank at once (world size 1, no communication, the cores shared as in the DDP
    rows): 3 warm-up steps, then ``--floor-steps`` steps; the median of the per-step max over
    ranks."""
    import time

    import torch.distributed as dist

    from ddp_step import FLOOR

    model = task.model()
    opt = task.optimizer(model.parameters())
    times = []
    for step in range(3 + args.floor_steps):
        dist.barrier()
        t0 = time.perf_counter()
        x, y = task.batch_at(step, rank, world)
        opt.zero_grad(set_to_none=False)
        task.loss(model(x), y).backward()
        opt.step()
        if step >= 3:
            times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    return {"hook": FLOOR, "algorithm": "none", "step_ms": 1e3 * statistics.median(t.tolist())}


def _write_ttq(args, task, rows, runs, dense_final, skipped, world, floor, load_before,
               load_after) -> None:
    out = args.out
    tables.write_csv(out + ".csv", rows, TTQ_COLUMNS + ["final_loss", "vs_floor", "util"])
    tables.write_csv(out + "_curves.csv",
                     [{"hook": h, "step": s, "seconds": t, "loss": v}
                      for h, run in runs.items() for (s, v), t in zip(run["curve"], run["times"])],
                     ["hook", "step", "seconds", "loss"])
    png = _plot_ttq(runs, dense_final, out, f"{task.name}, {world} ranks, link {args.link}")
    steps = steps_for(task, args)
    md = [f"# Time to quality: {task.name}, {world} gloo ranks, link {args.link}", "", "```",
          args.command, "```", "",
          f"Machine: {machine.machine_facts()}.", "",
          f"Load: before `{load_before}`; after `{load_after}`.", "",
          f"Task `{task.name}`: {' '.join((task.__doc__ or '').split())}"
          + (f" Here: width {task.width}, depth {task.depth}, "
             f"{sum(p.numel() for p in task.model().parameters()) / 1e6:.2f}M parameters."
             if getattr(task, "width", None) else "")
          + f" Dense trains {steps} steps; every other hook trains until its smoothed loss reaches "
          f"dense's final loss (`stop` = reached) or for {args.budget:g}x dense's wall time (`stop` = "
          f"budget; at most {args.max_steps_factor:g}x dense's steps, `stop` = steps): a hook that "
          f"stops on the budget is slower to dense's quality than dense. The same "
          f"initial weights and data order for every hook; batch {task.batch} per rank, lr {task.lr}. "
          f"Loss evaluated every {args.eval_every} steps; smoothed loss = mean of the last "
          f"{args.tail} evaluations; dense's final loss = its smoothed loss at the end "
          f"({dense_final:.4g}).", "",
          "Clock: per hook, registering the hook plus every training step (batch, forward, "
          "backward, optimizer step), the max over ranks; evaluations are off the clock. Auto "
          "rows (`default(...)`) pay their link probing and autotuning inside the clock, as a "
          "user does (`tuned` = the autotuner's tuning steps).", "",
          "Columns: `path` — `default`: `comms.register(ddp, spec, optimizer=opt)` with every "
          "other default (algorithm auto; out of the box); `pinned`: a hand-picked algorithm and "
          "setting (e.g. `topk:density=0.01,exact=false` at allgather), not the default; `torch`: "
          "PyTorch's own hooks (optimizer keeps its momentum). `steps`/`wall_s`: the whole run "
          "(up to its stop); `outer(...)` rows communicate every H steps (`comms.register(ddp, "
          "spec, optimizer=opt, sync_every=H, sync_fragments=P, sync_delay=tau)`, hand-picked H, P, "
          "tau; the wire bytes are per step, a round of fragments spread over its H steps); "
          "`step_ms`: median step; `loss_ratio` = final loss / dense's final; `ttq_step`/`ttq_s`: "
          "the first evaluation whose smoothed loss is <= dense's final loss (`not reached` if "
          "none); `speedup` = dense's ttq_s / the row's; `vs_psgd_r1` = torch PowerSGD r1's "
          "ttq_s / the row's; `wire_MB` per rank per step; `raw_ms`: one plain gloo allreduce "
          "sending the row's wire bytes on the same links in the same run (the wire-time floor).",
          ""]
    if floor is not None:
        how = ("`bench/ddp_step.py`'s `measure_floor`" if getattr(task, "floor_model", None) else
               f"`task_floor`: the task's own optimizer and batches, {args.floor_steps} steps "
               f"after 3 warm-up steps")
        md += [f"Floor (same run): `{floor['hook']}` — the same model and batch trained without "
               f"DDP on every rank at once (world size 1, no communication; {how}), median step "
               f"{floor['step_ms']:.0f} ms: "
               f"no hook's step can beat it; `vs_floor` = a row's median step / the floor's; `util` "
               f"(compute utilization) = the floor / the row's mean step over its whole run, tuning "
               f"included.", ""]
    dense = next(r for r in rows if r["hook"] == "dense")
    if dense.get("raw_ms"):
        md += [f"Wire floor of a dense step (same run): {dense['wire_MB']:.1f} MB per rank in one "
               f"plain gloo allreduce on the same links takes {dense['raw_ms']:.1f} ms (dense's "
               f"`raw_ms`): the communication a dense step cannot avoid.", ""]
    md += [f"Skipped: {what} — {why}" for what, why in skipped] + ([""] if skipped else [])
    md.append(tables.format_table(rows, TTQ_COLUMNS + (["vs_floor", "util"] if floor else []), markdown=True))
    md += ["", f"![{os.path.basename(png)}]({os.path.basename(png)})"]
    tables.write_text(out + ".md", "\n".join(md) + "\n")


def _plot_ttq(runs, dense_final, out, title) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    cmap = plt.get_cmap("tab20")
    for i, (h, run) in enumerate(runs.items()):
        ax.plot(run["times"], [v for _, v in run["curve"]], label=h,
                color="black" if h == "dense" else cmap(i % 20),
                linewidth=2.2 if h == "dense" else 1.1,
                linestyle="--" if h.startswith("torch") else ":" if run["path"] == "pinned" else "-")
    ax.axhline(dense_final, color="black", linewidth=0.8, alpha=0.6)
    ax.set_xlabel("training wall-clock seconds (max over ranks; evaluation excluded)")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title(f"Loss against wall-clock time: {title} (line: dense's final loss)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = out + ".png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _final(curve, tail: int) -> float:
    vals = [v for _, v in curve[-tail:]]
    return sum(vals) / len(vals)


def _write(args, rows, curves, cols, skipped, world, steps) -> None:
    out = args.out
    tables.write_csv(out + ".csv", rows, cols)
    tables.write_csv(out + "_curves.csv", curves, ["task", "hook", "step", "loss"])
    pngs = _plot(curves, out)
    md = [f"# Convergence: final loss against dense allreduce ({world} gloo ranks)", "", "```",
          args.command, "```", "",
          f"Machine: {machine.machine_facts()}. Steps (a fixed count per task, the same for "
          f"every hook): {', '.join(f'{t} {n}' for t, n in steps.items())}; fixed seeds, the same data "
          f"order for every hook; loss evaluated every {args.eval_every} steps (digits: the whole "
          f"training split; charlm: 64 held-out sequences of the stdlib's source); final = mean of "
          f"the last {args.tail} evaluations. ratio = final / dense final; target: the ratio each kind of hook should stay within.", ""]
    md += [f"Skipped: {what} — {why}" for what, why in skipped] + [""]
    md.append(tables.format_table(rows, cols, markdown=True))
    md += [""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in pngs]
    tables.write_text(out + ".md", "\n".join(md) + "\n")


def _plot(curves, out) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for task in dict.fromkeys(c["task"] for c in curves):
        hook_names = list(dict.fromkeys(c["hook"] for c in curves if c["task"] == task))
        fig, ax = plt.subplots(figsize=(9, 5.5))
        cmap = plt.get_cmap("tab20")
        for i, h in enumerate(hook_names):
            pts = [(c["step"], c["loss"]) for c in curves if c["task"] == task and c["hook"] == h]
            ax.plot(*zip(*pts), label=h, color="black" if h == "dense" else cmap(i % 20),
                    linewidth=2.2 if h == "dense" else 1.1,
                    linestyle="--" if h.startswith("torch") else "-")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_yscale("log")
        ax.set_title(f"{task}: loss against step, every hook vs dense allreduce")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = f"{out}_{task}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    launching.add_launch_args(p)
    p.add_argument("--tasks", default=None,
                   help="comma-separated: digits, charlm, oddconv, digits25m, charlm12m (default: the "
                        "first three; with --time-to-quality: digits25m)")
    p.add_argument("--time-to-quality", action="store_true",
                   help="time-to-quality mode (implied by --netsim): one task (default digits25m), "
                        f"hooks {TTQ_HOOKS.replace('%', '%%')!r} unless --hooks; loss against wall-clock seconds and "
                        "per hook the time to reach dense's final loss, with the floors of the run")
    p.add_argument("--width", type=int, default=None,
                   help="digits25m: MLP width (2048); charlm12m: transformer width (512)")
    p.add_argument("--depth", type=int, default=None,
                   help="digits25m: MLP layers (6); charlm12m: transformer layers (4)")
    p.add_argument("--budget", type=float, default=1.0,
                   help="time-to-quality: every hook after dense trains until its smoothed loss "
                        "reaches dense's final loss, or for BUDGET x dense's wall time (default 1: "
                        "a hook that cannot beat dense's clock stops there)")
    p.add_argument("--max-steps-factor", type=float, default=3.0,
                   help="time-to-quality: at most this many times dense's steps per hook")
    p.add_argument("--floor-steps", type=int, default=10,
                   help="time-to-quality: measured steps of the no-communication floor")
    p.add_argument("--pairing", choices=("optimizer", "none"), default="optimizer",
                   help="register(..., optimizer=opt) (default: SGD momentum moves into the hook) "
                        "or register without it (the optimizer keeps its momentum)")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per hook (default: per task, digits 1000, charlm 300, oddconv 500)")
    p.add_argument("--seed", type=int, default=0,
                   help="model initialisation and batch order (each results file's command names its seed; "
                        "the data and the evaluation set stay fixed)")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--tail", type=int, default=5, help="evaluations averaged into the final loss")
    p.add_argument("--batch", type=int, default=None, help="per rank (digits 32, charlm 16)")
    p.add_argument("--lr", type=float, default=None, help="digits 0.05 (SGD), charlm 2e-3 (AdamW)")
    p.add_argument("--lr-warmup", type=int, default=None,
                   help="steps of linear lr warm-up, the same for every hook (default 0: off)")
    p.add_argument("--start-iter", type=int, default=2)
    p.add_argument("--bucket-cap-mb", type=float, default=64.0,
                   help="one bucket for these models (torch powerSGD_hook needs that on gloo)")
    p.add_argument("--hooks", default=None, help="comma-separated hook names or substrings")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="our hooks: DGC warm-up over this many compressed steps (0: off; default: "
                        "each compressor's default_warmup_steps, 5 for top-k)")
    p.add_argument("--outer", action="append", default=None, metavar="SPEC@KEY=VALUE,...",
                   help="an outer-sync row: spec and register's sync keywords, e.g. "
                        "'qsgd:bits=4@sync_every=16,sync_fragments=4,sync_delay=3' (repeatable)")
    p.add_argument("--hook-opt", action="append", default=None, metavar="KEY=VALUE",
                   help="another comms.register option for our hooks (repeatable), e.g. "
                        "momentum_masking=false, clip_norm=1.0")
    p.add_argument("--specs", default=None,
                   help="';'-separated 'spec@algorithm' hooks to run instead (dense stays), e.g. "
                        "'qsgd:bits=4,chunk=64@allgather;qsgd:bits=4,chunk=512@allgather'")
    p.add_argument("--out", default=None,
                   help="write OUT.md, OUT.csv, OUT_curves.csv, OUT_<task>.png ('' for none; default "
                        "bench/results/convergence, with --time-to-quality "
                        "bench/results/time_to_quality_<link>, writing OUT.png)")
    p.add_argument("--command", default=None, help=argparse.SUPPRESS)
    p.add_argument("--link", default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.command is None:  # what the user typed, before the defaults below are made explicit
        args.command = launching.shell_command(argv)
        argv = [*argv, "--command", args.command]
    if args.netsim and not args.time_to_quality:  # --netsim means time to quality; the netsim
        args.time_to_quality = True               # children never see --netsim: tell them
        argv = [*argv, "--time-to-quality"]
    if args.tasks is None:
        args.tasks = "digits25m" if args.time_to_quality else "digits,charlm,oddconv"
        argv = [*argv, "--tasks", args.tasks]
    if args.time_to_quality and args.hooks is None and args.specs is None:
        args.hooks = getattr(TASKS.get(args.tasks), "ttq_hooks", TTQ_HOOKS)
        argv = [*argv, "--hooks", args.hooks]
    if args.out is None:
        link = args.link or args.netsim or "unshaped"
        args.out = os.path.join(harness.RESULTS, f"time_to_quality_{link}" if args.time_to_quality
                                else "convergence")
        argv = [*argv, "--out", args.out]
    bad = [t for t in args.tasks.split(",") if t not in TASKS]
    if bad:
        raise SystemExit(f"unknown task(s) {bad}; known: {sorted(TASKS)}")
    if args.time_to_quality and "," in args.tasks:
        raise SystemExit("--time-to-quality runs one task (--tasks NAME)")
    if (args.steps is not None and args.steps < 1) or args.eval_every < 1 or args.tail < 1:
        raise SystemExit("--steps, --eval-every and --tail must be >= 1")
    return launching.launch_recorded(os.path.abspath(__file__), rank_main, args, argv)


if __name__ == "__main__":
    main()

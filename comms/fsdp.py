"""Compressed gradient sync for FSDP2 (``fully_shard``) and HSDP: one call, :func:`register`.

Two modes, chosen by whether a replicate group is given:

* **FSDP** (``replicate_group=None``): every FSDP module's reduce-scatter becomes the
  scatter-reduce half of ``two_phase`` (:func:`comms.algorithms.two_phase.scatter_send` /
  :func:`~comms.algorithms.two_phase.decode_sum`): each rank compresses the chunk of its
  flat padded gradient that each destination owns, one ``all_to_all`` moves them, the owner
  decodes and sums them **in rank order** into its output shard. No second compression:
  the owner's sum is what FSDP keeps, so every rank of the group holds the bits it owns
  and nobody else recomputes them (ARCHITECTURE.md §5, "computed once"). Bytes sent per
  rank per module: ``(W - 1) * (P + 1)``, ``P`` one chunk's payload, 1 the flag byte.
* **HSDP** (``replicate_group`` given; the model is 1-D ``fully_shard`` over the *shard*
  group, e.g. ``mesh["shard"]`` of a ``(replicate, shard)`` mesh): FSDP's own
  full-precision reduce-scatter inside the shard group (fast intra-node links), then our
  compressed all-reduce of the output shard across the replicate group through
  ``set_all_reduce_hook`` with any flat algorithm (``allreduce``, ``allgather``,
  ``two_phase``) — "shard within a node, replicate across nodes".

Averaging happens once, by FSDP: :func:`register` turns on
``set_force_sum_reduction_for_comms(True)`` so every collective sums, and FSDP divides the
output by its divide factor afterwards (the shard group's size; in HSDP mode
``register`` sets ``set_gradient_divide_factor(shard x replicate)`` unless the module has
its own). A ``ReduceOp.AVG`` that reaches the reduce-scatter anyway is honoured (divide by
the group size after the rank-order sum); ``PREMUL_SUM`` is refused.

Error feedback (on by default for biased compressors: top-k, random-k, sign, casts; off for
QSGD) keeps per rank and per module: in FSDP mode the residual of the **whole unsharded
padded gradient** (``W x shard`` elements: the memory of one full gradient of the model per
rank, in the reduce dtype — the price of compressing what every rank sends); in HSDP mode the
residual of the output shard only (``1/W`` of that) plus the algorithm's own store.
``error_feedback=False`` turns it off.

Non-finite guard: in FSDP mode every rank's flag rides its ``all_to_all`` payloads as one
byte, so all ranks learn it with no extra collective; in HSDP mode one 1-element
allreduce per module runs next to the data. A flagged module's output is NaN on every rank
(``GradScaler`` skips the step) and its residual and store are zeroed. Neither reads the
flag on the host (``state.nonfinite_modules`` does, when asked).

Example::

    >>> from torch.distributed.fsdp import fully_shard
    >>> for block in model.blocks:
    ...     fully_shard(block)
    >>> fully_shard(model)
    >>> state = comms.fsdp.register(model, "topk:density=0.01")   # before the first step
    >>> torch.save(state.state_dict(), f"comm.rank{rank}.pt")     # per rank
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

try:  # a private path of torch 2.11-2.13: ``import comms`` must not fail where it moved
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - register() still works: FSDP duck-types the comm
    ReduceScatter = object

from compressors import Compressor, Context, ErrorFeedback, from_spec

from .algorithms import get_algorithm
from .algorithms.two_phase import decode_sum, scatter_send
from .communicator import TorchCommunicator
from .config_check import ConfigCheck
from .errors import where
from .checkpoint import hash64 as _hash64, plain as _plain, to_device as _to_device
from .stats import record_call

__all__ = ["register", "FSDPCompressionState", "CompressedReduceScatter", "ReplicateAllReduce",
           "FSDP_CONFIG_FIELDS", "fsdp_modules"]

logger = logging.getLogger(__name__)

# what every rank must agree on for a module, in the order of the cross-rank config check
FSDP_CONFIG_FIELDS = ("compressor", "mode", "algorithm", "seed", "start_iter", "error_feedback",
                      "module", "step", "numel", "dtype")

_HSDP_ALGORITHMS = ("allreduce", "allgather", "two_phase")


def fsdp_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(fqn, module)`` of every FSDP2 module of ``model`` that owns parameters, in
    ``named_modules`` order (the root's fqn is ``""``)."""
    out = []
    for fqn, m in model.named_modules():
        if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_groups:
            out.append((fqn, m))
    return out


def _is_fsdp1(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


class FSDPCompressionState:
    """What the FSDP reduce-scatters / HSDP all-reduce hooks keep between calls.

    Args:
        compressor: a :class:`compressors.Compressor` or a spec string.
        replicate_group: ``None``: FSDP mode; a ``ProcessGroup``: HSDP mode (see the module
            docstring). Not pickled.
        error_feedback: ``None``: on for biased compressors. See the module docstring for
            the memory it costs.
        algorithm: HSDP mode only: the replicate all-reduce's algorithm (``None``: the
            compressor's cheapest of allreduce, allgather, two_phase).
        seed: shared seed of the hash RNG streams.
        start_iter: calls per module of plain (uncompressed) reduction first.

    Raises:
        TypeError / ValueError: a bad option or a compressor that cannot travel this way,
            naming it.

    Example::

        >>> state = FSDPCompressionState("sign")
        >>> state.state_dict()["compressor"]
        'sign:chunk=128'
    """

    def __init__(self, compressor: "Compressor | str", *, replicate_group=None,
                 error_feedback: bool | None = None, algorithm: str | None = None, seed: int = 0,
                 start_iter: int = 0):
        if not isinstance(compressor, (str, Compressor)):
            raise TypeError(f"compressor must be a spec string or a compressors.Compressor, got {compressor!r}")
        self.compressor = c = from_spec(compressor)
        for name, v in (("seed", seed), ("start_iter", start_iter)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {v!r}")
        if start_iter < 0:
            raise ValueError(f"start_iter must be >= 0, got {start_iter!r}")
        if error_feedback is not None and not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be True, False or None, got {error_feedback!r}")
        if replicate_group is not None and not isinstance(replicate_group, dist.ProcessGroup):
            hint = " (for a DeviceMesh pass mesh.get_group('replicate'))" \
                if "Mesh" in type(replicate_group).__name__ else ""
            raise TypeError(f"replicate_group must be a torch.distributed.ProcessGroup or None, got "
                            f"{type(replicate_group).__name__}{hint}")
        self.mode = "fsdp" if replicate_group is None else "hsdp"
        if self.mode == "fsdp":
            if algorithm is not None:
                raise ValueError(f"algorithm={algorithm!r} applies to the HSDP replicate all-reduce "
                                 "only (pass replicate_group); the FSDP reduce-scatter is one algorithm")
            # the scatter-reduce needs every receiver to decode any rank's chunk payload
            # (allgather/two_phase families) and equal payloads per chunk (fixed size)
            if not (c.fixed_size and (c.supports("two_phase") or c.supports("allgather"))):
                raise ValueError(f"compressor {c.spec()!r} cannot compress the FSDP reduce-scatter: it "
                                 "needs rank-decodable, fixed-size chunk payloads (identity, fp16, bf16, "
                                 f"qsgd, sign, topk, randomk); {c.spec()!r} supports {list(c.families)}")
        else:
            if algorithm is None:
                algorithm = next((a for a in _HSDP_ALGORITHMS if c.supports(a)), None)
            if algorithm not in _HSDP_ALGORITHMS:
                raise ValueError(f"HSDP replicate all-reduce algorithm must be one of {_HSDP_ALGORITHMS}, "
                                 f"got {algorithm!r} (for {c.spec()!r})")
            if c.name == "powersgd" or not get_algorithm(algorithm).supports(c):
                raise ValueError(f"compressor {c.spec()!r} cannot travel with {algorithm!r} on a flat "
                                 f"FSDP shard (it supports {list(c.families)})")
        self.algorithm = algorithm
        self.error_feedback = (not c.unbiased) if error_feedback is None else error_feedback
        self.seed = seed
        self.start_iter = start_iter
        self.replicate_group = replicate_group
        self.memory = ErrorFeedback()            # module index -> residual
        self.algo_store: dict[int, dict] = {}    # HSDP: the algorithm's per-module store
        self.steps: dict[int, int] = {}          # module index -> calls so far (the RNG step)
        self.modules: list[str] = []             # module index -> fqn
        self.stats: dict = {}
        self._nonfinite: torch.Tensor | None = None
        self.config_check = ConfigCheck(FSDP_CONFIG_FIELDS)
        self._comms: dict[int, TorchCommunicator] = {}

    # -- per call ------------------------------------------------------------------------
    def comm_for(self, group) -> TorchCommunicator:
        c = self._comms.get(id(group))
        if c is None:
            c = self._comms[id(group)] = TorchCommunicator(group)
        return c

    def config_values(self, index: int, numel: int, dtype, step: int) -> tuple:
        return (self.compressor.spec(), self.mode, self.algorithm, self.seed, self.start_iter,
                self.error_feedback, self.modules[index], step, numel, str(dtype))

    def check(self, comm, index: int, x: torch.Tensor, step: int) -> None:
        """Cross-rank config check, once per (module, numel, dtype) (collective)."""
        self.config_check.check(
            comm, index, x, step,
            lambda: [_hash64(v) for v in self.config_values(index, x.numel(), x.dtype, step)],
            lambda: self.config_values(index, x.numel(), x.dtype, step))

    def count_nonfinite(self, flagged: torch.Tensor) -> None:
        f = flagged.reshape(()).to(torch.int64)
        self._nonfinite = f if self._nonfinite is None else self._nonfinite.add(f.to(self._nonfinite.device))

    @property
    def nonfinite_modules(self) -> int:
        """How many (module, step) reductions were non-finite and NaN-filled (reads the device)."""
        return 0 if self._nonfinite is None else int(self._nonfinite.item())

    def residual_bytes(self) -> int:
        """Bytes of error-feedback memory this rank holds (residuals and algorithm stores)."""
        n = sum(r.numel() * r.element_size() for r in self.memory.residuals.values())
        return n + sum(t.numel() * t.element_size() for d in self.algo_store.values()
                       for t in d.values() if isinstance(t, torch.Tensor))

    def report(self) -> str:
        """Per-module table: numel, dense and wire bytes one rank sends per step."""
        rows = [f"{'module':>24} {'numel':>11} {'dense B':>12} {'wire B':>12} {'ratio':>7}"]
        for i in sorted(self.stats):
            s = self.stats[i]
            rows.append(f"{self.modules[i] or '<root>':>24} {s.numel:>11} {s.dense_bytes:>12} "
                        f"{s.wire_bytes:>12} {s.ratio:>7.1f}")
        rows.append(f"compressor={self.compressor.spec()} mode={self.mode} error_feedback="
                    f"{self.error_feedback} residual bytes={self.residual_bytes()}")
        return "\n".join(rows)

    # -- checkpointing ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and numbers (``torch.load(weights_only=True)`` reads it); per rank."""
        return {
            "kind": "fsdp", "compressor": self.compressor.spec(), "mode": self.mode,
            "algorithm": self.algorithm, "seed": self.seed, "start_iter": self.start_iter,
            "error_feedback": self.error_feedback, "modules": list(self.modules),
            "steps": {int(i): int(s) for i, s in self.steps.items()},
            "memory": self.memory.state_dict(),
            "algo_store": {int(i): _plain(d, f"algo_store[{i}]") for i, d in self.algo_store.items()},
            "nonfinite_modules": self.nonfinite_modules,
        }

    def load_state_dict(self, sd: dict[str, Any], device=None) -> None:
        """Restore :meth:`state_dict` (this rank's own file); validates before changing anything.

        Raises:
            TypeError: not a dict from :meth:`state_dict`.
            ValueError: saved with another compressor, mode, algorithm, error feedback or
                another set of FSDP modules.
        """
        if not isinstance(sd, dict) or sd.get("kind") != "fsdp":
            raise TypeError(f"load_state_dict needs a dict from FSDPCompressionState.state_dict(), "
                            f"got {type(sd).__name__}")
        for key, mine in (("compressor", self.compressor.spec()), ("mode", self.mode),
                          ("algorithm", self.algorithm), ("error_feedback", self.error_feedback),
                          ("modules", list(self.modules))):
            if sd.get(key) != mine:
                raise ValueError(f"state was saved with {key}={sd.get(key)!r}, this model uses {mine!r}")
        self.seed = int(sd["seed"])
        self.steps = {int(i): int(s) for i, s in sd["steps"].items()}
        self.memory.load_state_dict(sd["memory"], device=device)
        self.algo_store = {int(i): _to_device(d, device) for i, d in sd["algo_store"].items()}
        n = int(sd.get("nonfinite_modules", 0))
        self._nonfinite = torch.tensor(n) if n else None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("replicate_group", "_comms", "config_check")}

    def __setstate__(self, st):
        self.__dict__.update(st)
        self.replicate_group, self._comms = None, {}
        self.config_check = ConfigCheck(FSDP_CONFIG_FIELDS)


def _op_divides(op) -> bool:
    """True for AVG, False for SUM; anything else is refused (we cannot read a PREMUL_SUM factor)."""
    if op == dist.ReduceOp.SUM:
        return False
    if op == dist.ReduceOp.AVG:
        return True
    raise ValueError(f"commpress FSDP reduce-scatter got reduce op {op!r}; only SUM and AVG are "
                     "supported. comms.fsdp.register turns on set_force_sum_reduction_for_comms(True) "
                     "so that FSDP divides once itself; do not turn it off")


def _wait(fut, what: str):
    try:
        return fut.wait()
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        raise RuntimeError(f"{what} failed: {exc}") from exc


class CompressedReduceScatter(ReduceScatter):
    """The FSDP-mode reduce-scatter of one module (an FSDP ``ReduceScatter``; see the module
    docstring). Built by :func:`register`; one instance per FSDP module.

    ``__call__(output, input, group, op)`` is synchronous (FSDP calls it with
    ``async_op=False`` and reads ``output`` right after): it waits for its ``all_to_all``.

    Example::

        >>> rs = CompressedReduceScatter(state, index=0)
        >>> out = rs.allocate((m,), dtype=torch.float32, device="cpu")
        >>> rs(out, flat_grad, group, dist.ReduceOp.SUM)   # out: this rank's summed shard
    """

    def __init__(self, state: FSDPCompressionState, index: int):
        self.state, self.index = state, index

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if async_op:
            raise ValueError("commpress FSDP reduce-scatter is synchronous; async_op=True is not supported")
        st, idx = self.state, self.index
        comm = st.comm_for(group)
        world, rank = comm.world_size, comm.rank
        x = input_tensor.view(-1)
        n, m = x.numel(), output_tensor.numel()
        if n != world * m or not output_tensor.is_contiguous():
            raise ValueError(f"commpress FSDP reduce-scatter of module {st.modules[idx]!r}: input "
                             f"{n} elements, output {m}, world {world}; need input == world x output")
        divide = _op_divides(op)
        step = st.steps.get(idx, 0)
        st.check(comm, idx, x, step)
        what = where(comm, "FSDP compressed reduce-scatter", idx, n, x.dtype, step)
        if step < st.start_iter:  # plain full-precision reduce-scatter (sum)
            record_call(st.stats, idx, n, x.dtype, x.element_size(), world, "dense", None)
            out = _wait(comm.reduce_scatter(x), what)
            if divide:
                out = out.div(world)
            output_tensor.view(-1).copy_(out)
            st.steps[idx] = step + 1
            return None
        c = st.compressor
        if st.error_feedback:
            st.memory.add_residual_(idx, x)  # x is our allocate()'s buffer: FSDP reads it no more
        # a tensor, not a bool: no host sync; every rank's flag rides its payloads
        bad = (~torch.isfinite(x.sum(dtype=torch.float32))).to(torch.uint8).view(1)
        ctx = Context(numel=n, dtype=x.dtype, device=x.device, step=step, bucket=idx, rank=rank,
                      seed=st.seed)
        rec = record_call(st.stats, idx, n, x.dtype, x.element_size(), world, "fsdp_reduce_scatter",
                          lambda: (world - 1) * (c.wire_bytes(m, x.dtype) + 1))
        rec.dense_bytes = (world - 1) * m * x.element_size()  # a reduce-scatter, not an allreduce
        fut, own, layout, nb, stride = scatter_send(comm, c, x, ctx, tail=bad)
        recv = _wait(fut, what)
        acc = decode_sum(c, recv, layout, nb, stride, ctx, world, rank)  # rank order, fp32/fp64
        flagged = recv.view(world, stride)[:, nb].ne(0).any()  # same value on every rank
        if divide:
            acc.div_(world)
        output_tensor.view(-1).copy_(acc)
        output_tensor.masked_fill_(flagged, float("nan"))
        if st.error_feedback:
            st.memory.update_(idx, x, own[:n]).masked_fill_(flagged, 0.0)
        st.count_nonfinite(flagged)
        st.steps[idx] = step + 1
        return None  # synchronous: the output holds the result when FSDP continues


class ReplicateAllReduce:
    """The HSDP-mode ``set_all_reduce_hook`` hook of one module: compressed all-reduce (sum)
    of the reduce-scatter output across the replicate group; FSDP divides afterwards.

    Example::

        >>> module.set_all_reduce_hook(ReplicateAllReduce(state, index=0))
    """

    def __init__(self, state: FSDPCompressionState, index: int):
        self.state, self.index = state, index

    def __call__(self, reduce_output: torch.Tensor) -> None:
        st, idx = self.state, self.index
        comm = st.comm_for(st.replicate_group)
        x = reduce_output.view(-1)
        step = st.steps.get(idx, 0)
        if comm.world_size == 1:
            st.steps[idx] = step + 1
            return
        st.check(comm, idx, x, step)
        what = where(comm, f"HSDP replicate {st.algorithm}", idx, x.numel(), x.dtype, step)
        if step < st.start_iter:
            record_call(st.stats, idx, x.numel(), x.dtype, x.element_size(), comm.world_size, "dense", None)
            _wait(comm.all_reduce(x), what)
            st.steps[idx] = step + 1
            return
        alg = get_algorithm(st.algorithm)
        if st.error_feedback:
            st.memory.add_residual_(idx, x)
        bad = (~torch.isfinite(x.sum(dtype=torch.float32))).to(torch.float32).view(1)
        if x.device.type != "cpu" and comm.backend in ("gloo", "mpi"):
            bad = bad.cpu()
        flag_fut = comm.all_reduce(bad)  # issued first, in program order on every rank
        ctx = Context(numel=x.numel(), dtype=x.dtype, device=x.device, step=step, bucket=idx,
                      rank=comm.rank, seed=st.seed)
        record_call(st.stats, idx, x.numel(), x.dtype, x.element_size(), comm.world_size, alg.name,
                    lambda: alg.wire_bytes(st.compressor, x.numel(), x.dtype, comm.world_size) + 4)
        store = st.algo_store.setdefault(idx, {})
        total, own = _wait(alg(comm, st.compressor, x, ctx, store), what)
        flagged = (_wait(flag_fut, what).to(x.device) > 0).reshape(())
        if st.error_feedback:
            st.memory.update_(idx, x, own).masked_fill_(flagged, 0.0)
        for t in store.values():  # e.g. the two_phase owner residual
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.masked_fill_(flagged, 0.0)
        x.copy_(total)
        x.masked_fill_(flagged, float("nan"))
        st.count_nonfinite(flagged)
        st.steps[idx] = step + 1


def register(model: torch.nn.Module, compressor, *, replicate_group=None,
             error_feedback: bool | None = None, algorithm: str | None = None, seed: int = 0,
             start_iter: int = 0) -> FSDPCompressionState:
    """Equip every FSDP2 module of ``model`` with compressed gradient sync; return the state.

    Call after ``fully_shard`` and before the first backward, on every rank with the same
    arguments. Everything is validated before any module is changed.

    Args:
        model: the root module, after ``fully_shard`` was applied to it and/or its children.
        compressor: a :class:`compressors.Compressor` or a spec (``"topk:density=0.01"``).
        replicate_group: ``None``: FSDP mode (compressed reduce-scatter). A
            ``ProcessGroup``: HSDP mode — ``model`` must be 1-D ``fully_shard`` over the
            shard group, and the gradient shards are all-reduced, compressed, across this
            group (see the module docstring).
        error_feedback: ``None``: on for biased compressors; ``False`` saves its memory
            (FSDP mode: one unsharded gradient per rank).
        algorithm: HSDP mode: ``"allreduce"``, ``"allgather"`` or ``"two_phase"``.
        seed: shared hash-RNG seed.
        start_iter: calls per module of plain reduction before compressing.

    Returns:
        The :class:`FSDPCompressionState` (``state_dict()`` / ``load_state_dict()`` per rank).

    Raises:
        TypeError: ``model`` is an FSDP1 ``FullyShardedDataParallel`` (or holds one), or has
            no FSDP2 module; a bad option type.
        ValueError: an unsupported compressor; an FSDP module with several parameter groups;
            a native 2-D HSDP module; a module that already has a commpress or custom
            reduce-scatter / all-reduce hook.

    Example::

        >>> state = comms.fsdp.register(model, "sign")                       # FSDP
        >>> state = comms.fsdp.register(model, "qsgd:bits=4",                # HSDP
        ...                             replicate_group=mesh.get_group("replicate"))
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"register() needs an nn.Module, got {type(model).__name__}")
    if _is_fsdp1(model):
        raise TypeError("commpress FSDP support needs FSDP2 (torch.distributed.fsdp.fully_shard); this "
                        "model holds an FSDP1 FullyShardedDataParallel, which is not supported: "
                        "apply fully_shard (FSDP2) instead")
    state = FSDPCompressionState(compressor, replicate_group=replicate_group, error_feedback=error_feedback,
                                 algorithm=algorithm, seed=seed, start_iter=start_iter)
    mods = fsdp_modules(model)
    if not mods:
        raise TypeError(f"{type(model).__name__} has no FSDP2 module with parameters: apply "
                        "torch.distributed.fsdp.fully_shard first")
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    factors = {}
    for fqn, m in mods:
        name = fqn or "<root>"
        groups = m._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise ValueError(f"FSDP module {name!r} has {len(groups)} parameter groups (per-parameter "
                             "meshes via shard_placement_fn); a custom reduce-scatter is ambiguous there")
        g = groups[0]
        if g._is_hsdp or type(g.mesh_info).__name__ != "FSDPMeshInfo":
            raise ValueError(f"FSDP module {name!r} is on a {type(g.mesh_info).__name__} (native 2-D HSDP "
                             "or replicate); shard it with fully_shard(mesh=mesh['shard']) and pass "
                             "replicate_group=mesh.get_group('replicate')")
        if isinstance(g._reduce_scatter_comm, CompressedReduceScatter) or isinstance(
                g._all_reduce_hook, ReplicateAllReduce):
            raise ValueError(f"FSDP module {name!r} already has commpress registered")
        if state.mode == "fsdp" and type(g._reduce_scatter_comm) is not DefaultReduceScatter:
            raise ValueError(f"FSDP module {name!r} already has a custom reduce-scatter "
                             f"({type(g._reduce_scatter_comm).__name__})")
        if state.mode == "hsdp" and g._all_reduce_hook is not None:
            raise ValueError(f"FSDP module {name!r} already has an all-reduce hook")
        shard = g.mesh_info.shard_mesh_size
        if state.mode == "hsdp":
            factors[fqn] = g.gradient_divide_factor or float(shard * dist.get_world_size(replicate_group))
    # validated: now change the modules
    state.modules = [fqn for fqn, _ in mods]
    for i, (fqn, m) in enumerate(mods):
        m.set_force_sum_reduction_for_comms(True)  # FSDP divides once, after our sum
        if state.mode == "fsdp":
            comm = CompressedReduceScatter(state, i)
            m.set_custom_reduce_scatter(comm)
        else:
            m.set_gradient_divide_factor(factors[fqn])
            m.set_all_reduce_hook(ReplicateAllReduce(state, i))
    model._commpress_fsdp_state = state
    logger.info("commpress: %s on %d FSDP modules (%s), error feedback %s", state.compressor.spec(),
                len(mods), state.mode, state.error_feedback)
    return state

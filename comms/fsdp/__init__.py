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

The parameters (FSDP mode): FSDP2 moves them twice a step (the all-gathers before forward and
before backward) against the gradient once, so by default they travel block-quantized too
(``params``; :mod:`comms.fsdp_params`, ZeRO++'s qwZ): int8 codes with an fp32 scale per 256
elements, every rank decoding the same bytes — its own shard included — so every rank computes
with the same unsharded parameters; the fp32 shards the optimizer updates and a checkpoint
saves are untouched. ``params="auto"`` (the default) times full and int8 per module; HSDP's
all-gathers stay inside a host and the identity compressor stays bitwise plain FSDP2: full.

The owner's own chunk of the reduce-scatter never leaves it, so it is added exactly (never
encoded, no residual): the codec does ``(W - 1) / W`` of the whole gradient. Inside backward
the compressed reduce-scatter returns once its exchange is issued and the decode lands when
backward ends (an autograd final callback), so the exchange overlaps the rest of backward.

Averaging happens once: :func:`register` turns on ``set_force_sum_reduction_for_comms(True)``
so every collective sums; in FSDP mode the reduce-scatter divides by the module's divide
factor itself (``register`` sets FSDP's to 1: FSDP's divide would read the output at once);
in HSDP mode FSDP divides afterwards (``register`` sets ``set_gradient_divide_factor(shard x
replicate)`` unless the module has its own). A ``ReduceOp.AVG`` that reaches a direct call
anyway is honoured (divide by the group size after the rank-order sum); ``PREMUL_SUM`` is
refused.

Every option of :func:`comms.register` works here too (one
:class:`~comms.options.PipelineOptions`; the stages of :mod:`comms.pipeline`): ``optimizer=``
(SGD momentum taken over as momentum correction), ``warmup_steps``, ``residual_bound``,
``clip_norm``, ``timeout``, ``check_replicas_every`` (HSDP: the replicas' shards; FSDP: the
gathered parameters) and ``algorithm="auto"`` (per module, dense or compressed by measured
calls: :mod:`comms.fsdp_tuner`). Parameters without a gradient in a step (FSDP2 would leave
them out of the reduce-scatter and change its layout, losing the residual) are reduce-scattered
as zeros (``set_reduce_scatter_unused_params(True)``): a zero costs its compressed bytes, and
the residual survives. A reset that still happens is counted in ``report()`` and logged once.

Error feedback (on by default for biased compressors: top-k, random-k, sign, casts; off for
QSGD) keeps per rank and per module: in FSDP mode the residual of the **whole unsharded
padded gradient** (``W x shard`` elements: the memory of one full gradient of the model per
rank, in the reduce dtype — the price of compressing what every rank sends); in HSDP mode the
residual of the output shard only (``1/W`` of that) plus the algorithm's own store.
``error_feedback=False`` turns it off.

Non-finite guard: in FSDP mode every rank's flag rides its ``all_to_all`` payloads as one
byte, so all ranks learn it with no extra collective; in HSDP mode (and on dense calls that
keep per-rank memory) one 1-element allreduce per module runs next to the data. A flagged module's output is NaN on every rank
(``GradScaler`` skips the step) and its residual and store are zeroed. Neither reads the
flag on the host (``state.nonfinite_modules`` does, when asked).

Example::

    >>> from torch.distributed.fsdp import fully_shard
    >>> for block in model.blocks:
    ...     fully_shard(block)
    >>> fully_shard(model)
    >>> state = comms.fsdp.register(model, "qsgd:bits=4")   # before the first step
    >>> torch.save(state.state_dict(), f"comm.rank{rank}.pt")     # per rank
"""

from .registration import (FSDP_CONFIG_FIELDS, PARAM_MODES, CompressedReduceScatter, FSDPCompressionState,
                           QuantizedAllGather, ReplicateAllReduce, fsdp_modules, register)

__all__ = ["register", "FSDPCompressionState", "CompressedReduceScatter", "ReplicateAllReduce",
           "QuantizedAllGather", "PARAM_MODES", "FSDP_CONFIG_FIELDS", "fsdp_modules"]

"""Wire-dtype bandwidths, local passes, refine on one rank, and the planner's proposals and
rules (no communication)."""

import math

import pytest
import torch

import compressors
from comms.tuning.autotune import MODEL
from comms.algorithms import get_algorithm
from comms.algorithms.allreduce import payload_dtype
from comms.transport.communicator import LocalCommunicator
from comms.tuning.cost_model import HOOK_PASSES, ComputeCost, CostModel, TierCost
from comms.tuning.plan_table import apply_rule
from comms.tuning.planner import Planner
from comms.tuning.probe import PROBE_CAP_BYTES, PROBE_SECONDS, _timed_bytes, refine, shaped_sample
from comms.tuning.rule_ranking import propose_rules, tie_cost


def test_wire_dtype_bandwidth_is_charged():
    fp16 = compressors.from_spec("fp16")
    assert payload_dtype(fp16) == torch.float16
    assert payload_dtype(compressors.from_spec("powersgd:rank=1")) == torch.float32
    base = TierCost("flat", 2, 1e-3, 1e9)
    slow16 = base.with_betas({("allreduce", "torch.float16"): 0.25e9})
    n = 1 << 20
    assert slow16.allreduce(4 * n) == base.allreduce(4 * n)  # fp32 (or no dtype): base beta
    assert slow16.allreduce(2 * n, torch.float16) == pytest.approx(1e-3 + 2 * n / 0.25e9)
    m = CostModel({"flat": slow16}, {fp16.spec(): ComputeCost()})
    # fp16 halves the bytes, but gloo's fp16 sum is 4x slower per byte: dense wins
    assert m.predict("allreduce", fp16, n) > m.predict("dense", fp16, n)
    assert CostModel({"flat": base}, {fp16.spec(): ComputeCost()}).predict("allreduce", fp16, n) \
        < m.predict("dense", fp16, n)
    ops = CostModel({"flat": base}).wire_ops("allreduce", fp16, n, torch.float32)
    assert ops == [("flat", "allreduce", "torch.float16", fp16.wire_bytes(n))]
    topk = compressors.from_spec("topk:density=0.01")
    assert [o[1:3] for o in CostModel({"flat": base}).wire_ops("two_phase", topk, n, torch.float32)] == \
        [("all_to_all", "torch.uint8"), ("allgather", "torch.uint8")]
    hier = CostModel({"flat": base, "intra": base, "inter": base}, local_size=2).wire_ops(
        "hier_allreduce", fp16, n, torch.float32)
    assert [o[0] for o in hier] == ["intra", "inter", "intra"] and hier[1][2] == "torch.float16"


def test_local_passes_charged_to_compressed_candidates():
    fp16 = compressors.from_spec("fp16")
    tiers = {"flat": TierCost("flat", 2, 1e-3, 1e9)}
    m0 = CostModel(tiers, {fp16.spec(): ComputeCost()})
    m1 = CostModel(tiers, {fp16.spec(): ComputeCost()}, mem_per_element=1e-9)
    n = 10 ** 6
    assert m1.predict("allreduce", fp16, n) - m0.predict("allreduce", fp16, n) == pytest.approx(HOOK_PASSES * 1e-3)
    assert m1.predict("dense", fp16, n) == m0.predict("dense", fp16, n)


def test_refine_on_one_rank_times_compute_at_bucket_size():
    comp = compressors.from_spec("qsgd:bits=8")
    m = CostModel({"flat": TierCost("flat", 1, 0.0, 1e9)})
    r = refine(m, LocalCommunicator(), comp, [(1 << 18, torch.float32)], ["allgather"], compute_numel=1 << 18)
    # timings: assert what noise cannot flip (a two-point fit's slope can come out 0 when a
    # busy core stalls the small size); the predicted time at the bucket size is positive
    cc = r.compute[comp.spec()]
    assert r.mem_per_element > 0 and cc.compress_per_element >= 0 and cc.compress(1 << 18) > 0
    assert r.tiers["flat"].betas == {}  # one rank: nothing to probe, nothing hangs


@pytest.mark.parametrize("link, need, expect", [
    (1.25e8, 100 << 20, PROBE_CAP_BYTES),            # 1 Gb/s: 60 ms move less than the cap
    (1.25e9, 100 << 20, int(PROBE_SECONDS * 1.25e9)),  # 10 Gb/s: the op takes ~60 ms
    (1.25e9, 20 << 20, 20 << 20),                    # never more than the buckets need
    (1.25e9, 1000, 64 << 10),                        # nor under 64 KiB
])
def test_refine_times_an_op_long_enough_to_outlast_its_noise(link, need, expect):
    # a 2-rank ring allreduce moves its payload once over the link: bytes = seconds x link
    tier = TierCost("flat", 2, 1e-3, link)
    assert _timed_bytes(tier, "allreduce", need, PROBE_CAP_BYTES) == expect


def test_shaped_sample_takes_whole_leading_tensors():
    mlp = ((2048,), (2048, 2048), (2048,), (2048, 2048))
    assert shaped_sample(mlp, 1 << 22) == ((2048,), (2048, 2048))  # first prefix >= 4M elements
    assert shaped_sample(mlp, 1 << 30) == mlp  # the whole bucket when it is smaller
    assert shaped_sample(((10,), (2048, 2048)), 5) == ()  # a prefix of 1-D tensors: nothing to time
    assert shaped_sample([torch.Size([3, 4, 5])], 1) == ((3, 4, 5),)


def test_refine_times_a_shape_bound_compressor_on_the_bucket_tensors(monkeypatch):
    # PowerSGD factorizes each weight matrix: with the bucket's shapes it is timed on its
    # leading tensors (passed in ctx.shapes) and costed per element of that sample, no fixed part
    import comms.tuning.probe as probe_mod

    psgd, qsgd = compressors.from_spec("powersgd:rank=1"), compressors.from_spec("qsgd:bits=8")
    timed, real = [], probe_mod._time_compute

    def fake(comp, numels, reps, shapes=()):
        if not shapes:
            return real(comp, numels, reps)
        timed.append((comp.spec(), shapes))
        return [0.5, 0.0]

    monkeypatch.setattr(probe_mod, "_time_compute", fake)
    m = CostModel({"flat": TierCost("flat", 1, 0.0, 1e9)})
    shapes = ((64,), (64, 64), (64, 32))
    r = refine(m, LocalCommunicator(), psgd, [(64 + 64 * 64 + 64 * 32, torch.float32)], ["allreduce"],
                 compute_numel=1000, shapes=shapes)
    assert timed == [(psgd.spec(), ((64,), (64, 64)))]
    assert r.compute[psgd.spec()] == ComputeCost(0.0, 0.5 / (64 + 64 * 64), 0.0, 0.0)
    # elementwise compressors (and PowerSGD without shapes) keep the flat two-size fit
    refine(m, LocalCommunicator(), qsgd, [(1 << 16, torch.float32)], ["allgather"], compute_numel=1 << 16,
             shapes=((256, 256),))
    refine(m, LocalCommunicator(), psgd, [(1 << 16, torch.float32)], ["allreduce"], compute_numel=1 << 16)
    assert len(timed) == 1


def test_planner_refines_with_the_largest_buckets_shapes(monkeypatch):
    got = []

    def fake_refine(model, comm, compressor, buckets, algorithms, **kw):
        got.append((buckets, kw.get("shapes")))
        return model

    class Bucket:
        def __init__(self, *shapes):
            self.params = [torch.zeros(sh) for sh in shapes]

        def parameters(self):
            return self.params

    monkeypatch.setattr("comms.tuning.planner.refine", fake_refine)
    comp = compressors.from_spec("powersgd:rank=1")
    p = Planner(comp, cost_model=CostModel({"flat": TierCost("flat", 2, 1e-3, 1e9)}), autotune=False)
    p.ready, p.comm, p._own_model = True, LocalCommunicator(), True
    small, big = Bucket((8,), (8, 8)), Bucket((32,), (32, 16), (32, 32))
    p.begin_step(0, 1, 72, torch.float32)
    p.observe(0, 72, torch.float32, small)
    p.observe(1, 32 + 512 + 1024, torch.float32, big)
    assert got == []  # before start_iter: nothing measured
    p.begin_step(1, 1, 72, torch.float32)
    assert got == [([(72, torch.float32), (1568, torch.float32)], ((32,), (32, 16), (32, 32)))]


def _planner(beta16, spec="fp16", **kw):
    comp = compressors.from_spec(spec)
    tiers = {"flat": TierCost("flat", 2, 1e-3, 0.1e9, {("allreduce", "torch.float16"): beta16,
                                                         ("allgather", "torch.uint8"): 0.1e9,
                                                         ("all_to_all", "torch.uint8"): 0.1e9})}
    p = Planner(comp, cost_model=CostModel(tiers, {comp.spec(): ComputeCost()}), **kw)
    p.ready = True
    return p


def _proposals(p, keys):
    """The rules ``p`` proposes to its tuner for the buckets of ``keys``."""
    return propose_rules([p._row(k) for k in keys], p.candidate_names())


def test_proposals_ranked_distinct_and_rules_applied():
    p = _planner(beta16=0.1e9)
    keys = [(0, 1 << 22, torch.float32), (1, 100, torch.float32)]  # a big and a small bucket
    rules = _proposals(p, keys)
    # the model's pick equals uniform "allreduce" on these buckets: listed once, best first
    assert rules[0] in (MODEL, "allreduce") and len(rules) == len(set(rules))
    assert not (MODEL in rules and "allreduce" in rules)
    assert set(rules) >= {"allgather", "two_phase"}
    big, small = p._row(keys[0]), p._row(keys[1])
    assert apply_rule("two_phase", big) == "two_phase" and apply_rule("two_phase", small) == "dense"
    assert apply_rule("dense", big) == "dense"
    # the tuner's rule decides what choose() returns, for every bucket
    p.tuner.rule = "allgather"
    assert p.choose(0, 1 << 22) == "allgather" and p.choose(1, 100) == "dense"
    assert "model: allreduce" in str(p.plan)
    sd = p.state_dict()
    assert sd["decisions"][0] == [0, 1 << 22, "torch.float32", "allgather"]
    # a slow fp16 sum: every compressed plan predicted slower than dense is still proposed
    # (the tuner measures), but the model alone picks dense
    slow = _planner(beta16=0.01e9, algorithms=["allreduce"])
    assert slow._row(keys[0]).chosen == "dense" and _proposals(slow, keys) == ["allreduce"]
    assert all(math.isfinite(t) for t in slow._row(keys[0]).predicted.values())


@pytest.mark.parametrize("world, preferred", [(2, "allgather"), (4, "allreduce")])
def test_ties_go_to_fewer_link_bytes_then_fewer_hops(world, preferred):
    """random-k on a ring: at 2 ranks an allgather moves the bytes an allreduce moves in half
    the hops, so a tie goes to allgather; at 4 ranks allreduce moves half of allgather's bytes.
    Top-k: two_phase compresses twice (its owners re-compress the sum), so a tie goes to
    allgather at any world — at 4 ranks although two_phase's link bytes are half of allgather's."""
    comp = compressors.from_spec("randomk:density=0.01")
    tiers = {"flat": TierCost("flat", world, 1e-3, 0.1e9)}
    p = Planner(comp, cost_model=CostModel(tiers, {comp.spec(): ComputeCost()}))
    p.ready = True
    keys = [(0, 1 << 22, torch.float32), (1, 1 << 16, torch.float32)]
    for k in keys:
        p._row(k)
    rules = ["allreduce", "allgather"]
    assert min(rules, key=p._preference) == preferred
    ar, ag = (tie_cost(p.model, p.compressor, r, p._row(keys[0])) for r in rules)
    assert ar[2] == 2 * ag[2] == 2 * (world - 1) and ar[1] == ag[1] == 0  # no compute measured
    assert (ar[0] == ag[0]) if world == 2 else (ar[0] * 2 == pytest.approx(ag[0], rel=1e-3))
    top = Planner(compressors.from_spec("topk:density=0.01"),
                  cost_model=CostModel(tiers, {"x": ComputeCost()}))
    top.ready = True
    top._row(keys[0])
    assert min(["two_phase", "allgather"], key=top._preference) == "allgather"
    tp, ag = (tie_cost(top.model, top.compressor, a, top._row(keys[0])) for a in ("two_phase", "allgather"))
    assert (tp[0] == ag[0]) if world == 2 else (tp[0] * 2 == pytest.approx(ag[0], rel=0.01))
    # qsgd8: shared_scale's scales allgather counts; at 2 ranks its bytes equal allgather's
    # (scales plus one byte per element either way), in three hops to one
    q8 = compressors.from_spec("qsgd:bits=8")
    qp = Planner(q8, cost_model=CostModel(tiers, {q8.spec(): ComputeCost()}))
    qp.ready = True
    qp._row(keys[0])
    if world == 2:
        ss, ag = (tie_cost(qp.model, qp.compressor, a, qp._row(keys[0])) for a in ("shared_scale", "allgather"))
        assert ss == (ag[0], 0, 3.0) and ag[2] == 1.0
        assert min(["shared_scale", "allgather"], key=qp._preference) == "allgather"
    assert len(p._preference("dense")) == 2  # one entry per bucket, dense included


@pytest.mark.parametrize("world", [2, 4])
def test_ties_with_equal_bytes_go_to_less_codec_work(world):
    """With the compute measured (per-element costs like those refine measures on the
    bench's 25M bucket), equal link bytes are decided by the codec work around the wire: at 2
    ranks qsgd8's shared_scale decodes one integer sum where allgather decodes and adds two
    payloads (measured 4-9% faster); random-k's adds touch 1% of the bucket, so the hops
    still decide (allgather at 2 ranks); top-k's two_phase does more codec work than
    allgather, and compresses twice: allgather at any world."""
    numel = 25_178_112
    tiers = {"flat": TierCost("flat", world, 1e-3, 1e9)}

    def planner(spec, comp_s, dec_s):
        comp = compressors.from_spec(spec)
        cc = ComputeCost(compress_per_element=comp_s, decompress_per_element=dec_s)
        p = Planner(comp, cost_model=CostModel(tiers, {comp.spec(): cc}))
        p.ready = True
        p._row((0, numel, torch.float32))
        return p

    q8 = planner("qsgd:bits=8", 0.33e-9, 0.27e-9)
    ss, ag = (tie_cost(q8.model, q8.compressor, a, q8._row((0, numel, torch.float32))) for a in ("shared_scale", "allgather"))
    if world == 2:
        assert ss[0] == ag[0] and ss[2] > ag[2]  # the bytes tie; shared_scale has more hops
        # allgather's extra decode-and-add of a payload: 0.27 ns x 25M = 6.8 ms
        assert ag[1] - ss[1] == round(0.27e-9 * numel / 1e-3)
        assert min(["allgather", "shared_scale"], key=q8._preference) == "shared_scale"
    rk = planner("randomk:density=0.01", 0.04e-9, 0.45e-9)
    ar, ag = (tie_cost(rk.model, rk.compressor, a, rk._row((0, numel, torch.float32))) for a in ("allreduce", "allgather"))
    assert ag[1] - ar[1] <= 1  # 1% of a decode per extra payload: within a millisecond
    assert min(["allreduce", "allgather"], key=rk._preference) == ("allgather" if world == 2 else "allreduce")
    tk = planner("topk:density=0.01", 0.6e-9, 0.4e-9)
    tp, ag = (tie_cost(tk.model, tk.compressor, a, tk._row((0, numel, torch.float32))) for a in ("two_phase", "allgather"))
    assert tp[1] > ag[1]
    assert min(["two_phase", "allgather"], key=tk._preference) == "allgather"


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("spec, single", [("topk:density=0.01", "allgather"), ("sign", "allgather"),
                                          ("qsgd:bits=4", "allgather"), ("qsgd:bits=8", None)])
def test_ties_go_to_one_compression_stage_before_fewer_bytes(world, spec, single):
    """two_phase compresses twice (its owners compress the chunk sums again; top-k's keep k of
    up to ``world * k`` values: 1.093x dense's loss on the momentum task at 4 ranks against
    allgather's 1.032), so it loses every tie, at any world — also from 3 ranks, where its
    link bytes are the fewest. Its hierarchical form compresses twice as well."""
    assert get_algorithm("two_phase").compress_stages == 2
    assert get_algorithm("hier_two_phase").compress_stages == 2
    assert all(get_algorithm(a).compress_stages == 1
               for a in ("allreduce", "allgather", "shared_scale", "hier_allgather"))
    comp = compressors.from_spec(spec)
    tiers = {"flat": TierCost("flat", world, 1e-3, 0.1e9)}
    p = Planner(comp, cost_model=CostModel(tiers, {comp.spec(): ComputeCost()}))
    p.ready = True
    key = (0, 1 << 22, torch.float32)
    p._row(key)
    rules = [a for a in ("allgather", "two_phase", "shared_scale") if get_algorithm(a).supports(comp)]
    tp, ag = (tie_cost(p.model, p.compressor, a, p._row(key)) for a in ("two_phase", "allgather"))
    if world > 2:
        assert tp[0] < ag[0]  # fewer link bytes: what decided the tie before the stage count
    best = min(rules, key=p._preference)
    assert best != "two_phase"
    if single is not None:
        assert best == single
    # qsgd8 from 3 ranks: shared_scale's bytes are about two_phase's (both ~2(W-1)/W of a
    # byte per element) and less than allgather's; one stage either way
    if spec == "qsgd:bits=8" and world > 2:
        assert best == "shared_scale"
    # dense compresses nothing: stage count 0
    assert p._preference("dense")[0][0] == 0 and p._preference("allgather")[0][0] == 1

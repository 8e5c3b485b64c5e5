"""The pipelined point-to-point exchange (comms/transport/pipelined_exchange.py) behind gloo's large
allgather / all_to_all: the same bytes as gloo's own collectives, in issue order, with many
exchanges in flight, and an error (not a hang) when a peer is gone."""

import pytest
import torch
import torch.distributed as dist

from comms.transport import pipelined_exchange as px
from comms.transport.communicator import TorchCommunicator
from comms.cluster.launch import spawn

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

# sizes in bytes per rank around the threshold and the chunk: below (gloo's own call), at the
# threshold, a partial last chunk, more chunks than px.WINDOW keeps in flight
SIZES = (px.MIN_BYTES - 4, px.MIN_BYTES, 2 * px.CHUNK_BYTES + 4096 + 12)
DTYPES = (torch.uint8, torch.float16)  # bytes are bytes: one odd and one 2-byte itemsize


def _data(rank, nbytes, dtype, salt=0):
    n = nbytes // dtype.itemsize
    g = torch.Generator().manual_seed(1000 * rank + salt)
    return torch.randint(0, 250, (n,), generator=g).to(dtype)


def _exchanges(rank, world):
    px.MAX_WORLD = max(px.MAX_WORLD, world)  # exercise the every-peer exchange at 3 ranks too
    comm = TorchCommunicator(None)
    out = {}
    for nbytes in SIZES:
        for dtype in DTYPES:
            t = _data(rank, nbytes, dtype)
            n = t.numel() - t.numel() % world
            a2a_in = t[:n].clone()
            # all issued before any is waited: several exchanges in flight, completed in order
            futs = (comm.all_gather(t), comm.all_to_all(a2a_in))
            ref_ag = torch.empty(world * t.numel(), dtype=dtype)
            dist.all_gather_into_tensor(ref_ag, t)
            ref_a2a = torch.empty_like(a2a_in)
            dist.all_to_all_single(ref_a2a, a2a_in)
            got = [f.wait() for f in futs]
            out[(nbytes, str(dtype))] = (torch.equal(got[0], ref_ag), torch.equal(got[1], ref_a2a),
                                         px.use_pipelined(t, comm.backend, world))
    # the gloo reduce_scatter built on all_to_all, large enough to be pipelined
    t = torch.arange(world * px.MIN_BYTES // 4, dtype=torch.float32) * (rank + 1)
    out["reduce_scatter"] = comm.reduce_scatter(t).wait()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_pipelined_exchange_equals_gloo_collectives(world):
    res = spawn(_exchanges, world, timeout=150)
    for r in range(world):
        for key, val in res[r].items():
            if key == "reduce_scatter":
                n = world * px.MIN_BYTES // 4 // world
                full = torch.arange(world * n, dtype=torch.float32) * sum(range(1, world + 1))
                assert torch.equal(val, full[r * n:(r + 1) * n])
                continue
            ag_ok, a2a_ok, pipelined = val
            assert ag_ok and a2a_ok, (r, key)
            assert pipelined == (key[0] >= px.MIN_BYTES), key  # both paths were exercised


def _many_in_flight(rank, world, rounds=12):
    """Many large allgathers issued back to back whose completion callbacks run on the worker
    thread (as the hook's decode does) and themselves read the results."""
    comm = TorchCommunicator(None)
    sums = []
    futs = []
    for i in range(rounds):
        t = torch.full((px.CHUNK_BYTES // 4 + 3 * i,), float(rank * 100 + i))
        futs.append(comm.all_gather(t).then(lambda f: f.value().view(world, -1)[:, 0].clone()))
    for f in futs:
        sums.append(f.wait().tolist())
    return sums


def test_many_exchanges_in_flight_complete_in_issue_order():
    world = 2
    res = spawn(_many_in_flight, world, timeout=120)
    for r in range(world):
        assert res[r] == [[float(q * 100 + i) for q in range(world)] for i in range(12)]


def _peer_exits(rank, world):
    comm = TorchCommunicator(None)
    t = torch.ones(px.MIN_BYTES)
    comm.all_gather(t).wait()  # one good round
    if rank == 1:
        return "left"
    try:
        comm.all_gather(t).wait()
    except Exception as exc:  # noqa: BLE001 - the point of the test
        return f"raised {type(exc).__name__}"
    return "no error"


def test_missing_peer_raises_instead_of_hanging():
    res = spawn(_peer_exits, 2, timeout=100, pg_timeout=10)
    assert res[1] == "left"
    assert res[0].startswith("raised"), res[0]


def _algorithms_both_paths(rank, world):
    """allgather and two_phase on buckets whose payloads take the pipelined exchange, and the
    same calls with the exchange disabled (gloo's collectives): the results must be the same
    bits."""
    import compressors
    from comms.algorithms import allgather, two_phase

    comm = TorchCommunicator(None)
    n = 3 * px.MIN_BYTES  # sign: n/8 bytes per rank, above the threshold; two_phase chunks too
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    out = {}
    for path in ("pipelined", "gloo"):
        if path == "gloo":
            px.MIN_BYTES, saved = 1 << 62, px.MIN_BYTES
        try:
            for name, alg, comp in (("sign allgather", allgather, compressors.from_spec("sign")),
                                    ("qsgd8 two_phase", two_phase, compressors.from_spec("qsgd:bits=8"))):
                ctx = compressors.Context.of(x, rank=rank, step=3)
                total, own = alg(comm, comp, x, ctx, {}).wait()
                out[(path, name)] = (total.clone(), own.clone())
        finally:
            if path == "gloo":
                px.MIN_BYTES = saved
    return {k: (torch.equal(v[0], out[("gloo", k[1])][0]), torch.equal(v[1], out[("gloo", k[1])][1]))
            for k, v in out.items() if k[0] == "pipelined"}


def test_algorithms_same_bits_through_either_transport():
    res = spawn(_algorithms_both_paths, 2, timeout=150)
    for r in range(2):
        assert res[r] and all(a and b for a, b in res[r].values()), res[r]


def _dropped_exchange_is_freed(rank, world):
    import gc
    import weakref

    comm = TorchCommunicator(None)
    t = _data(rank, 2 * px.MIN_BYTES, torch.uint8)
    out = comm.all_gather(t).wait()
    ok = torch.equal(out.view(world, -1)[rank], t)
    ex = comm.exchange()
    alive, worker = weakref.ref(ex), ex._thread
    del comm, ex, out
    gc.collect()
    worker.join(timeout=10)
    dist.barrier()
    return ok, alive() is None, worker.is_alive()


def test_a_dropped_exchange_ends_its_worker_and_frees_its_pool():
    # one exchange per registration: a worker holding its exchange leaked every pool (12 GB
    # after ~150 registrations in one bench process)
    for r, (ok, freed, worker_alive) in enumerate(spawn(_dropped_exchange_is_freed, 2, timeout=120)):
        assert ok and freed and not worker_alive, (r, ok, freed, worker_alive)

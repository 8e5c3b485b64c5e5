"""Scratch buffers and payload memory: reuse never hands out memory someone still holds."""

import copy
import pickle
import threading

import torch

from compressors import QSGD, Context
from compressors.memory import PayloadPool, Workspace, chunk_pieces, fresh_empty

MB4 = 4 << 20


def test_pool_reuses_only_unreferenced_memory():
    pool = PayloadPool()
    a = pool.empty(MB4, torch.uint8, "cpu")
    pa = a.data_ptr()
    b = pool.empty(MB4, torch.uint8, "cpu")
    assert b.data_ptr() != pa  # a is held
    view = a[10:20]
    del a
    c = pool.empty(MB4, torch.uint8, "cpu")
    assert c.data_ptr() != pa  # a view of it is held
    del view, c
    arr = b.numpy()
    pb = b.data_ptr()
    del b
    d = pool.empty(MB4, torch.uint8, "cpu")
    assert d.data_ptr() == pa  # released: reused
    e = pool.empty(MB4, torch.uint8, "cpu")
    assert e.data_ptr() != pb  # a numpy array still holds b's memory
    del arr, e
    f = pool.empty(MB4, torch.uint8, "cpu")
    assert f.data_ptr() == pb


def test_pool_small_or_other_sizes_are_plain_fresh():
    pool = PayloadPool()
    a = pool.empty(1000, torch.uint8, "cpu")
    assert pool._free == {}
    b = pool.empty(MB4, torch.float32, "cpu")
    c = pool.empty(MB4, torch.uint8, "cpu")
    assert b.data_ptr() != c.data_ptr() and len(pool._free) == 2
    del a


def test_qsgd_payload_memory_recycled_only_after_release():
    q = QSGD(8)
    x = torch.randn(3_000_000)
    ctx = Context.of(x)
    p1 = q.compress(x, ctx)
    keep = p1[1].clone()
    p2 = q.compress(x * 2, ctx)
    assert p2[1].data_ptr() != p1[1].data_ptr()
    assert torch.equal(p1[1], keep)
    ptr = p1[1].data_ptr()
    del p1
    p3 = q.compress(x, Context.of(x))
    assert p3[1].data_ptr() == ptr and torch.equal(p3[1], keep)


def test_fresh_empty_large_and_small():
    for n in (10, 3_000_000):
        t = fresh_empty(n, torch.float32, "cpu")
        assert t.shape == (n,) and t.dtype == torch.float32 and t.is_contiguous()
        t.fill_(1.5)
        assert float(t.sum()) == 1.5 * n
        assert torch.equal(pickle.loads(pickle.dumps(t)), t)


def test_workspace_grows_and_is_per_thread():
    ws = Workspace()
    a = ws.get("x", 10, torch.float32, "cpu")
    b = ws.get("x", 5, torch.float32, "cpu")
    assert b.data_ptr() == a.data_ptr() and b.numel() == 5
    c = ws.get("x", 100, torch.float32, "cpu")
    assert c.numel() == 100
    assert ws.get("x", 5, torch.int32, "cpu").dtype == torch.int32
    other = []
    th = threading.Thread(target=lambda: other.append(ws.get("x", 100, torch.float32, "cpu")))
    th.start()
    th.join()
    assert other[0].data_ptr() != c.data_ptr()
    assert torch.equal(ws.iota(7, "cpu"), torch.arange(7, dtype=torch.int32))
    assert isinstance(copy.deepcopy(ws), Workspace) and isinstance(pickle.loads(pickle.dumps(ws)),
                                                                    Workspace)


def test_chunk_pieces_cover_exactly():
    for b0, b1, c in [(0, 10, 3), (5, 17, 4), (0, 8, 8), (3, 4, 100), (8, 40, 8)]:
        pieces = list(chunk_pieces(b0, b1, c))
        covered = []
        for lo, hi, ci, rows in pieces:
            if rows:
                assert lo == ci * c and hi == lo + rows * c
            else:
                assert ci * c <= lo < hi <= (ci + 1) * c
            covered.extend(range(lo, hi))
        assert covered == list(range(b0, b1))

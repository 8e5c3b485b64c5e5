"""The counter-based hash RNG against an independent numpy uint32 implementation."""

import numpy as np
import pytest
import torch

import compressors.hashrng as H
from compressors.hashrng import (SHARED, add_uniform_, hash_block_, hash_u32, lowbias32_int,
                                 stream_key, uniform, uniform_into)
from unit_reference import (lowbias32_inverse, np_hash, np_lowbias32, np_stream_key,
                            np_uniform)


@pytest.fixture(params=[True, False], ids=["numpy", "torch"])
def backend(request, monkeypatch):
    """CPU hashing through numpy (default) and through the torch ops other devices use."""
    monkeypatch.setattr(H, "USE_NUMPY_ON_CPU", request.param)
    return request.param


def test_lowbias32_int_matches_numpy():
    xs = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0x12345678, 0xDEADBEEF]
    ref = np_lowbias32(np.array(xs, dtype=np.uint64).astype(np.uint32))
    assert [lowbias32_int(x) for x in xs] == [int(v) for v in ref]
    # known value, so a bug shared by both implementations still shows
    assert lowbias32_int(0) == 0
    assert lowbias32_int(1) == int(np_lowbias32(np.array([1], np.uint32))[0]) != 1


@pytest.mark.parametrize("args", [(0, 0, 0, 0), (7, 3, 1, SHARED), (2**31, 2**40 + 5, 9, 3),
                                  (123, 0, 2**32 - 1, 0)])
def test_stream_key_matches_numpy(args):
    assert stream_key(*args) == np_stream_key(*args)


@pytest.mark.parametrize("start,n", [(0, 0), (0, 1), (5, 100), (65536 * 3 - 7, 70001),
                                     (1 << 20, 1 << 17), (2**31 - 1000, 1000)])
def test_hash_u32_matches_numpy(backend, start, n):
    key = stream_key(3, 1, 4, 1)
    got = hash_u32(start, n, key).numpy().view(np.uint32)
    np.testing.assert_array_equal(got, np_hash(start, n, key))


@pytest.mark.parametrize("B", [8, 1024, 1 << 16, 1 << 18])
def test_hash_block_iota_paths(backend, B):
    """Aligned blocks take the folded-key shortcuts; all paths give the same words."""
    key = stream_key(11, 2, 0, 5)
    iota = torch.arange(min(B, 1 << 16), dtype=torch.int32)
    for start in (0, B, 3 * B, 5):
        for n in (B, B - 3, 1):
            h = torch.empty(n, dtype=torch.int32)
            hash_block_(h, start, key, torch.empty_like(h), iota)
            np.testing.assert_array_equal(h.numpy().view(np.uint32), np_hash(start, n, key))


def test_uniform_matches_numpy_and_is_in_unit_interval(backend):
    key = stream_key(1, 2, 3, 0)
    u = uniform(200_003, key, start=17)
    np.testing.assert_array_equal(u.numpy(), np_uniform(17, 200_003, key))
    assert u.dtype == torch.float32
    assert float(u.min()) > 0.0 and float(u.max()) <= 1.0
    n = u.numel()
    mean, var = float(u.double().mean()), float(u.double().var())
    assert abs(mean - 0.5) < 4 * (1 / 12 / n) ** 0.5
    assert abs(var - 1 / 12) < 4 * (1 / 180 / n) ** 0.5  # var of (u - 1/2)^2 is 1/180


def test_add_uniform_matches_t_plus_u(backend):
    key = stream_key(5, 6, 7, 8)
    for start, n, B in [(0, 1 << 16, 1 << 16), (1 << 19, 1 << 19, 1 << 19), (3, 1000, 1024),
                        (1 << 19, 70_000, 1 << 19)]:
        t = torch.rand(n, generator=torch.Generator().manual_seed(n)) * 255
        want = t + torch.from_numpy(np_uniform(start, n, key))
        h, tmp = torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.int32)
        got = add_uniform_(t.clone(), start, key, h, tmp, tmp.view(torch.float32),
                           torch.arange(min(B, 1 << 16), dtype=torch.int32))
        assert torch.equal(got, want)


def test_uint32_conversion_trick_exhaustive():
    """add_uniform_ relies on fp32(h24 * 256 + 128) == 256 * fl(h24 + 0.5) for every h24."""
    h24 = np.arange(1 << 24, dtype=np.uint32)
    want = (h24.astype(np.float32) + np.float32(0.5)) * np.float32(256)
    word = torch.from_numpy((h24 * np.uint32(256) + np.uint32(128)).view(np.int32))
    got = word.view(torch.uint32).float().numpy()
    np.testing.assert_array_equal(got, want)


def test_u_is_one_for_the_top_hash_value(backend):
    """Documented corner: h >> 8 == 2**24 - 1 rounds (h24 + 0.5) up to 2**24, so u == 1.0."""
    key = stream_key(0, 0, 0, 0)
    for low in range(256):
        i = lowbias32_inverse(0xFFFFFF00 | low) ^ key
        if i < 2**31 - 8:
            break
    assert int(np_hash(i, 1, key)[0]) >> 8 == 0xFFFFFF
    assert float(uniform(1, key, start=i)[0]) == 1.0
    t = torch.zeros(8)
    h, tmp = torch.empty(8, dtype=torch.int32), torch.empty(8, dtype=torch.int32)
    add_uniform_(t, i, key, h, tmp, tmp.view(torch.float32))
    assert float(t[0]) == 1.0 and float(t[1:].max()) < 1.0


def test_streams_differ_by_rank_and_shared_is_rank_free():
    keys = {stream_key(7, 3, 2, r) for r in (SHARED, 0, 1, 2, 3)}
    assert len(keys) == 5
    a, b = uniform(1000, stream_key(7, 3, 2, 0)), uniform(1000, stream_key(7, 3, 2, 1))
    assert not torch.equal(a, b)
    assert float((a - b).abs().mean()) > 0.2  # independent streams, not a shifted copy
    # the shared stream only depends on (seed, step, bucket): every rank derives the same
    assert torch.equal(uniform(1000, stream_key(7, 3, 2, SHARED)),
                       uniform(1000, stream_key(7, 3, 2, SHARED)))
    assert stream_key(7, 4, 2, SHARED) != stream_key(7, 3, 2, SHARED)
    assert stream_key(7, 3, 3, SHARED) != stream_key(7, 3, 2, SHARED)


def test_uniform_into_start_offsets_compose(backend):
    key = stream_key(9, 9, 9, 9)
    whole = uniform(5000, key)
    parts = torch.cat([uniform_into(torch.empty(n), s, key)
                       for s, n in [(0, 1234), (1234, 1), (1235, 3765)]])
    assert torch.equal(whole, parts)

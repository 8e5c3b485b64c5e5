"""Bit packing against a bit-by-bit reference, for every width and odd lengths."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compressors.memory import Workspace
from compressors.bitpack import check_bits, pack, packed_nbytes, unpack
from unit_reference import ref_pack


@st.composite
def codes_and_bits(draw):
    bits = draw(st.sampled_from([1, 2, 4, 8]))
    codes = draw(st.lists(st.integers(0, (1 << bits) - 1), min_size=0, max_size=300))
    offset = draw(st.integers(0, 7))  # misaligned views take the copying path
    return bits, codes, offset


@settings(max_examples=300, deadline=None)
@given(codes_and_bits())
def test_pack_unpack_exact(case):
    bits, codes, offset = case
    n = len(codes)
    buf = torch.zeros(n + offset, dtype=torch.uint8)
    buf[offset:] = torch.tensor(codes, dtype=torch.uint8)
    c = buf[offset:]
    packed = pack(c, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(n, bits)
    assert bytes(packed.tolist()) == ref_pack(codes, bits)
    out = torch.full((n + offset,), 77, dtype=torch.uint8)
    got = unpack(packed, bits, n, out=out[offset:])
    assert got.tolist() == codes
    assert out[:offset].tolist() == [77] * offset  # nothing written outside out
    assert unpack(packed, bits, n).tolist() == codes


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4095, 65536 + 13])
def test_pack_large_with_workspace(bits, n):
    g = torch.Generator().manual_seed(n * 10 + bits)
    codes = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8, generator=g)
    ws = Workspace()
    p = pack(codes, bits, ws=ws)
    assert bytes(p.tolist()) == ref_pack(codes.tolist(), bits)
    assert torch.equal(unpack(p, bits, n, ws=ws), codes)
    # into a slice of a bigger buffer, as the blocked compressors do
    big = torch.zeros(p.numel() + 5, dtype=torch.uint8)
    pack(codes, bits, out=big[3:3 + p.numel()], ws=ws)
    assert torch.equal(big[3:3 + p.numel()], p) and big[:3].tolist() == [0, 0, 0]


def test_pack_bool_codes():
    b = torch.tensor([True, False, True, True, False, False, False, True, True])
    assert pack(b, 1).tolist() == [0b10001101, 0b1]


def test_known_layout():
    # code i at byte i*bits//8, bit offset (i*bits)%8, least significant first
    assert pack(torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8), 2).tolist() == [0b00111001, 0b11]
    assert pack(torch.tensor([0xA, 0x5, 0xF], dtype=torch.uint8), 4).tolist() == [0x5A, 0x0F]


@pytest.mark.parametrize("bad", [3, 0, 16, -1])
def test_bad_bits_value(bad):
    with pytest.raises(ValueError, match=str(bad)):
        check_bits(bad)


@pytest.mark.parametrize("bad", [2.0, "4", True, None])
def test_bad_bits_type(bad):
    with pytest.raises(TypeError, match="bits"):
        check_bits(bad)

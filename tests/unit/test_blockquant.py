"""BlockQuantizer: the parameter all-gather codec's format, exact where the math is exact."""

import pytest
import torch

from compressors.blockquant import BLOCK, BlockQuantizer


def _decode(q, payloads, n, dtype=torch.float32):
    out = torch.empty(len(payloads) * n, dtype=dtype)
    q.decode_into(torch.cat(payloads), out, world=len(payloads))
    return out


@pytest.mark.parametrize("bits,levels", [(8, 127), (4, 7)])
def test_values_on_the_grid_round_trip_exactly(bits, levels):
    q = BlockQuantizer(bits)
    scale = 8.0  # inputs made as code * (scale / levels): the decode computes the same fp32 product
    codes = torch.arange(-levels, levels + 1, dtype=torch.float32)
    x = torch.zeros(BLOCK)
    x[:codes.numel()] = codes * (scale / levels)
    x[-1] = scale  # the block's max |x| is the scale
    out = _decode(q, [q.encode(x)], BLOCK)
    assert torch.equal(out, codes.new_zeros(BLOCK).index_copy_(0, torch.arange(codes.numel()), codes)
                       .mul_(scale / levels).index_fill_(0, torch.tensor([BLOCK - 1]), scale))


def test_int8_layout_scales_then_codes():
    q = BlockQuantizer(8)
    x = torch.tensor([1.0, -0.5, 0.25, 0.0] + [0.0] * (BLOCK - 4) + [-4.0, 2.0])  # 2 blocks
    p = q.encode(x)
    assert p.numel() == q.payload_bytes(x.numel()) == 2 * 4 + 2 * BLOCK
    assert torch.equal(p[:8].view(torch.float32), torch.tensor([1.0, 4.0]))
    codes = p[8:].view(torch.int8)
    assert codes[:4].tolist() == [127, -64, 32, 0]  # round half to even: -63.5 -> -64, 31.75 -> 32
    assert codes[BLOCK:BLOCK + 2].tolist() == [-127, 64]  # 63.5 -> 64
    assert codes[BLOCK + 2:].eq(0).all()  # the last block's padding


def test_int4_packs_two_codes_a_byte_low_nibble_first():
    q = BlockQuantizer(4)
    x = torch.zeros(BLOCK)
    x[:4] = torch.tensor([7.0, -7.0, 1.0, 0.0])
    p = q.encode(x)
    assert p.numel() == 4 + BLOCK // 2
    packed = p[4:]
    assert packed[0].item() == (7 + 8) | ((-7 + 8) << 4)
    assert packed[1].item() == (1 + 8) | ((0 + 8) << 4)
    assert packed[2:].eq(8 | (8 << 4)).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_error_bound_every_rank_the_same_values_and_bf16_is_the_fp32_cast(bits):
    q = BlockQuantizer(bits)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1000, generator=g) * (r + 1) for r in range(3)]
    ps = [q.encode(x) for x in xs]
    out = _decode(q, ps, 1000)
    for r, x in enumerate(xs):
        blocks = torch.nn.functional.pad(x, (0, 1024 - 1000)).view(-1, BLOCK)
        bound = (blocks.abs().amax(1) / q.levels / 2).repeat_interleave(BLOCK)[:1000]
        assert ((out[r * 1000:(r + 1) * 1000] - x).abs() <= bound * (1 + 1e-6)).all()
    assert torch.equal(_decode(q, ps, 1000), out)  # deterministic
    assert torch.equal(_decode(q, ps, 1000, torch.bfloat16), out.bfloat16())


def test_zero_and_non_finite_blocks():
    q = BlockQuantizer(8)
    x = torch.zeros(2 * BLOCK)
    x[BLOCK + 3] = float("inf")
    out = _decode(q, [q.encode(x)], 2 * BLOCK)
    assert out[:BLOCK].eq(0).all()
    assert out[BLOCK:].isnan().all()  # a non-finite block decodes to NaN, never to numbers


def test_bad_width_and_sizes_raise():
    with pytest.raises(ValueError, match="bits must be one of"):
        BlockQuantizer(2)
    q = BlockQuantizer(8)
    with pytest.raises(ValueError, match="does not hold 2 payloads"):
        q.decode_into(q.encode(torch.zeros(10)), torch.empty(20), world=2)

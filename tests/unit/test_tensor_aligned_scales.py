"""Sign and QSGD scales that respect tensor boundaries (``align="tensor"``).

With the bucket's shapes in the context, the payload is the per-tensor flat payloads one after
another; every entry point (decompress, decompress_into, decompress_add_) decodes it the same
way, and without shapes the layout is the flat one."""

import math

import pytest
import torch

from compressors import Context, from_spec

SHAPES = ((5, 7), (3,), (40,), (2, 3, 3), (1,), (130,))
SPECS = ["sign:chunk=16", "qsgd:bits=4,chunk=16", "qsgd:bits=8,chunk=64", "qsgd:bits=2,chunk=5"]


def _x(seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(math.prod(s) for s in SHAPES)
    return torch.randn(n, generator=g) * torch.linspace(0.01, 10, n)


@pytest.mark.parametrize("spec", SPECS)
def test_aligned_payload_is_the_per_tensor_payloads(spec):
    comp = from_spec(spec)
    x = _x()
    ctx = Context.of(x, shapes=SHAPES, bucket=3, step=5, seed=1)
    s, packed = comp.compress(x, ctx)
    want_scales = sum(-(-math.prod(sh) // comp.chunk) for sh in SHAPES)
    assert s.numel() == want_scales
    assert 4 * s.numel() + packed.numel() == comp.shaped_wire_bytes(SHAPES)
    dec = comp.decompress([s, packed], ctx)
    # each tensor alone, with the stream the aligned layout gives it
    off = 0
    for i, sh in enumerate(SHAPES):
        n = math.prod(sh)
        sub = ctx.with_(numel=n, shapes=(), bucket=(3 * 0x9E3779B1 + i + 1) & 0xFFFFFFFF)
        alone = comp.decompress(comp.compress(x[off:off + n], sub), sub)
        assert torch.equal(dec[off:off + n], alone), (spec, i)
        if spec.startswith("sign"):  # a scale never straddles: |decoded| is the tensor's own mean
            assert torch.equal(alone.abs().max(), alone.abs().max())
        off += n
    out = torch.full_like(x, 7.0)
    assert torch.equal(comp.decompress_into([s, packed], ctx, out), dec)
    acc = torch.ones_like(x)
    assert torch.equal(comp.decompress_add_([s, packed], ctx, acc), torch.ones_like(x) + dec)


@pytest.mark.parametrize("spec", SPECS)
def test_flat_align_and_unknown_shapes_keep_the_flat_layout(spec):
    x = _x(1)
    aligned, flat = from_spec(spec), from_spec(spec + ",align=flat")
    plain = Context.of(x, bucket=2, step=1)
    a, f = aligned.compress(x, plain), flat.compress(x, plain)
    assert all(torch.equal(p, q) for p, q in zip(a, f))
    shaped = plain.with_(shapes=SHAPES)
    f2 = flat.compress(x, shaped)
    assert all(torch.equal(p, q) for p, q in zip(f, f2))
    assert flat.shaped_wire_bytes(SHAPES) == flat.wire_bytes(x.numel())


def test_sign_scale_of_a_small_tensor_is_its_own():
    """A LayerNorm-like vector of ones next to a large weight keeps its own scale."""
    x = torch.cat([torch.full((100,), 50.0), torch.ones(28)])
    comp = from_spec("sign:chunk=128")
    ctx = Context.of(x, shapes=((100,), (28,)))
    dec = comp.decompress(comp.compress(x, ctx), ctx)
    assert torch.equal(dec, x)
    flat_dec = from_spec("sign:chunk=128,align=flat")
    d2 = flat_dec.decompress(flat_dec.compress(x, ctx), ctx)
    assert not torch.equal(d2[100:], x[100:])  # the flat chunk mixes the two


def test_bad_align_is_named():
    with pytest.raises(ValueError, match="align"):
        from_spec("sign:align=row")


def test_two_phase_chunk_pieces_and_padded_wire():
    """two_phase's chunks carry the tensor pieces they hold (the zero padding of the last chunk
    is a piece); chunks inside one tensor keep the flat layout; unequal chunk payloads are
    zero-padded on the wire and cut back bitwise."""
    from comms.algorithms.two_phase import ChunkWire, chunk_context, chunk_shapes
    from compressors import ScaledSign

    ctx = Context(numel=3620, shapes=((300,), (17, 5), (1,), (2000,), (1234,)))
    assert chunk_shapes(ctx, 2, 0) == ((300,), (85,), (1,), (1424,))
    assert chunk_shapes(ctx, 2, 1) == ((576,), (1234,))
    assert chunk_shapes(ctx, 3, 2) == ((1206,), (1,))  # 1206 of the last tensor, 1 of padding
    assert chunk_shapes(ctx, 8, 3) == ()  # [1359, 1812): inside the 2000-element tensor
    assert chunk_shapes(Context(numel=3620), 2, 0) == ()
    c = ScaledSign()
    x = torch.randn(3620)
    ctxs = [chunk_context(ctx, 2, 1, j, 0) for j in range(2)]
    payloads = [c.compress(x[j * 1810:(j + 1) * 1810], ctxs[j]) for j in range(2)]
    assert [tuple((t.numel(), t.dtype) for t in p) for p in payloads] == [c.payload_layout(k) for k in ctxs]
    wire = ChunkWire([c.payload_layout(k) for k in ctxs])
    assert wire.wire == ((17, torch.float32), (228, torch.uint8))  # 3+1+1+12 scales; 38+11+1+178 B
    for j, p in enumerate(payloads):
        buf = torch.full((wire.nbytes,), 0xAB, dtype=torch.uint8)
        wire.write(p, buf)
        back = wire.read(buf, j)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(back, p))
    with pytest.raises(RuntimeError, match="dtypes"):
        ChunkWire([((4, torch.float32),), ((4, torch.float16),)])

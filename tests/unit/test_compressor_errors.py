"""Bad compressor options, specs and inputs: ValueError/TypeError naming the bad value."""

import re

import pytest
import torch

from compressors import QSGD, Context, RandomK, ScaledSign, TopK, from_spec, get, parse_spec

from test_compressor_roundtrip import instances


@pytest.mark.parametrize("make", [lambda d: TopK(d), lambda d: RandomK(d),
                                  lambda d: TopK(0.1, sample=d)], ids=["topk", "randomk", "sample"])
@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-1, ValueError), (1.5, ValueError),
                                     (0.0, ValueError), ("x", TypeError), (True, TypeError),
                                     (None, TypeError)])
def test_bad_density(make, bad, exc):
    with pytest.raises(exc, match=re.escape(repr(bad))):
        make(bad)


@pytest.mark.parametrize("bad,exc", [(3, ValueError), (0, ValueError), (16, ValueError),
                                     (8.0, TypeError), ("8", TypeError)])
def test_bad_bits(bad, exc):
    with pytest.raises(exc, match=re.escape(repr(bad))):
        QSGD(bits=bad)


@pytest.mark.parametrize("cls", [QSGD, ScaledSign])
@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-5, ValueError), (2.5, TypeError),
                                     ("64", TypeError)])
def test_bad_chunk(cls, bad, exc):
    with pytest.raises(exc, match=re.escape(repr(bad))):
        cls(chunk=bad)


def test_bad_exact_and_seed():
    with pytest.raises(TypeError, match="'yes'"):
        TopK(0.1, exact="yes")
    with pytest.raises(TypeError, match="1.5"):
        RandomK(0.1, seed=1.5)


@pytest.mark.parametrize("spec,needle", [
    ("nosuch", "nosuch"),
    ("nosuch:density=1", "nosuch"),
    ("topk:", "topk:"),
    ("topk:density", "density"),
    ("topk:=1", "=1"),
    ("topk:density=", "density="),
    ("topk:density=0.1,density=0.2", "density"),
    ("topk:foo=1", "foo"),
    ("identity:foo=1", "foo"),
    ("topk:density=0", "0"),
    ("topk:density=1.5", "1.5"),
    ("topk:density=x", "'x'"),
    ("qsgd:bits=3", "3"),
    ("qsgd:chunk=-5", "-5"),
    (":density=1", ":density=1"),
])
def test_bad_specs(spec, needle):
    with pytest.raises((ValueError, TypeError)) as ei:
        from_spec(spec)
    assert needle in str(ei.value), str(ei.value)


def test_duplicate_key_message_says_twice():
    with pytest.raises(ValueError, match="twice"):
        parse_spec("topk:density=0.1,density=0.2")


def test_spec_and_name_types():
    with pytest.raises(TypeError, match="3"):
        from_spec(3)
    with pytest.raises(TypeError, match="None"):
        get(None)


@pytest.mark.parametrize("c", instances(), ids=repr)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_non_floating_input(c, dtype):
    x = torch.ones(100, dtype=dtype)
    with pytest.raises(TypeError, match=re.escape(str(dtype))):
        c.compress(x, Context.of(x))


@pytest.mark.parametrize("c", instances(), ids=repr)
def test_not_a_tensor(c):
    with pytest.raises(TypeError, match="list"):
        c.compress([1.0, 2.0], Context(numel=2))


def test_block_must_be_power_of_two():
    q = QSGD()
    q.block = 1000
    x = torch.ones(10)
    with pytest.raises(ValueError, match="1000"):
        q.compress(x, Context.of(x))

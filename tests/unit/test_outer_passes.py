"""The outer sync's send and landing passes (comms.outer.passes): the compiled pass gives the
torch twin's bits, and both give the unfused reference's (gather, subtract, step, move, add),
for every thread count, non-finite values and non-contiguous parameters."""

import shutil

import pytest
import torch

from comms.outer.passes import land_pass, send_pass
from compressors import cpu_kernels


def _params(seed: int, nonfinite: bool = False):
    g = torch.Generator().manual_seed(seed)
    shapes = [(70000,), (33, 17), (5,), (300, 301)]
    ps = [torch.randn(s, generator=g) * 3 for s in shapes]
    ps.append(torch.randn(40, 30, generator=g).t())  # non-contiguous: the torch path
    if nonfinite:
        ps[0][7], ps[1][2, 3], ps[3][0, 0] = float("nan"), float("inf"), -float("inf")
    return ps


def _flat(ps):
    return torch.cat([p.reshape(-1) for p in ps])


def _reference(anchor, avg, ps_sent, ps_now, delay: bool, div: int = 1):
    """The unfused form: gather, subtract, this rank's share, the plain step, each parameter's
    move."""
    local = _flat(ps_sent)
    d = torch.sub(anchor, local).div_(div)
    new = anchor.clone()
    if avg is not None:
        new.sub_(avg)
    out, off = [], 0
    for p in ps_now:
        n = p.numel()
        q = p.clone()
        if delay:
            q.add_(torch.sub(new[off:off + n], local[off:off + n]).view_as(q))
        else:
            q.copy_(new[off:off + n].view_as(q))
        out.append(q)
        off += n
    return d, new, out


def _run(anchor, avg, ps_sent, drift, delay: bool, div: int = 1):
    ps = [p.clone() for p in ps_sent]
    d, local = torch.empty_like(anchor), (torch.empty_like(anchor) if delay else None)
    send_pass(anchor, ps, d, local, div=div)
    d_sent = d.clone()
    for p, m in zip(ps, drift):  # what the rank trains while the fragment travels
        p.add_(m)
    a = anchor.clone()
    land_pass(a, avg, local, ps)
    return d_sent, a, ps


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("delay", [True, False])
@pytest.mark.parametrize("step", [True, False])
@pytest.mark.parametrize("nonfinite", [False, True])
@pytest.mark.parametrize("div", [1, 3])
def test_passes_match_the_unfused_reference(monkeypatch, threads, delay, step, nonfinite, div):
    ps = _params(1, nonfinite)
    g = torch.Generator().manual_seed(2)
    anchor = _flat(ps) + torch.randn(sum(p.numel() for p in ps), generator=g)
    avg = torch.randn(anchor.numel(), generator=g) * 0.01 if step else None
    drift = [torch.randn(p.shape, generator=g) * 0.001 for p in ps]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runs = {}
        for switch in ("1", "0"):
            monkeypatch.setenv(cpu_kernels.ENV_SWITCH, switch)
            runs[switch] = _run(anchor, avg, ps, drift, delay, div)
    finally:
        torch.set_num_threads(old)
    ps_now = [p + m for p, m in zip(ps, drift)]
    ref_d, ref_anchor, ref_ps = _reference(anchor, avg, ps, ps_now, delay, div)
    for d, a, out in runs.values():
        assert torch.equal(d.view(torch.int32), ref_d.view(torch.int32))
        assert torch.equal(a.view(torch.int32), ref_anchor.view(torch.int32))
        for q, r in zip(out, ref_ps):
            assert torch.equal(q.view(torch.int32), r.view(torch.int32))


@pytest.mark.parametrize("nonfinite", [False, True])
@pytest.mark.parametrize("delay", [True, False])
def test_send_reports_the_largest_magnitude_it_wrote(monkeypatch, nonfinite, delay):
    """The compiled send returns the fp32 bits of max |d| (NaN above inf): the engine's
    non-finite flag from it equals the flag of one sum over d; the torch twin returns None."""
    from comms.core.stages import nonfinite_flag
    ps = _params(3, nonfinite)[:-1]  # contiguous only: every parameter in the compiled pass
    anchor = _flat(ps) * 0.5
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_kernels.ENV_SWITCH, switch)
        d, local = torch.empty_like(anchor), (torch.empty_like(anchor) if delay else None)
        amax = send_pass(anchor, ps, d, local, div=2)
        if switch == "0" or cpu_kernels.lib() is None:
            assert amax is None
            continue
        assert amax == int((d.view(torch.int32) & 0x7FFFFFFF).max())
        assert bool(nonfinite_flag(d, amax)) == bool(nonfinite_flag(d)) == nonfinite


def test_compiled_pass_runs_where_a_compiler_is():
    if not shutil.which("g++") and not shutil.which("c++"):
        pytest.skip("no C++ compiler")
    assert cpu_kernels.lib() is not None, cpu_kernels.build_error()
    assert hasattr(cpu_kernels.lib(), "cp_outer_sync_land")

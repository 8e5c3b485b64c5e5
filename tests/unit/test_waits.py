"""comms.transport (waits, errors, deadlines): bounded waits, message cleaning, the watchdog, the timeout option."""

import threading
import time
from datetime import timedelta

import pytest
import torch

import comms
from comms.transport.deadlines import DeadlineWatch as Watchdog
from comms.transport.errors import ADVICE, CollectiveTimeout, clean_message, failure
from comms.transport.waits import check_timeout, fail, wait


def test_wait_times_out_with_a_named_error():
    fut = torch.futures.Future()
    with pytest.raises(CollectiveTimeout) as info:
        wait(fut, 0.05, "commpress: x allgather of bucket 3 (10 x float32) at step 7 on rank 1 of 3")
    msg = str(info.value)
    assert msg.startswith("commpress: x allgather of bucket 3") and "did not complete within 0.05 s" in msg
    assert ADVICE in msg


def test_wait_returns_the_value_and_cleans_failures():
    fut = torch.futures.Future()
    threading.Timer(0.02, lambda: fut.set_result(torch.ones(2))).start()
    assert torch.equal(wait(fut, 5.0, "commpress: w"), torch.ones(2))
    bad = torch.futures.Future()
    chained = bad.then(lambda f: (_ for _ in ()).throw(RuntimeError("gloo: Connection closed by peer")))
    bad.set_result(1)
    with pytest.raises(RuntimeError) as info:
        wait(chained, 1.0, "commpress: dense allreduce of bucket 0 (4 x float32) at step 2 on rank 0 of 2")
    msg = str(info.value)
    assert msg.startswith("commpress: dense allreduce of bucket 0") and "failed: gloo: Connection closed by peer" in msg
    assert "Got the following error" not in msg and "\n" not in msg and msg.count("commpress:") == 1


def test_clean_message_unwraps_torch_and_ddp_wording():
    raw = ("Unable to cast Got the following error when running the callback: RuntimeError: "
           "commpress: a failed\n\nAt:\n  /x.py(1): f\n to Tensor")
    assert clean_message(RuntimeError(raw)) == "commpress: a failed"
    ours = failure("commpress: b", RuntimeError(raw))
    assert str(ours) == f"commpress: a failed; {ADVICE}"  # the first failure's wording wins
    assert str(failure("commpress: b", ours)) == str(ours)  # no doubled advice or prefix


def test_fail_completes_once():
    fut = torch.futures.Future()
    assert fail(fut, RuntimeError("commpress: first"))
    assert not fail(fut, RuntimeError("commpress: second"))
    with pytest.raises(RuntimeError, match="first"):
        fut.wait()


def test_watchdog_fires_only_overdue_unfinished_entries():
    dog = Watchdog(poll=0.01)
    fired = []
    dog.watch(time.monotonic() + 0.05, lambda: False, lambda: fired.append("late"))
    dog.watch(time.monotonic() + 0.05, lambda: True, lambda: fired.append("done"))
    time.sleep(0.3)
    assert fired == ["late"] and dog.pending() == 0


def test_timeout_option_validated_before_communication():
    assert check_timeout(None) is None and check_timeout(timedelta(seconds=3)) == 3.0
    for bad in (0, -1, "5", True, float("inf")):
        with pytest.raises(ValueError, match="timeout must be"):
            comms.CompressionState("fp16", algorithm="allreduce", timeout=bad)
    assert comms.CompressionState("fp16", algorithm="allreduce", timeout=2.5).timeout == 2.5


class _FlagComm:
    """A 3-rank communicator whose flag allreduce hands back what gloo may once a peer is
    gone: garbage (here: this rank's own vector, rank count 1)."""

    rank, world_size, backend, timeout = 0, 3, "gloo", None

    def all_reduce(self, t):
        fut = torch.futures.Future()
        fut.set_result(t)
        return fut


def _step_with_garbled_bucket(flags_ok: bool):
    from comms.ddp.step_flags import StepFlags

    comm = _FlagComm()
    if flags_ok:
        comm.all_reduce = lambda t: _done(t * torch.tensor([1.0, 3.0]))  # rank count 3
    flags = StepFlags()
    decode = torch.futures.Future()
    what = "commpress: allgather collective of bucket 0 (8 x float32) at step 6 on rank 0 of 3"
    out = flags.enqueue(0, 6, torch.tensor(False), torch.zeros(8), decode, what=what)
    decode.set_exception(RuntimeError(f"{what} failed: index out of range in self"))
    flags.flush(comm, 6, lambda b, s: None)
    with pytest.raises(RuntimeError) as info:
        out.wait()
    return str(info.value)


def _done(v):
    fut = torch.futures.Future()
    fut.set_result(v)
    return fut


def test_garbage_from_a_dead_peer_reports_the_peer_not_the_decode():
    # topk allgather, stopped peer: a collective handed back garbage and the decode
    # raised; the step's flag allreduce counted 1 rank of 3: that is the error backward() gets
    msg = _step_with_garbled_bucket(flags_ok=False)
    assert msg.startswith("commpress: non-finite-flag allreduce") and "rank count of 1 instead of 3" in msg
    assert "index out of range" not in msg and msg.count("commpress:") == 1 and msg.count(ADVICE) == 1
    # every rank answered: a decode failure is a real one and is reported as such
    msg = _step_with_garbled_bucket(flags_ok=True)
    assert msg.startswith("commpress: allgather collective of bucket 0") and "index out of range" in msg


def test_a_round_failing_in_the_hook_thread_is_named():
    # a multi-round algorithm decodes an intermediate round in the hook's thread: garbage from
    # a dead peer raised a bare IndexError out of backward(); now it names the collective
    from comms.transport.errors import round_failure as _round_failure

    what = "commpress: two_phase collective of bucket 1 (16512 x float32) at step 7 on rank 0 of 3"
    msg = str(_round_failure(what, IndexError("index out of range in self")))
    assert msg.startswith(what + " failed: index out of range in self") and "peer died" in msg
    assert msg.count("commpress:") == 1 and ADVICE in msg
    ours = CollectiveTimeout(f"commpress: two_phase all_to_all round of bucket 1 did not complete within 5 s; {ADVICE}")
    again = _round_failure(what, ours)
    assert isinstance(again, CollectiveTimeout) and str(again) == str(ours)

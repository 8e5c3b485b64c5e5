"""comms.transport.futures: the futures DDP waits on (CPU side; the CUDA side is tests/gpu)."""

import pytest
import torch

from comms.transport.futures import device_future, stream_mark, wait_mark, when_all


def test_device_future_of_a_cpu_value_is_a_plain_future():
    x = torch.arange(4.0)
    fut = device_future(x)
    fut.set_result(x)
    assert fut.wait() is x
    assert device_future(None) is not None  # a non-tensor value: a plain future too


def test_when_all_gives_the_value_after_every_future_and_the_first_error():
    a, b = torch.futures.Future(), torch.futures.Future()
    value = torch.ones(3)
    out = when_all([a, b], value)
    a.set_result(1)
    assert not out.done()
    b.set_result(2)
    assert out.wait() is value
    c, d = torch.futures.Future(), torch.futures.Future()
    out = when_all([c, d], value)
    c.set_exception(RuntimeError("collective 1 failed"))
    d.set_result(0)
    with pytest.raises(RuntimeError, match="collective 1 failed"):
        out.wait()


def test_stream_marks_are_nothing_on_cpu():
    x = torch.zeros(3)
    mark = stream_mark(x)
    assert mark is None
    wait_mark(mark, x)  # a no-op, no error

"""ModuleTuner: the route schedule and the decision rule, on a one-rank communicator."""

import pytest

from comms.transport.communicator import LocalCommunicator
from comms.tuning.module_tuner import COMPRESSED, ModuleTuner


def _tuned(prefer_dense: float, dense_s: float, comp_s: float) -> str:
    t = ModuleTuner(trials=2, prefer_dense=prefer_dense)
    comm = LocalCommunicator()
    comm.timeout = None
    for k in range(t.decide_at):
        route = t.route(0, k)
        t.record(0, k, route, comp_s if route == COMPRESSED else dense_s)
    assert t.due(0, t.decide_at)
    return t.decide(0, comm, "m")


def test_schedule_alternates_dense_first_and_skips_the_first_call_of_each():
    t = ModuleTuner(trials=2)
    assert [t.route(0, k) for k in range(-1, 6)] == ["compressed", "dense", "compressed", "dense",
                                                     "compressed", "dense", "compressed"]
    t.record(0, 0, "dense", 9.0)
    t.record(0, 1, "compressed", 9.0)
    assert 0 not in t.times  # calls 0 and 1 are warm-up


@pytest.mark.parametrize("prefer_dense,dense_s,comp_s,want", [
    (0.03, 1.0, 0.98, "dense"),        # gradients: a tie goes to dense (exact, no memory)
    (0.03, 1.0, 0.96, "compressed"),
    (-0.03, 1.0, 1.02, "compressed"),  # parameters: a tie goes to int8 (fewer bytes)
    (-0.03, 1.0, 1.04, "dense"),
])
def test_decision_margin(prefer_dense, dense_s, comp_s, want):
    assert _tuned(prefer_dense, dense_s, comp_s) == want

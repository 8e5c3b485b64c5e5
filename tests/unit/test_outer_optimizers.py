"""The outer optimizers (comms.outer.optimizers): which one ``outer=None`` means, what each
does to the synced parameters, and the settings they refuse."""

import pytest
import torch

import compressors
from comms.outer.optimizers import OuterOptimizer, check_outer, default_outer, is_adaptive


def _params():
    return [torch.nn.Parameter(torch.zeros(3))]


def test_default_outer_is_the_average_unless_momentum_is_asked_for():
    assert default_outer() == "average" and default_outer(outer_momentum=0.5) == "nesterov"


@pytest.mark.parametrize("make,expected", [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), False),
    (lambda p: torch.optim.AdamW(p, lr=1e-3), True),
    (lambda p: torch.optim.NAdam(p, lr=1e-3), True),
], ids=["sgd", "adamw", "nadam"])
def test_adaptive_inner_optimizers_are_told_apart(make, expected):
    assert is_adaptive(make(_params())) is expected


def test_average_moves_the_anchor_to_the_replicas_mean_exactly():
    anchor = torch.tensor([1.0, 2.0, -4.0])
    d = torch.tensor([0.25, -0.5, 1.0])  # anchor minus the replicas' mean
    out = OuterOptimizer("average").step_(anchor.clone(), d, {})
    assert torch.equal(out, torch.tensor([0.75, 2.5, -5.0]))


def test_nesterov_first_step_is_lr_times_one_plus_mu_of_d():
    state = {}
    out = OuterOptimizer("nesterov", lr=1.0, momentum=0.5).step_(torch.zeros(2), torch.tensor([1.0, -2.0]), state)
    assert torch.equal(out, torch.tensor([-1.5, 3.0])) and torch.equal(state["momentum"], torch.tensor([1.0, -2.0]))


@pytest.mark.parametrize("name,lr,mu,match", [
    ("average", None, 0.5, "applies to outer='nesterov'"),
    ("adam", None, None, "outer must be one of"),
    ("nesterov", -1.0, None, "outer_lr must be"),
    ("nesterov", None, 1.0, "outer_momentum must be < 1"),
])
def test_bad_outer_settings_are_named(name, lr, mu, match):
    with pytest.raises(ValueError, match=match):
        check_outer(name, lr, mu, compressors.from_spec("qsgd:bits=4"), False)

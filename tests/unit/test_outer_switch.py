"""``auto``'s switch to the outer sync hands the hook's momentum-correction velocity to SGD
(comms.ddp.outer_switch.velocity_to_optimizer)."""

from types import SimpleNamespace

import torch

from comms.ddp.outer_switch import velocity_to_optimizer


def _state(velocities, layouts):
    return SimpleNamespace(memory=SimpleNamespace(velocities=velocities),
                           layout_tracker=SimpleNamespace(layouts=layouts),
                           param_key=lambda p: names[id(p)])


model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
names = {id(p): n for n, p in model.named_parameters()}


def test_each_parameter_takes_world_times_its_slice_and_sgd_continues_it():
    params = list(model.parameters())
    u = torch.randn(sum(p.numel() for p in params), generator=torch.Generator().manual_seed(0))
    keys = tuple(n for n, _ in model.named_parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    assert velocity_to_optimizer(_state({0: u}, {0: keys}), opt, params, world=4) == len(params)
    off = 0
    for p in params:
        buf = opt.state[p]["momentum_buffer"]
        assert torch.equal(buf, u[off:off + p.numel()].view_as(p) * 4) and buf.shape == p.shape
        off += p.numel()
    # SGD's next step continues that velocity: buf <- 0.9 buf + g, p <- p - lr buf
    for p in params:
        p.grad = torch.ones_like(p)
    before = [(p.detach().clone(), opt.state[p]["momentum_buffer"].clone()) for p in params]
    opt.step()
    for p, (w, b) in zip(params, before):
        torch.testing.assert_close(p.detach(), w - 0.1 * (b * 0.9 + 1))  # SGD's own rounding order


def test_a_bucket_of_another_layout_is_skipped():
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    keys = ("0.weight", "0.bias")
    wrong = torch.zeros(5)  # 0.weight + 0.bias hold 8 elements
    assert velocity_to_optimizer(_state({0: wrong, 1: torch.zeros(8)}, {1: ("unknown",)}), opt, params, 2) == 0
    assert velocity_to_optimizer(_state({0: wrong}, {0: keys}), opt, params, 2) == 0
    assert not opt.state

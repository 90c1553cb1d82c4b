"""Optimizers and learning-rate schedules."""

import math

import pytest
import torch

from dpscale.config import OptimConfig
from dpscale.train.optim import build_optimizer, build_scheduler, lr_multiplier


def test_warmup_then_cosine_values():
    # 4 warmup steps: lr/4, 2lr/4, 3lr/4, lr; then cosine from lr down to min_ratio * lr.
    got = [lr_multiplier(s, 14, "cosine", warmup_steps=4, min_ratio=0.1) for s in range(14)]
    assert got[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    for s in range(4, 14):
        progress = (s - 4) / 10
        assert got[s] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    assert all(a >= b for a, b in zip(got[3:], got[4:]))  # non-increasing after warmup


def test_constant_schedule_with_warmup():
    assert [lr_multiplier(s, 10, "constant", warmup_steps=2) for s in range(4)] == [
        0.5,
        1.0,
        1.0,
        1.0,
    ]
    with pytest.raises(ValueError, match="schedule"):
        lr_multiplier(0, 10, "step")


def test_scheduler_drives_the_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(3))
    cfg = OptimConfig(name="sgd", lr=2.0, schedule="cosine", warmup_steps=2)
    opt = build_optimizer(cfg, [p])
    sched = build_scheduler(cfg, opt, total_steps=6)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones(3)
        opt.step()
        sched.step()
    assert lrs[:2] == pytest.approx([1.0, 2.0])
    assert lrs[-1] < lrs[2]


def test_sgd_nesterov_momentum_matches_hand_computation():
    # torch semantics: b_t = mu b_{t-1} + g (dampening 0); nesterov step uses g + mu b_t.
    p = torch.nn.Parameter(torch.tensor([1.0]))
    opt = build_optimizer(OptimConfig(name="sgd", lr=0.1, momentum=0.9, nesterov=True), [p])
    buf, value = 0.0, 1.0
    for g in (1.0, -2.0, 0.5):
        p.grad = torch.tensor([g])
        opt.step()
        buf = 0.9 * buf + g
        value -= 0.1 * (g + 0.9 * buf)
        assert float(p.detach()) == pytest.approx(value)


def test_dampening_and_weight_decay_are_passed_through():
    p = torch.nn.Parameter(torch.tensor([2.0]))
    opt = build_optimizer(
        OptimConfig(name="sgd", lr=0.1, momentum=0.5, dampening=0.5, weight_decay=0.1), [p]
    )
    group = opt.param_groups[0]
    assert (group["momentum"], group["dampening"], group["weight_decay"], group["nesterov"]) == (
        0.5,
        0.5,
        0.1,
        False,
    )


@pytest.mark.parametrize(
    "name, cls",
    [("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD)],
)
def test_optimizer_kinds(name, cls):
    opt = build_optimizer(
        OptimConfig(name=name, lr=1e-3, betas=(0.8, 0.9), weight_decay=0.01),
        [torch.nn.Parameter(torch.zeros(1))],
    )
    assert type(opt) is cls
    if name != "sgd":
        assert opt.param_groups[0]["betas"] == (0.8, 0.9)

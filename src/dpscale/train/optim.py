"""Optimizers and learning-rate schedules (thin wrappers over ``torch.optim``)."""

from __future__ import annotations

import math
from typing import Iterable

import torch

from dpscale.config import OptimConfig


def build_optimizer(
    cfg: OptimConfig, params: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    """SGD (momentum / Nesterov / dampening), Adam or AdamW from the config.

    DP noise is already in the gradient when the optimizer sees it, so any optimizer is a
    post-processing of the private gradient and costs no extra privacy.
    """
    params = list(params)
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=cfg.lr,
            momentum=cfg.momentum,
            dampening=cfg.dampening,
            nesterov=cfg.nesterov,
            weight_decay=cfg.weight_decay,
        )
    if cfg.name == "adam":
        return torch.optim.Adam(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    raise ValueError(f"unknown optimizer {cfg.name!r}; choose sgd, adam or adamw")


def lr_multiplier(
    step: int, total_steps: int, schedule: str, warmup_steps: int = 0, min_ratio: float = 0.0
) -> float:
    """Learning-rate factor at ``step`` (0-based): linear warmup, then constant or cosine decay.

    Args:
        step: index of the step about to run.
        total_steps: length of the run.
        schedule: "constant" or "cosine".
        warmup_steps: steps of linear warmup from lr / warmup_steps to lr.
        min_ratio: cosine floor as a fraction of the peak lr.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        decay_steps = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {schedule!r}; choose constant or cosine")


def build_scheduler(
    cfg: OptimConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(
            step, total_steps, cfg.schedule, cfg.warmup_steps, cfg.min_lr_ratio
        ),
    )

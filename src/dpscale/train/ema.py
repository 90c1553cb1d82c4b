"""Exponential moving average (EMA) of the weights (TAN / De et al. 2022 evaluate it).

It is a function of the released (noisy) updates only, so it costs no privacy.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn


def warmup_decay(updates: int) -> float:
    """The warm-up's bound on the decay after ``updates`` updates: (1 + t) / (10 + t)."""
    return (1 + updates) / (10 + updates)


def warmup_reaches_decay_at(decay: float) -> int:
    """The first update at which the warm-up no longer sets the decay.

    Args:
        decay: the long-run decay d, in (0, 1).

    Returns:
        the smallest t with warmup_decay(t) >= d (8,990 for 0.999): before it, any two decays
        above the warm-up average the same weights.
    """
    if not 0 < decay < 1:
        raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
    t = max(0, math.ceil((10 * decay - 1) / (1 - decay)))
    # the closed form, then the float comparison current_decay makes (it can differ by one)
    while t > 0 and warmup_decay(t - 1) >= decay:
        t -= 1
    while warmup_decay(t) < decay:
        t += 1
    return t


def decay_not_reached_note(decay: float, steps: int) -> str | None:
    """A note for a run that ends before the warm-up reaches its decay (the decay then changes nothing).

    Args:
        decay: the configured long-run decay d.
        steps: the run's logical steps (one EMA update each).

    Returns:
        the note, or None when the run reaches d.
    """
    reached_at = warmup_reaches_decay_at(decay)
    if steps > reached_at:
        return None
    last = warmup_decay(steps - 1)
    return (
        f"train.ema_decay={decay:g} is never reached: the EMA's warm-up min(d, (1 + t) / (10 + t)) sets the "
        f"decay until step {reached_at:,} and this run has {steps:,} steps (the last update uses {last:.4f}), "
        f"so any decay >= {last:.4f} averages the same weights"
    )


class WeightEMA:
    """ema <- d_t * ema + (1 - d_t) * weights after every logical step, with the usual warm-up
    d_t = min(decay, (1 + t) / (10 + t)) (t = number of updates so far), so the average is not
    dominated by the initial weights in short runs.

    Args:
        model: the trained model; a copy holds the average (parameters and buffers).
        decay: the long-run decay d, in (0, 1).
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.updates = 0
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    def current_decay(self) -> float:
        return min(self.decay, warmup_decay(self.updates))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        d = self.current_decay()
        for average, live in zip(self.model.parameters(), model.parameters()):
            average.lerp_(live.detach(), 1.0 - d)
        for average_buffer, live_buffer in zip(self.model.buffers(), model.buffers()):
            average_buffer.copy_(live_buffer)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "updates": self.updates, "model": self.model.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["decay"] != self.decay:
            raise ValueError(f"checkpoint EMA decay {state['decay']} != configured {self.decay}")
        self.updates = int(state["updates"])
        self.model.load_state_dict(state["model"])

"""The train-loss window of a run: the loss sum, examples and non-finite examples since the last
evaluation, added up on the device (no host sync per step) and saved in every checkpoint."""

from __future__ import annotations

from typing import Any

import torch

from dpscale.train.step import StepStats

EMPTY = {"loss_sum": 0.0, "examples": 0, "nonfinite_examples": 0}


class LossWindow:
    """The train-loss window on ``device``, from a checkpoint's ``window`` (default: empty).

    Attributes:
        sums: loss sum, examples, non-finite examples (float64, on the device).
    """

    def __init__(self, device: torch.device, window: dict[str, Any] | None = None) -> None:
        self.device = device
        self.load(EMPTY if window is None else window)

    def load(self, window: dict[str, Any]) -> None:
        """Set the window (``as_dict``'s layout: a checkpoint's, or ``EMPTY`` after an evaluation)."""
        values = [
            float(window["loss_sum"]),
            float(window["examples"]),
            float(window["nonfinite_examples"]),
        ]
        self.sums = torch.tensor(values, dtype=torch.float64, device=self.device)

    def add(self, stats: StepStats) -> None:
        """A step's loss sum, examples and non-finite examples added (on the device: no host sync)."""
        self.sums += stats.select("loss_sum", "examples", "nonfinite").to(self.sums.device)

    def as_dict(self) -> dict[str, float | int]:
        """The window as evaluation records and checkpoints read it (waits for the device)."""
        loss_sum, examples, nonfinite = self.sums.tolist()
        return {
            "loss_sum": loss_sum,
            "examples": int(examples),
            "nonfinite_examples": int(nonfinite),
        }

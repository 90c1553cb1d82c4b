"""Training: the DP-SGD step, the run loop, checkpoints and metrics."""

from dpscale.train.loop import Trainer
from dpscale.train.step import StepStats, apply_gradient, noisy_clipped_mean, physical_chunks

__all__ = ["StepStats", "Trainer", "apply_gradient", "noisy_clipped_mean", "physical_chunks"]

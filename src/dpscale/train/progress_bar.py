"""The training run's progress bar (tqdm, to stderr): the steps, and the last step's loss with the
epsilon spent, recomputed after an evaluation or every ``EPSILON_REFRESH_S`` seconds."""

from __future__ import annotations

import sys
import time
from typing import Callable

from tqdm import tqdm

from dpscale.train.report import format_epsilon
from dpscale.train.step import StepStats

# How often the progress bar's epsilon is recomputed between evaluations (PLD takes ~0.5 s).
EPSILON_REFRESH_S = 10.0


class StepBar:
    """A run's progress bar, from step ``initial`` of ``total``.

    Args:
        total, initial: the planned steps and the steps taken.
        show: draw it (off: nothing is drawn or computed for it).
        epsilon: computes the epsilon spent (shown from the start after a resume).

    Attributes:
        epsilon: the epsilon the bar shows (an evaluation sets the one it computed).
    """

    def __init__(self, total: int, initial: int, show: bool, epsilon: Callable[[], float]) -> None:
        self.show = show
        self.bar = tqdm(
            total=total,
            initial=initial,
            disable=not show,
            file=sys.stderr,
            desc="train",
            unit="step",
            dynamic_ncols=True,
        )
        self.epsilon, self.reported_at = epsilon() if initial else 0.0, time.perf_counter()

    def after_step(self, stats: StepStats, evaluated: bool, epsilon: Callable[[], float]) -> None:
        """One step more; the loss and epsilon redrawn after an evaluation (``evaluated``) or when
        ``EPSILON_REFRESH_S`` have passed (``epsilon`` computes the epsilon spent)."""
        self.bar.update(1)
        # Reading the step's loss waits for the device: only when the bar is redrawn.
        if self.show and (evaluated or time.perf_counter() - self.reported_at > EPSILON_REFRESH_S):
            self.epsilon, self.reported_at = epsilon(), time.perf_counter()
            loss = stats.loss_sum / max(1, stats.examples)
            self.bar.set_postfix(
                loss=f"{loss:.3f}", eps=format_epsilon(self.epsilon), refresh=False
            )

    def close(self) -> None:
        """Close the bar (its last line stays on the terminal)."""
        self.bar.close()

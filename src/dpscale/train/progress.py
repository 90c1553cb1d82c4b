"""Where a run stands between steps: the loop's counters that checkpoints, evaluation records and
the summary read (``Progress``), handed to those helpers explicitly rather than the Trainer."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dpscale.privacy.plan.dp_plan import DPPlan


@dataclass
class Progress:
    """The loop's counters of one run.

    Attributes:
        step: logical steps taken.
        wall_time_s: training wall time so far, evaluations aside (s, every session of the run).
        data_wait_s: streaming only: time this process waited for chunks (s, this session).
        augtest_seed: seeds AugTest's test views (the same views at every evaluation).
        config_changes: the changes asked for with ``--set`` on resume, by step.
    """

    step: int = 0
    wall_time_s: float = 0.0
    data_wait_s: float = 0.0
    augtest_seed: int = 0
    config_changes: list[dict[str, Any]] = field(default_factory=list)


def epochs_done(plan: DPPlan, step: int) -> float:
    """Epochs after ``step`` steps: step * B / N (an epoch is N / B expected-size batches)."""
    return step * plan.batch_size / plan.dataset_size


def evaluation_due(plan: DPPlan, every_epochs: float, step: int, total_steps: int) -> bool:
    """True after the last step and whenever another ``every_epochs`` (train.eval_every_epochs)
    have passed at ``step`` (epochs of the reference run for a TAN simulation, so both evaluate
    at the same steps)."""
    if step == total_steps:
        return True
    batch = plan.simulation.batch_size if plan.simulation else plan.batch_size
    period = lambda s: math.floor(s * batch / plan.dataset_size / every_epochs + 1e-9)  # noqa: E731
    return period(step) > period(step - 1)

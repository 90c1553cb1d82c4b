"""``dpscale sweep --private-tuning DIST``: random-repetition tuning whose privacy cost is
accounted (Papernot & Steinke 2022; the bound is in ``dpscale.privacy.tuning``).

Instead of every grid point, the sweep draws K from DIST and K points uniformly from the grid
(with replacement, each a separate run with its own randomness), with OS entropy, and records the
draws in sweep.json before anything trains (a resumed sweep continues them, never redraws).
Only the best run may be released, with the tuned epsilon; the other runs' results are for the
tuner alone.
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np

from dpscale.config import ConfigError
from dpscale.features.extract import read_source_run
from dpscale.privacy.accountant import AccountingSegment, PrivacyAccountant
from dpscale.privacy.tuning import TuningDistribution, parse_tuning_distribution, tuned_epsilon

# Grid keys that change a run's privacy cost (q, sigma, steps, N, releases): the bound needs one
# RDP curve for every candidate. dp.max_grad_norm scales the noise with C and costs nothing.
COST_KEYS = ("dp.", "train.epochs", "train.steps", "data.", "features.", "model.init", "augment.")
FREE_KEYS = ("dp.max_grad_norm",)


def tuning_from_text(text: str, grid_keys: list[str]) -> TuningDistribution:
    """The distribution of ``--private-tuning``, refusing grids whose points differ in privacy cost."""
    try:
        tuning = parse_tuning_distribution(text)
    except ValueError as err:
        raise ConfigError(f"--private-tuning: {err}") from None
    costly = [k for k in grid_keys if k.startswith(COST_KEYS) and k not in FREE_KEYS]
    if costly:
        raise ConfigError(
            f"--private-tuning needs every candidate run to have the same privacy cost, and --grid {', '.join(costly)} "
            "changes it (q, sigma, steps, N or releases); tune those on public data, or fix them"
        )
    return tuning


def draw_trials(tuning: TuningDistribution, points: int) -> list[int]:
    """K ~ ``tuning`` and K grid indices drawn uniformly with replacement, from OS entropy (the
    draws are part of the mechanism: nobody may choose or replay them)."""
    rng = np.random.Generator(np.random.PCG64DXSM(np.random.SeedSequence(secrets.randbits(128))))
    k = tuning.sample(rng)
    return [int(i) for i in rng.integers(0, points, size=k)]


def tuning_release(tuning: TuningDistribution, best_run_dir: str | None, run_dirs: list[str], delta: float | None) -> dict[str, Any]:
    """What may be released: the best run and its epsilon with the tuning composed.

    Args:
        tuning: the distribution K was drawn from.
        best_run_dir: the best finished run (None when K = 0 or none finished).
        run_dirs: every trial's run directory (their accounting histories must agree).
        delta: the runs' delta.

    Returns:
        {"distribution", "released_run", "tuned_epsilon", "delta"} (epsilon None with nothing to release).
    """
    record: dict[str, Any] = {
        "distribution": tuning.describe(), "released_run": best_run_dir, "tuned_epsilon": None, "run_epsilon_rdp": None,
        "delta": delta,
    }  # fmt: skip
    if best_run_dir is None:
        return record
    histories = {read_source_run(d).history for d in run_dirs}
    if len(histories) != 1:
        raise ConfigError("the tuning runs differ in their privacy accounting; the tuning bound needs one cost for all")
    history = histories.pop()
    record["tuned_epsilon"] = tuned_epsilon(history, delta, tuning)
    record["run_epsilon_rdp"] = compute_history_epsilon(history, delta)  # one run alone, same accountant
    return record


def compute_history_epsilon(history: tuple[AccountingSegment, ...], delta: float) -> float:
    """Epsilon of one run's history with the RDP accountant (the tuned epsilon's baseline)."""
    accountant = PrivacyAccountant("rdp")
    for segment in history:
        accountant.record(segment)
    return accountant.epsilon(delta)

"""``dpscale sweep --private-tuning DIST``: random-repetition tuning whose privacy cost is
accounted (Papernot & Steinke 2022; the bound is in ``dpscale.privacy.accounting.tuning``).

Instead of every grid point, the sweep draws K from DIST and K points uniformly from the grid
(with replacement, each a separate run with its own randomness), with OS entropy, and records the
draws in sweep.json before anything trains (a resumed sweep continues them, never redraws).
Only the best run may be released, with the tuned epsilon; the other runs' results are for the
tuner alone. The bound also needs K itself hidden (revealing it moves a toy mechanism's epsilon
from 6.1 to 18-24), so what is released, ``released/`` (the model, its config and
``release.json``), holds neither K nor anything that bounds it: no trial's name, index or seed.
"""

from __future__ import annotations

import io
import json
import secrets
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpscale._io import atomic_write_bytes, atomic_write_text
from dpscale.config import save_config
from dpscale.errors import ConfigError
from dpscale.features.source_run import read_source_run
from dpscale.privacy.accounting.accountant import PrivacyAccountant
from dpscale.privacy.accounting.segments import AccountingSegment
from dpscale.privacy.accounting.tuning import (
    TuningDistribution,
    parse_tuning_distribution,
    tuned_epsilon,
)
from dpscale.runs import CONFIG_NAME, read_run
from dpscale.train.metrics import json_safe

# Grid keys that change a run's privacy cost (q, sigma, steps, N, releases): the bound needs one
# RDP curve for every candidate. dp.max_grad_norm scales the noise with C and costs nothing.
COST_KEYS = ("dp.", "train.epochs", "train.steps", "data.", "features.", "model.init", "augment.")
FREE_KEYS = ("dp.max_grad_norm",)
# The summary keys measured on the held-out test split. A metric of the training data (train_loss,
# gradient norms) would be a further release about it that the bound does not cover; epsilon,
# steps or wall time measure no model.
TEST_METRICS = ("test_accuracy", "test_loss", "test_accuracy_ema", "test_accuracy_augtest")

# What may be published: this folder of the sweep, nothing else in it.
RELEASED_DIR = "released"
RELEASE_NAME = "release.json"
RELEASED_MODEL = "model.pt"
RELEASED_CONFIG = CONFIG_NAME  # named as in a run directory
# The checkpoint entries a user of the model needs; never the RNG states, optimizer or sampler.
RELEASED_STATE = ("model", "ema", "feature_norm")

MECHANISM = "random repetition, the best run released (Papernot & Steinke 2022)"
K_SECRET = (
    "K, the number of trials drawn, must stay secret, and so must every other trial (its run, result, "
    "index or seed): the tuned epsilon holds only while K is hidden"
)
TUNER_PRIVATE = f"PRIVATE TO THE TUNER: this reveals K and the other trials; never publish it. {K_SECRET}. Publish only {RELEASED_DIR}/"


def tuning_from_text(text: str, grid_keys: list[str]) -> TuningDistribution:
    """The distribution of ``--private-tuning``, refusing grids whose points differ in privacy cost."""
    try:
        tuning = parse_tuning_distribution(text)
    except ValueError as err:
        raise ConfigError(f"--private-tuning: {err}") from err
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


def check_tuning_metric(metric: str) -> None:
    """Refuse a selection ``metric`` that is not measured on the test split (see TEST_METRICS)."""
    if metric not in TEST_METRICS:
        raise ConfigError(
            f"--private-tuning selects on the test split only; --metric {metric} is not a test-split metric (use {', '.join(TEST_METRICS)})"
        )


def tuning_release(
    tuning: TuningDistribution,
    best_run_dir: str | None,
    run_dirs: list[str],
    delta: float | None,
    selection: dict[str, Any],
) -> dict[str, Any]:
    """What may be released: the best run's epsilon with the tuning composed; never K or the trial.

    Args:
        tuning: the distribution K was drawn from.
        best_run_dir: the best finished run (None when K = 0 or none finished).
        run_dirs: every finished trial's run directory (their accounting histories must agree).
        delta: the runs' delta.
        selection: {"metric", "value", "hyperparameters", "guarantee_caveats"} of the best run (values
            None without one).

    Returns:
        The record of release.json: the mechanism, the distribution, whether a model is released,
        the selection, "tuned_epsilon" and "run_epsilon_rdp" (None with nothing released), delta,
        the released files' names and the K_SECRET note.
    """
    released = best_run_dir is not None
    record: dict[str, Any] = {
        "mechanism": MECHANISM,
        "distribution": tuning.describe(),
        "released": released,
        **selection,
        "tuned_epsilon": None,
        "run_epsilon_rdp": None,
        "delta": delta,
        "model": RELEASED_MODEL if released else None,
        "config": RELEASED_CONFIG if released else None,
        "k_secret": K_SECRET,
    }
    if not released:
        return record
    if delta is None:  # a finished private run's summary always holds its delta
        raise ValueError(
            f"the summary of {best_run_dir} holds no delta: cannot account for the tuning"
        )
    histories = {read_source_run(d).history for d in run_dirs}
    if len(histories) != 1:
        raise ConfigError(
            "the tuning runs differ in their privacy accounting; the tuning bound needs one cost for all"
        )
    history = histories.pop()
    record["tuned_epsilon"] = tuned_epsilon(history, delta, tuning)
    # one run alone, same accountant
    record["run_epsilon_rdp"] = compute_history_epsilon(history, delta)
    return record


def write_release(directory: Path, record: dict[str, Any], best_run_dir: str | None) -> None:
    """Write the release into ``directory``: the best run's model and config under neutral names,
    then ``release.json`` (last: its presence says the release is decided).

    Args:
        directory: the sweep's RELEASED_DIR.
        record: from ``tuning_release``.
        best_run_dir: the run released (None: release.json alone).
    """
    directory.mkdir(parents=True, exist_ok=True)
    if best_run_dir is not None:
        config, state = read_run(best_run_dir)
        buffer = io.BytesIO()  # a plain state-dict file: model.init and torch.load read it
        torch.save(
            {key: state[key] for key in RELEASED_STATE if state.get(key) is not None}, buffer
        )
        atomic_write_bytes(directory / RELEASED_MODEL, buffer.getbuffer())
        # The trial's seed is the sweep's seed + its index, and its run directory is named after it.
        save_config(
            replace(config, run=replace(config.run, out_dir=None, seed=None)),
            directory / RELEASED_CONFIG,
        )
    atomic_write_text(directory / RELEASE_NAME, json.dumps(json_safe(record), indent=2) + "\n")


def release_statement(release: dict[str, Any]) -> str:
    """The one line that may be published about a release (no K, no trial)."""
    head = f"Private tuning ({release['distribution']}, Papernot & Steinke 2022)"
    if not release["released"]:
        return f"{head}: nothing to release. {K_SECRET}."
    return (
        f"{head}: release only the model in {RELEASED_DIR}/ ({release['metric']}={release['value']:.4g}), with "
        f"epsilon={release['tuned_epsilon']:.4g} at delta={release['delta']:g} (RDP, the tuning included; one run "
        f"alone: {release['run_epsilon_rdp']:.4g} RDP). {K_SECRET}."
    )


def compute_history_epsilon(history: tuple[AccountingSegment, ...], delta: float) -> float:
    """Epsilon of one run's history with the RDP accountant (the tuned epsilon's baseline)."""
    accountant = PrivacyAccountant("rdp")
    for segment in history:
        accountant.record(segment)
    return accountant.epsilon(delta)

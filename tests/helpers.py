"""What several test modules share (issue 46, item 5): the shared data's paths, the short run
configurations (``short_config``, ``small_config``, ``tiny_config``), the one-line-error check.
Import it as ``from helpers import ...`` (pytest puts ``tests/`` on the path); a test module
imports nothing from another test module."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dpscale.cli import main
from dpscale.config import Config, load_config
from dpscale.privacy.plan.make_plan import make_dp_plan
from dpscale.privacy.plan.numbers import PrivacyNumbers
from dpscale.privacy.plan.dp_plan import DPPlan
from dpscale.train.distributed import launch_command

REPO = Path(__file__).resolve().parents[1]
# Read from there, never copied into the repository; tests that need them skip cleanly without them.
SHARED_DATA = REPO / ".." / "shared" / "data"
SHARED_MNIST = SHARED_DATA / "mnist-10k"
SHARED_FMNIST = SHARED_DATA / "fashion-mnist"


def short_config(out_dir: Path | str, steps: int, *extra: str) -> Config:
    """The common short run: ``steps`` private steps of the default model (papernot-cnn) on the
    embedded MNIST sample (N = 4000) at run.seed 0 and B = 128, an evaluation about every 8 steps,
    the default target epsilon (3), chunks and optimiser; ``extra`` are further ``--set`` overrides."""
    return load_config(
        None,
        [
            f"run.out_dir={out_dir}",
            "run.seed=0",
            "dp.batch_size=128",
            f"train.steps={steps}",
            "train.eval_every_epochs=0.25",  # ~every 8 steps
            *extra,
        ],
    )


def small_config(out_dir: Path | str, *extra: str) -> Config:
    """``short_config()`` of 24 steps at epsilon 4, chunks of 64, momentum 0.9 and a cosine schedule
    with warm-up; ``extra`` are further ``--set`` overrides."""
    return short_config(
        out_dir,
        24,
        "dp.epsilon=4",
        "train.max_physical_batch_size=64",
        "optim.momentum=0.9",
        "optim.schedule=cosine",
        "optim.warmup_steps=3",
        *extra,
    )


def tiny_config(out_dir: Path | str, *extra: str) -> Config:
    """The cheapest private run: 3 steps of the linear model on the embedded MNIST sample at B = 64
    and a fixed noise multiplier of 1 (no epsilon to calibrate), unseeded; ``extra`` are further
    ``--set`` overrides."""
    return load_config(
        None,
        [
            f"run.out_dir={out_dir}",
            "model.name=linear",
            "dp.batch_size=64",
            "dp.epsilon=null",
            "dp.noise_multiplier=1.0",
            "train.steps=3",
            *extra,
        ],
    )


def one_line_error(capsys: pytest.CaptureFixture, argv: list[str], *patterns: str) -> str:
    """Run the CLI; assert exit code 2 and exactly one stderr line matching every pattern.

    Args:
        capsys: pytest's capture fixture.
        argv: the command line after ``dpscale``.
        patterns: regular expressions the line must contain.

    Returns:
        The error line.
    """
    code = main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, lines)
    for pattern in patterns:
        assert re.search(pattern, lines[0]), (pattern, lines[0])
    return lines[0]


def run_job(nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``dpscale ARGS`` as a torchrun job of ``nproc`` processes (one plain process for 1), from the
    repository root; asserts it exits 0 (the stderr tail in the message otherwise).

    Returns:
        the finished process (stdout and stderr captured, as text).
    """
    cmd, env = launch_command(nproc, list(args))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def plan_of(**settings: Any) -> DPPlan:
    """``make_dp_plan`` from flat keywords: the privacy numbers among ``settings`` gathered into
    ``PrivacyNumbers``, the rest (dataset_size, steps, releases, ...) passed as the run's facts."""
    names = {f.name for f in dataclasses.fields(PrivacyNumbers)}
    numbers = PrivacyNumbers(**{k: v for k, v in settings.items() if k in names})
    return make_dp_plan(numbers, **{k: v for k, v in settings.items() if k not in names})


def leave_spawned_worker() -> None:
    """End a torch.multiprocessing.spawn worker after its process group is destroyed.

    Leaves without the interpreter's teardown: after some earlier tests in the same pytest
    session, gloo's threads were sometimes destroyed joinable at exit ("terminate called without
    an active exception", SIGABRT, seen in CI for both two-process tests) although the worker's
    work and its barrier had finished.
    """
    os._exit(0)


# A tiny private run on the embedded MNIST sample (N = 4000): a linear model, 12 steps (the tune and TAN tests).
TINY_RUN_SETS = (
    "model.name=linear",
    "dp.batch_size=512",
    "dp.accountant=rdp",
    "train.steps=12",
    "train.eval_every_epochs=100",
    "optim.lr=2",
    "run.threads=1",
)


def set_flags(*items: str) -> list[str]:
    """``--set`` before each ``key=value`` item: the command-line form of config overrides."""
    return [x for item in items for x in ("--set", item)]

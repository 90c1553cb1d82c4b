"""Run directories read back: the one module that names a run directory's files and reads them.

    <run dir>/config.yaml          the resolved config (written complete, or not at all)
              checkpoint.pt        model, optimizer, DP mechanism state (atomic replace, checksummed)
              checkpoint.prev.pt   the checkpoint before it (resume falls back on it if the newest is damaged)
              checkpoint.damaged.pt  a damaged newest checkpoint, set aside by a resume
              metrics.jsonl        one line per evaluation
              summary.json         the finished run's result
              audit.json           marks a `dpscale audit` run (canaries in its training set), with its result
              .dpscale.lock        held (flock) by the one process training in the directory

It sits below every layer that reads runs (features, models, train, tune, cli may import it) and
imports only the config and ``dpscale._io``. Writing a run (its lock, a new run's claim) is
``dpscale.train.rundir``'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from dpscale._io import CHECKPOINT_NAME, PREVIOUS_CHECKPOINT_NAME, DamagedFileError, load_checkpoint
from dpscale.config import Config, load_config
from dpscale.errors import ConfigError

# The checkpoint names are defined beside the checkpoint writer (``_io.save_checkpoint`` keeps the
# previous one under its name); every reader takes them from here.
CONFIG_NAME = "config.yaml"
METRICS_NAME = "metrics.jsonl"
SUMMARY_NAME = "summary.json"
AUDIT_NAME = "audit.json"
TENSORBOARD_NAME = "tensorboard"  # a folder of TensorBoard event files (dpscale.train.tensorboard)
LOCK_NAME = ".dpscale.lock"
DAMAGED_CHECKPOINT_NAME = "checkpoint.damaged.pt"
RUN_FILES = (CONFIG_NAME, CHECKPOINT_NAME, PREVIOUS_CHECKPOINT_NAME, SUMMARY_NAME, METRICS_NAME)
# What a run leaves before its first checkpoint: nothing of it can be continued, so a new start may clear it.
UNSTARTED_RUN_FILES = (CONFIG_NAME, METRICS_NAME, AUDIT_NAME)
# What a run leaves once it got as far as a checkpoint (or finished): a new start must not clear it.
CHECKPOINTED_RUN_FILES = (CHECKPOINT_NAME, PREVIOUS_CHECKPOINT_NAME, SUMMARY_NAME)

__all__ = [
    "AUDIT_NAME",
    "CHECKPOINT_NAME",
    "CHECKPOINTED_RUN_FILES",
    "CONFIG_NAME",
    "DAMAGED_CHECKPOINT_NAME",
    "LOCK_NAME",
    "METRICS_NAME",
    "PREVIOUS_CHECKPOINT_NAME",
    "RUN_FILES",
    "SUMMARY_NAME",
    "TENSORBOARD_NAME",
    "UNSTARTED_RUN_FILES",
    "LatestCheckpoint",
    "NotARunDirectory",
    "find_run_dirs",
    "holds_checkpoint",
    "holds_run",
    "is_audit_run",
    "is_run_dir",
    "latest_checkpoint",
    "read_metrics",
    "read_run",
    "read_run_config",
    "read_summary",
]


class NotARunDirectory(ConfigError):
    """A directory read as a run directory holds no config.yaml."""


def is_run_dir(path: str | Path) -> bool:
    """Whether ``path`` is a dpscale run directory (it holds a config.yaml)."""
    return (Path(path) / CONFIG_NAME).is_file()


# How deep below a folder ``find_run_dirs`` looks: runs/NAME, or a sweep's SWEEP/runs/POINT.
RUN_SEARCH_DEPTH = 2


def find_run_dirs(path: str | Path, depth: int = RUN_SEARCH_DEPTH) -> list[Path]:
    """The run directories ``path`` stands for: itself if it is one, else those in it (a runs/
    folder, a sweep directory), down to ``depth`` levels, by name.

    Args:
        path: a run directory or a folder of them.
        depth: how many folder levels below ``path`` to look in.

    Returns:
        the run directories found ([] when none: not a run directory, nor a folder of runs).
    """
    path = Path(path)
    # its own folders (plots/, tensorboard/) are not searched: runs do not nest
    if is_run_dir(path):
        return [path]
    if depth == 0 or not path.is_dir():
        return []
    return [
        run
        for child in sorted(path.iterdir())
        if child.is_dir()
        for run in find_run_dirs(child, depth - 1)
    ]


def holds_run(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` already holds (part of) a run: any of ``RUN_FILES``."""
    return any((Path(run_dir) / name).exists() for name in RUN_FILES)


def holds_checkpoint(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds a run that got as far as a checkpoint (or finished)."""
    return any((Path(run_dir) / name).exists() for name in CHECKPOINTED_RUN_FILES)


def is_audit_run(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` is (or was started as) a ``dpscale audit`` run."""
    return (Path(run_dir) / AUDIT_NAME).exists()


def read_run_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> Config:
    """The run's config.yaml (with ``overrides`` applied), ``run.out_dir`` set to where it is now.

    Args:
        run_dir: the run directory.
        overrides: ``section.key=value`` strings, applied in order after the file.

    Returns:
        The validated config.

    Raises:
        NotARunDirectory: ``run_dir`` holds no config.yaml.
        ConfigError: the file is malformed (one line naming file:line:col).
    """
    run_dir = Path(run_dir)
    if not is_run_dir(run_dir):
        raise NotARunDirectory(f"{run_dir} is not a dpscale run directory (no {CONFIG_NAME})")
    config = load_config(run_dir / CONFIG_NAME, list(overrides))
    # The directory may have been moved or renamed since: it is wherever it is now.
    return replace(config, run=replace(config.run, out_dir=str(run_dir)))


def read_run(run_dir: str | Path) -> tuple[Config, dict[str, Any]]:
    """The config and newest checkpoint of the run in ``run_dir`` (wherever the directory is now).

    Unlike ``latest_checkpoint`` this never falls back: what it returns is the run as it stands.

    Raises:
        NotARunDirectory / ConfigError: as ``read_run_config``.
        FileNotFoundError: no checkpoint.pt.
        DamagedFileError: checkpoint.pt is damaged (the message says when a resume can fall back).
    """
    run_dir = Path(run_dir)
    config = read_run_config(run_dir)
    try:
        return config, load_checkpoint(run_dir / CHECKPOINT_NAME)
    except DamagedFileError as err:
        if (run_dir / PREVIOUS_CHECKPOINT_NAME).is_file():
            raise DamagedFileError(
                f"{err}; the previous checkpoint {PREVIOUS_CHECKPOINT_NAME} is kept: `dpscale train --resume {run_dir}` continues from it"
            ) from err
        raise


@dataclass(frozen=True)
class LatestCheckpoint:
    """The checkpoint a resume continues from.

    Attributes:
        state: the checkpoint, or None when the run stopped before its first one.
        damaged: the newest checkpoint's file, when it was damaged and ``state`` is the previous one.
        note: a line saying which checkpoint was chosen and why (None for the plain case).
    """

    state: dict[str, Any] | None
    damaged: Path | None = None
    note: str | None = None


def latest_checkpoint(run_dir: str | Path) -> LatestCheckpoint:
    """The newest intact checkpoint of ``run_dir``: checkpoint.pt, else (missing or damaged)
    checkpoint.prev.pt, else none at all.

    Raises:
        DamagedFileError: the newest is damaged and no intact previous one is kept.
    """
    run_dir = Path(run_dir)
    newest, previous = run_dir / CHECKPOINT_NAME, run_dir / PREVIOUS_CHECKPOINT_NAME
    try:
        return LatestCheckpoint(load_checkpoint(newest))
    except FileNotFoundError:
        damage = None
    except DamagedFileError as err:
        damage = err
    if not previous.is_file():
        if damage is not None:
            raise DamagedFileError(
                f"{damage}, and no previous checkpoint is kept; the run cannot be resumed"
            ) from damage
        return LatestCheckpoint(
            None,
            note=f"{run_dir} has no checkpoint (the run stopped before its first): starting it from step 0",
        )
    try:
        state = load_checkpoint(previous)
    except DamagedFileError as err:
        raise DamagedFileError(f"{damage or 'no newest checkpoint'}; {err}") from err
    why = str(damage) if damage is not None else f"{newest} is missing"
    note = f"{why}: resuming from the previous checkpoint {previous} (step {state['step']})"
    return LatestCheckpoint(state, newest if damage is not None else None, note)


def read_summary(run_dir: str | Path) -> dict[str, Any] | None:
    """The finished run's summary.json, or None when the run has not finished (no file).

    Raises:
        DamagedFileError: the file is not valid JSON (it is written atomically, so it was changed).
    """
    path = Path(run_dir) / SUMMARY_NAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DamagedFileError(f"{path} is not valid JSON ({err})") from err


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's evaluations, one record per line of metrics.jsonl, oldest first ([] when none).

    A line cut short by a crash mid-write is left out (a resume drops it too).
    """
    path = Path(run_dir) / METRICS_NAME
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records

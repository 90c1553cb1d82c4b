"""A run directory: its file names, claiming a new one, reading a run back.

    <run dir>/config.yaml     the resolved config (written first: it claims the directory)
              checkpoint.pt   model, optimizer, DP mechanism state (atomic replace, dpscale._io)
              metrics.jsonl   one line per evaluation
              summary.json    the finished run's result
"""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from dpscale._io import CHECKPOINT_NAME, load_checkpoint
from dpscale.config import Config, ConfigError, load_config, save_config

CONFIG_NAME = "config.yaml"
METRICS_NAME = "metrics.jsonl"
SUMMARY_NAME = "summary.json"
AUDIT_NAME = "audit.json"  # marks a `dpscale audit` run (canaries in its training set), with its result
RUN_FILES = (CONFIG_NAME, CHECKPOINT_NAME, SUMMARY_NAME, METRICS_NAME)

__all__ = ["CHECKPOINT_NAME", "CONFIG_NAME", "METRICS_NAME", "RUN_FILES", "SUMMARY_NAME", "claim", "default_out_dir", "holds_run", "read_run"]


def default_out_dir(config: Config) -> str:
    """runs/<model>-<data>-<date-time>, with a suffix if that directory already exists."""
    base = f"runs/{config.model.name}-{config.data.name}-{datetime.now():%Y%m%d-%H%M%S}"
    candidate, n = base, 1
    while Path(candidate).exists():
        n += 1
        candidate = f"{base}-{n}"
    return candidate


def taken_message(run_dir: Path) -> str:
    return f"{run_dir} already holds a run; continue it with `dpscale train --resume {run_dir}` or choose another run.out_dir"


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` already holds (part of) a run."""
    return any((Path(run_dir) / name).exists() for name in RUN_FILES)


def claim(run_dir: Path, config: Config) -> str | None:
    """Create ``run_dir`` and write ``config`` into it, atomically claiming it: of two runs
    started on one directory at once, exactly one succeeds.

    Returns:
        None, or why the directory could not be claimed.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(run_dir / CONFIG_NAME, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        save_config(config, run_dir / CONFIG_NAME)
    except FileExistsError:
        return taken_message(run_dir)
    except OSError as err:  # e.g. permissions
        return f"cannot write the run directory {run_dir}: {err}"
    return None


def read_run(run_dir: str | Path) -> tuple[Config, dict[str, Any]]:
    """The config and checkpoint of the run in ``run_dir`` (wherever the directory is now)."""
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_NAME).is_file():
        raise ConfigError(f"{run_dir} is not a dpscale run directory (no {CONFIG_NAME})")
    config = load_config(run_dir / CONFIG_NAME)
    # The directory may have been moved or renamed since: it is wherever it is now.
    config = replace(config, run=replace(config.run, out_dir=str(run_dir)))
    return config, load_checkpoint(run_dir / CHECKPOINT_NAME)

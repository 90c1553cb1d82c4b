"""Opening a run directory for a Trainer: a new run's claim, the run read at its checkpoint, the
run to resume (locked, its newest intact checkpoint chosen, config edits checked). Each takes the
directory and returns what ``Trainer.create``, ``resume`` and ``load`` build the Trainer from."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

from dpscale.config import Config
from dpscale.errors import ConfigError
from dpscale.privacy.plan.dp_plan import DPPlan
from dpscale.runs import (
    LatestCheckpoint,
    is_audit_run,
    latest_checkpoint,
    read_run,
    read_run_config,
)
from dpscale.train.distributed import Distributed, init_distributed
from dpscale.train.rundir import NewRun, RunLock, check_config_edits, open_new_run

T = TypeVar("T")


def run_dir_of(config: Config) -> Path:
    """The run directory of a resolved config (``run.out_dir``; ``default_out_dir`` names one).

    Raises:
        ValueError: ``run.out_dir`` is not set.
    """
    if config.run.out_dir is None:
        raise ValueError(
            "a Trainer needs config.run.out_dir (set it, or name one with dpscale.train.rundir.default_out_dir)"
        )
    return Path(config.run.out_dir)


def claim_new_run(config: Config) -> NewRun | None:
    """Create and lock ``config.run.out_dir`` for a new run (rank 0; other ranks get None).

    Raises:
        ConfigError: the directory holds a checkpointed run, or another process trains in it.
    """
    run_dir = run_dir_of(config)
    return on_main(init_distributed(config.run.device), lambda: open_new_run(run_dir))


def write_claim(claim: NewRun | None, config: Config, dist: Distributed) -> None:
    """Write a new run's config.yaml into its claimed directory (rank 0, which holds the claim;
    a failure raised on every rank)."""
    on_main(dist, lambda: claim.claim(config) if claim is not None else None)


def cleared_note(claim: NewRun | None) -> str | None:
    """The report line for files a run that stopped before its first checkpoint left, or None."""
    if claim is None or not claim.cleared:
        return None
    return f"{claim.run_dir} held a run that stopped before its first checkpoint: cleared its {', '.join(claim.cleared)} and started again"


def read_saved_run(run_dir: str | Path) -> tuple[Config, dict[str, Any]]:
    """The run in ``run_dir`` at its checkpoint, read-only: its config and checkpoint state.

    Raises:
        ConfigError: an audit run, or config.yaml edited since the checkpoint.
    """
    refuse_audit_run(run_dir)
    config, state = read_run(run_dir)
    check_config_edits(Path(run_dir), state["config"], config, (), int(state["step"]))
    return config, state


def saved_parts(state: dict[str, Any] | None) -> tuple[DPPlan | None, dict[str, Any] | None]:
    """A checkpoint's DP plan and feature normaliser, which a Trainer is built from (None, None: no
    checkpoint). A state without its released statistics is refused later: drawing them again would
    be a second release."""
    if state is None:
        return None, None
    return DPPlan(**state["mechanism"]["plan"]), state.get("feature_norm")


@dataclass
class Resumption:
    """A run directory opened to continue its run.

    Attributes:
        config: the run's config with the ``--set`` overrides applied.
        lock, held: the directory's lock, held (``held``) by rank 0 until the run returns.
        latest: the newest intact checkpoint (its state None when the run stopped before one).
        changes: setting -> (old, new) for the overrides that change the checkpoint's config.
    """

    config: Config
    lock: RunLock
    held: bool
    latest: LatestCheckpoint
    changes: dict[str, tuple[Any, Any]]


def open_to_resume(run_dir: Path, overrides: Sequence[str]) -> Resumption:
    """Lock ``run_dir`` (rank 0), choose its newest intact checkpoint and check config.yaml's
    edits against it (refused unless asked for with ``overrides``); the lock is released again
    when anything here fails.

    Raises:
        ConfigError: an audit run, another process training in it, a refused edit.
    """
    refuse_audit_run(run_dir)
    config = read_run_config(run_dir, overrides)
    dist = init_distributed(config.run.device)
    lock = RunLock(run_dir)
    on_main(dist, lock.acquire)
    try:
        latest = latest_checkpoint(run_dir)
        changes = {}
        if latest.state is not None:
            changes = check_config_edits(
                run_dir, latest.state["config"], config, overrides, int(latest.state["step"])
            )
    except BaseException:
        lock.release()
        raise
    return Resumption(config, lock, dist.is_main, latest, changes)


def change_record(step: int, changes: dict[str, tuple[Any, Any]]) -> tuple[dict[str, Any], str]:
    """The run's record of the changes asked for on resume at ``step``, and the line announcing them."""
    record = {
        "step": step,
        "changes": {k: {"from": old, "to": new} for k, (old, new) in changes.items()},
    }
    listed = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())
    return record, f"changed on resume at step {step} (recorded in the run): {listed}"


def on_main(dist: Distributed, action: Callable[[], T]) -> T | None:
    """``action()`` on rank 0, its failure raised on every rank (each would otherwise wait for
    the failed one); other ranks get None."""
    result, error = None, None
    if dist.is_main:
        try:
            result = action()
        except (ConfigError, OSError) as err:
            if not dist.enabled:
                raise
            error = str(err)
    error = dist.broadcast_object(error) if dist.enabled else error
    if error:
        raise ConfigError(error)
    return result


@contextlib.contextmanager
def undone_on_failure(undo: Callable[[], None] | None) -> Iterator[None]:
    """The block, and when it raises, ``undo`` before the error goes on: a new run's claim abandoned
    (``NewRun.abandon``) or a resumed run's lock released, so a start that fails leaves nothing behind."""
    try:
        yield
    except BaseException:
        if undo is not None:
            undo()
        raise


def refuse_audit_run(run_dir: str | Path) -> None:
    """Refuse a ``dpscale audit`` run (its training set holds canaries its config does not describe)."""
    if is_audit_run(run_dir):
        raise ConfigError(
            f"{run_dir} is a `dpscale audit` run: its training set holds canaries its config does not describe, "
            "so it cannot be resumed or evaluated; run `dpscale audit` again"
        )

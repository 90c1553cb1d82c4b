"""Starting, continuing and reading a Trainer's run directory: the directory's lock, a new
run's claim, the newest intact checkpoint, config edits checked (``Trainer.create``,
``Trainer.resume`` and ``Trainer.load`` are these)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from dpscale.config import Config, save_config
from dpscale.errors import ConfigError
from dpscale.privacy.plan import DPPlan
from dpscale.runs import CONFIG_NAME, is_audit_run, latest_checkpoint, read_run, read_run_config
from dpscale.train.distributed import Distributed, init_distributed
from dpscale.train.hooks import RunHooks
from dpscale.train.rundir import RunLock, check_config_edits, open_new_run

if TYPE_CHECKING:  # the loop imports this module: a type for checkers only, no import circle at run time
    from dpscale.train.loop import Trainer

T = TypeVar("T")


def start(cls: type, config: Config, progress: bool, hooks: RunHooks | None, report: bool | None) -> Trainer:
    """``Trainer.create``: a new run in ``config.run.out_dir``, its directory locked until ``run`` returns."""
    dist = init_distributed(config.run.device)
    claim = on_main(dist, lambda: open_new_run(config.run.out_dir))
    try:
        trainer = cls(config, progress, hooks=hooks, report=report)
        if claim is not None and claim.cleared:
            trainer.log(f"{trainer.run_dir} held a run that stopped before its first checkpoint: cleared its "
                        f"{', '.join(claim.cleared)} and started again")  # fmt: skip
        on_main(dist, lambda: claim.claim(config))
    except BaseException:
        if claim is not None:
            claim.abandon()
        raise
    trainer.hold(claim.lock if claim is not None else None)
    return trainer


def load(cls: type, run_dir: str | Path, progress: bool) -> Trainer:
    """``Trainer.load``: the run at its checkpoint, read-only (nothing in the directory changes)."""
    refuse_audit_run(run_dir)
    config, state = read_run(run_dir)
    check_config_edits(Path(run_dir), state["config"], config, (), int(state["step"]))
    return _from_checkpoint(cls, config, state, progress, None)


def resume(cls: type, run_dir: str | Path, progress: bool, overrides: Sequence[str], report: bool | None) -> Trainer:
    """``Trainer.resume``: the run in ``run_dir`` continued from its newest intact checkpoint."""
    run_dir = Path(run_dir)
    refuse_audit_run(run_dir)
    config = read_run_config(run_dir, overrides)
    dist = init_distributed(config.run.device)
    lock = RunLock(run_dir)
    on_main(dist, lock.acquire)
    try:
        trainer = _continue(cls, run_dir, config, progress, overrides, report)
    except BaseException:
        lock.release()
        raise
    trainer.hold(lock if dist.is_main else None)  # rank 0 holds it for the job
    return trainer


def _from_checkpoint(cls: type, config: Config, state: dict[str, Any], progress: bool, report: bool | None) -> Trainer:
    saved_plan = DPPlan(**state["mechanism"]["plan"])
    # a state without its released statistics is refused (drawing them again would be a second release)
    trainer = cls(config, progress, plan=saved_plan, feature_norm=state.get("feature_norm"), report=report)
    trainer.load_state(state)
    return trainer


def _continue(cls: type, run_dir: Path, config: Config, progress: bool, overrides: Sequence[str], report: bool | None) -> Trainer:
    """``resume`` under the lock: the newest intact checkpoint loaded, config edits checked."""
    latest = latest_checkpoint(run_dir)
    if latest.state is None:  # stopped before its first checkpoint: starts again from step 0
        trainer = cls(config, progress, report=report)
        trainer.log(latest.note)
        if trainer.dist.is_main:
            trainer.metrics.truncate_after(0)
            if overrides:
                save_config(config, run_dir / CONFIG_NAME)
        return trainer
    state = latest.state
    changes = check_config_edits(run_dir, state["config"], config, overrides, int(state["step"]))
    trainer = _from_checkpoint(cls, config, state, progress, report)
    if latest.note:
        trainer.announce(latest.note)
    trainer.damaged_checkpoint = latest.damaged
    if trainer.dist.is_main:
        trainer.metrics.truncate_after(trainer.step)
    if changes:
        record_config_changes(trainer, changes)
    return trainer


def record_config_changes(trainer: Trainer, changes: dict[str, tuple[Any, Any]]) -> None:
    """Keep the changes asked for on resume in the run: in the checkpoint (written now, so
    the next resume compares against the new values), config.yaml and the summary."""
    record = {"step": trainer.step, "changes": {k: {"from": old, "to": new} for k, (old, new) in changes.items()}}
    trainer.config_changes.append(record)
    listed = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())
    trainer.announce(f"changed on resume at step {trainer.step} (recorded in the run): {listed}")
    trainer.save()
    if trainer.dist.is_main:
        save_config(trainer.config, trainer.run_dir / CONFIG_NAME)


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


def refuse_audit_run(run_dir: str | Path) -> None:
    if is_audit_run(run_dir):
        raise ConfigError(
            f"{run_dir} is a `dpscale audit` run: its training set holds canaries its config does not describe, "
            "so it cannot be resumed or evaluated; run `dpscale audit` again"
        )

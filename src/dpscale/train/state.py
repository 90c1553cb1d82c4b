"""The Trainer's checkpoint (layout: ``dpscale.checkpoint_format``): what a run saves, and how a
new Trainer takes it back. The DP mechanism writes and reads its own part (plan, sampler,
noise, accountant, steps) through ``DPMechanism.state_dict``; this module adds the loop's."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from dpscale._io import CHECKPOINT_NAME, save_checkpoint
from dpscale.config import TrainConfig
from dpscale.errors import ConfigError
from dpscale.train.build import Run
from dpscale.train.distributed import NOISE_RANK, Distributed, rank_stream_seed
from dpscale.runs import DAMAGED_CHECKPOINT_NAME
from dpscale.train.progress import Progress

FRESH_NOISE_ON_RESUME = (
    "run.seed is null: the noise continues from fresh OS entropy, so no two continuations of this checkpoint share "
    "noise (release one; releasing two continuations of one checkpoint composes both)"
)
FRESH_CORRELATED_NOISE_ON_RESUME = " BandMF's noise recursion restarts too (the checkpoint holds no past noise): the same epsilon, a little more error"


def training_state(
    built: Run, progress: Progress, *, rank_streams: dict[str, Any], window: dict[str, Any]
) -> dict[str, Any]:
    """The checkpoint. Collective with P processes: gathers every rank's sampling streams.

    Args:
        built, progress: the run and where it stands.
        rank_streams: this rank's streams before the next step's draw ("sampler": the sampler's
            state, "augment_generator": the augmentation generator's).
        window: the train-loss window since the last evaluation (loss sum, examples, non-finite examples).
    """
    streams = built.dist.all_gather_object(rank_streams)
    # before the next draw
    mechanism = {**built.mechanism.state_dict(), "sampler": streams[0]["sampler"]}
    return {
        "step": progress.step,
        "wall_time_s": progress.wall_time_s,
        "world_size": built.dist.world_size,
        "mechanism": mechanism,
        "rank_streams": streams,  # [rank 0's, rank 1's, ...]
        "fresh_streams": False,
        "model": built.model.state_dict(),
        "optimizer": built.optimizer.state_dict(),
        "scheduler": built.scheduler.state_dict(),
        "ema": built.ema.state_dict() if built.ema else None,
        "window": window,
        "augtest_seed": progress.augtest_seed,
        "data_fingerprint": built.data_fingerprint,
        "feature_norm": built.feature_normalizer.state_dict(),
        "model_init": built.init_report,
        "config": built.config.to_dict(),  # a resume refuses config.yaml edited since (unless --set)
        "config_changes": progress.config_changes,
    }


def restore(built: Run, state: dict[str, Any]) -> tuple[Progress, list[str]]:
    """Continue ``built`` (new, not stepped) from a checkpoint's ``state`` (current layout): the
    model, mechanism, optimizer, scheduler and EMA take the saved states.

    Returns:
        where the run stands, and the notes to report (fresh noise on resume).

    Raises:
        ConfigError: other training data, a checkpoint that does not fit the run or is inconsistent.
    """
    if state["data_fingerprint"] != built.data_fingerprint:
        raise ConfigError(
            f"the training data at data.root={built.config.data.root!r} differs from the data this run was trained on; refusing to resume"
        )
    # first: the mechanism's state is tied to these weights
    built.model.load_state_dict(state["model"])
    try:
        # plan checked, accountant replaced, never added
        built.mechanism.load_state_dict(state["mechanism"])
    except ValueError as err:
        raise ConfigError(f"the checkpoint does not fit this run: {err}") from err
    built.plan = built.mechanism.plan  # the steps taken keep their caveats (a seed, checks off)
    built.init_report = state["model_init"]
    built.optimizer.load_state_dict(state["optimizer"])
    built.scheduler.load_state_dict(state["scheduler"])
    if built.ema is not None:
        if state["ema"] is None:
            raise ConfigError("train.ema_decay is set but the checkpoint has no EMA of the weights")
        built.ema.load_state_dict(state["ema"])
    progress = Progress(
        step=int(state["step"]),
        wall_time_s=float(state["wall_time_s"]),
        # absent in checkpoints from before augmentation existed
        augtest_seed=int(state["augtest_seed"])
        if state["augtest_seed"] is not None
        else built.seeds["augtest"],
        config_changes=list(state["config_changes"]),
    )
    _check_accounting(built, progress.step)
    notes = []
    if not built.plan.seeded and built.plan.is_private:
        notes.append(
            FRESH_NOISE_ON_RESUME
            + (FRESH_CORRELATED_NOISE_ON_RESUME if built.plan.bands > 1 else "")
        )
    return progress, notes


def _check_accounting(built: Run, step: int) -> None:
    plan, accountant = built.plan, built.mechanism.accountant
    if plan.is_private and accountant.steps != plan.compositions(step):
        raise ConfigError(
            f"checkpoint is inconsistent: step {step} needs {plan.compositions(step)} accounted composition(s), it holds {accountant.steps}"
        )
    if accountant.releases != plan.releases:
        raise ConfigError(
            "checkpoint is inconsistent: its accountant's releases differ from the DP plan's"
        )


def saved_rank_streams(
    state: dict[str, Any], dist: Distributed
) -> tuple[dict[str, Any] | None, str | None]:
    """This rank's sampling streams to continue from a checkpoint's ``state``, or why fresh ones
    start at its step: with a different number of processes than the checkpoint's, or generator
    states it cannot continue (32-bit torch states, from before the 128-bit DP RNG). Fresh streams
    never replay used ones: had a run resumed from this checkpoint been abandoned, the same noise
    on other batches would otherwise cancel out between the two.

    Returns:
        (this rank's saved streams, None), or (None, the note to report) when fresh ones start.
    """
    step, saved_world = int(state["step"]), int(state["world_size"])
    # seeds: fresh OS entropy without run.seed, else derived from it and the step
    if state["fresh_streams"]:
        return None, (
            f"the checkpoint's noise and sampling generators are 32-bit-seeded torch states (written "
            f"before the 128-bit DP RNG): continuing with fresh 128-bit streams from step {step} on"
        )
    if saved_world != dist.world_size:
        return None, (
            f"resuming a {saved_world}-process run with {dist.world_size} process(es): each rank "
            f"samples its shard from a fresh stream from step {step} on"
        )
    return state["rank_streams"][dist.rank], None


def fresh_noise_seed(seeds: dict[str, int], world_size: int, step: int) -> int:
    """The noise rank's seed for streams restarted at ``step`` (see ``saved_rank_streams``)."""
    return rank_stream_seed(seeds["noise"], NOISE_RANK, world_size, step)


class RunCheckpoints:
    """The checkpoints of the run in ``run_dir`` as the loop writes them: when the last was written,
    its step, and a damaged newest one to set aside at the next save.

    Attributes:
        saved_at: ``time.perf_counter()`` when the last checkpoint was written (or the session began).
        step: the step of the last checkpoint this process wrote or read (None: none).
        damaged: a damaged newest checkpoint a resume fell back from, set aside at the next save.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.saved_at = time.perf_counter()
        self.step: int | None = None
        self.damaged: Path | None = None

    def due(self, train: TrainConfig, step: int, dist: Distributed) -> bool:
        """Whether a checkpoint is due after ``step``: every ``train.checkpoint_every_steps`` steps,
        and once ``train.checkpoint_every_minutes`` have passed since the last checkpoint (agreed by
        all ranks: saving is collective)."""
        every = train.checkpoint_every_steps
        if every and step % every == 0:
            return True
        minutes = train.checkpoint_every_minutes
        if minutes is None:
            return False
        return dist.any(time.perf_counter() - self.saved_at >= 60.0 * minutes)

    def write(self, saved: dict[str, Any], step: int, is_main: bool) -> None:
        """``saved`` (``training_state``'s) as the checkpoint of ``step``, written by rank 0
        (``is_main``) and recorded by every rank (see ``write_checkpoint``).

        Raises:
            OSError: the checkpoint could not be written, saying which one is intact.
        """
        if is_main:
            write_checkpoint(self.run_dir, saved, damaged=self.damaged, intact_step=self.step)
            self.damaged = None
        self.step = step
        self.saved_at = time.perf_counter()


def write_checkpoint(
    run_dir: Path, saved: dict[str, Any], *, damaged: Path | None, intact_step: int | None
) -> None:
    """Write ``saved`` as ``run_dir``'s checkpoint (atomic; the one before kept as the previous).

    Args:
        damaged: a damaged newest checkpoint a resume set aside: moved out of the way first, so a
            damaged file is never kept as the previous checkpoint.
        intact_step: the step of the last checkpoint written or read (None: none), for the error.

    Raises:
        OSError: the checkpoint could not be written (e.g. a full disk), saying which one is intact.
    """
    path = run_dir / CHECKPOINT_NAME
    if damaged is not None:
        os.replace(damaged, run_dir / DAMAGED_CHECKPOINT_NAME)
    try:
        save_checkpoint(path, saved)
    except OSError as err:
        kept = (
            "no earlier checkpoint"
            if intact_step is None
            else f"the checkpoint of step {intact_step} is intact"
        )
        raise OSError(
            f"cannot write {path} at step {saved['step']}: {err.strerror or err}; {kept}"
        ) from err

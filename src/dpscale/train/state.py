"""The Trainer's checkpoint (layout: ``dpscale.checkpoint_format``): what a run saves, and how a
new Trainer takes it back. The DP mechanism writes and reads its own part (plan, sampler,
noise, accountant, steps) through ``DPMechanism.state_dict``; this module adds the loop's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dpscale.errors import ConfigError
from dpscale.train.distributed import NOISE_RANK, rank_stream_seed

if TYPE_CHECKING:  # the loop imports this module: a type for checkers only, no import circle at run time
    from dpscale.train.loop import Trainer

FRESH_NOISE_ON_RESUME = (
    "run.seed is null: the noise continues from fresh OS entropy, so no two continuations of this checkpoint share "
    "noise (release one; releasing two continuations of one checkpoint composes both)"
)
FRESH_CORRELATED_NOISE_ON_RESUME = (
    " BandMF's noise recursion restarts too (the checkpoint holds no past noise): the same epsilon, a little more error"
)


def training_state(trainer: Trainer) -> dict[str, Any]:
    """The checkpoint. Collective with P processes: gathers every rank's sampling streams."""
    built = trainer.built
    streams = built.dist.all_gather_object({"sampler": trainer.sampler_state(), "augment_generator": trainer.augment_generator.get_state()})
    mechanism = {**built.mechanism.state_dict(), "sampler": streams[0]["sampler"]}  # before the next draw
    return {
        "step": trainer.step,
        "wall_time_s": trainer.wall_time_s,
        "world_size": built.dist.world_size,
        "mechanism": mechanism,
        "rank_streams": streams,  # [rank 0's, rank 1's, ...]
        "fresh_streams": False,
        "model": built.model.state_dict(),
        "optimizer": built.optimizer.state_dict(),
        "scheduler": built.scheduler.state_dict(),
        "ema": built.ema.state_dict() if built.ema else None,
        "window": trainer.window_as_dict(),
        "augtest_seed": trainer.augtest_seed,
        "data_fingerprint": built.data_fingerprint,
        "feature_norm": built.feature_normalizer.state_dict(),
        "model_init": built.init_report,
        "config": built.config.to_dict(),  # a resume refuses config.yaml edited since (unless --set)
        "config_changes": trainer.config_changes,
    }


def restore(trainer: Trainer, state: dict[str, Any]) -> None:
    """Continue ``trainer`` (new, not stepped) from a checkpoint's ``state`` (current layout)."""
    built = trainer.built
    if state["data_fingerprint"] != built.data_fingerprint:
        raise ConfigError(
            f"the training data at data.root={built.config.data.root!r} differs from the data this run was trained on; refusing to resume"
        )
    built.model.load_state_dict(state["model"])  # first: the mechanism's state is tied to these weights
    try:
        built.mechanism.load_state_dict(state["mechanism"])  # plan checked, accountant replaced, never added
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
    trainer.step = int(state["step"])
    trainer.wall_time_s = float(state["wall_time_s"])
    trainer.config_changes = list(state["config_changes"])
    trainer.load_window(state["window"])
    if state["augtest_seed"] is not None:  # absent in checkpoints from before augmentation existed
        trainer.augtest_seed = int(state["augtest_seed"])
    _check_accounting(trainer)
    if not built.plan.seeded and built.plan.is_private:
        trainer.log(FRESH_NOISE_ON_RESUME + (FRESH_CORRELATED_NOISE_ON_RESUME if built.plan.bands > 1 else ""))
    _continue_rank_streams(trainer, state)


def _check_accounting(trainer: Trainer) -> None:
    plan, accountant = trainer.built.plan, trainer.built.mechanism.accountant
    if plan.is_private and accountant.steps != plan.compositions(trainer.step):
        raise ConfigError(
            f"checkpoint is inconsistent: step {trainer.step} needs {plan.compositions(trainer.step)} accounted "
            f"composition(s), it holds {accountant.steps}"
        )
    if accountant.releases != plan.releases:
        raise ConfigError("checkpoint is inconsistent: its accountant's releases differ from the DP plan's")


def _continue_rank_streams(trainer: Trainer, state: dict[str, Any]) -> None:
    """Continue this rank's sampling streams; with a different number of processes than the
    checkpoint's, or generator states it cannot continue (32-bit torch states, from before
    the 128-bit DP RNG), start fresh sampling and noise streams at the checkpoint's step (never
    replaying used ones: had a run resumed from this checkpoint been abandoned, the same noise
    on other batches would otherwise cancel out between the two)."""
    dist, step = trainer.built.dist, int(state["step"])
    saved_world = int(state["world_size"])
    if state["fresh_streams"] or saved_world != dist.world_size:
        trainer.start_rank_streams(step)
        if state["fresh_streams"]:  # seeds: fresh OS entropy without run.seed, else derived from it and the step
            trainer.log(
                f"the checkpoint's noise and sampling generators are 32-bit-seeded torch states (written "
                f"before the 128-bit DP RNG): continuing with fresh 128-bit streams from step {step} on"
            )
        else:
            trainer.log(
                f"resuming a {saved_world}-process run with {dist.world_size} process(es): each rank "
                f"samples its shard from a fresh stream from step {step} on"
            )
        return
    mine = state["rank_streams"][dist.rank]
    trainer.built.mechanism.sampler.load_state_dict(mine["sampler"])
    if mine.get("augment_generator") is not None:
        trainer.augment_generator.set_state(mine["augment_generator"])


def fresh_noise_seed(trainer: Trainer, step: int) -> int:
    """The noise rank's seed for streams restarted at ``step`` (see ``_continue_rank_streams``)."""
    dist = trainer.built.dist
    return rank_stream_seed(trainer.built.seeds["noise"], NOISE_RANK, dist.world_size, step)


def window_tensor(window: dict[str, Any], device: torch.device) -> torch.Tensor:
    """The train-loss window (loss sum, examples, non-finite examples) as a float64 tensor."""
    values = [float(window["loss_sum"]), float(window["examples"]), float(window["nonfinite_examples"])]
    return torch.tensor(values, dtype=torch.float64, device=device)

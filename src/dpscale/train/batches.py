"""The logical batches a run trains on, as physical chunks on the device: drawn through the DP
mechanism (data in memory) or read ahead by the stream's workers (data.loader=stream), each
example as K augmented views, a user's examples together at the user unit."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from dpscale.data.run_data import data_workers
from dpscale.data.stream import StreamFeed
from dpscale.train.build import Run
from dpscale.train.distributed import rank_stream_seed
from dpscale.train.state import fresh_noise_seed, saved_rank_streams
from dpscale.train.step import physical_chunks
from dpscale.train.units import chunk_size_for, streamed_chunks, user_step_chunks
from dpscale.train.step import AugmentViews


class TrainBatches:
    """This rank's source of training batches from ``start_step`` on.

    Args:
        built: the run (data, mechanism, device, seeds).
        start_step: the step this source starts at (its augmentation stream is derived from it).

    Attributes:
        augment_generator: the CPU generator of the augmentations (not privacy-relevant).
        feed: the stream's read-ahead (data.loader=stream), started at the first step; else None.
    """

    def __init__(self, built: Run, start_step: int) -> None:
        self.built = built
        rank, world = built.dist.rank, built.dist.world_size
        augment_seed = rank_stream_seed(built.seeds["augment"], rank, world, start_step)
        # torch takes 64 bits
        self.augment_generator = torch.Generator().manual_seed(augment_seed % 2**64)
        self.feed: StreamFeed | None = None

    def chunks(self, step: int) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        """The batch of ``step`` (0-based) as physical chunks on the device: drawn now from the
        mechanism (in memory), or the stream's read-ahead (its sampler is the mechanism's)."""
        built, config = self.built, self.built.config
        mechanism, data, device, augment = built.mechanism, built.data, built.device, config.augment
        views = AugmentViews(
            augment.type,
            augment.multiplicity,
            self.augment_generator,
            built.value_range,
            augment.padding,
        )
        plan, physical = mechanism.plan, built.physical_batch_size
        # examples (users) per chunk
        chunk_size = chunk_size_for(plan, physical, augment.multiplicity)
        if not built.streamed:
            drawn = mechanism.draw_batch()
            if plan.user_level:
                return user_step_chunks(drawn, data, plan, physical, views)
            indices = drawn.indices
            if device.type == "cuda":  # pinned, so the copy does not wait for the device's queue
                indices = indices.pin_memory().to(device, non_blocking=True)
            return views.chunks(physical_chunks(data.x_train, data.y_train, indices, chunk_size))
        if self.feed is None:
            self.feed = StreamFeed(
                data,
                mechanism.sampler,
                chunk_size=chunk_size,
                start_step=step,
                total_steps=built.total_steps,
                device=device,
                workers=data_workers(config),
                prefetch=config.data.prefetch,
            )
        return streamed_chunks(self.feed.chunks(step), plan, views)

    def waited_s(self) -> float:
        """Time this source's stream has waited for chunks so far (s; 0 in memory)."""
        return self.feed.wait_s if self.feed is not None else 0.0

    def stop(self, step: int) -> float:
        """Stop the stream's workers now (left to the garbage collector, each takes seconds to
        shut down) and put the sampler back before ``step``'s draw.

        Returns:
            the time the stream waited for chunks (s), to add to the session's.
        """
        waited = self.waited_s()
        if self.feed is not None:
            self.feed.close(step)
            self.feed = None
        return waited

    def state(self, step: int) -> dict[str, Any]:
        """This rank's streams before ``step``'s draw (a stream draws batches ahead)."""
        sampler = (
            self.feed.sampler_state(step)
            if self.feed is not None
            else self.built.mechanism.sampler.state_dict()
        )
        return {"sampler": sampler, "augment_generator": self.augment_generator.get_state()}

    def load_state(self, saved: dict[str, Any]) -> None:
        """Continue this rank's saved streams (``state``'s)."""
        self.built.mechanism.sampler.load_state_dict(saved["sampler"])
        if saved.get("augment_generator") is not None:
            self.augment_generator.set_state(saved["augment_generator"])


def restarted_streams(built: Run, start_step: int) -> TrainBatches:
    """Fresh sampling, noise and augmentation streams for this rank, for a job of P processes
    that restarts at ``start_step`` with a different P or from streams it cannot continue
    (``state.saved_rank_streams``): derived from the run's seeds and the step, never the ones
    used before.

    Returns:
        the rank's batches from ``start_step`` on (the mechanism's sampler and noise restarted).
    """
    rank, world, seeds = built.dist.rank, built.dist.world_size, built.seeds
    built.mechanism.restart_streams(
        sampler_seed=rank_stream_seed(seeds["sampler"], rank, world, start_step),
        noise_seed=fresh_noise_seed(seeds, world, start_step),
    )
    return TrainBatches(built, start_step)


def continued_batches(
    batches: TrainBatches, built: Run, saved: dict[str, Any], step: int, log: Callable[[str], Any]
) -> TrainBatches:
    """This rank's batches from a checkpoint: ``batches`` continuing its saved streams, or fresh
    ones (``restarted_streams``, the reason logged) where they cannot continue
    (``state.saved_rank_streams``).

    Args:
        batches: this rank's batches as built; built: the run.
        saved: the checkpoint's state; step: its step (where fresh streams start).
        log: prints a line of the run's report.
    """
    mine, restart_note = saved_rank_streams(saved, built.dist)
    if mine is None:  # fresh sampling, noise and augmentation streams, never the ones used before
        batches = restarted_streams(built, step)
        log(restart_note or "")
    else:
        batches.load_state(mine)
    return batches

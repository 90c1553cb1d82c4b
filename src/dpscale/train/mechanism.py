"""One DP-SGD mechanism for any training loop: ``dpscale.make_private``.

A :class:`DPMechanism` owns everything that must stay in step for the guarantee to hold: the
frozen plan (q, sigma, C, steps, delta), the per-example clipping engine, the Poisson sampler and
the noise generator (128-bit seeded), and the accountant. A loop asks it which examples form the
next logical batch, hands it those examples, and it clips, adds the noise once, divides by the
expected batch size, steps the optimizer and accounts, refusing to go past the planned steps::

    mechanism = dpscale.make_private(model, optimizer, dataset_size=len(ds), batch_size=256,
                                     max_grad_norm=1.0, target_epsilon=3.0, delta=1e-5, epochs=10)
    for indices in mechanism.batches():
        x, y = gather(ds, indices)
        stats = mechanism.step(x, y)
    print(mechanism.epsilon())

The Trainer takes its steps through the same object. What the mechanism keeps in step, and its
checkpoint, is its base :class:`~dpscale.train.mechanism_state.MechanismState`; this module takes the
steps and checks a user's loop against the draw.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, cast

import torch

from dpscale.cpu_memory import bound_kept_memory
from dpscale.data.user_ids import user_slices
from dpscale.privacy.clipping.adaptive import (
    AdaptiveClipping,
    next_clip,
    noisy_unclipped_fraction,
    normalised_update,
)
from dpscale.privacy.clipping.independence import MIN_EXAMPLES
from dpscale.privacy.clipping.per_example import Batch
from dpscale.privacy.noise.gaussian import Params
from dpscale.privacy.sampling.units import UnitBatch
from dpscale.train.guards import (
    FirstChunkCheck,
    check_optimizer_covers_trainable,
    independence_check,
    model_digest,
)
from dpscale.train.mechanism_state import MechanismState
from dpscale.train.step import StepStats, apply_gradient, noisy_clipped_mean, padded_chunks
from dpscale.train.units import (
    DrawnChunks,
    check_gathered,
    rows_per_user,
    user_step_chunks_of,
    users_per_chunk,
)


class PrivacyBudgetExhausted(RuntimeError):
    """A step was asked for after the planned number of steps (the budget is spent)."""


class DPMechanism(MechanismState):
    """The DP-SGD mechanism of one training run (build it with :func:`make_private`).

    Attributes:
        plan: the frozen DP plan (q, sigma, C, steps, delta, accountant).
        engine: the per-example clipping engine.
        sampler: the logical-batch sampler (Poisson: what the accountant assumes).
        noise_generator: the 128-bit generator of the Gaussian noise.
        accountant: the privacy accountant (one entry per step taken).
        steps_taken: logical steps taken so far.
    """

    # ----------------------------------------------------------------- batches
    def sample(self) -> torch.Tensor:
        """The next logical batch's example indices (int64, possibly empty): sorted, or at the user
        unit each drawn user's contributed examples consecutive."""
        self._check_budget()
        if self._drawn is not None:
            raise RuntimeError(
                "a drawn batch is waiting for its step: take mechanism.step(...) on it before drawing again "
                "(choosing among several draws would change the sampling the epsilon describes)"
            )
        self._drawn_batch = self.draw_batch()
        self._drawn = int(self._drawn_batch.indices.numel())
        return self._drawn_batch.indices

    def draw_batch(self) -> UnitBatch:
        """The next logical batch's indices and units (at the user unit, each drawn user's
        boundaries) for a loop that steps it with ``step_drawn_chunks``; ``sample()`` draws
        through this and records the draw for ``step`` to check."""
        self._check_budget()
        if self.plan.user_level:
            return self.sampler.sample_units()
        indices = self.sampler.sample()
        return UnitBatch(indices, torch.arange(len(indices) + 1))

    def batches(self) -> Iterator[torch.Tensor]:
        """The example indices of every remaining logical batch, one step at a time (draw a
        batch, take its step, then draw the next)."""
        while self.remaining_steps() > 0:
            expected = self.steps_taken
            yield self.sample()
            if self.steps_taken != expected + 1:
                raise RuntimeError(
                    "call mechanism.step(...) once for each batch that batches() yields"
                )

    def data_loader(
        self, dataset: torch.utils.data.Dataset, **loader_options: Any
    ) -> Iterator[list[Batch]]:
        """For a map-style dataset returning (x, y): each remaining logical batch as a list of
        physical chunks of at most ``max_physical_batch_size`` examples, read by a DataLoader
        (``loader_options`` such as num_workers are passed on)."""
        chunk = self.max_physical_batch_size or int(math.ceil(self.plan.batch_size * 2))
        for indices in self.batches():
            if self.plan.user_level:  # whole users per chunk
                per_chunk = users_per_chunk(chunk, rows_per_user(self.plan), 1, 0)
                parts = [
                    indices[a:b].tolist()
                    for a, b, _ in user_slices(self._drawn_units().offsets, per_chunk)
                ]
            else:
                parts = [p.tolist() for p in indices.split(chunk)]
            loader = torch.utils.data.DataLoader(dataset, batch_sampler=parts, **loader_options)
            yield DrawnChunks(loader, indices)

    # -------------------------------------------------------------------- step
    def step(
        self,
        inputs: torch.Tensor | Iterable[Batch],
        targets: torch.Tensor | None = None,
        *,
        indices: torch.Tensor | None = None,
    ) -> StepStats:
        """One private step on the logical batch that ``batches()``/``sample()`` drew.

        Args:
            inputs, targets: the batch's examples, or ``inputs`` = an iterable of (x, y) physical
                chunks (for a logical batch larger than memory) and no ``targets``.
            indices: the dataset indices the examples were gathered from, in their order (any
                order of the drawn ones for tensors; the drawn order for chunks; ``data_loader``'s
                chunks carry them). Required at the user unit, where a user's examples are clipped
                together; checked against the draw when given.

        Returns:
            the step's statistics (on the device; reading them waits for it).
        """
        self._check_budget()
        drawn = self._drawn_units()
        if targets is not None:
            self._check_size(len(targets))  # before anything is computed
        # data_loader's chunks carry their indices
        if indices is None and isinstance(inputs, DrawnChunks):
            indices = inputs.indices
        chunks: Iterable[Batch]
        if self.plan.user_level:  # whole users per chunk, each user's examples together
            chunks = user_step_chunks_of(
                inputs,
                targets,
                indices,
                drawn,
                rows_per_user(self.plan),
                self.views,
                self.max_physical_batch_size,
            )
        elif targets is not None:  # then inputs is the batch's tensor
            check_gathered(indices, drawn.indices, chunks=False)
            size = self.max_physical_batch_size or max(1, len(targets))
            # views: no copy of the batch
            chunks = zip(cast(torch.Tensor, inputs).split(size), targets.split(size))
        else:
            check_gathered(indices, drawn.indices, chunks=True)
            chunks = cast(Iterable[Batch], inputs)
        # users: cut_at_users counts
        stats = self.step_drawn_chunks(chunks, check_drawn=not self.plan.user_level)
        self._drawn, self._drawn_batch = None, None
        return stats

    def _drawn_units(self) -> UnitBatch:
        """The batch ``sample()`` drew for the coming ``step``; refused when none was drawn."""
        if self._drawn_batch is None:
            raise RuntimeError(
                "mechanism.step(...) takes the logical batch that mechanism.batches()/sample() drew (Poisson "
                "sampling, which the epsilon describes), and none was drawn: iterate `for indices in "
                "mechanism.batches()` and pass those examples, or use mechanism.data_loader(dataset)"
            )
        return self._drawn_batch

    def _check_size(self, examples: int) -> None:
        if examples != self._drawn:
            raise ValueError(
                f"this step got {examples} examples but the drawn logical batch has {self._drawn}: pass exactly the "
                "examples of the indices that mechanism.batches()/sample() gave (a batch from your own DataLoader "
                "is not the Poisson sample the epsilon describes); nothing was released"
            )

    def step_drawn_chunks(
        self,
        chunks: Iterable[Batch],
        *,
        all_reduce_sum: Callable | None = None,
        add_noise: bool = True,
        check_drawn: bool = False,
    ) -> StepStats:
        """``step`` for physical chunks, with the data-parallel hooks: the seam to a loop that draws
        with ``draw_batch`` (or a stream's read-ahead from ``sampler``) itself (the Trainer, the
        step-time bench) and so vouches for ``chunks``; users call ``step``, which checks them.

        Args:
            chunks: the logical batch as physical (x, y) chunks.
            all_reduce_sum, add_noise: data-parallel hooks (see ``noisy_clipped_mean``).
            check_drawn: refuse, before anything is released, chunks whose examples do not add
                up to the batch ``sample()`` drew (``step``'s own check).
        """
        self._check_budget()
        check_optimizer_covers_trainable(self.model, self.optimizer, self.plan.max_grad_norm)
        history = self.correlated_noise.snapshot() if self.correlated_noise is not None else None
        gradient, stats = self._noisy_clipped_mean(chunks, all_reduce_sum, add_noise)
        if check_drawn:  # chunks of unknown size: counted, refused before the release
            try:
                self._check_size(stats.examples)
            except ValueError:
                # BandMF: the recursion untouched
                if self.correlated_noise is not None and history is not None:
                    self.correlated_noise.rewind(history)
                raise
        if self.observer is not None:
            self.observer(gradient)
        adaptive = self.plan.adaptive
        # the step in C_0's units (its scale lr x C_0), the count's release, C_{t+1}
        if adaptive is not None:
            gradient = normalised_update(gradient, self.clip, self.plan.max_grad_norm)  # type: ignore[arg-type]
            self._release_count_and_move_clip(stats, adaptive)
        self._apply_and_account(gradient)
        return stats

    def _noisy_clipped_mean(
        self, chunks: Iterable[Batch], all_reduce_sum: Callable | None, add_noise: bool
    ) -> tuple[Params, StepStats]:
        """The step's release: its chunks through the first-chunk check and padded, then clipped,
        summed, noised once and divided by B (``noisy_clipped_mean``), in the plan's precision."""
        with self.engine.precision.matmul_flags():  # the check and the step in the plan's precision
            # checked as drawn, then padded
            chunks = padded_chunks(self._run_first_chunk_check(chunks), self.pad_rows)
            adaptive = self.plan.adaptive
            engine = self.engine
            if adaptive is not None:
                engine = replace(engine, max_grad_norm=self.clip)  # type: ignore[type-var]
            # adaptive clipping's C is a number (make_dp_plan refuses per-layer bounds with it)
            noise_std = (
                self.plan.noise_std
                if adaptive is None
                else self.plan.gradient_noise_multiplier * cast(float, self.clip)
            )
            gradient, stats = noisy_clipped_mean(
                engine,
                self.model,
                chunks,
                noise_std=noise_std,
                expected_batch_size=self.plan.batch_size,
                noise_generator=self.noise_generator,
                all_reduce_sum=all_reduce_sum,
                add_noise=add_noise,
                correlate=self.correlated_noise.next if self.correlated_noise is not None else None,
            )
        return gradient, stats

    def _apply_and_account(self, gradient: Params) -> None:
        """The released gradient applied by the optimizer (its guard lifted for this step alone), the
        scheduler stepped, the step accounted and counted."""
        self.optimizer._dpscale_in_step = True  # type: ignore[attr-defined]
        try:
            apply_gradient(self.model, gradient, self.optimizer)
        finally:
            self.optimizer._dpscale_in_step = False  # type: ignore[attr-defined]
        if self.scheduler is not None:
            self.scheduler.step()
        if self.plan.is_private and self.steps_taken % self.plan.bands == 0:
            # DP-SGD: one composition per step. BandMF: one per b steps, at p = b*q, counted when
            # its first step runs (an example joins at most one step of each b).
            self.accountant.step(
                sample_rate=self.plan.participation_rate,
                noise_multiplier=self.plan.noise_multiplier,
                batches=self.plan.batch_sampling,
            )
        self.steps_taken += 1
        bound_kept_memory()  # a fragmenting kept heap trimmed (dpscale.cpu_memory: at most 256 MiB over its level)

    def _release_count_and_move_clip(self, stats: StepStats, adaptive: AdaptiveClipping) -> None:
        """Adaptive clipping: the noisy share of unclipped examples of this step (drawn from the
        noise generator after the gradient's noise), and C_{t+1} from it."""
        share = noisy_unclipped_fraction(
            stats.examples - stats.clipped,
            stats.examples,
            generator=self.noise_generator,
            expected_batch_size=self.plan.batch_size,
            count_noise=adaptive.count_noise,
        )
        self.clip = next_clip(cast(float, self.clip), share, adaptive)

    def _run_first_chunk_check(self, chunks: Iterable[Batch]) -> Iterable[Batch]:
        """The first-chunk check on this step's first chunk, if it holds ``MIN_EXAMPLES`` or more
        and more than any chunk checked before (a layer may mix examples only in larger batches);
        it may replace the engine (``engine=auto``) or refuse. (A chunk of one example has nothing
        to mix with.)"""
        if self.first_chunk_check is None:
            return chunks
        chunks = iter(chunks)
        first = next(chunks, None)
        if first is None:
            return chunks
        rows = len(first[1])
        if rows >= MIN_EXAMPLES and rows > self._checked_rows:
            self.engine = self.first_chunk_check(self.engine, self.model, first)
            self._checked_rows = rows
        return itertools.chain([first], chunks)

    def _check_budget(self) -> None:
        if self.steps_taken >= self.plan.steps:
            raise PrivacyBudgetExhausted(
                f"all {self.plan.steps} planned steps are taken (epsilon {self.epsilon():.4g} at delta "
                f"{self.plan.delta:g}); another step would spend more than the plan. Make a new mechanism "
                "with more steps (and a new budget) to train further"
            )


__all__ = [
    "DPMechanism",
    "FirstChunkCheck",
    "PrivacyBudgetExhausted",
    "independence_check",
    "model_digest",
]

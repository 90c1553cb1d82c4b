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

The Trainer takes its steps through the same object.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, replace
from typing import Any, Callable, Iterable, Iterator, cast

import torch
from torch import nn

from dpscale.clip_norms import MaxGradNorm
from dpscale.cpu_memory import bound_kept_memory
from dpscale.privacy.accounting.accountant import PrivacyAccountant
from dpscale.privacy.clipping.autotune import methods_state, pin_methods
from dpscale.privacy.clipping.adaptive import AdaptiveClipping, next_clip, noisy_unclipped_fraction, normalised_update
from dpscale.privacy.clipping.independence import MIN_EXAMPLES
from dpscale.privacy.clipping.per_example import Batch, PerExampleEngine
from dpscale.privacy.plan.dp_plan import LASTING_CAVEATS, DPPlan
from dpscale.privacy.noise.banded import BandedNoise
from dpscale.rng import DPRandom, derive_seed, noise_generator
from dpscale.train.distributed import NOISE_RANK
from dpscale.train.guards import (
    FirstChunkCheck,
    check_optimizer_covers_trainable,
    check_state_fits,
    independence_check,
    model_digest,
    refuse_steps_outside_the_mechanism,
)
from dpscale.train.step import StepStats, apply_gradient, noisy_clipped_mean, padded_chunks
from dpscale.train.units import (
    DrawnChunks, check_chunk_fits, check_gathered, rows_per_user, user_step_chunks_of, users_per_chunk,
)  # fmt: skip
from dpscale.data.user_ids import UserIndex, user_slices
from dpscale.privacy.sampling.units import UnitBatch

PARTITION_KEY = (0x62616E64,)  # spawn key of BandMF's partition seed when none is given (make_private: one process)


class PrivacyBudgetExhausted(RuntimeError):
    """A step was asked for after the planned number of steps (the budget is spent)."""


class DPMechanism:
    """The DP-SGD mechanism of one training run (build it with :func:`make_private`).

    Attributes:
        plan: the frozen DP plan (q, sigma, C, steps, delta, accountant).
        engine: the per-example clipping engine.
        sampler: the logical-batch sampler (Poisson: what the accountant assumes).
        noise_generator: the 128-bit generator of the Gaussian noise.
        accountant: the privacy accountant (one entry per step taken).
        steps_taken: logical steps taken so far.
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, plan: DPPlan, engine: PerExampleEngine, *,
        sampler_seed: int, noise_seed: int, scheduler: Any = None, max_physical_batch_size: int | None = None,
        rank: int = 0, world_size: int = 1, first_chunk_check: FirstChunkCheck | None = None,
        partition_seed: int | None = None, users: UserIndex | None = None, views: int = 1, pad_rows: int | None = None,
    ) -> None:  # fmt: skip
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        refuse_steps_outside_the_mechanism(optimizer)
        self.plan, self.engine = plan, engine
        self.rank, self.world_size = rank, world_size
        # the user unit: the users sampled, and the AugMult views of each example (for user_rows)
        self.users, self.views = users, views
        if plan.user_level:
            check_chunk_fits(max_physical_batch_size, rows_per_user(plan))
        if plan.adaptive is not None and world_size > 1:
            raise ValueError("adaptive clipping runs in one process (its count's noise and C are not shared across ranks yet)")
        self.clip: MaxGradNorm = plan.max_grad_norm  # C_t: fixed, or adaptive clipping's current norm
        self.steps_taken = 0
        # BandMF's b groups, fixed for the whole run (every rank must pass the same seed)
        self.partition_seed = derive_seed(sampler_seed, PARTITION_KEY) if partition_seed is None else partition_seed
        self.restart_streams(sampler_seed=sampler_seed, noise_seed=noise_seed)
        self.correlated_noise = BandedNoise(plan.correlated.coefficients) if plan.correlated is not None else None
        self.accountant = PrivacyAccountant(plan.run_accountant)
        for release in plan.releases:  # one-off releases made before the first step
            self.accountant.record(release)
        self.max_physical_batch_size, self.pad_rows = max_physical_batch_size, pad_rows  # pad_rows: step.pad_rows_for
        # run, in train mode and before anything is released, on the first chunk of >= MIN_EXAMPLES
        # and again on every first chunk larger than any checked before
        self.first_chunk_check = first_chunk_check
        self._checked_rows = 0
        self._drawn: int | None = None  # size of the logical batch sample() drew, until its step
        self._drawn_batch: UnitBatch | None = None  # its indices (and users' boundaries at the user unit)
        # sees each released gradient (noisy sum / B) before the optimizer: an audit's adversary
        self.observer: Callable[[dict[str, torch.Tensor]], None] | None = None

    def restart_streams(self, *, sampler_seed: int, noise_seed: int) -> None:
        """Fresh sampling and noise streams (at the start, or when a run restarts with another
        number of processes or from generator states it cannot continue: never replaying used
        ones). The sampler's 128-bit stream decides which examples join a batch (private);
        dp.secure_noise draws the noise from the OS CSPRNG (no seed, no state). BandMF's groups
        stay those of ``partition_seed``, and its cyclic sampling continues at the step taken next."""
        self.sampler = self.plan.make_sampler(
            DPRandom(sampler_seed), self.rank, self.world_size, partition_seed=self.partition_seed,
            start_step=self.steps_taken, users=self.users,
        )  # fmt: skip
        self.noise_generator = noise_generator(noise_seed, self.plan.secure_noise)

    # ----------------------------------------------------------------- batches
    def remaining_steps(self) -> int:
        """Logical steps left in the plan."""
        return self.plan.steps - self.steps_taken

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
                raise RuntimeError("call mechanism.step(...) once for each batch that batches() yields")

    def data_loader(self, dataset: torch.utils.data.Dataset, **loader_options: Any) -> Iterator[list[Batch]]:
        """For a map-style dataset returning (x, y): each remaining logical batch as a list of
        physical chunks of at most ``max_physical_batch_size`` examples, read by a DataLoader
        (``loader_options`` such as num_workers are passed on)."""
        chunk = self.max_physical_batch_size or int(math.ceil(self.plan.batch_size * 2))
        for indices in self.batches():
            if self.plan.user_level:  # whole users per chunk
                per_chunk = users_per_chunk(chunk, rows_per_user(self.plan), 1, 0)
                parts = [indices[a:b].tolist() for a, b, _ in user_slices(self._drawn_units().offsets, per_chunk)]
            else:
                parts = [p.tolist() for p in indices.split(chunk)]
            loader = torch.utils.data.DataLoader(dataset, batch_sampler=parts, **loader_options)
            yield DrawnChunks(loader, indices)

    # -------------------------------------------------------------------- step
    def step(
        self, inputs: torch.Tensor | Iterable[Batch], targets: torch.Tensor | None = None, *,
        indices: torch.Tensor | None = None,
    ) -> StepStats:  # fmt: skip
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
        if indices is None and isinstance(inputs, DrawnChunks):  # data_loader's chunks carry their indices
            indices = inputs.indices
        chunks: Iterable[Batch]
        if self.plan.user_level:  # whole users per chunk, each user's examples together
            chunks = user_step_chunks_of(inputs, targets, indices, drawn, rows_per_user(self.plan),
                                         self.views, self.max_physical_batch_size)  # fmt: skip
        elif targets is not None:  # then inputs is the batch's tensor
            check_gathered(indices, drawn.indices, chunks=False)
            size = self.max_physical_batch_size or max(1, len(targets))
            chunks = zip(cast(torch.Tensor, inputs).split(size), targets.split(size))  # views: no copy of the batch
        else:
            check_gathered(indices, drawn.indices, chunks=True)
            chunks = cast(Iterable[Batch], inputs)
        stats = self.step_drawn_chunks(chunks, check_drawn=not self.plan.user_level)  # users: cut_at_users counts
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
        self, chunks: Iterable[Batch], *, all_reduce_sum: Callable | None = None, add_noise: bool = True,
        check_drawn: bool = False,
    ) -> StepStats:  # fmt: skip
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
        with self.engine.precision.matmul_flags():  # the check and the step in the plan's precision
            chunks = padded_chunks(self._run_first_chunk_check(chunks), self.pad_rows)  # checked as drawn, then padded
            adaptive = self.plan.adaptive
            engine = self.engine if adaptive is None else replace(self.engine, max_grad_norm=self.clip)  # type: ignore[type-var]
            # adaptive clipping's C is a number (make_dp_plan refuses per-layer bounds with it)
            noise_std = self.plan.noise_std if adaptive is None else self.plan.gradient_noise_multiplier * cast(float, self.clip)
            gradient, stats = noisy_clipped_mean(
                engine, self.model, chunks, noise_std=noise_std, expected_batch_size=self.plan.batch_size,
                noise_generator=self.noise_generator, all_reduce_sum=all_reduce_sum, add_noise=add_noise,
                correlate=self.correlated_noise.next if self.correlated_noise is not None else None)  # fmt: skip
        if check_drawn:  # chunks of unknown size: counted, refused before the release
            try:
                self._check_size(stats.examples)
            except ValueError:
                if self.correlated_noise is not None and history is not None:  # BandMF: the recursion untouched
                    self.correlated_noise.rewind(history)
                raise
        if self.observer is not None:
            self.observer(gradient)
        if adaptive is not None:  # the step in C_0's units (its scale lr x C_0), the count's release, C_{t+1}
            gradient = normalised_update(gradient, self.clip, self.plan.max_grad_norm)  # type: ignore[arg-type]
            self._release_count_and_move_clip(stats, adaptive)
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
            self.accountant.step(sample_rate=self.plan.participation_rate, noise_multiplier=self.plan.noise_multiplier,
                                 batches=self.plan.batch_sampling)  # fmt: skip
        self.steps_taken += 1
        bound_kept_memory()  # a fragmenting kept heap trimmed (dpscale.cpu_memory: at most 256 MiB over its level)
        return stats

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

    @property
    def _keeps_noise_history(self) -> bool:
        """Whether a checkpoint holds BandMF's past noise: a seeded run's, without dp.secure_noise."""
        return self.correlated_noise is not None and self.plan.seeded and not self.plan.secure_noise

    def _check_budget(self) -> None:
        if self.steps_taken >= self.plan.steps:
            raise PrivacyBudgetExhausted(
                f"all {self.plan.steps} planned steps are taken (epsilon {self.epsilon():.4g} at delta "
                f"{self.plan.delta:g}); another step would spend more than the plan. Make a new mechanism "
                "with more steps (and a new budget) to train further"
            )

    # ---------------------------------------------------------------- privacy
    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (default: the plan's); inf when not private."""
        if not self.plan.is_private:
            return math.inf
        return self.accountant.epsilon(self.plan.delta if delta is None else delta)

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Sampler, accountant and step (with the plan, to check on load), and the noise
        generator's state for a seeded mechanism only: an unseeded one continues with fresh noise
        (so no checkpoint holds what reproduces its noise). With the model's and optimizer's
        state, a seeded loop resumes bit-identically."""
        return {
            "plan": asdict(self.plan),
            "model_digest": model_digest(self.model),
            "steps_taken": self.steps_taken,
            "sampler": self.sampler.state_dict(),
            "noise_generator": self.noise_generator.state_dict() if self.plan.seeded else None,
            "accountant": self.accountant.state_dict(),
            "partition_seed": self.partition_seed,
            # BandMF's last b-1 noise vectors: past noise, kept (like the generator) for a seeded run
            # only, and never with dp.secure_noise (no file may reproduce that noise)
            "correlated_noise": self.correlated_noise.state_dict() if self.correlated_noise and self._keeps_noise_history else None,
            "clip_norm": self.clip,  # adaptive clipping's C_t (a function of released counts)
            "users": self.users.digest() if self.users is not None else None,  # the people it sampled
            "clip_methods": methods_state(self.engine),  # bk's per-layer methods: a resume computes as the run did
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``, on a mechanism that has not stepped yet.

        The accountant continues from the state's steps; the noise continues from the state's
        generator if this mechanism is seeded (bit-identical resume, with the seed's caveat),
        else from this mechanism's own fresh entropy: two continuations of one state never share
        noise (releasing both still composes both: each one's epsilon covers itself only). An
        unseeded BandMF mechanism also restarts its noise recursion (its checkpoint holds no past
        noise): from here on a new block of the banded strategy, whose columns still have norm <= 1
        and never overlap for b-separated participations, so the same epsilon, a little more error.

        Raises:
            RuntimeError: this mechanism has already taken steps (loading would roll its
                accountant back below the steps it released, and replay noise).
            ValueError: the state was written under another plan.
        """
        if self.steps_taken > 0:
            raise RuntimeError(
                f"this mechanism has taken {self.steps_taken} step(s); loading a state now would roll its accountant "
                "back (epsilon below what was released) and could replay noise. Load a state into a new mechanism "
                "(make_private) before its first step"
            )
        if self._drawn is not None:
            raise RuntimeError(
                "a batch was drawn before loading this state: it came from this mechanism's own sampling, not the "
                "saved run's (for BandMF another partition, breaking the b-step separation the epsilon assumes). "
                "Load the state first, then draw"
            )
        saved = check_state_fits(state, self.plan, self.model, self.users)
        if state["sampler"] is not None:  # first: it refuses an old partition before anything is loaded
            self.sampler.load_state_dict(state["sampler"])  # (None: a state whose sampler stream is not continued)
        # the steps already taken keep their caveats (a seed, checks off), whatever this mechanism's
        self.plan = replace(self.plan, **{k: getattr(self.plan, k) or getattr(saved, k) for k in LASTING_CAVEATS})
        self.partition_seed = state.get("partition_seed", self.partition_seed)  # the run keeps its groups
        if self.plan.seeded and state.get("noise_generator") is not None:
            self.noise_generator.load_state_dict(state["noise_generator"])
        history = state.get("correlated_noise") if self._keeps_noise_history and self.rank == NOISE_RANK else None
        if self.correlated_noise is not None and history is not None:
            self.correlated_noise.load_state_dict(history)  # the noise rank's alone
        self.accountant.load_state_dict(state["accountant"])
        self.steps_taken = int(state["steps_taken"])
        self.clip = state.get("clip_norm", self.plan.max_grad_norm)
        pin_methods(self.engine, state.get("clip_methods"))


__all__ = ["DPMechanism", "FirstChunkCheck", "PrivacyBudgetExhausted", "independence_check", "model_digest"]

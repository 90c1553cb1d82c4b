"""What a DP mechanism keeps in step, and its checkpoint: the frozen plan, the engine, the sampling
and noise streams (128-bit seeded, or the OS CSPRNG), the accountant and the steps taken.
``state_dict`` is the privacy part of every checkpoint; ``DPMechanism`` (train/mechanism.py) takes
the steps."""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from typing import Any, Callable

import torch
from torch import nn

from dpscale.clip_norms import MaxGradNorm
from dpscale.data.user_ids import UserIndex
from dpscale.privacy.accounting.accountant import PrivacyAccountant
from dpscale.privacy.clipping.autotune import methods_state, pin_methods
from dpscale.privacy.clipping.per_example import PerExampleEngine
from dpscale.privacy.noise.banded import BandedNoise
from dpscale.privacy.plan.dp_plan import LASTING_CAVEATS, DPPlan
from dpscale.privacy.sampling.units import UnitBatch
from dpscale.rng import DPRandom, derive_seed, noise_generator
from dpscale.train.distributed import NOISE_RANK
from dpscale.train.guards import (
    FirstChunkCheck,
    check_state_fits,
    model_digest,
    refuse_steps_outside_the_mechanism,
)
from dpscale.train.units import check_chunk_fits, rows_per_user

# spawn key of BandMF's partition seed when none is given (make_private: one process)
PARTITION_KEY = (0x62616E64,)


class MechanismState:
    """The state of a DP mechanism (``DPMechanism`` takes its steps; build it with ``make_private``):
    the plan, engine, streams and accountant kept in step, and their checkpoint."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        plan: DPPlan,
        engine: PerExampleEngine,
        *,
        sampler_seed: int,
        noise_seed: int,
        scheduler: Any = None,
        max_physical_batch_size: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        first_chunk_check: FirstChunkCheck | None = None,
        partition_seed: int | None = None,
        users: UserIndex | None = None,
        views: int = 1,
        pad_rows: int | None = None,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        refuse_steps_outside_the_mechanism(optimizer)
        self.plan, self.engine = plan, engine
        self.rank, self.world_size = rank, world_size
        # the user unit: the users sampled, and the AugMult views of each example (for user_rows)
        self.users, self.views = users, views
        if plan.user_level:
            check_chunk_fits(max_physical_batch_size, rows_per_user(plan))
        if plan.adaptive is not None and world_size > 1:
            raise ValueError(
                "adaptive clipping runs in one process (its count's noise and C are not shared across ranks yet)"
            )
        # C_t: fixed, or adaptive clipping's current norm
        self.clip: MaxGradNorm = plan.max_grad_norm
        self.steps_taken = 0
        # BandMF's b groups, fixed for the whole run (every rank must pass the same seed)
        self.partition_seed = (
            derive_seed(sampler_seed, PARTITION_KEY) if partition_seed is None else partition_seed
        )
        self.restart_streams(sampler_seed=sampler_seed, noise_seed=noise_seed)
        self.correlated_noise = (
            BandedNoise(plan.correlated.coefficients) if plan.correlated is not None else None
        )
        self.accountant = PrivacyAccountant(plan.run_accountant)
        for release in plan.releases:  # one-off releases made before the first step
            self.accountant.record(release)
        # pad_rows: step.pad_rows_for
        self.max_physical_batch_size, self.pad_rows = (max_physical_batch_size, pad_rows)
        # run, in train mode and before anything is released, on the first chunk of >= MIN_EXAMPLES
        # and again on every first chunk larger than any checked before
        self.first_chunk_check = first_chunk_check
        self._checked_rows = 0
        self._drawn: int | None = None  # size of the logical batch sample() drew, until its step
        # its indices (and users' boundaries at the user unit)
        self._drawn_batch: UnitBatch | None = None
        # sees each released gradient (noisy sum / B) before the optimizer: an audit's adversary
        self.observer: Callable[[dict[str, torch.Tensor]], None] | None = None

    def restart_streams(self, *, sampler_seed: int, noise_seed: int) -> None:
        """Fresh sampling and noise streams (at the start, or when a run restarts with another
        number of processes or from generator states it cannot continue: never replaying used
        ones). The sampler's 128-bit stream decides which examples join a batch (private);
        dp.secure_noise draws the noise from the OS CSPRNG (no seed, no state). BandMF's groups
        stay those of ``partition_seed``, and its cyclic sampling continues at the step taken next."""
        self.sampler = self.plan.make_sampler(
            DPRandom(sampler_seed),
            self.rank,
            self.world_size,
            partition_seed=self.partition_seed,
            start_step=self.steps_taken,
            users=self.users,
        )
        self.noise_generator = noise_generator(noise_seed, self.plan.secure_noise)

    def remaining_steps(self) -> int:
        """Logical steps left in the plan."""
        return self.plan.steps - self.steps_taken

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (default: the plan's); inf when not private."""
        if not self.plan.is_private:
            return math.inf
        return self.accountant.epsilon(self.plan.delta if delta is None else delta)

    @property
    def _keeps_noise_history(self) -> bool:
        """Whether a checkpoint holds BandMF's past noise: a seeded run's, without dp.secure_noise."""
        return self.correlated_noise is not None and self.plan.seeded and not self.plan.secure_noise

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
            "correlated_noise": self.correlated_noise.state_dict()
            if self.correlated_noise and self._keeps_noise_history
            else None,
            "clip_norm": self.clip,  # adaptive clipping's C_t (a function of released counts)
            # the people it sampled
            "users": self.users.digest() if self.users is not None else None,
            # bk's per-layer methods: a resume computes as the run did
            "clip_methods": methods_state(self.engine),
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
        # first: it refuses an old partition before anything is loaded
        if state["sampler"] is not None:
            # (None: a state whose sampler stream is not continued)
            self.sampler.load_state_dict(state["sampler"])
        # the steps already taken keep their caveats (a seed, checks off), whatever this mechanism's
        self.plan = replace(
            self.plan, **{k: getattr(self.plan, k) or getattr(saved, k) for k in LASTING_CAVEATS}
        )
        # the run keeps its groups
        self.partition_seed = state.get("partition_seed", self.partition_seed)
        if self.plan.seeded and state.get("noise_generator") is not None:
            self.noise_generator.load_state_dict(state["noise_generator"])
        history = (
            state.get("correlated_noise")
            if self._keeps_noise_history and self.rank == NOISE_RANK
            else None
        )
        if self.correlated_noise is not None and history is not None:
            self.correlated_noise.load_state_dict(history)  # the noise rank's alone
        self.accountant.load_state_dict(state["accountant"])
        self.steps_taken = int(state["steps_taken"])
        self.clip = state.get("clip_norm", self.plan.max_grad_norm)
        pin_methods(self.engine, state.get("clip_methods"))

"""Sampling people (user-level DP, issue 43): the sampler draws *users* (each independently with
probability q = expected users per step / U); a drawn user contributes at most k of its examples (a fresh
uniformly random subset each step when it has more: chosen from the secret sampling stream, never from the
data), and the engine clips the sum of a user's contributed gradients as one vector. The batches keep each
user's examples consecutive (``UnitBatch.offsets``) so that a chunk never splits a user; the grouping of
examples by user is ``dpscale.data.user_ids.UserIndex``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dpscale.data.splits import keyed_hashes
from dpscale.data.user_ids import UserIndex
from dpscale.rng import DPRandom, require_dprandom


@dataclass(frozen=True)
class UnitBatch:
    """One step's examples, grouped by privacy unit.

    Attributes:
        indices: (n,) int64 example indices; each unit's examples consecutive.
        offsets: (m + 1,) int64: unit j of this batch holds ``indices[offsets[j]:offsets[j + 1]]``.
    """

    indices: torch.Tensor
    offsets: torch.Tensor

    @property
    def num_units(self) -> int:
        """Units (users) drawn at this step."""
        return len(self.offsets) - 1


class UserPoissonSampler:
    """Independent Bernoulli(q) inclusion of each of U users per step, at most k examples each.

    A drawn user with more than k examples contributes a uniformly random subset of k, drawn anew at
    every step from this sampler's (secret) generator: which of its examples are used depends on no
    other user and on nothing in the data but the user's own count.

    With ``bands`` = b > 1 (BandMF) users are sampled cyclically: each user's group is a keyed hash
    of its id under ``partition_seed`` (``user_groups``: independent of every other user, so adding
    or removing a person moves nobody else), and step t draws only group t mod b, each member with
    probability p = b * q.

    With ``max_batch_size`` = M (truncated Poisson sampling of users, b = 1 only) a step that draws
    more than M users keeps a uniformly random M of them, chosen from the same secret generator:
    what dp_accounting's ``TruncatedSubsampledGaussianDpEvent(U, q, M, sigma)`` assumes, with the
    users as its units (as ``dpscale.privacy.sampling.samplers.PoissonSampler`` caps examples).

    Args:
        users: the grouping of the N examples by user.
        sample_rate: q in (0, 1], per user (p = b * q must also be <= 1).
        max_examples_per_user: k >= 1.
        generator: the sampling RNG; its state (with the step) is the sampler's whole state.
        bands: b >= 1; partition_seed: the groups' key (needed when b > 1); start_step: the next step.
        max_batch_size: M >= 1, the most users a step trains on (None: uncapped).
    """

    def __init__(
        self,
        users: UserIndex,
        sample_rate: float,
        max_examples_per_user: int,
        generator: DPRandom,
        *,
        bands: int = 1,
        partition_seed: int | None = None,
        start_step: int = 0,
        max_batch_size: int | None = None,
    ) -> None:
        if not 0.0 < sample_rate <= 1.0 or not sample_rate * bands <= 1.0:
            raise ValueError(
                f"sample_rate must be in (0, 1/bands], got {sample_rate} with bands={bands}"
            )
        if (
            isinstance(max_examples_per_user, bool)
            or int(max_examples_per_user) != max_examples_per_user
            or max_examples_per_user < 1
        ):
            raise ValueError(
                f"max_examples_per_user must be an integer >= 1, got {max_examples_per_user!r}"
            )
        if bands > 1 and partition_seed is None:
            raise ValueError(
                f"bands={bands} (cyclic Poisson sampling of users) needs a partition_seed"
            )
        _check_user_cap(max_batch_size, bands)
        self.max_batch_size = None if max_batch_size is None else int(max_batch_size)
        self.users, self.sample_rate, self.bands = users, sample_rate, int(bands)
        self.max_examples_per_user = int(max_examples_per_user)
        self.generator = require_dprandom(generator, "user-level Poisson sampling")
        self.step = int(start_step)
        self._digest = users.digest()
        self._set_partition(partition_seed)

    def _set_partition(self, partition_seed: int | None) -> None:
        self.partition_seed = partition_seed
        if self.bands == 1:
            self._members: tuple[np.ndarray, ...] = (np.arange(self.users.num_users),)
            return
        group = user_groups(self.users.ids, self.bands, partition_seed)
        self._members = tuple(np.flatnonzero(group == g) for g in range(self.bands))

    def sample_units(self) -> UnitBatch:
        """The next step's drawn users and their contributed examples (possibly none)."""
        members = self._members[self.step % self.bands]
        # float64 uniforms, as for examples (PoissonSampler): no rounding of a small q upwards
        drawn = self._capped(
            members[self.generator.uniform(len(members)).numpy() < self.sample_rate * self.bands]
        )
        self.step += 1
        sizes = self.users.sizes[drawn]
        keep = np.minimum(sizes, self.max_examples_per_user)
        # every example of every drawn user, with its user's rank in this batch
        rank = np.repeat(np.arange(len(drawn)), sizes)
        flat = np.repeat(self.users.offsets[drawn] - np.cumsum(sizes) + sizes, sizes) + np.arange(
            int(sizes.sum())
        )
        chosen = self._k_smallest_keys(rank, sizes, keep)
        rank, examples = rank[chosen], self.users.examples[flat[chosen]]
        order = np.lexsort((examples, rank))  # users in drawn order, each one's examples ascending
        offsets = np.concatenate([[0], np.cumsum(keep)]).astype(np.int64)
        return UnitBatch(torch.from_numpy(examples[order]), torch.from_numpy(offsets))

    def _capped(self, drawn: np.ndarray) -> np.ndarray:
        """``drawn`` (ascending users), or with more than M of them a uniformly random M-subset, still
        ascending: the first M of a permutation from the secret generator (drawn only when cut, so an
        uncapped run's stream is unchanged)."""
        if self.max_batch_size is None or len(drawn) <= self.max_batch_size:
            return drawn
        kept = self.generator.permutation(len(drawn))[: self.max_batch_size].numpy()
        return drawn[np.sort(kept)]

    def _k_smallest_keys(self, rank: np.ndarray, sizes: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """A boolean mask over the drawn users' examples: all of a user with at most k, else the k
        whose fresh uniform keys are smallest (a uniform k-subset), keys drawn only for such users."""
        mask = np.ones(len(rank), dtype=bool)
        over = (sizes > keep)[rank]
        if not over.any():
            return mask
        keys = self.generator.uniform(int(over.sum())).numpy()
        position = np.flatnonzero(over)
        order = position[np.lexsort((keys, rank[position]))]  # each user's examples by key
        # where each user's run starts
        first = np.searchsorted(rank[order], rank[order], side="left")
        mask[order] = (np.arange(len(order)) - first) < keep[rank[order]]
        return mask

    def sample(self) -> torch.Tensor:
        """Indices (int64, 1-D) of the next step's contributed examples, each user's consecutive."""
        return self.sample_units().indices

    def state_dict(self) -> dict[str, Any]:
        return {
            "unit": "user",
            "generator": self.generator.state_dict(),
            "step": self.step,
            "bands": self.bands,
            "partition_seed": self.partition_seed,
            "users": self._digest,
            "max_batch_size": self.max_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where the sampler that wrote ``state`` stood, with its groups.

        Raises:
            ValueError: a state of an example-level sampler, of another number of bands or batch cap
                (a state without a cap was written uncapped), or of another grouping of the examples
                into users.
        """
        if state.get("unit") != "user":
            raise ValueError(
                "this sampler state samples examples, not users: it cannot continue a user-level run"
            )
        if state.get("users") != self._digest:
            raise ValueError(
                "the user ids are not the ones this run was sampled with (another grouping of the examples into "
                "people): each part of the run would protect another person; continue with the same ids"
            )
        if int(state["bands"]) != self.bands:
            raise ValueError(
                f"this sampler state was written with bands={state['bands']}, not {self.bands}"
            )
        if state.get("max_batch_size") != self.max_batch_size:
            raise ValueError(
                f"this sampler state was written with a cap of {state.get('max_batch_size')} users a step, not "
                f"{self.max_batch_size}: the run's steps would be sampled two ways that one epsilon does not describe"
                + (
                    " (a run begun before dpscale applied the user-level cap drew every user its plan capped: start it anew)"
                    if "max_batch_size" not in state
                    else ""
                )
            )
        self.generator.load_state_dict(state["generator"])
        self.step = int(state["step"])
        if state["partition_seed"] != self.partition_seed:  # the run's groups win (b-separation)
            self._set_partition(state["partition_seed"])


def _check_user_cap(max_batch_size: int | None, bands: int) -> None:
    """Refuse a cap that is not an integer >= 1, or one with cyclic sampling (b > 1), which no
    accountant composes with a cap (the plan refuses it too: ``sampling_plan.check_sampling_settings``)."""
    if max_batch_size is None:
        return
    if (
        isinstance(max_batch_size, bool)
        or int(max_batch_size) != max_batch_size
        or max_batch_size < 1
    ):
        raise ValueError(
            f"max_batch_size must be an integer >= 1 (users a step), got {max_batch_size!r}"
        )
    if bands > 1:
        raise ValueError(
            f"a batch cap truncates Poisson batches of users; cyclic sampling (bands={bands}) takes none"
        )


def user_groups(ids: np.ndarray, bands: int, partition_seed: int | None) -> np.ndarray:
    """Each user's BandMF group: a keyed BLAKE2b hash of its id under the secret ``partition_seed``,
    scaled to 0..b-1. A function of the seed and the user's own id only: adding or removing a user
    moves no other user to another group (docs/correlated_noise.md).

    Args:
        ids: (U,) user ids (integers or strings).
        bands: b >= 1.
        partition_seed: the key (an integer of up to 512 bits).

    Returns:
        (U,) int64 groups.
    """
    if partition_seed is None:
        raise ValueError("user groups need a partition_seed")
    seed = int(partition_seed)
    key = seed.to_bytes(max(1, (seed.bit_length() + 7) // 8), "little")
    values = keyed_hashes(np.asarray(ids), key)
    # floor(v * b / 2^64) exactly: (v >> 32) * b + ((v & (2^32 - 1)) * b >> 32), then >> 32 (b < 2^31)
    high, low = values >> np.uint64(32), values & np.uint64(0xFFFFFFFF)
    b = np.uint64(bands)
    return ((high * b + ((low * b) >> np.uint64(32))) >> np.uint64(32)).astype(np.int64)


def user_sampler(
    plan: Any,
    users: UserIndex | None,
    generator: DPRandom,
    *,
    world_size: int,
    partition_seed: int | None,
    start_step: int,
) -> UserPoissonSampler:
    """The sampler of a user-level plan (``DPPlan.make_sampler``).

    Raises:
        ValueError: no user index, one of another number of users than the plan's N, or several processes.
    """
    if users is None:
        raise ValueError(
            "a user-level plan samples users: give the user ids (data.privacy_unit=user needs them)"
        )
    if users.num_users != plan.dataset_size:
        raise ValueError(
            f"the plan counts N={plan.dataset_size} users but the data holds {users.num_users}"
        )
    if world_size > 1:
        raise ValueError(
            "data.privacy_unit=user runs in one process (users are not sharded across ranks yet)"
        )
    return UserPoissonSampler(
        users,
        plan.sample_rate,
        plan.max_examples_per_user,
        generator,
        bands=plan.bands,
        partition_seed=partition_seed,
        start_step=start_step,
        max_batch_size=plan.max_batch_size,
    )

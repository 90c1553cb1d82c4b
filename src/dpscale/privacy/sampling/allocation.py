"""Random allocation (issue 65): each epoch, every example joins k of the epoch's t steps.

Feldman & Shenfeld (ICML 2026, "Efficient Privacy Loss Accounting for Subsampling and Random
Allocation"): at the start of each epoch of t steps, every example is assigned to k distinct steps,
each k-subset of the t equally likely, independently of every other example and of every other
epoch; step s's batch is the examples assigned to it, so batch sizes vary around N k / t and every
example is seen exactly k times per epoch. The sampler alone: no door takes ``dp.sampling:
allocation`` until its accountant is in (a sampler the accountant does not describe must never run).
"""

from __future__ import annotations

from typing import Any

import torch

from dpscale.privacy.sampling.samplers import split_by_group
from dpscale.rng import DPRandom, require_dprandom, uniform_below


def allocate(dataset_size: int, steps: int, k: int, generator: DPRandom) -> torch.Tensor:
    """Each example's k distinct steps of one epoch, each k-subset of 0..t-1 equally likely and
    independent across examples (Floyd's algorithm, one uniform per example per round).

    Args:
        dataset_size: N.
        steps: t, the steps of the epoch.
        k: steps per example, 1 <= k <= t.
        generator: the sampling RNG (N k uniforms are drawn from it, in rounds of N).

    Returns:
        int64 [N, k]: row i holds example i's steps (in the order Floyd's rounds chose them).
    """
    chosen = torch.empty(dataset_size, k, dtype=torch.int64)
    # Floyd: for j = t-k .. t-1 draw r uniform in 0..j; take r unless already taken, else j. Each
    # round keeps every k'-subset of 0..j equally likely, so the last leaves a uniform k-subset.
    for column, j in enumerate(range(steps - k, steps)):
        r = uniform_below(generator.uniform(dataset_size), j + 1)
        taken = (chosen[:, :column] == r[:, None]).any(dim=1)
        chosen[:, column] = torch.where(taken, torch.full_like(r, j), r)
    return chosen


def _batches_of(chosen: torch.Tensor, steps: int) -> tuple[torch.Tensor, ...]:
    """The examples of each step, ascending, from each example's steps (``allocate``'s rows)."""
    # row-major positions p of the [N, k] allocation: example p // k, ascending within each step
    return tuple(p // chosen.shape[1] for p in split_by_group(chosen.flatten(), steps))


class AllocationSampler:
    """Random allocation: each epoch of t steps allocates every example to k of them (see the
    module's docstring); ``sample`` returns the next step's examples, ascending.

    Args:
        dataset_size: N.
        steps_per_epoch: t >= 1.
        generator: the sampling RNG; the epoch's allocation is drawn from it at its first step.
        k: steps per example per epoch, 1 <= k <= t (default 1: each example once per epoch).
    """

    def __init__(
        self, dataset_size: int, steps_per_epoch: int, generator: DPRandom, k: int = 1
    ) -> None:
        if dataset_size < 1:
            raise ValueError(f"dataset_size must be >= 1, got {dataset_size}")
        if not 1 <= steps_per_epoch < 2**36:
            raise ValueError(f"steps_per_epoch must be in [1, 2^36), got {steps_per_epoch}")
        if not 1 <= k <= steps_per_epoch:
            raise ValueError(f"k must be in [1, steps_per_epoch={steps_per_epoch}], got {k}")
        self.dataset_size, self.steps_per_epoch, self.k = dataset_size, steps_per_epoch, k
        self.generator = require_dprandom(generator, "random allocation")
        self._chosen = torch.empty(0, k, dtype=torch.int64)  # this epoch's allocation, [N, k]
        self._batches: tuple[torch.Tensor, ...] = ()
        self._cursor = 0  # the next step within the epoch

    def sample(self) -> torch.Tensor:
        if self._cursor == 0:
            self._chosen = allocate(self.dataset_size, self.steps_per_epoch, self.k, self.generator)
            self._batches = _batches_of(self._chosen, self.steps_per_epoch)
        batch = self._batches[self._cursor]
        self._cursor = (self._cursor + 1) % self.steps_per_epoch
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "generator": self.generator.state_dict(),
            "allocation": self._chosen.clone(),
            "cursor": self._cursor,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where the state was taken, mid-epoch included (the epoch's allocation is saved).

        Raises:
            ValueError: a state of another N, t or k, or a cursor outside the epoch.
        """
        chosen, cursor = state["allocation"], int(state["cursor"])
        mid_epoch = cursor != 0
        if mid_epoch and tuple(chosen.shape) != (self.dataset_size, self.k):
            raise ValueError(
                f"an allocation of shape {tuple(chosen.shape)} cannot resume N={self.dataset_size}, "
                f"k={self.k}"
            )
        if not 0 <= cursor < self.steps_per_epoch or (
            mid_epoch and int(chosen.max()) >= self.steps_per_epoch
        ):
            raise ValueError(f"the saved allocation is not one of t={self.steps_per_epoch} steps")
        self.generator.load_state_dict(state["generator"])
        self._chosen, self._cursor = chosen.clone(), cursor
        self._batches = _batches_of(self._chosen, self.steps_per_epoch) if mid_epoch else ()

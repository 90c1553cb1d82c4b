"""How each step's batch was drawn, as the accountant composes it (torch-free).

Four samplers, each with the accounting that describes exactly what ran:

- ``poisson``: each example joins each step independently with probability q = B/N. Add/remove
  adjacency; dp_accounting's ``PoissonSampledDpEvent`` (PLD or RDP).
- ``truncated``: Poisson batches cut to at most ``max_batch_size`` examples (a uniformly random
  subset of a larger draw), so shapes and memory are bounded. Add/remove adjacency;
  ``TruncatedSubsampledGaussianDpEvent`` (PLD only: dp_accounting has no RDP for it).
- ``fixed``: each step independently draws exactly B distinct examples, uniformly. Amplification by
  sampling without replacement is proven for replace-one adjacency (a neighbouring dataset has one
  example replaced by another, N unchanged): ``SampledWithoutReplacementDpEvent`` (RDP only, Wang,
  Balle and Kasiviswanathan 2019).
- ``shuffle``: fixed-size batches from a fresh permutation each epoch. No amplification is claimed:
  given the permutation (drawn without looking at the data), a replaced example is in at most one
  batch per epoch, so the run is at most E adaptive Gaussian mechanisms on it, E the epochs the run
  touches; composed, one Gaussian with noise multiplier (sigma/2)/sqrt(E). A bound over every
  permutation bounds their mixture too. Chua et al. 2024 ("How private are DP-SGD
  implementations?") show the Poisson epsilon can be far below shuffling's true one, so shuffling
  is never reported with it.

Under replace-one adjacency the sum of per-example terms clipped to C changes by up to 2C (one
term g becomes g'), so a Gaussian with std sigma*C is, in dp_accounting's units (std over
sensitivity), a Gaussian with noise multiplier sigma/2: ``replace_one_noise``. Epsilons under the
two adjacencies are different promises (replace-one ones are about which of two images was used),
and every output names the one it gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ADD_REMOVE = "add/remove"
REPLACE_ONE = "replace-one"
# Sampler -> the adjacency its accounting proves a guarantee for (one place for both lists).
ADJACENCY_OF = {
    "poisson": ADD_REMOVE,
    "truncated": ADD_REMOVE,
    "fixed": REPLACE_ONE,
    "shuffle": REPLACE_ONE,
}
# Sampler -> the accountants dp_accounting 0.6 can compose it with.
ACCOUNTANTS_OF = {
    "poisson": ("pld", "rdp"),
    "truncated": ("pld",),
    "fixed": ("rdp",),
    "shuffle": ("pld", "rdp"),
}
ADJACENCY_WORDS = {
    ADD_REMOVE: "add/remove adjacency: any one image added to or removed from the training set",
    REPLACE_ONE: "replace-one adjacency: any one image replaced by another, N unchanged",
}


@dataclass(frozen=True)
class BatchSampling:
    """The batch sampler of a run of steps, as the accountant needs it.

    Attributes:
        mode: "poisson", "truncated", "fixed" or "shuffle" (see the module docstring).
        dataset_size: N (needed by every mode but poisson; 0 there).
        max_batch_size: the cap of truncated Poisson batches (0 for the other modes).
    """

    mode: str = "poisson"
    dataset_size: int = 0
    max_batch_size: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ADJACENCY_OF:
            raise ValueError(
                f"unknown batch sampling {self.mode!r}; choose one of {', '.join(ADJACENCY_OF)}"
            )
        if self.mode != "poisson" and not (
            isinstance(self.dataset_size, int) and self.dataset_size >= 1
        ):
            raise ValueError(
                f"{self.mode} sampling needs the dataset size N >= 1, got {self.dataset_size!r}"
            )
        if self.mode == "truncated" and not (
            isinstance(self.max_batch_size, int) and self.max_batch_size >= 1
        ):
            raise ValueError(
                f"truncated Poisson sampling needs a batch cap >= 1, got {self.max_batch_size!r}"
            )
        if self.mode != "truncated" and self.max_batch_size:
            raise ValueError(f"a batch cap belongs to truncated Poisson sampling, not {self.mode}")

    @property
    def adjacency(self) -> str:
        """ "add/remove" or "replace-one": what the accounted guarantee is about."""
        return ADJACENCY_OF[self.mode]

    def batch_size(self, sample_rate: float) -> int:
        """B = q*N, the fixed batch of ``fixed`` and ``shuffle`` (rounded: q was B/N)."""
        return max(1, round(sample_rate * self.dataset_size))

    def compositions(self, sample_rate: float, steps: int) -> int:
        """Gaussian mechanisms one example can enter in ``steps`` steps: the epochs they touch for
        ``shuffle`` (ceil(S / floor(N/B))), else one per step (subsampled)."""
        if self.mode != "shuffle" or steps == 0:
            return steps
        per_epoch = self.dataset_size // self.batch_size(sample_rate)
        return math.ceil(steps / per_epoch)

    def describe(self, sample_rate: float) -> str:
        """Short words for outputs, e.g. "fixed-size batches of 256 without replacement"."""
        if self.mode == "fixed":
            return f"fixed-size batches of {self.batch_size(sample_rate)} drawn without replacement each step"
        if self.mode == "shuffle":
            return (
                f"shuffled batches of {self.batch_size(sample_rate)}, no amplification by sampling"
            )
        if self.mode == "truncated":
            return f"poisson batches capped at {self.max_batch_size}"
        return "poisson"


POISSON = BatchSampling()


def batch_sampling_for(
    sampling: str, dataset_size: int, max_batch_size: int | None = None
) -> BatchSampling:
    """The accountant's view of ``dp.sampling`` (and a Poisson batch cap): the one mapping the plan
    and ``dpscale account`` share."""
    if sampling == "poisson":
        return (
            POISSON
            if max_batch_size is None
            else BatchSampling("truncated", dataset_size, max_batch_size)
        )
    return BatchSampling(sampling, dataset_size)


def replace_one_noise(noise_multiplier: float) -> float:
    """dp_accounting's noise multiplier (std / sensitivity) of a Gaussian with std sigma*C on a sum
    clipped to C, under replace-one adjacency (sensitivity 2C): sigma / 2."""
    return noise_multiplier / 2.0


def history_adjacency(samplings: list[BatchSampling], subsampled: list[bool]) -> str:
    """The one adjacency a history's segments share.

    Args:
        samplings: each segment's sampling.
        subsampled: whether each segment samples (q < 1). Full-data releases fit either adjacency:
            a Poisson-labelled one is neutral, one labelled with a run's sampling takes its adjacency.

    Raises:
        ValueError: replace-one segments beside add/remove subsampled ones (a Poisson run composed
            with a fixed-size one): no dp_accounting event composes the two.
    """
    kinds = {s.adjacency for s, sub in zip(samplings, subsampled) if sub or s.mode != "poisson"}
    if len(kinds) > 1:
        raise ValueError(
            "a history mixes add/remove (Poisson) and replace-one (fixed-size or shuffled) sampled steps, which "
            "no accountant composes; keep one sampling for a run and the runs it builds on"
        )
    return kinds.pop() if kinds else ADD_REMOVE

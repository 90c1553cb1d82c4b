"""Batch samplers for DP-SGD.

``PoissonSampler`` is what the privacy accountant assumes: every example joins each
logical batch independently with probability q = B / N, so batch sizes vary
(Binomial(N, q)) and can be empty. ``ShuffleSampler`` (fixed-size batches from a
per-epoch permutation) is what many codebases run instead; the guarantee we report
then does *not* strictly apply, and every output says so.

Both draw from a ``DPRandom`` (128-bit seed): which examples join a batch is as secret as the
noise, since Poisson subsampling's privacy amplification assumes the adversary cannot predict it.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from dpscale.rng import DPRandom, require_dprandom

SAMPLING_MODES = ("poisson", "shuffle")
SHUFFLE_CAVEAT = (
    "sampling=shuffle: the reported epsilon is computed for Poisson sampling and does not "
    "strictly cover the fixed-size shuffled batches that ran"
)


class BatchSampler(Protocol):
    def sample(self) -> torch.Tensor:
        """Indices (int64, 1-D) of the next logical batch."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class PoissonSampler:
    """Independent Bernoulli(q) inclusion of each of N examples per step.

    In data-parallel training, rank r of P samples only its shard {i : i mod P = r}, with the
    same q and its own generator: the shards are disjoint and cover all N examples, so the union
    of the ranks' batches is exactly a Poisson sample of the whole dataset.

    Args:
        dataset_size: N.
        sample_rate: q in (0, 1].
        generator: the sampling RNG; its state is the sampler's whole state.
        rank, world_size: this process's shard (default: the whole dataset).
    """

    def __init__(
        self, dataset_size: int, sample_rate: float, generator: DPRandom, rank: int = 0, world_size: int = 1
    ) -> None:
        if dataset_size < 1:
            raise ValueError(f"dataset_size must be >= 1, got {dataset_size}")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got {rank} and {world_size}")
        self.dataset_size = dataset_size
        self.sample_rate = sample_rate
        self.generator = require_dprandom(generator, "Poisson sampling")
        self.rank, self.world_size = rank, world_size
        self.shard_size = len(range(rank, dataset_size, world_size))

    def sample(self) -> torch.Tensor:
        # One uniform per example keeps the draw exactly Bernoulli(q) per example; O(N/P) per
        # step is negligible next to a training step. float64: float32 uniforms are multiples
        # of 2^-24, which would round the inclusion probability *up* for small q.
        mask = self.generator.uniform(self.shard_size) < self.sample_rate
        return mask.nonzero().flatten() * self.world_size + self.rank  # shard position j -> example jP + r

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.load_state_dict(state["generator"])


class ShuffleSampler:
    """Fixed-size batches of B from a fresh random permutation each epoch (last partial batch dropped).

    Args:
        dataset_size: N.
        batch_size: B <= N.
        generator: the sampling RNG.
    """

    def __init__(self, dataset_size: int, batch_size: int, generator: DPRandom) -> None:
        if not 1 <= batch_size <= dataset_size:
            raise ValueError(f"batch_size must be in [1, {dataset_size}], got {batch_size}")
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.generator = require_dprandom(generator, "shuffle sampling")
        self._perm = torch.empty(0, dtype=torch.long)
        self._cursor = 0

    def sample(self) -> torch.Tensor:
        if self._cursor + self.batch_size > self._perm.numel():
            self._perm = self.generator.permutation(self.dataset_size)
            self._cursor = 0
        batch = self._perm[self._cursor : self._cursor + self.batch_size]
        self._cursor += self.batch_size
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.state_dict(), "perm": self._perm.clone(), "cursor": self._cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.load_state_dict(state["generator"])
        self._perm = state["perm"].clone()
        self._cursor = int(state["cursor"])


def make_sampler(
    mode: str, dataset_size: int, batch_size: float, generator: DPRandom, rank: int = 0, world_size: int = 1
) -> PoissonSampler | ShuffleSampler:
    """Sampler for ``mode`` ("poisson" | "shuffle") with expected batch size B = ``batch_size``
    (of the whole logical batch; with ``world_size`` > 1 each rank samples its own shard)."""
    if mode == "poisson":
        return PoissonSampler(dataset_size, batch_size / dataset_size, generator, rank, world_size)
    if world_size > 1:
        raise ValueError("distributed training samples with sampling=poisson only (shuffle has no sharded form)")
    if mode == "shuffle":
        return ShuffleSampler(dataset_size, batch_size, generator)
    raise ValueError(f"unknown sampling {mode!r}; choose one of {', '.join(SAMPLING_MODES)}")

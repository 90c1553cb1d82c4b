"""Batch samplers for DP-SGD.

``PoissonSampler`` is what the privacy accountant assumes by default: every example joins each
logical batch independently with probability q = B / N, so batch sizes vary
(Binomial(N, q)) and can be empty; with ``max_batch_size`` a batch above the cap is cut to a
uniformly random subset of that size (truncated Poisson, accounted as such).
``FixedSizeSampler`` draws exactly B distinct examples each step, independently of other steps
(sampling without replacement, accounted under replace-one adjacency). ``ShuffleSampler``
(fixed-size batches from a per-epoch permutation) is what many codebases run; it is accounted
without amplification (``dpscale.privacy.accounting.batch_sampling``).

``CyclicPoissonSampler`` is the sampling that amplified banded matrix factorization
(Choquette-Choo et al. 2023, "b-min-separation") assumes: each example is put once, for the
whole run, into one of b groups, uniformly and independently of every other example (a seeded
draw per example: ``partition_groups``); step t samples only group t mod b, each of its
examples independently with probability b * q. The expected batch is B (over the partition's
draw), and an example can join two steps only when they are a multiple of b apart, which is
what lets a b-banded correlated-noise mechanism be accounted with amplification. Adding or
removing one example changes no other example's group (docs/correlated_noise.md, "Why it is
private"). With b = 1 it is exactly Poisson sampling, and ``make_sampler`` then returns a
``PoissonSampler``.

All draw from a ``DPRandom`` (128-bit seed): which examples join a batch is as secret as the
noise, since Poisson subsampling's privacy amplification assumes the adversary cannot predict it.
"""

from __future__ import annotations

from numbers import Integral
from typing import Any, Protocol

import numpy as np
import torch

from dpscale.privacy.sampling.modes import RATE_TOLERANCE, SAMPLING_MODES
from dpscale.rng import DPRandom, derive_seed, require_dprandom, uniform_below

# Names the construction a cyclic sampler's state's partition_seed stands for. States without it
# were written by the first cyclic sampler (issue 27), whose partition cut a seeded permutation of
# 0..N-1 into b equal parts: the same seed gives other groups now (see load_state_dict).
PARTITION = "uniform-per-example-v1"
# spawn key of the stream all ranks share for a fixed-size, shuffled or capped draw
SHARED_DRAW_KEY = 0x5D


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
        max_batch_size: cut a batch of more than this many examples to a uniformly random subset
            of this size, drawn from the same generator (None: uncapped; one process only).
    """

    def __init__(
        self,
        dataset_size: int,
        sample_rate: float,
        generator: DPRandom,
        rank: int = 0,
        world_size: int = 1,
        max_batch_size: int | None = None,
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
        if max_batch_size is not None and (max_batch_size < 1 or world_size > 1):
            raise ValueError(
                f"a batch cap must be >= 1 and needs one process, got {max_batch_size} over {world_size}"
            )
        self.max_batch_size = max_batch_size

    def sample(self) -> torch.Tensor:
        # One uniform per example keeps the draw exactly Bernoulli(q) per example; O(N/P) per
        # step is negligible next to a training step. float64: float32 uniforms are multiples
        # of 2^-24, which would round the inclusion probability *up* for small q.
        mask = self.generator.uniform(self.shard_size) < self.sample_rate
        # shard position j -> example jP + r
        batch = mask.nonzero().flatten() * self.world_size + self.rank
        if self.max_batch_size is not None and batch.numel() > self.max_batch_size:
            # a uniformly random subset of the cap's size: what the truncated event assumes
            kept = self.generator.permutation(batch.numel())[: self.max_batch_size]
            batch = batch[kept.sort().values]
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.load_state_dict(state["generator"])


class FixedSizeSampler:
    """Exactly B distinct examples each step, each B-subset of the N equally likely, independently of
    every other step (sampling without replacement; an example may join consecutive steps).

    Args:
        dataset_size: N.
        batch_size: B <= N.
        generator: the sampling RNG; its state is the sampler's whole state.
    """

    def __init__(self, dataset_size: int, batch_size: int, generator: DPRandom) -> None:
        if not 1 <= batch_size <= dataset_size:
            raise ValueError(f"batch_size must be in [1, {dataset_size}], got {batch_size}")
        self.dataset_size = dataset_size
        self.batch_size = int(batch_size)
        self.generator = require_dprandom(generator, "fixed-size sampling")

    def sample(self) -> torch.Tensor:
        # The first B of a uniform permutation are a uniform B-subset; O(N) per step like Poisson's draw.
        return self.generator.permutation(self.dataset_size)[: self.batch_size].sort().values

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.load_state_dict(state["generator"])


class ShardedDraw:
    """One rank's part of a logical batch that only the whole dataset can draw (fixed-size,
    shuffled or capped Poisson batches): every rank runs ``inner`` on the same shared stream, so all
    draw the same batch, and keeps the examples of its shard {i : i mod P = r}. The ranks' parts are
    disjoint and their union is exactly ``inner``'s batch: the sampling is the one-process sampling
    the accountant describes.

    Args:
        inner: the whole-dataset sampler, drawing from a generator every rank seeds alike.
        rank, world_size: this process's shard.
    """

    def __init__(self, inner: BatchSampler, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got {rank} and {world_size}")
        self.inner, self.rank, self.world_size = inner, rank, world_size

    def sample(self) -> torch.Tensor:
        batch = self.inner.sample()
        return batch[batch % self.world_size == self.rank]

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


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
        return {
            "generator": self.generator.state_dict(),
            "perm": self._perm.clone(),
            "cursor": self._cursor,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.load_state_dict(state["generator"])
        self._perm = state["perm"].clone()
        self._cursor = int(state["cursor"])


class CyclicPoissonSampler:
    """Cyclic Poisson sampling (b-min-separation) for amplified banded matrix factorization.

    The N examples are split once into ``bands`` = b groups: example i goes to group
    floor(b * u_i), u_i the i-th uniform ``DPRandom(partition_seed)`` draws
    (``partition_groups``). So each example's group is uniform over the b groups and independent
    of every other example's, and it depends on the seed and i only, not on N: appending an
    example or removing the last moves no other (what the accounting of add/remove neighbours
    needs: docs/correlated_noise.md).
    Group sizes are therefore random, Binomial(N, 1/b) each (possibly 0). Step t (0-based, from
    the start of the run) samples only group t mod b, each of its examples independently with
    probability p = b * q, so the expected batch is q * N = B over the partition's draw and an
    example joins steps t and t' only when t = t' (mod b). The partition must stay the same for
    the whole run: another one would break the min-separation the accounting assumes
    (``load_state_dict`` restores it).

    In data-parallel training, rank r of P samples only the members of the step's group in its
    shard {i : i mod P = r}, with its own generator (as ``PoissonSampler`` does): the ranks'
    batches are disjoint and their union is a cyclic Poisson sample of the whole dataset. All
    ranks must share ``partition_seed``, hence the partition.

    Args:
        dataset_size: N.
        sample_rate: q = B / N, the per-step expected rate over the whole dataset.
        bands: b >= 1, the number of groups (the band count of the noise correlation).
        generator: the sampling RNG (the within-group draws: as secret as the noise).
        partition_seed: seed of the partition, shared by all ranks and kept for the run.
        rank, world_size: this process's shard (default: the whole dataset).
        start_step: index of the first step this sampler draws (a run resumed at step k).

    Attributes:
        participation_rate: p = b * q, each group member's inclusion probability at its steps.
        step: index of the step the next ``sample()`` draws.
        groups: the whole partition, b sorted int64 tensors of random sizes (the same on every
            rank).
    """

    def __init__(
        self,
        dataset_size: int,
        sample_rate: float,
        bands: int,
        generator: DPRandom,
        *,
        partition_seed: int,
        rank: int = 0,
        world_size: int = 1,
        start_step: int = 0,
    ) -> None:
        self.participation_rate = _check_cyclic_args(
            dataset_size, sample_rate, bands, rank, world_size, start_step
        )
        self.dataset_size = dataset_size
        self.sample_rate = sample_rate
        self.bands = int(bands)
        self.generator = require_dprandom(generator, "cyclic Poisson sampling")
        self.rank, self.world_size = rank, world_size
        self.step = int(start_step)
        self._set_partition(partition_seed)

    def _set_partition(self, partition_seed: int) -> None:
        """Build the partition from ``partition_seed`` and this rank's part of each group."""
        self.groups = split_by_group(
            partition_groups(partition_seed, self.dataset_size, self.bands), self.bands
        )
        # precomputed once so that a step draws O(N / (bP)) uniforms and indexes, nothing more
        self._members = tuple(g[g % self.world_size == self.rank] for g in self.groups)
        self.partition_seed = int(partition_seed)

    def group_of_step(self, step: int) -> int:
        """The group that step ``step`` (0-based, from the start of the run) samples.

        Args:
            step: a step index >= 0.

        Returns:
            ``step mod bands``.
        """
        return int(step) % self.bands

    def sample(self) -> torch.Tensor:
        """This rank's sample of the current step's group; advances ``step``.

        Returns:
            sorted int64 example indices (possibly empty).
        """
        members = self._members[self.group_of_step(self.step)]
        # one float64 uniform per member: exactly Bernoulli(p) each (float32 uniforms would
        # round a small p up), and the same consumption as PoissonSampler when b = 1
        mask = self.generator.uniform(members.numel()) < self.participation_rate
        self.step += 1
        return members[mask]

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state: generator, next step, and what fixes the partition.

        Returns:
            ``{"generator": ..., "step": int, "partition_seed": int, "bands": int, "partition": PARTITION}``.
        """
        return {
            "generator": self.generator.state_dict(),
            "step": self.step,
            "partition_seed": self.partition_seed,
            "bands": self.bands,
            "partition": PARTITION,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the sampler that wrote ``state`` stood, with its partition.

        Args:
            state: from ``state_dict()``.

        Raises:
            ValueError: if ``state`` is not a cyclic sampler's, was written with another number
                of bands (the run's min-separation and accounting assume that number), or with
                another partition construction (its seed would give other groups here).
        """
        _check_cyclic_state(state, self.bands)
        self.generator.load_state_dict(state["generator"])
        self.step = int(state["step"])
        if int(state["partition_seed"]) != self.partition_seed:
            # the run's partition wins: a new one would let an example join steps < b apart
            self._set_partition(int(state["partition_seed"]))


def partition_groups(partition_seed: int, dataset_size: int, bands: int) -> torch.Tensor:
    """Each example's group under the partition ``partition_seed`` seeds.

    Example i goes to group floor(b * u_i), u_i the i-th of ``DPRandom(partition_seed)``'s
    uniforms: one draw per example, so the groups are independent and each is uniform over the
    b groups (to within 2^-53: u_i = k_i / 2^53 and the floor is taken exactly, in integers).
    The stream draws u_0, u_1, ... in order whatever N, so example i's group is a function of
    the seed and i alone: the first M entries for N examples are the entries for M examples.

    Args:
        partition_seed: the partition's seed (at least 128 bits of entropy for a run).
        dataset_size: N.
        bands: b >= 1, below 2^36 (the integer product k * b stays within int64).

    Returns:
        an int64 CPU tensor of shape [N], values in 0..b-1.
    """
    return uniform_below(DPRandom(partition_seed).uniform(dataset_size), bands)


def split_by_group(group_of: torch.Tensor, bands: int) -> tuple[torch.Tensor, ...]:
    """The members of each group, from each example's group (cyclic sampling's partition, random
    allocation's steps).

    Args:
        group_of: int64 [N], example i's group (``partition_groups``).
        bands: b.

    Returns:
        b sorted int64 tensors (some possibly empty) that together hold 0..N-1 once each.
    """
    # a stable sort by group keeps each group's indices ascending; on int16 keys numpy's stable
    # sort is a radix sort, O(N) (0.3-0.7 s for N = 10^7 on a loaded 2-core machine)
    keys = group_of.numpy().astype(np.int16 if bands <= np.iinfo(np.int16).max else np.int64)
    order = torch.from_numpy(np.argsort(keys, kind="stable").astype(np.int64, copy=False))
    return tuple(order.split(torch.bincount(group_of, minlength=bands).tolist()))


def _check_cyclic_state(state: dict[str, Any], bands: int) -> None:
    """Raise ValueError unless ``state`` is a cyclic sampler state this sampler can continue.

    Args:
        state: from ``CyclicPoissonSampler.state_dict()``.
        bands: the loading sampler's b.
    """
    if not {"generator", "step", "partition_seed", "bands"} <= set(state):
        raise ValueError(
            "not a CyclicPoissonSampler state (it needs generator, step, partition_seed and bands)"
        )
    if state.get("partition") != PARTITION:
        # rebuilding from the seed would give other groups mid-run (steps fewer than b apart), and
        # the old partition is the one that add/remove neighbours shift (issue 43): not continued
        written = state.get("partition", "a seeded permutation cut into b equal parts")
        raise ValueError(
            f"this cyclic sampler state's partition ({written}) is not the one this dpscale builds "
            f"({PARTITION}: each example's group drawn independently of the others); "
            "continuing it would move examples to other groups mid-run, which the accounting does not cover: "
            "start the run again"
        )
    if int(state["bands"]) != bands:
        raise ValueError(
            f"sampler state has bands={state['bands']}, this sampler bands={bands}: a run must keep "
            "one number of bands (the min-separation its accounting assumes)"
        )


def _check_cyclic_args(
    dataset_size: int, sample_rate: float, bands: int, rank: int, world_size: int, start_step: int
) -> float:
    """Validate ``CyclicPoissonSampler``'s arguments.

    Returns:
        the participation rate p = bands * sample_rate (rounding excess above 1 clipped).

    Raises:
        ValueError: on any invalid argument, in particular bands * sample_rate > 1.
    """
    if dataset_size < 1:
        raise ValueError(f"dataset_size must be >= 1, got {dataset_size}")
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    _check_bands(bands)
    if bands > dataset_size:  # some group would surely be empty: every b-th step a batch of nothing
        raise ValueError(
            f"bands={bands} exceeds dataset_size={dataset_size}: some group would have no example"
        )
    rate = bands * sample_rate
    if rate > 1.0 + RATE_TOLERANCE:
        raise ValueError(
            f"cyclic Poisson sampling includes each example of a step's group with probability b*q, which must "
            f"be <= 1: got bands b={bands}, sample_rate q={sample_rate:g}, b*q={rate:g} (lower the batch size "
            "or the number of bands)"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got {rank} and {world_size}")
    if start_step < 0:
        raise ValueError(f"start_step must be >= 0, got {start_step}")
    return min(rate, 1.0)


def _check_bands(bands: int) -> None:
    """Raise ValueError unless ``bands`` is an integer >= 1."""
    if isinstance(bands, bool) or not isinstance(bands, Integral) or bands < 1:
        raise ValueError(f"bands must be an integer >= 1, got {bands!r}")


def make_sampler(
    mode: str,
    dataset_size: int,
    batch_size: float,
    generator: DPRandom,
    rank: int = 0,
    world_size: int = 1,
    *,
    bands: int = 1,
    partition_seed: int | None = None,
    start_step: int = 0,
    max_batch_size: int | None = None,
) -> PoissonSampler | FixedSizeSampler | ShuffleSampler | CyclicPoissonSampler | ShardedDraw:
    """The sampler for ``mode`` with expected batch size B = ``batch_size``.

    Args:
        mode: "poisson" | "fixed" | "shuffle".
        dataset_size: N.
        batch_size: B, of the whole logical batch (with ``world_size`` > 1 each rank samples
            its own shard).
        generator: the sampling RNG.
        rank, world_size: this process's shard.
        bands: b; 1 (the default) is plain Poisson sampling, b > 1 cyclic Poisson sampling.
        partition_seed: the partition's seed, required when b > 1 (shared by all ranks); also
            seeds the shared stream of a whole-dataset draw over several processes.
        start_step: the first step's index (cyclic sampling only; Poisson has no step).
        max_batch_size: cap Poisson batches (truncated Poisson; b = 1, one process).

    Returns:
        a ``PoissonSampler`` (poisson, b = 1: unchanged for every existing caller), a
        ``CyclicPoissonSampler`` (poisson, b > 1), a ``FixedSizeSampler`` (fixed) or a
        ``ShuffleSampler`` (shuffle); over several processes, fixed-size, shuffled and capped
        batches come as a ``ShardedDraw``.

    Raises:
        ValueError: on an unknown mode, fixed or shuffle with b > 1, or b > 1 (or fixed-size,
            shuffled or capped batches over several processes) without partition_seed.

    Over several processes fixed-size, shuffled and capped batches are drawn whole by every rank
    from one stream (seeded from ``partition_seed`` and ``start_step``), each rank keeping its shard
    (``ShardedDraw``).
    """
    if mode not in SAMPLING_MODES:
        raise ValueError(f"unknown sampling {mode!r}; choose one of {', '.join(SAMPLING_MODES)}")
    _check_bands(bands)
    if mode != "poisson" and bands > 1:
        raise ValueError(
            f"sampling={mode} cannot run with bands={bands}: banded matrix factorization's accounting assumes "
            "cyclic Poisson sampling (b-min-separation), which shuffled batches do not give; use sampling=poisson"
        )
    if mode == "poisson" and bands > 1:
        if partition_seed is None:
            raise ValueError(
                f"bands={bands} (cyclic Poisson sampling) needs a partition_seed shared by all ranks"
            )
        return CyclicPoissonSampler(
            dataset_size,
            batch_size / dataset_size,
            bands,
            generator,
            partition_seed=partition_seed,
            rank=rank,
            world_size=world_size,
            start_step=start_step,
        )
    whole_draw = mode != "poisson" or max_batch_size is not None
    # every rank draws the whole batch from one shared stream (ShardedDraw)
    if whole_draw and world_size > 1:
        if partition_seed is None:
            raise ValueError(
                f"sampling={mode} over {world_size} processes needs a partition_seed shared by all ranks"
            )
        shared = DPRandom(derive_seed(partition_seed, (SHARED_DRAW_KEY, world_size, start_step)))
        inner = make_sampler(mode, dataset_size, batch_size, shared, max_batch_size=max_batch_size)
        return ShardedDraw(inner, rank, world_size)
    if mode == "poisson":
        return PoissonSampler(
            dataset_size, batch_size / dataset_size, generator, rank, world_size, max_batch_size
        )
    if mode == "fixed":
        return FixedSizeSampler(dataset_size, int(batch_size), generator)
    return ShuffleSampler(dataset_size, int(batch_size), generator)

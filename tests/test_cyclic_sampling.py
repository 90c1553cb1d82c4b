"""Cyclic Poisson sampling (b-min-separation, Choquette-Choo et al. 2023).

Statistical tests (seeded, so they are reproducible, but each can fail if the sampler is wrong):
an example joins only the steps of its group, there with probability b*q; per-step batch sizes
follow Binomial(group size, b*q); the seeded partition puts a fixed example in each group with
probability 1/b. Exact tests: min separation, bands == 1 is PoissonSampler bit for bit, resuming
from a state continues bit for bit, and the refusals.
"""

import io
import math

import numpy as np
import pytest
import torch
from scipy import stats

from dpscale.data.sampling import CyclicPoissonSampler, PoissonSampler, make_sampler
from dpscale.rng import DPRandom

P_MIN = 1e-4  # p-value below which a goodness-of-fit test fails


def _group_ids(sampler: CyclicPoissonSampler) -> torch.Tensor:
    """Group index of each example under ``sampler``'s partition."""
    ids = torch.full((sampler.dataset_size,), -1, dtype=torch.long)
    for g, members in enumerate(sampler.groups):
        ids[members] = g
    return ids


def _chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Chi-squared goodness-of-fit p-value, neighbouring cells merged until each expects >= 5."""
    bins_o, bins_e, acc_o, acc_e = [], [], 0.0, 0.0
    for o, e in zip(observed, expected):
        acc_o, acc_e = acc_o + o, acc_e + e
        if acc_e >= 5.0:
            bins_o.append(acc_o)
            bins_e.append(acc_e)
            acc_o = acc_e = 0.0
    bins_o[-1] += acc_o  # the right tail joins the last cell
    bins_e[-1] += acc_e
    o, e = np.array(bins_o), np.array(bins_e)
    return float(stats.chi2.sf(((o - e) ** 2 / e).sum(), len(o) - 1))


# ------------------------------------------------------------------ 1. inclusion
def test_each_example_joins_only_its_groups_steps_with_probability_b_q():
    n, b, q, steps = 601, 4, 0.05, 4000
    sampler = CyclicPoissonSampler(n, q, b, DPRandom(1), partition_seed=2)
    p = sampler.participation_rate
    assert p == pytest.approx(b * q)
    group = _group_ids(sampler)
    counts, sizes = torch.zeros(n), []
    for t in range(steps):
        assert sampler.step == t and sampler.group_of_step(t) == t % b
        batch = sampler.sample()
        assert batch.dtype == torch.int64 and bool((batch[1:] > batch[:-1]).all())  # sorted, no repeats
        assert bool((group[batch] == t % b).all())  # never outside the step's group
        counts[batch] += 1
        sizes.append(batch.numel())
    # each example had steps / b chances (n's groups all get steps / b steps): binomial z-scores
    trials = steps // b
    z = (counts - trials * p) / math.sqrt(trials * p * (1 - p))
    assert z.abs().max() < 5.0
    assert abs(float(z.mean())) < 4.0 / math.sqrt(n)
    chi2 = float((z**2).sum())  # ~ chi2(n) if the counts are independent Binomial(trials, p)
    assert stats.chi2.sf(chi2, n) > P_MIN and stats.chi2.cdf(chi2, n) > P_MIN
    # batch sizes: step t's size ~ Binomial(|group t mod b|, p); groups here are 151/150/150/150
    group_sizes = [g.numel() for g in sampler.groups]
    assert sorted(group_sizes) == [150, 150, 150, 151]
    k = np.arange(max(group_sizes) + 1)
    expected = sum(stats.binom.pmf(k, group_sizes[t % b], p) for t in range(steps))
    observed = np.bincount(np.array(sizes), minlength=k.size)
    assert _chi2_pvalue(observed, expected) > P_MIN


# ------------------------------------------------------------------ 2. partition
def test_partition_is_a_balanced_seeded_split():
    n, b = 601, 4
    sampler = CyclicPoissonSampler(n, 0.01, b, DPRandom(0), partition_seed=5)
    sizes = [g.numel() for g in sampler.groups]
    assert max(sizes) - min(sizes) <= 1 and len(sizes) == b
    assert torch.equal(torch.cat(sampler.groups).sort().values, torch.arange(n))  # each example once
    # exactly the specified construction: DPRandom(seed).permutation(N), array_split, sorted
    perm = DPRandom(5).permutation(n).numpy()
    for got, want in zip(sampler.groups, np.array_split(perm, b)):
        assert got.dtype == torch.int64 and torch.equal(got, torch.from_numpy(np.sort(want)))
    # all ranks get the same partition
    ranks = [CyclicPoissonSampler(n, 0.01, b, DPRandom(r), partition_seed=5, rank=r, world_size=3) for r in range(3)]
    assert all(torch.equal(a, c) for s in ranks for a, c in zip(s.groups, sampler.groups))


def test_a_fixed_example_is_in_each_group_with_probability_one_over_b():
    n, b, seeds = 50, 5, 2000
    watched = [0, 17, 49]
    hits = np.zeros((len(watched), b))
    same_group = 0
    for seed in range(seeds):
        group = _group_ids(CyclicPoissonSampler(n, 0.01, b, DPRandom(0), partition_seed=seed))
        for row, i in enumerate(watched):
            hits[row, group[i]] += 1
        same_group += int(group[0] == group[1])
    for row in hits:  # uniform over the b groups
        assert stats.chi2.sf(((row - seeds / b) ** 2 / (seeds / b)).sum(), b - 1) > P_MIN
    # a pair shares a group with probability (N/b - 1) / (N - 1), not always and not never
    pair = (n / b - 1) / (n - 1)
    assert 0 < same_group < seeds
    assert abs(same_group - seeds * pair) / math.sqrt(seeds * pair * (1 - pair)) < 5.0


# ------------------------------------------------------------------ 3. min separation
def test_steps_that_include_an_example_are_multiples_of_b_apart_across_a_resume():
    n, b, q = 200, 7, 0.1
    first = CyclicPoissonSampler(n, q, b, DPRandom(3), partition_seed=4)
    steps_of = [[] for _ in range(n)]
    for t in range(300):
        for i in first.sample().tolist():
            steps_of[i].append(t)
    # resumed by a sampler built with another partition seed: the saved partition must win
    second = CyclicPoissonSampler(n, q, b, DPRandom(8), partition_seed=9)
    second.load_state_dict(first.state_dict())
    for t in range(300, 600):
        for i in second.sample().tolist():
            steps_of[i].append(t)
    for included in steps_of:
        s = torch.tensor(included)
        assert s.numel() > 10  # p = 0.7 over ~85 chances: every example was sampled repeatedly
        assert bool(((s[:, None] - s[None, :]) % b == 0).all())


# ------------------------------------------------------------------ 4. bands == 1
@pytest.mark.parametrize("rank,world", [(0, 1), (1, 3)])
def test_one_band_is_exactly_poisson_sampling(rank, world):
    n, batch = 1000, 50.0
    made = make_sampler("poisson", n, batch, DPRandom(3), rank, world, bands=1, partition_seed=6)
    plain = PoissonSampler(n, batch / n, DPRandom(3), rank, world)
    cyclic = CyclicPoissonSampler(n, batch / n, 1, DPRandom(3), partition_seed=6, rank=rank, world_size=world)
    assert type(made) is PoissonSampler
    for _ in range(20):
        expected = plain.sample()
        assert torch.equal(made.sample(), expected) and torch.equal(cyclic.sample(), expected)
    # same generator consumption: the streams stand at the same place afterwards
    assert made.generator.state_dict() == plain.generator.state_dict() == cyclic.generator.state_dict()
    # the default (no bands) is unchanged for every existing caller
    assert type(make_sampler("poisson", n, batch, DPRandom(3))) is PoissonSampler


# ------------------------------------------------------------------ 5. state
def test_resume_from_state_continues_bit_identically():
    n, b, q = 503, 5, 0.04
    original = CyclicPoissonSampler(n, q, b, DPRandom(11), partition_seed=12)
    for _ in range(13):
        original.sample()
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)  # as a checkpoint stores it
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["step"] == 13 and state["partition_seed"] == 12 and state["bands"] == b
    after = [original.sample() for _ in range(20)]
    resumed = CyclicPoissonSampler(n, q, b, DPRandom(99), partition_seed=100)
    resumed.load_state_dict(state)
    assert resumed.step == 13 and resumed.partition_seed == 12
    assert all(torch.equal(a, resumed.sample()) for a in after)
    assert resumed.state_dict() == original.state_dict()


def test_start_step_samples_its_group_first():
    n, b, q, k = 503, 5, 0.04, 13
    sampler = CyclicPoissonSampler(n, q, b, DPRandom(21), partition_seed=12, start_step=k)
    assert sampler.step == k and sampler.group_of_step(k) == k % b
    group = sampler.groups[k % b]
    expected = group[DPRandom(21).uniform(group.numel()) < b * q]
    assert torch.equal(sampler.sample(), expected)
    assert sampler.step == k + 1
    made = make_sampler("poisson", n, q * n, DPRandom(21), bands=b, partition_seed=12, start_step=k)
    assert isinstance(made, CyclicPoissonSampler) and torch.equal(made.sample(), expected)


# ------------------------------------------------------------------ 6. sharded
def test_sharded_cyclic_sampler_is_a_cyclic_poisson_sample_of_the_whole_set():
    n, b, q, world, steps = 1001, 3, 0.1, 3, 3000
    samplers = [
        CyclicPoissonSampler(n, q, b, DPRandom(10 + r), partition_seed=77, rank=r, world_size=world)
        for r in range(world)
    ]
    group, p = _group_ids(samplers[0]), samplers[0].participation_rate
    counts = torch.zeros(n)
    for t in range(steps):
        parts = [s.sample() for s in samplers]
        for r, part in enumerate(parts):
            assert bool((part % world == r).all())  # each rank draws only from its shard
            assert bool((group[part] == t % b).all())  # ... and only from the step's group
        union = torch.cat(parts)
        assert union.unique().numel() == union.numel()  # disjoint
        counts[union] += 1
    trials = steps // b  # each example's group had this many steps
    z = (counts - trials * p) / math.sqrt(trials * p * (1 - p))
    assert z.abs().max() < 5.0
    assert abs(float(z.mean())) < 4.0 / math.sqrt(n)


# ------------------------------------------------------------------ 7. refusals
def test_refusals():
    g = DPRandom(0)
    with pytest.raises(ValueError, match=r"bands b=4.*q=0\.3.*b\*q=1\.2"):
        CyclicPoissonSampler(100, 0.3, 4, g, partition_seed=1)
    with pytest.raises(ValueError, match=r"b\*q"):
        make_sampler("poisson", 100, 30, g, bands=4, partition_seed=1)
    for bands in (0, -2, True, 2.0):
        with pytest.raises(ValueError, match="bands"):
            CyclicPoissonSampler(100, 0.01, bands, g, partition_seed=1)
    with pytest.raises(ValueError, match="bands"):
        make_sampler("poisson", 100, 1, g, bands=0)
    with pytest.raises(ValueError, match="cyclic Poisson sampling"):
        make_sampler("shuffle", 100, 10, g, bands=2, partition_seed=1)
    with pytest.raises(ValueError, match="partition_seed"):
        make_sampler("poisson", 100, 10, g, bands=2)
    with pytest.raises(ValueError, match="dataset_size"):
        CyclicPoissonSampler(3, 0.01, 4, g, partition_seed=1)  # an empty group
    sampler = CyclicPoissonSampler(100, 0.05, 4, g, partition_seed=1)
    with pytest.raises(ValueError, match="bands=5"):
        sampler.load_state_dict(CyclicPoissonSampler(100, 0.05, 5, DPRandom(1), partition_seed=1).state_dict())
    with pytest.raises(ValueError, match="CyclicPoissonSampler state"):
        sampler.load_state_dict(PoissonSampler(100, 0.05, DPRandom(1)).state_dict())


def test_b_q_of_exactly_one_takes_the_whole_group():
    # B * b == N: b*q rounds to 1 (or a hair above); every member of the group joins every time
    sampler = make_sampler("poisson", 300, 100, DPRandom(0), bands=3, partition_seed=1)
    assert sampler.participation_rate == 1.0
    for t in range(6):
        assert torch.equal(sampler.sample(), sampler.groups[t % 3])

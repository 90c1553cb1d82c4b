"""Random allocation's sampler (issue 65): every example exactly k times per epoch, each k-subset of
the epoch's steps equally likely and independent across examples and epochs, resumable mid-epoch,
and the exact integer scaling its uniform draws rest on."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from dpscale.privacy.sampling.allocation import AllocationSampler, allocate
from dpscale.privacy.sampling.samplers import ShardedDraw
from dpscale.rng import DPRandom, uniform_below


def test_uniform_below_is_the_exact_integer_floor():
    gen = DPRandom(3)
    u = gen.uniform(2000)
    for n in (1, 2, 3, 7, 234, 1000003, 2**36 - 1):
        got = uniform_below(u, n).tolist()
        want = [int(x * 2**53) * n >> 53 for x in u.tolist()]  # Python integers: no rounding
        assert got == want and max(got) < n


def _epoch(sampler: AllocationSampler) -> list[torch.Tensor]:
    return [sampler.sample() for _ in range(sampler.steps_per_epoch)]


@pytest.mark.parametrize("k", [1, 3])
def test_every_example_joins_exactly_k_distinct_steps_each_epoch(k):
    sampler = AllocationSampler(500, 10, DPRandom(1), k=k)
    for _ in range(3):
        batches = _epoch(sampler)
        joined = torch.cat(batches)
        assert torch.equal(torch.bincount(joined, minlength=500), torch.full((500,), k))
        assert all(
            torch.equal(b, b.sort().values) and b.unique().numel() == b.numel() for b in batches
        )
    assert sum(b.numel() for b in batches) == 500 * k


def test_the_steps_of_one_example_are_a_uniform_k_subset():
    # Floyd's rounds must leave every 2-subset of 6 steps equally likely: 15 cells
    t, k, n, epochs = 6, 2, 4000, 6
    gen, counts = DPRandom(7), {}
    for _ in range(epochs):
        for row in allocate(n, t, k, gen).sort(dim=1).values.tolist():
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    cells = list(itertools.combinations(range(t), k))
    assert set(counts) == set(cells)
    assert chisquare([counts[c] for c in cells]).pvalue > 1e-4


def test_examples_and_epochs_are_allocated_independently():
    # the joint (step of example 0, step of example 1, next epoch's step of example 0) is uniform
    # over the t^3 cells: no example's step depends on another's or on the epoch before
    t, trials = 4, 3000
    gen, joint = DPRandom(13), [0] * t**3
    for _ in range(trials):
        a, b = allocate(2, t, 1, gen), allocate(2, t, 1, gen)
        joint[(int(a[0, 0]) * t + int(a[1, 0])) * t + int(b[0, 0])] += 1
    assert chisquare(joint).pvalue > 1e-4


def test_batch_sizes_vary_around_n_k_over_t():
    sampler = AllocationSampler(1000, 8, DPRandom(5))
    sizes = [b.numel() for _ in range(40) for b in _epoch(sampler)]
    mean = sum(sizes) / len(sizes)
    assert mean == 1000 / 8  # exactly N per epoch
    var = sum((s - mean) ** 2 for s in sizes) / (len(sizes) - 1)
    assert 0.7 < var / (1000 * (1 / 8) * (7 / 8)) < 1.3  # binomial(N, 1/t) sizes, not fixed ones


def test_resume_mid_epoch_is_bit_identical():
    ran = AllocationSampler(300, 7, DPRandom(21), k=2)
    for _ in range(10):  # an epoch and 3 steps
        ran.sample()
    resumed = AllocationSampler(300, 7, DPRandom(99), k=2)
    resumed.load_state_dict(ran.state_dict())
    for _ in range(15):  # the rest of the epoch and the next two
        assert torch.equal(ran.sample(), resumed.sample())


def test_a_state_of_another_allocation_is_refused():
    ran = AllocationSampler(300, 7, DPRandom(21))
    ran.sample()
    with pytest.raises(ValueError, match="cannot resume"):
        AllocationSampler(200, 7, DPRandom(1)).load_state_dict(ran.state_dict())
    with pytest.raises(ValueError, match="t=5"):
        AllocationSampler(300, 5, DPRandom(1)).load_state_dict(ran.state_dict())


def test_ranks_shards_add_up_to_the_one_process_draw():
    whole = _epoch(AllocationSampler(101, 5, DPRandom(8)))
    parts = [ShardedDraw(AllocationSampler(101, 5, DPRandom(8)), r, 3) for r in range(3)]
    for step in range(5):
        merged = torch.cat([p.sample() for p in parts]).sort().values
        assert torch.equal(merged, whole[step])


@pytest.mark.parametrize("bad", [{"k": 0}, {"k": 11}, {"steps_per_epoch": 0}])
def test_bad_settings_are_refused(bad):
    settings = {"dataset_size": 50, "steps_per_epoch": 10, "generator": DPRandom(1), **bad}
    with pytest.raises(ValueError):
        AllocationSampler(**settings)


def test_k_equal_to_t_puts_every_example_in_every_step():
    assert all(b.numel() == 40 for b in _epoch(AllocationSampler(40, 4, DPRandom(2), k=4)))

"""Feature normalisation: per-sample GroupNorm and private Data Normalization (Tramer Algorithm 2)."""

import math

import pytest
import torch

from dpscale.features.normalize import (
    DATA_NORM,
    FeatureNormalizer,
    data_norm_release,
    group_normalize,
    private_channel_mean,
    private_data_norm,
)
from dpscale.rng import DPRandom


def test_groupnorm_gives_zero_mean_unit_variance_per_example_and_group():
    x = torch.randn(5, 81, 7, 7, dtype=torch.float64) * 3 + torch.arange(81, dtype=torch.float64).view(1, 81, 1, 1)
    y = group_normalize(x, 27)
    groups = y.reshape(5, 27, -1)
    assert torch.allclose(groups.mean(-1), torch.zeros(5, 27, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(groups.var(-1, unbiased=False), torch.ones(5, 27, dtype=torch.float64), atol=1e-3)
    # Per example: another example in the batch does not change the result (no privacy cost).
    assert torch.equal(group_normalize(x[:1], 27), y[:1])
    with pytest.raises(ValueError, match="do not divide"):
        group_normalize(x, 10)


def _algorithm_2_reference(x, c1, c2, sigma, tau, seed):
    """Tramer & Boneh Algorithm 2 written as loops over examples (the noise drawn in the same order)."""
    n, k = x.shape[:2]
    generator = DPRandom(seed)

    def channel_mean(data, clip):
        total = [0.0] * k
        for i in range(n):
            mu = [float(data[i, c].double().mean()) for c in range(k)]
            norm = math.sqrt(sum(v * v for v in mu))
            scale = min(1.0, clip / norm) if norm > 0 else 1.0
            total = [t + v * scale for t, v in zip(total, mu)]
        noise = generator.normal((k,), dtype=torch.float64).tolist()
        return [(t + sigma * clip * z) / n for t, z in zip(total, noise)]

    mean = channel_mean(x, c1)
    mean_sq = channel_mean(x * x, c2)
    var = [max(s - m * m, tau) for s, m in zip(mean_sq, mean)]
    return torch.tensor(mean, dtype=torch.float64), torch.tensor(var, dtype=torch.float64)


def test_private_data_norm_matches_algorithm_2_loop():
    torch.manual_seed(1)
    x = torch.rand(7, 3, 2, 2) * torch.tensor([1.0, 5.0, 0.01]).view(1, 3, 1, 1)
    stats = private_data_norm(x, 0.5, 2.0, 1.5, 1e-3, DPRandom(42))
    mean, var = _algorithm_2_reference(x, 0.5, 2.0, 1.5, 1e-3, 42)
    assert torch.allclose(stats.mean, mean, rtol=1e-6, atol=1e-12)
    assert torch.allclose(stats.var, var, rtol=1e-6, atol=1e-12)
    assert (stats.var >= 1e-3).all()
    normalised = FeatureNormalizer("datanorm", stats=stats)(x)
    expected = (x.double() - mean.view(1, 3, 1, 1)) / var.sqrt().view(1, 3, 1, 1)
    assert torch.allclose(normalised.double(), expected, atol=1e-5)


def test_channel_mean_noise_has_std_sigma_c_over_n():
    # With all-zero data the estimate is pure noise: N(0, (sigma C / N)^2) per channel.
    n, k, sigma, clip = 50, 20000, 2.0, 0.3
    estimate = private_channel_mean(torch.zeros(n, k, 1, 1), clip, sigma, DPRandom(3))
    expected_std = sigma * clip / n
    # The sample std of 20000 normals is within 3% of the truth with overwhelming probability.
    assert float(estimate.std()) == pytest.approx(expected_std, rel=0.03)
    assert abs(float(estimate.mean())) < 4 * expected_std / math.sqrt(k)


def test_one_example_moves_the_noiseless_sum_by_at_most_the_clip_norm():
    torch.manual_seed(0)
    x = torch.rand(10, 4, 3, 3)
    outlier = torch.full((1, 4, 3, 3), 1e6)
    gen = lambda: DPRandom(0)  # noqa: E731
    without = private_channel_mean(x, 0.2, 0.0, gen()) * 10
    with_outlier = private_channel_mean(torch.cat([x, outlier]), 0.2, 0.0, gen()) * 11
    assert float((with_outlier - without).norm()) <= 0.2 + 1e-9


def test_variance_floor_and_state_round_trip():
    x = torch.ones(8, 2, 3, 3)  # constant channels: true variance 0
    stats = private_data_norm(x, 10.0, 10.0, 0.0, 1e-5, DPRandom(0))
    assert torch.allclose(stats.var, torch.full((2,), 1e-5, dtype=torch.float64))
    norm = FeatureNormalizer("datanorm", stats=stats)
    restored = FeatureNormalizer.from_state_dict(norm.state_dict())
    assert torch.equal(restored(x), norm(x))
    group = FeatureNormalizer.from_state_dict(FeatureNormalizer("groupnorm", 2).state_dict())
    y = torch.randn(3, 4, 2, 2)
    assert (group.kind, group.groups) == ("groupnorm", 2) and torch.equal(group(y), group_normalize(y, 2))


def test_data_norm_release_is_two_gaussian_sums():
    release = data_norm_release(8.0)
    assert (release.label, release.sample_rate, release.noise_multiplier, release.steps) == (DATA_NORM, 1.0, 8.0, 2)

"""Feature normalisation: per-sample GroupNorm, private Data Normalization (Tramer Algorithm 2) and private centring."""

import math

import pytest
import torch

from dpscale.features.normalize import (
    FeatureNormalizer,
    group_normalize,
    private_channel_mean,
    private_data_norm,
    private_feature_mean,
)
from dpscale.privacy.accounting.segments import (
    DATA_NORM,
    FEATURE_MEAN,
    data_norm_release,
    feature_mean_release,
)
from dpscale.rng import DPRandom


def test_groupnorm_gives_zero_mean_unit_variance_per_example_and_group():
    x = torch.randn(5, 81, 7, 7, dtype=torch.float64) * 3 + torch.arange(
        81, dtype=torch.float64
    ).view(1, 81, 1, 1)
    y = group_normalize(x, 27)
    groups = y.reshape(5, 27, -1)
    assert torch.allclose(groups.mean(-1), torch.zeros(5, 27, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(
        groups.var(-1, unbiased=False), torch.ones(5, 27, dtype=torch.float64), atol=1e-3
    )
    # Per example: another example in the batch does not change the result (no privacy cost).
    assert torch.equal(group_normalize(x[:1], 27), y[:1])
    with pytest.raises(ValueError, match="do not divide"):
        group_normalize(x, 10)


def _algorithm_2_reference(x, c1, c2, sigma, tau, seed):
    """Tramer & Boneh Algorithm 2 written as loops over examples in Python floats (float64; the
    noise drawn in the same order). An example whose K-vector (or its norm) is not finite
    contributes nothing to that sum (issue 43, 6b)."""
    n, k = x.shape[:2]
    generator = DPRandom(seed)
    rows = [[[float(v) for v in x[i, c].flatten()] for c in range(k)] for i in range(n)]

    def channel_mean(square, clip):
        total = [0.0] * k
        for example in rows:
            mu = [sum(v * v if square else v for v in values) / len(values) for values in example]
            norm = math.sqrt(sum(v * v for v in mu))
            if not math.isfinite(norm):
                continue
            scale = min(1.0, clip / norm) if norm > 0 else 1.0
            total = [t + v * scale for t, v in zip(total, mu)]
        noise = generator.normal((k,), dtype=torch.float64).tolist()
        return [(t + sigma * clip * z) / n for t, z in zip(total, noise)]

    mean = channel_mean(False, c1)
    mean_sq = channel_mean(True, c2)
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


# One example holding inf, NaN, or a finite float32 value whose square overflows float32 (issue 43,
# 6b): Data Normalization released NaN, so that example's presence was visible in the release.
BAD_VALUES = pytest.mark.parametrize(
    "bad", [float("inf"), float("nan"), 3e19], ids=["inf", "nan", "3e19"]
)


def _normal_batch(n=10):
    torch.manual_seed(4)
    return torch.rand(n, 3, 2, 2) * 4  # per-channel variance about 1.3, well above the noise below


def _with_bad_example(x, bad):
    """x plus one more example: ordinary except for one coordinate set to ``bad``."""
    example = x[:1].clone()
    example[0, 1, 0, 1] = bad
    return torch.cat([x, example])


@BAD_VALUES
def test_one_non_finite_or_overflowing_example_cannot_make_the_release_non_finite(bad):
    x = _with_bad_example(_normal_batch(), bad)
    stats = private_data_norm(x, 0.5, 2.0, 1.5, 1e-3, DPRandom(0))
    assert stats.mean.isfinite().all() and stats.var.isfinite().all()
    assert private_channel_mean(x, 0.5, 1.5, DPRandom(0)).isfinite().all()
    assert private_channel_mean(x.square(), 0.5, 1.5, DPRandom(0)).isfinite().all()


@pytest.mark.parametrize("fill", [float("inf"), float("-inf"), float("nan")])
def test_an_all_non_finite_batch_releases_pure_noise(fill):
    x = torch.full((4, 3, 2, 2), fill)
    stats = private_data_norm(x, 0.5, 2.0, 1.5, 1e-3, DPRandom(1))
    noise = DPRandom(1).normal((2, 3), dtype=torch.float64)  # mean's noise, then mean-square's
    assert torch.allclose(stats.mean, noise[0] * 1.5 * 0.5 / 4, rtol=1e-12, atol=0)
    expected_var = torch.clamp(noise[1] * 1.5 * 2.0 / 4 - stats.mean.square(), min=1e-3)
    assert torch.allclose(stats.var, expected_var, rtol=1e-12, atol=0)


def _noisy_sums(x, c1, c2, sigma, tau, seed):
    """N * released mean and N * released mean-square (recovered from var; var must exceed tau)."""
    stats = private_data_norm(x, c1, c2, sigma, tau, DPRandom(seed))
    assert (stats.var > tau).all(), "var was floored: the mean-square cannot be recovered"
    return stats.mean * len(x), (stats.var + stats.mean.square()) * len(x)


@BAD_VALUES
def test_adding_a_bad_example_moves_each_noisy_sum_by_at_most_its_clip(bad):
    # Neighbouring datasets under add/remove, same noise: the noise cancels in the difference of
    # the (un-normalised) sums, which is the added example's clipped contribution.
    x, c1, c2 = _normal_batch(), 0.5, 2.0
    mean_without, square_without = _noisy_sums(x, c1, c2, 0.1, 1e-3, 5)
    mean_with, square_with = _noisy_sums(_with_bad_example(x, bad), c1, c2, 0.1, 1e-3, 5)
    mean_shift, square_shift = (
        (mean_with - mean_without).norm(),
        (square_with - square_without).norm(),
    )
    if math.isfinite(bad):  # 3e19: clipped to exactly C1 and C2 (it needs clipping on both)
        assert float(mean_shift) == pytest.approx(c1, rel=1e-9)
        assert float(square_shift) == pytest.approx(c2, rel=1e-9)
    else:  # a non-finite example contributes exactly nothing
        assert float(mean_shift) < 1e-12 and float(square_shift) < 1e-12
    without = private_channel_mean(x, c1, 3.0, DPRandom(6)) * len(x)
    with_bad = private_channel_mean(_with_bad_example(x, bad), c1, 3.0, DPRandom(6)) * (len(x) + 1)
    assert float((with_bad - without).norm()) <= c1 * (1 + 1e-9)


def test_data_norm_with_bad_examples_matches_the_float64_loop():
    x = _normal_batch()
    for bad in (float("inf"), float("nan"), 3e19, -3e19):
        x = _with_bad_example(x, bad)
    stats = private_data_norm(x, 0.5, 2.0, 1.5, 1e-3, DPRandom(42))
    mean, var = _algorithm_2_reference(x, 0.5, 2.0, 1.5, 1e-3, 42)
    assert torch.allclose(stats.mean, mean, rtol=1e-9, atol=1e-12)
    assert torch.allclose(stats.var, var, rtol=1e-9, atol=1e-12)
    # Batching the float64 casts does not change the release.
    batched = private_data_norm(x, 0.5, 2.0, 1.5, 1e-3, DPRandom(42), batch_size=3)
    assert torch.allclose(batched.mean, stats.mean, rtol=1e-12) and torch.allclose(
        batched.var, stats.var, rtol=1e-12
    )
    # float64 input whose square overflows float64 (2e154^2 > 1.8e308): its channel means (norm
    # about 5e153) still count, clipped to C1; its mean-squares contribute nothing.
    x64 = _with_bad_example(_normal_batch().double(), 2e154)
    stats = private_data_norm(x64, 0.5, 2.0, 1.5, 1e-3, DPRandom(42))
    mean, var = _algorithm_2_reference(x64, 0.5, 2.0, 1.5, 1e-3, 42)
    assert torch.allclose(stats.mean, mean, rtol=1e-9, atol=1e-12)
    assert torch.allclose(stats.var, var, rtol=1e-9, atol=1e-12)
    shift = (
        private_data_norm(x64[:-1], 0.5, 2.0, 1.5, 1e-3, DPRandom(42)).mean * 10 - stats.mean * 11
    )
    assert float(shift.norm()) == pytest.approx(0.5, rel=1e-9)


def test_data_norm_refuses_parameters_that_make_the_release_non_finite():
    x = _normal_batch()
    for args in (
        (float("inf"), 1.0, 1.0, 1e-3),
        (1.0, 1.0, float("inf"), 1e-3),
        (1.0, 0.0, 1.0, 1e-3),
    ):
        with pytest.raises(ValueError, match="private_data_norm needs"):
            private_data_norm(x, *args, DPRandom(0))
    with pytest.raises(ValueError, match="private_channel_mean needs"):
        private_channel_mean(x, float("inf"), 1.0, DPRandom(0))
    with pytest.raises(ValueError, match="private_channel_mean needs"):
        private_channel_mean(x[:0], 1.0, 1.0, DPRandom(0))


def test_variance_floor_and_state_round_trip():
    x = torch.ones(8, 2, 3, 3)  # constant channels: true variance 0
    stats = private_data_norm(x, 10.0, 10.0, 0.0, 1e-5, DPRandom(0))
    assert torch.allclose(stats.var, torch.full((2,), 1e-5, dtype=torch.float64))
    norm = FeatureNormalizer("datanorm", stats=stats)
    restored = FeatureNormalizer.from_state_dict(norm.state_dict())
    assert torch.equal(restored(x), norm(x))
    group = FeatureNormalizer.from_state_dict(FeatureNormalizer("groupnorm", 2).state_dict())
    y = torch.randn(3, 4, 2, 2)
    assert (group.kind, group.groups) == ("groupnorm", 2) and torch.equal(
        group(y), group_normalize(y, 2)
    )


def test_data_norm_release_is_two_gaussian_sums():
    release = data_norm_release(8.0)
    assert (release.label, release.sample_rate, release.noise_multiplier, release.steps) == (
        DATA_NORM,
        1.0,
        8.0,
        2,
    )


def _feature_mean_reference(x, clip, sigma, seed):
    """Private centring as a loop over examples in float64: clip each flattened example to
    ``clip``, sum, add sigma * clip times one standard normal per feature (same draw order), / N."""
    rows = [[float(v) for v in example.double().flatten()] for example in x]
    total = [0.0] * len(rows[0])
    for row in rows:
        norm = math.sqrt(sum(v * v for v in row))
        scale = min(1.0, clip / norm) if norm > 0 else 1.0
        total = [t + v * scale for t, v in zip(total, row)]
    noise = DPRandom(seed).normal((len(total),), dtype=torch.float64).tolist()
    mean = [(t + sigma * clip * z) / len(rows) for t, z in zip(total, noise)]
    return torch.tensor(mean, dtype=torch.float64).reshape(x.shape[1:])


def test_private_feature_mean_matches_the_float64_loop_and_is_subtracted():
    torch.manual_seed(2)
    x = torch.randn(9, 3, 2, 2) * 2 + 1  # norms around 4-8: some examples clipped at 5, some not
    center = private_feature_mean(x, 5.0, 1.5, DPRandom(7), batch_size=4)  # batches must not matter
    assert torch.allclose(center, _feature_mean_reference(x, 5.0, 1.5, 7), rtol=1e-9, atol=1e-12)
    assert center.dtype == torch.float64 and center.shape == (3, 2, 2)
    normalizer = FeatureNormalizer("groupnorm", 3, center=center)
    # Normalising batch by batch inside equals normalising first (the pipeline's memory-saving path).
    grouped = group_normalize(x, 3)
    inside = private_feature_mean(
        x, 5.0, 1.5, DPRandom(7), batch_size=4, transform=FeatureNormalizer("groupnorm", 3)
    )
    assert torch.allclose(
        inside, private_feature_mean(grouped, 5.0, 1.5, DPRandom(7)), rtol=1e-9, atol=1e-12
    )
    assert torch.allclose(
        normalizer(x).double(), group_normalize(x, 3).double() - center, atol=1e-6
    )
    restored = FeatureNormalizer.from_state_dict(normalizer.state_dict())
    assert torch.equal(restored.center, center) and torch.equal(restored(x), normalizer(x))
    assert not normalizer.is_identity and FeatureNormalizer().is_identity
    assert not FeatureNormalizer(center=center).is_identity


def test_feature_mean_noise_has_std_sigma_r_over_n_and_one_example_moves_the_sum_by_at_most_r():
    n, d, sigma, clip = 40, 20000, 3.0, 0.7
    estimate = private_feature_mean(torch.zeros(n, d), clip, sigma, DPRandom(5))
    expected_std = sigma * clip / n
    # 20000 normals: within 3%
    assert float(estimate.std()) == pytest.approx(expected_std, rel=0.03)
    assert abs(float(estimate.mean())) < 4 * expected_std / math.sqrt(d)
    torch.manual_seed(0)
    x = torch.rand(10, 4, 3, 3)
    outlier = torch.full((1, 4, 3, 3), -1e6)  # an input that would dominate an unclipped mean
    without = private_feature_mean(x, 0.5, 0.0, DPRandom(0)) * 10
    with_outlier = private_feature_mean(torch.cat([x, outlier]), 0.5, 0.0, DPRandom(0)) * 11
    assert float((with_outlier - without).norm()) <= 0.5 + 1e-9
    # An input that overflows (inf, NaN) contributes nothing instead of poisoning the release.
    broken = torch.cat(
        [x, torch.full((1, 4, 3, 3), float("inf")), torch.full((1, 4, 3, 3), float("nan"))]
    )
    assert torch.allclose(
        private_feature_mean(broken, 0.5, 0.0, DPRandom(0)) * 12, without, atol=1e-12
    )
    with pytest.raises(ValueError, match="clip > 0"):
        private_feature_mean(x, 0.0, 1.0, DPRandom(0))


def test_feature_mean_release_is_one_gaussian_sum():
    release = feature_mean_release(8.0)
    assert (release.label, release.sample_rate, release.noise_multiplier, release.steps) == (
        FEATURE_MEAN,
        1.0,
        8.0,
        1,
    )

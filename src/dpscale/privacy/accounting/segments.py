"""The vocabulary of an accounting history: its segments, the DP-SGD label and the one-off releases.

Besides DP-SGD steps the history holds one-off *releases* computed from the private data
before training, e.g. the two Gaussian sums of private Data Normalization (Tramer & Boneh,
Algorithm 2). They are Gaussian mechanisms on the whole dataset (q = 1), composed with the
DP-SGD steps by ``dp_accounting`` exactly like the steps themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from dpscale.privacy.accounting.batch_sampling import (
    POISSON,
    REPLACE_ONE,
    BatchSampling,
    history_adjacency,
)

DP_SGD = "dp-sgd"  # label of DP-SGD steps; any other label is a one-off release


@dataclass(frozen=True)
class AccountingSegment:
    """A run of ``steps`` identical Gaussian mechanisms on a Poisson sample of the data.

    Attributes:
        sample_rate: Poisson sampling probability q = B / N, in (0, 1] (1: the whole dataset).
        noise_multiplier: sigma; the noise std is sigma * C on a sum of terms clipped to norm C.
        steps: number of mechanisms (logical DP-SGD steps, or releases) with these parameters.
        label: "dp-sgd" for training steps; anything else names a one-off release
            (e.g. "data-norm"), which does not count as a training step.
        batches: how the steps' batches were drawn (``dpscale.privacy.accounting.batch_sampling``): Poisson
            unless the run sampled fixed-size, shuffled or capped batches.
    """

    sample_rate: float
    noise_multiplier: float
    steps: int
    label: str = DP_SGD
    batches: BatchSampling = POISSON

    def __post_init__(self) -> None:
        if isinstance(self.batches, dict):  # read back from a plan's dataclasses.asdict
            object.__setattr__(self, "batches", BatchSampling(**self.batches))

    @property
    def compositions(self) -> int:
        """Gaussian mechanisms one example can enter (the epochs of a shuffled segment, else steps)."""
        return self.batches.compositions(self.sample_rate, self.steps)


def check_mechanism(sample_rate: float, noise_multiplier: float, steps: int) -> None:
    """Refuse a mechanism the accountant cannot account.

    Args:
        sample_rate: q, which must be in (0, 1].
        noise_multiplier: sigma, which must be positive and finite (0 is a non-private run).
        steps: how many mechanisms, a non-negative integer.

    Raises:
        ValueError: one of them is out of range, in one line naming it.
    """
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate q must be in (0, 1], got {sample_rate}")
    if not noise_multiplier > 0.0 or not math.isfinite(noise_multiplier):
        raise ValueError(
            f"noise_multiplier must be a positive finite number for a private run, got {noise_multiplier}"
        )
    if int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps}")


def adjacency_of(segments: Sequence[AccountingSegment]) -> str:
    """The adjacency every segment of a history is accounted under.

    Args:
        segments: the history (DP-SGD segments and releases).

    Returns:
        ``batch_sampling.ADD_REMOVE`` or ``batch_sampling.REPLACE_ONE``.

    Raises:
        ValueError: segments that need different adjacencies.
    """
    return history_adjacency([s.batches for s in segments], [s.sample_rate < 1.0 for s in segments])


def gaussian_release(label: str, noise_multiplier: float, count: int = 1) -> AccountingSegment:
    """``count`` Gaussian mechanisms on the whole dataset, each a sum of per-example terms
    clipped to norm C plus N(0, (noise_multiplier * C)^2) noise (sensitivity C under add/remove).

    Args:
        label: what was released (e.g. "data-norm"); must not be "dp-sgd".
        noise_multiplier: sigma of each mechanism (noise std / clipping norm), > 0.
        count: number of such sums released.
    """
    if label == DP_SGD:
        raise ValueError(f"{DP_SGD!r} is reserved for training steps; name the release")
    check_mechanism(1.0, noise_multiplier, count)
    return AccountingSegment(1.0, float(noise_multiplier), int(count), label)


# label of private Data Normalization's two Gaussian sums (Tramer Algorithm 2)
DATA_NORM = "data-norm"
FEATURE_MEAN = "feature-mean"  # label of private centring's one Gaussian sum (features.center)


def data_norm_release(noise_multiplier: float) -> AccountingSegment:
    """The accounting event of PrivDataNorm: two Gaussian sums with noise multiplier sigma_norm."""
    return gaussian_release(DATA_NORM, noise_multiplier, 2)


def feature_mean_release(noise_multiplier: float) -> AccountingSegment:
    """The accounting event of private centring: one Gaussian sum with noise multiplier sigma_center."""
    return gaussian_release(FEATURE_MEAN, noise_multiplier, 1)


def feature_releases(
    data_norm_noise: float | None, feature_mean_noise: float | None
) -> tuple[AccountingSegment, ...]:
    """The releases a run's feature normalisation makes before training, in the order it draws
    them (Data Normalization, then centring); a None noise multiplier means that release is not made.
    The one list both a run's DP plan and ``dpscale account`` compose."""
    releases: tuple[AccountingSegment, ...] = ()
    if data_norm_noise is not None:
        releases += (data_norm_release(data_norm_noise),)
    if feature_mean_noise is not None:
        releases += (feature_mean_release(feature_mean_noise),)
    return releases


def releases_under(
    releases: Sequence[AccountingSegment], batches: BatchSampling
) -> tuple[AccountingSegment, ...]:
    """``releases`` labelled with a run's sampling, so that a replace-one run (fixed-size or
    shuffled batches) accounts its full-data releases under replace-one too (noise multiplier
    sigma/2), also when they are reported apart (``epsilon_by_label``).

    Raises:
        ValueError: a subsampled (Poisson) release, e.g. a source run's steps, in a replace-one run.
    """
    if batches.adjacency != REPLACE_ONE:
        return tuple(releases)
    tagged = tuple(replace(r, batches=batches) if r.sample_rate == 1.0 else r for r in releases)
    adjacency_of(tagged)  # a source run's Poisson steps cannot join a replace-one history
    return tagged

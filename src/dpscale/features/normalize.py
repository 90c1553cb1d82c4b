"""Feature normalisation: per-sample GroupNorm (free) or private Data Normalization (costs privacy).

Tramer & Boneh (2021, Section 2.2) find that normalising ScatterNet features is what makes linear
models converge fast. Two options:

* GroupNorm: each example's channels are split into G groups and each group is shifted and
  scaled to zero mean and unit variance *using that example alone*. No statistic of the
  dataset is involved, so there is no privacy cost.
* Data Normalization (their Appendix B, Algorithm 2, "PrivDataNorm"): channels are normalised by
  dataset-wide means and variances, estimated with two Gaussian mechanisms on clipped
  per-example statistics. Its cost is accounted as the "data-norm" release (two Gaussian sums
  with noise multiplier sigma_norm), composed with DP-SGD in the same accountant.

Either may be followed by private centring (``features.center``, dpscale issue 28): the mean
normalised feature vector of the training set (one Gaussian sum, the "feature-mean" release) is
subtracted from every input. GroupNorm leaves a large component common to all examples (on
Fashion-MNIST's padded ScatterNet features, 30 of each example's norm of about 53); in a linear
model the DP noise on the weights along it shifts every example's logits alike, and removing it
lifted the linear head by about 0.4 points at epsilon 3 (docs/results.md).

Both work on any [N, K, ...] tensor (features or images); trailing dimensions are spatial.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from dpscale.data.user_ids import UserIndex
from dpscale.rng import DPRandom, require_dprandom

__all__ = [  # the release labels and events are the accounting's (privacy/accounting/segments.py)
    "NORMALIZATIONS",
    "DataNormStats",
    "FeatureNormalizer",
    "group_normalize",
    "private_channel_mean",
    "private_data_norm",
    "private_feature_mean",
]
NORMALIZATIONS: tuple[str, ...] = ("none", "groupnorm", "datanorm")
GROUPNORM_EPS = 1e-5  # as torch.nn.GroupNorm


def group_normalize(x: torch.Tensor, groups: int, eps: float = GROUPNORM_EPS) -> torch.Tensor:
    """Per-example GroupNorm without affine parameters (zero mean, unit variance per group).

    Args:
        x: [N, K, ...] features; the K channels are split into ``groups`` consecutive groups.
        groups: G, must divide K.
        eps: added to each group's variance.

    Returns:
        Tensor of x's shape.
    """
    channels = x.shape[1]
    if groups < 1 or channels % groups:
        raise ValueError(
            f"features have {channels} channels, which {groups} groups do not divide evenly"
        )
    return F.group_norm(x, groups, eps=eps)


def _per_example_channel_means(x: torch.Tensor, square: bool, batch_size: int) -> torch.Tensor:
    """Each example's mean over its spatial positions of x (or of x^2), in float64.

    Args:
        x: [N, K, ...] features, any float dtype and device.
        square: average x^2 instead of x.
        batch_size: examples cast to float64 at a time (bounds the copy).

    Returns:
        [N, K] float64 on x's device; inf/NaN where an example's input is, or where its float64
        square or sum overflows (only float64 inputs can: float32's maximum squared is 1.2e77).
    """
    parts = []
    for start in range(0, len(x), batch_size):
        batch = x[start : start + batch_size]
        rows = batch.reshape(len(batch), x.shape[1], -1).to(torch.float64)
        # Square after the cast: 3e19 squared overflows float32 (max 3.4e38) but not float64.
        parts.append((rows.square() if square else rows).mean(dim=2))
    return torch.cat(parts)


def _clipped_sum(stats: torch.Tensor, clip: float) -> torch.Tensor:
    """Sum over examples of each row of ``stats`` clipped to L2 norm ``clip``.

    Args:
        stats: [N, K] float64 per-example statistics.
        clip: C, the L2 bound on each row (the sum's add/remove sensitivity).

    Returns:
        [K] float64 on CPU.
    """
    norms = stats.norm(dim=1, keepdim=True)
    factors = torch.clamp(clip / norms.clamp_min(1e-300), max=1.0)
    # A row whose norm is not finite (inf/NaN input, or a float64 row beyond about 1e154 whose
    # squares overflow) contributes exactly zero, as in private_feature_mean: inf * 0 would be
    # NaN and make that one example's presence visible in the release. Zero is within C, so the
    # sensitivity is unchanged, and each contribution still depends on its own example alone.
    return torch.where(norms.isfinite(), stats * factors, 0.0).sum(dim=0).cpu()


def _per_user_means(stats: torch.Tensor, users: UserIndex | None) -> torch.Tensor:
    """Each user's mean of its examples' rows of ``stats`` (the rows as they are without users):
    at the user unit one clipped row per person, so a person's sensitivity is the clip however
    many images they hold (a non-finite example makes its user's row non-finite: it then
    contributes zero, as an example does)."""
    if users is None:
        return stats
    codes = torch.from_numpy(users.codes).to(stats.device)
    sums = torch.zeros(
        users.num_users, stats.shape[1], dtype=stats.dtype, device=stats.device
    ).index_add_(0, codes, stats)
    return sums / torch.from_numpy(users.sizes).to(stats.device, stats.dtype).unsqueeze(1)


def _release_channel_mean(
    x: torch.Tensor,
    clip: float,
    noise_multiplier: float,
    generator: DPRandom,
    square: bool,
    batch_size: int,
    users: UserIndex | None = None,
) -> torch.Tensor:
    """PrivChannelMean on x (or x^2) without argument checks; see :func:`private_channel_mean`."""
    rows = _per_user_means(_per_example_channel_means(x, square, batch_size), users)
    total = _clipped_sum(rows, clip)
    noise = require_dprandom(generator, "Data Normalization noise").normal(
        total.shape, dtype=torch.float64
    )
    return (total + noise * (noise_multiplier * clip)) / len(rows)


def _finite_positive(*values: float) -> bool:
    """True if every value is a finite number > 0 (an infinite clip or floor would make the release inf/NaN)."""
    return all(math.isfinite(v) and v > 0 for v in values)


def private_channel_mean(
    x: torch.Tensor,
    clip: float,
    noise_multiplier: float,
    generator: DPRandom,
    batch_size: int = 4096,
    users: UserIndex | None = None,
) -> torch.Tensor:
    """PrivChannelMean of Algorithm 2: mean over examples of per-example channel means, each
    clipped to L2 norm ``clip``, plus N(0, (noise_multiplier * clip)^2) noise on the sum.

    One Gaussian mechanism with sensitivity ``clip`` (add/remove one example); the division by
    N treats the dataset size as public, as DP-SGD's division by the expected batch size does.
    An example whose channel means' L2 norm is not finite (an inf/NaN feature) contributes zero,
    so the estimate is finite for any input; how many did is not reported (it is not private).

    Args:
        x: [N, K, ...] private features; N >= 1.
        clip: C, finite L2 bound on each example's K-vector of channel means.
        noise_multiplier: sigma_norm, finite (0: no noise, not private).
        generator: the noise RNG (128-bit seeded: the released statistics must not reveal
            their noise); draws K standard normals (float64, on CPU), even when sigma_norm = 0.
        batch_size: examples cast to float64 at a time.
        users: the examples' users (privacy unit user): each user's mean of its examples' channel
            means is one clipped row (sensitivity C per person), and the sum is divided by U.

    Returns:
        [K] float64 estimate.
    """
    if not (
        _finite_positive(clip)
        and math.isfinite(noise_multiplier)
        and noise_multiplier >= 0
        and len(x) > 0
    ):
        raise ValueError(
            "private_channel_mean needs a finite clip > 0, a finite noise_multiplier >= 0 and N >= 1"
        )
    return _release_channel_mean(x, clip, noise_multiplier, generator, False, batch_size, users)


@dataclass(frozen=True)
class DataNormStats:
    """Per-channel statistics used to normalise: (x - mean) / sqrt(var), broadcast over space.

    Attributes:
        mean: [K] float64 (private estimate).
        var: [K] float64, at least the floor tau.
    """

    mean: torch.Tensor
    var: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        mean = self.mean.to(device=x.device, dtype=x.dtype).reshape(shape)
        std = self.var.sqrt().to(device=x.device, dtype=x.dtype).reshape(shape)
        return (x - mean) / std


def private_data_norm(
    x: torch.Tensor,
    clip_mean: float,
    clip_square: float,
    noise_multiplier: float,
    floor: float,
    generator: DPRandom,
    batch_size: int = 4096,
    users: UserIndex | None = None,
) -> DataNormStats:
    """PrivDataNorm (Tramer & Boneh, Algorithm 2): private per-channel mean and variance.

    mean = PrivChannelMean(x, C1); mean_sq = PrivChannelMean(x^2, C2) (drawn in this order from
    ``generator``); var = max(mean_sq - mean^2, tau). Privacy: two Gaussian mechanisms with noise
    multiplier sigma_norm, i.e. (alpha, alpha / sigma_norm^2)-RDP (their Claim B.5); see
    :func:`data_norm_release` for the accounting event.

    x^2 is taken in float64, so a float32 feature up to its maximum is clipped like any other.
    In each sum, an example whose statistic's L2 norm is not finite in float64 (an inf/NaN
    feature; for float64 input, values beyond about 1e154) contributes zero, so both statistics
    are finite for any input and each sum's sensitivity stays C1 or C2 (issue 43, 6b). How many
    examples that dropped is not reported (the count is not private).

    Args:
        x: [N, K, ...] private training features; N >= 1.
        clip_mean: C1, L2 bound on each example's channel means (finite).
        clip_square: C2, L2 bound on each example's channel mean-squares (finite).
        noise_multiplier: sigma_norm (finite).
        floor: tau, the smallest variance allowed (keeps noisy near-constant channels finite).
        generator: noise RNG.
        batch_size: examples cast to float64 at a time.
        users: the examples' users (privacy unit user): both sums clip one row per person, its
            mean over its images (``private_channel_mean``).

    Returns:
        DataNormStats.
    """
    finite_noise = math.isfinite(noise_multiplier) and noise_multiplier >= 0
    if not (_finite_positive(clip_mean, clip_square, floor) and finite_noise and len(x) > 0):
        raise ValueError(
            "private_data_norm needs finite clip_mean, clip_square, floor > 0, a finite noise_multiplier >= 0 and N >= 1"
        )
    mean = _release_channel_mean(
        x, clip_mean, noise_multiplier, generator, False, batch_size, users
    )
    mean_square = _release_channel_mean(
        x, clip_square, noise_multiplier, generator, True, batch_size, users
    )
    var = torch.clamp(mean_square - mean.square(), min=floor)
    return DataNormStats(mean, var)


def private_feature_mean(
    x: torch.Tensor,
    clip: float,
    noise_multiplier: float,
    generator: DPRandom,
    batch_size: int = 4096,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    users: UserIndex | None = None,
) -> torch.Tensor:
    """The training set's mean feature vector, privately: each example's flattened features are
    clipped to L2 norm ``clip``, summed in float64, and N(0, (noise_multiplier * clip)^2) noise is
    added to every coordinate of the sum, which is then divided by N (public, as DP-SGD's
    expected batch size).

    One Gaussian mechanism with sensitivity ``clip`` under add/remove of one example
    (:func:`feature_mean_release` is its accounting event).

    Args:
        x: [N, ...] private training features (normalised, or normalised by ``transform``); N >= 1.
        clip: R, the L2 bound on each example's feature vector.
        noise_multiplier: sigma_center (0: exact mean, not private).
        generator: the noise RNG; draws one standard normal per feature (float64, CPU), even
            when sigma_center = 0.
        batch_size: examples clipped at a time (bounds the float64 copy).
        transform: applied to each batch first (the normalisation, so that the normalised
            training set is never held twice); shape-preserving.
        users: the examples' users (privacy unit user): each user's mean feature vector is one
            clipped row (sensitivity R per person), read in batches of whole users; / U.

    Returns:
        [...] float64 tensor of one example's feature shape.
    """
    if not (clip > 0 and math.isfinite(clip) and noise_multiplier >= 0 and len(x) > 0):
        raise ValueError(
            "private_feature_mean needs clip > 0, noise_multiplier >= 0 and at least one example"
        )
    total = torch.zeros(x[0].numel(), dtype=torch.float64)
    for batch, local in _batches(x, users, batch_size):
        rows = (
            (transform(batch) if transform else batch).reshape(-1, total.numel()).to(torch.float64)
        )
        rows = _per_user_means(rows, local)
        norms = rows.norm(dim=1, keepdim=True)
        factors = torch.clamp(clip / norms.clamp_min(1e-300), max=1.0)
        # An example with a non-finite feature contributes nothing (inf * 0 would be NaN): still
        # within the sensitivity R, and one bad input cannot turn the released mean into NaN.
        total += torch.where(norms.isfinite(), rows * factors, 0.0).sum(dim=0).cpu()
    noise = require_dprandom(generator, "feature centring noise").normal(
        total.shape, dtype=torch.float64
    )
    units = len(x) if users is None else users.num_users
    return ((total + noise * (noise_multiplier * clip)) / units).reshape(x.shape[1:])


def _batches(
    x: torch.Tensor, users: UserIndex | None, batch_size: int
) -> Iterator[tuple[torch.Tensor, UserIndex | None]]:
    """``x`` in batches of about ``batch_size`` examples: in order, or of whole users (each batch
    with the index of its own users)."""
    if users is None:
        for start in range(0, len(x), batch_size):
            yield x[start : start + batch_size], None
        return
    first = 0
    while first < users.num_users:
        last = max(
            first + 1,
            int(np.searchsorted(users.offsets, users.offsets[first] + batch_size, side="right"))
            - 1,
        )
        last = min(last, users.num_users)
        rows = users.examples[users.offsets[first] : users.offsets[last]]
        local = UserIndex.from_ids(np.repeat(np.arange(last - first), users.sizes[first:last]))
        yield x[torch.from_numpy(rows).to(x.device)], local
        first = last


@dataclass(frozen=True)
class FeatureNormalizer:
    """The normalisation a run applies to every train and test input (checkpointed, so a
    resumed run or ``dpscale eval`` reuses the released statistics instead of drawing new ones).

    Attributes:
        kind: "none", "groupnorm" or "datanorm".
        groups: G for groupnorm.
        stats: the private statistics for datanorm.
        center: the privately released mean feature vector subtracted after ``kind``
            (float64, one example's feature shape), or None.
    """

    kind: str = "none"
    groups: int | None = None
    stats: DataNormStats | None = None
    center: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "groupnorm":
            if self.groups is None:
                raise ValueError("a groupnorm FeatureNormalizer needs groups")
            x = group_normalize(x, self.groups)
        elif self.kind == "datanorm":
            if self.stats is None:
                raise ValueError("a datanorm FeatureNormalizer needs stats")
            x = self.stats.apply(x)
        if self.center is not None:
            x = x - self.center.to(device=x.device, dtype=x.dtype)
        return x

    @property
    def is_identity(self) -> bool:
        return self.kind == "none" and self.center is None

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"kind": self.kind, "groups": self.groups}
        if self.stats is not None:
            state.update(mean=self.stats.mean, var=self.stats.var)
        if self.center is not None:
            state["center"] = self.center
        return state

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "FeatureNormalizer":
        stats = DataNormStats(state["mean"], state["var"]) if "mean" in state else None
        return cls(state["kind"], state["groups"], stats, state.get("center"))

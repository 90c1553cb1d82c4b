"""What a run does between loading images and training: extract features, then normalise them.

Order matters for privacy: the extractor is fixed (data-independent, or trained on other data),
so features cost nothing, unless it is a checkpoint of a run on this very training data, whose
whole accounting history the DP plan then composes (``extractor_privacy``); GroupNorm is per example and costs nothing; Data Normalization is a
release from the private training set whose cost the DP plan carries (``feature_releases``) and
whose noise multiplier it dictates, so plan, accountant and normaliser cannot disagree.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from dpscale.config import FeaturesConfig
from dpscale.data import ImageDataset
from dpscale.errors import ConfigError
from dpscale.features.extract import load_or_extract, make_extractor
from dpscale.features.source_run import source_run_privacy
from dpscale.features.normalize import FeatureNormalizer, private_data_norm, private_feature_mean
from dpscale.data.user_ids import UserIndex
from dpscale.privacy.accounting.segments import (
    DATA_NORM,
    FEATURE_MEAN,
    AccountingSegment,
    feature_releases as _releases,
)
from dpscale.privacy.plan.dp_plan import DPPlan
from dpscale.privacy.plan.source_runs import SourceRunPrivacy
from dpscale.rng import DPRandom


def extract_run_features(
    features: FeaturesConfig,
    data: ImageDataset,
    device: torch.device,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> ImageDataset:
    """``data`` with images replaced by features (unchanged when no extractor is configured).

    Features are computed on ``device`` (or loaded from the cache) and returned on ``device``.
    """
    if features.extractor is None:
        return data
    try:
        extractor = make_extractor(
            features.extractor,
            data.info.input_shape,
            J=features.scatter_j,
            L=features.scatter_angles,
            max_order=features.scatter_order,
            pad=features.scatter_pad,
            device=device,
        )
    except ValueError as err:
        raise ConfigError(f"features.extractor={features.extractor!r}: {err}") from err
    extracted, _ = load_or_extract(
        extractor,
        data,
        cache_dir=features.cache_dir,
        batch_size=features.batch_size,
        progress=progress,
        log=log,
        use_cache=features.cache,
    )
    return replace(
        extracted,
        x_train=extracted.x_train.to(device),
        y_train=extracted.y_train.to(device),
        x_test=extracted.x_test.to(device),
        y_test=extracted.y_test.to(device),
    )


def feature_releases(features: FeaturesConfig) -> tuple[AccountingSegment, ...]:
    """The privacy-costing releases the feature normalisation makes (for the DP plan), in the
    order the normaliser draws them (none at zero noise: a non-private run)."""
    data_norm = (
        features.norm_noise
        if features.normalize == "datanorm" and features.norm_noise > 0
        else None
    )
    return _releases(
        data_norm, features.center_noise if features.center and features.center_noise > 0 else None
    )


def extractor_privacy(
    features: FeaturesConfig, fingerprint_as: Callable[[bool], str], private: bool = True
) -> tuple[SourceRunPrivacy | None, tuple[AccountingSegment, ...]]:
    """How the run behind a ``checkpoint:`` extractor enters this run's guarantee, and the
    releases its training made that the DP plan must compose ("extractor-run:<label>"; see
    ``dpscale.features.extract.source_run_privacy``, unless ``features.extractor_public``).

    Args:
        features: the run's features section.
        fingerprint_as: this run's training-set fingerprint (``dpscale.data.dataset_fingerprint``)
            as prepared with data.normalize set to the given flag.
        private: whether this run is private (only then is a non-private source refused).

    Returns:
        (None, ()) for any other extractor; else the case that applies and the releases to
        compose (empty unless "composed").

    Raises:
        ConfigError: the source run cannot be read, or it trained on this run's data without
            noise and is not declared public.
    """
    spec = features.extractor or ""
    kind, _, where = spec.partition(":")
    if kind.strip().lower() != "checkpoint" or not where.strip():
        return None, ()
    return source_run_privacy(
        "extractor", spec, where.strip(), features.extractor_public, fingerprint_as, private
    )


def fit_normalizer(
    features: FeaturesConfig,
    x_train: torch.Tensor,
    plan: DPPlan,
    generator: DPRandom,
    users: UserIndex | None = None,
) -> FeatureNormalizer:
    """The normaliser a new run uses; Data Normalization, then centring, draw their noise from
    ``generator`` with the noise multipliers the DP plan accounts for (at the user unit, ``users``:
    each person's statistics clipped as one row)."""
    normalizer = _fit_base_normalizer(features, x_train, plan, generator, users)
    if not features.center:
        return normalizer
    sigma = plan.release_noise(FEATURE_MEAN) if plan.is_private else features.center_noise
    clip = features.center_clip * x_train[0].numel() ** 0.5  # normalisation keeps the shape
    center = private_feature_mean(
        x_train, clip, sigma, generator, transform=normalizer, users=users
    )
    return replace(normalizer, center=center)


def _fit_base_normalizer(
    features: FeaturesConfig,
    x_train: torch.Tensor,
    plan: DPPlan,
    generator: DPRandom,
    users: UserIndex | None,
) -> FeatureNormalizer:
    """GroupNorm, Data Normalization or nothing (before any centring)."""
    if features.normalize == "groupnorm":
        channels = x_train.shape[1]
        if channels % features.groups:
            raise ConfigError(
                f"features.groups={features.groups} does not divide the {channels} feature channels "
                f"(divisors of {channels}: {', '.join(str(g) for g in range(1, channels + 1) if channels % g == 0)})"
            )
        return FeatureNormalizer("groupnorm", features.groups)
    if features.normalize == "datanorm":
        sigma = plan.release_noise(DATA_NORM) if plan.is_private else features.norm_noise
        clip_mean, clip_square = features.norm_clip
        stats = private_data_norm(
            x_train, clip_mean, clip_square, sigma, features.norm_floor, generator, users=users
        )
        return FeatureNormalizer("datanorm", stats=stats)
    return FeatureNormalizer()


def normalize_dataset(
    data: ImageDataset, normalizer: FeatureNormalizer, batch_size: int = 4096
) -> ImageDataset:
    """Apply ``normalizer`` to the train and test inputs (in batches, to bound peak memory)."""
    if normalizer.is_identity:
        return data

    def apply(x: torch.Tensor) -> torch.Tensor:
        return (
            torch.cat([normalizer(x[i : i + batch_size]) for i in range(0, len(x), batch_size)])
            if len(x)
            else x
        )

    return replace(data, x_train=apply(data.x_train), x_test=apply(data.x_test))

"""What a run does between loading images and training: extract features, then normalise them.

Order matters for privacy: the extractor is fixed (data-independent, or trained on other data),
so features cost nothing; GroupNorm is per example and costs nothing; Data Normalization is a
release from the private training set whose cost the DP plan carries (``feature_releases``) and
whose noise multiplier it dictates, so plan, accountant and normaliser cannot disagree.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from dpscale.config import ConfigError, FeaturesConfig
from dpscale.data import ImageDataset
from dpscale.features.extract import load_or_extract, make_extractor
from dpscale.features.normalize import DATA_NORM, FeatureNormalizer, data_norm_release, private_data_norm
from dpscale.privacy.accountant import AccountingSegment
from dpscale.privacy.plan import DPPlan


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
            device=device,
        )
    except ValueError as err:
        raise ConfigError(f"features.extractor={features.extractor!r}: {err}") from None
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
    """The privacy-costing releases the feature normalisation makes (for the DP plan)."""
    if features.normalize == "datanorm" and features.norm_noise > 0:
        return (data_norm_release(features.norm_noise),)
    return ()


def fit_normalizer(
    features: FeaturesConfig, x_train: torch.Tensor, plan: DPPlan, generator: torch.Generator
) -> FeatureNormalizer:
    """The normaliser a new run uses; Data Normalization draws its noise from ``generator``
    with the noise multiplier the DP plan accounts for."""
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
        stats = private_data_norm(x_train, clip_mean, clip_square, sigma, features.norm_floor, generator)
        return FeatureNormalizer("datanorm", stats=stats)
    return FeatureNormalizer()


def normalize_dataset(data: ImageDataset, normalizer: FeatureNormalizer, batch_size: int = 4096) -> ImageDataset:
    """Apply ``normalizer`` to the train and test inputs (in batches, to bound peak memory)."""
    if normalizer.kind == "none":
        return data

    def apply(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([normalizer(x[i : i + batch_size]) for i in range(0, len(x), batch_size)]) if len(x) else x

    return replace(data, x_train=apply(data.x_train), x_test=apply(data.x_test))

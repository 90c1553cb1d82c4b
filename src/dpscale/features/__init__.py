"""Fixed (non-trained) feature extractors for DP training on features instead of pixels.

Tramèr & Boneh (2021) show that linear models and small CNNs trained with DP-SGD on
data-independent ScatterNet features beat end-to-end CNNs at moderate privacy budgets.
"""

from .extract import (
    FeatureExtractor,
    default_cache_dir,
    extract_features,
    feature_cache_key,
    load_or_extract,
    make_extractor,
)
from .normalize import (
    DATA_NORM,
    FEATURE_MEAN,
    DataNormStats,
    FeatureNormalizer,
    data_norm_release,
    feature_mean_release,
    group_normalize,
    private_channel_mean,
    private_data_norm,
    private_feature_mean,
)
from .scatternet import ScatterNet, scatter_output_shape

__all__ = [
    "DATA_NORM",
    "FEATURE_MEAN",
    "DataNormStats",
    "FeatureNormalizer",
    "data_norm_release",
    "feature_mean_release",
    "group_normalize",
    "private_channel_mean",
    "private_data_norm",
    "private_feature_mean",
    "FeatureExtractor",
    "ScatterNet",
    "default_cache_dir",
    "extract_features",
    "feature_cache_key",
    "load_or_extract",
    "make_extractor",
    "scatter_output_shape",
]

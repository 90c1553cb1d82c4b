"""Fixed (non-trained) feature extractors for DP training on features instead of pixels.

Tramèr & Boneh (2021) show that linear models and small CNNs trained with DP-SGD on
data-independent ScatterNet features beat end-to-end CNNs at moderate privacy budgets. Names are
imported on first use (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dpscale._lazy import lazy_dir, lazy_getattr

if TYPE_CHECKING:  # the types for checkers; at run time each name is imported on first use
    from dpscale.features.extract import (
        FeatureExtractor,
        default_cache_dir,
        extract_features,
        feature_cache_key,
        load_or_extract,
        make_extractor,
    )
    from dpscale.features.normalize import (
        DataNormStats,
        FeatureNormalizer,
        group_normalize,
        private_channel_mean,
        private_data_norm,
        private_feature_mean,
    )
    from dpscale.features.scatternet import ScatterNet, scatter_output_shape

_MODULE_OF = {
    **dict.fromkeys(
        ("FeatureExtractor", "default_cache_dir", "extract_features", "feature_cache_key")
        + ("load_or_extract", "make_extractor"),
        "extract",
    ),
    **dict.fromkeys(
        ("DataNormStats", "FeatureNormalizer", "group_normalize", "private_channel_mean")
        + ("private_data_norm", "private_feature_mean"),
        "normalize",
    ),
    **dict.fromkeys(("ScatterNet", "scatter_output_shape"), "scatternet"),
}
__all__ = [  # the names of _MODULE_OF, listed for checkers (tests/test_imports.py compares them)
    "DataNormStats",
    "FeatureExtractor",
    "FeatureNormalizer",
    "ScatterNet",
    "default_cache_dir",
    "extract_features",
    "feature_cache_key",
    "group_normalize",
    "load_or_extract",
    "make_extractor",
    "private_channel_mean",
    "private_data_norm",
    "private_feature_mean",
    "scatter_output_shape",
]
# the accounting's names (issue 64): served with a DeprecationWarning for one release
_MOVED = dict.fromkeys(
    ("DATA_NORM", "FEATURE_MEAN", "data_norm_release", "feature_mean_release"),
    "dpscale.privacy.accounting.segments",
)
__getattr__ = lazy_getattr(__name__, _MODULE_OF, _MOVED)
__dir__ = lazy_dir(_MODULE_OF)

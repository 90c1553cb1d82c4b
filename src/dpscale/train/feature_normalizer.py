"""A run's private Data Normalization: a checkpoint's feature normaliser reused (its statistics
never drawn again), or a new one fitted, one release whatever the number of processes."""

from __future__ import annotations

from typing import Any

from dpscale.config import Config
from dpscale.data.stream import StreamedData
from dpscale.errors import ConfigError
from dpscale.features.normalize import FeatureNormalizer
from dpscale.features.pipeline import fit_normalizer
from dpscale.privacy.plan.dp_plan import DPPlan
from dpscale.rng import noise_generator
from dpscale.train.distributed import Distributed
from dpscale.train.units import run_users


def feature_normalizer(
    config: Config,
    features: Any,
    plan: DPPlan,
    seeds: dict[str, int],
    dist: Distributed,
    saved: dict[str, Any] | None,
    *,
    loading: bool,
) -> FeatureNormalizer:
    """A checkpoint's normaliser (its private statistics reused, never drawn again), or a new one
    (``loading``: the run continues a checkpoint, whose normalisation must be the config's).

    Args:
        config: the run's config (``features``, ``dp.secure_noise``).
        features: the training features (in memory or streamed).
        plan: the run's DP plan (the statistics' noise, the user unit).
        seeds: the run's seeds (``features`` seeds the statistics' noise).
        dist: the process group (rank 0's statistics are every rank's).
        saved: a checkpoint's normaliser state, or None.
        loading: the run continues a checkpoint.

    Returns:
        The normaliser to apply to the features.
    """
    kind = (saved or {}).get("kind", "none")
    if loading and kind != config.features.normalize:
        raise ConfigError(
            f"the checkpoint's feature normalisation ({kind}) is not features.normalize={config.features.normalize} "
            "of its config; refusing to continue it"
        )
    if loading:
        _check_centring(config.features.center, "center" in (saved or {}))
    if saved is not None:
        return FeatureNormalizer.from_state_dict(saved)
    # Data Normalization's noise: 128-bit seed, or the OS CSPRNG with dp.secure_noise
    generator = noise_generator(seeds["features"], config.dp.secure_noise)
    # a stream has features.normalize=none (config validation): nothing to fit
    streamed = isinstance(features, StreamedData)
    # at the user unit: one clipped row per person
    users = run_users(plan, features) if not streamed else None
    normalizer = (
        FeatureNormalizer()
        if streamed
        else fit_normalizer(config.features, features.x_train, plan, generator, users)
    )
    if not dist.enabled:
        return normalizer
    # One release, whatever P: every rank uses rank 0's noisy statistics.
    return FeatureNormalizer.from_state_dict(dist.broadcast_object(normalizer.state_dict()))


def _check_centring(configured: bool, saved: bool) -> None:
    """A continued run keeps its checkpoint's centring: none added (a new release its history
    never accounted), none dropped (the model was trained on centred inputs)."""
    if configured and not saved:
        raise ConfigError(
            "features.center is true but the checkpoint holds no released feature mean; refusing to continue it "
            "(drawing one now would be a release its accounting never saw)"
        )
    if saved and not configured:
        raise ConfigError(
            "the checkpoint's model trained on inputs centred by a released feature mean but features.center is "
            "false; refusing to continue it"
        )

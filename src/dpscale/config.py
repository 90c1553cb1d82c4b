"""Run configuration: ``load_config`` (defaults <- YAML <- ``--set``, checked), saving it, and the
sections themselves (re-exported from ``dpscale.config_schema``, where every key and its meaning are).

Everything a run does is decided here, once; the resolved config is written to the run
directory so a run can be reproduced (and resumed) from it alone.

This module is where the rest of dpscale and users import the config from; reading YAML, presets
and ``--set key=value`` overrides is in ``dpscale.config_load``, the checks in
``dpscale.config_validate``, the sections in ``dpscale.config_schema`` (none of them importing this
module, not even for the type checker: no import cycle).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from dpscale.config_load import build_dataclass, read_config_values
from dpscale.config_validate import validate

# Re-exported: defined beside the code that uses them, imported from here (``from dpscale.config import ...``).
from dpscale.config_schema import (  # noqa: F401 (re-exported)
    AugmentConfig,
    Config,
    DataConfig,
    DPConfig,
    EvalConfig,
    FeaturesConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)
from dpscale.config_load import parse_override  # noqa: F401 (re-exported)
from dpscale.config_validate import DATA_LOADERS, FEATURE_EXTRACTORS, LR_SCHEDULES, OPTIMIZERS  # noqa: F401 (re-exported)
from dpscale.config_validate import is_private_config  # noqa: F401 (re-exported)
from dpscale.errors import ConfigError  # noqa: F401 (re-exported)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults <- YAML file <- ``--set`` overrides, validated.

    Args:
        path: YAML file with sections data, features, augment, model, dp, optim, train, run,
            eval (any may be omitted), or "preset:<name>" (``dpscale presets`` lists them).
        overrides: "section.key=value" strings, applied in order.

    Returns:
        The validated config.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or out-of-range value.
    """
    config: Config = build_dataclass(Config, "", read_config_values(path, overrides))
    validate(config)
    return config


def plan_labels(config: Config) -> dict[str, bool]:
    """The DP plan's labels a config determines (``dpscale.privacy.plan.dp_plan.PLAN_LABELS`` but the
    source runs, which are checked against their own directories): a fixed seed, the engine's
    self-check off, noise from the OS CSPRNG."""
    return {
        "seeded": config.run.seed is not None,
        "engine_unchecked": not config.train.self_check,
        "secure_noise": config.dp.secure_noise,
    }


def config_yaml(config: Config) -> str:
    """The resolved config as the YAML text of a run's config.yaml."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


def save_config(config: Config, path: Path) -> None:
    """Write the resolved config as YAML (atomically)."""
    from dpscale._io import atomic_write_text

    atomic_write_text(path, config_yaml(config))


def flat_config(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim.lr": 0.5, ...}: a config dict's leaves under dotted keys."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            flat.update(flat_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat

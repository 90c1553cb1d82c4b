"""The resolved config: the plan labels it determines, its YAML text, saving it (a run's config.yaml,
from which the run can be reproduced and resumed) and its leaves under dotted keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from dpscale.config.schema import Config


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

"""Run configuration: ``load_config`` (defaults <- YAML <- ``--set``, checked), the sections, saving.

Everything a run does is decided here, once; the resolved config is written to the run directory so a
run can be reproduced (and resumed) from it alone. The rest of dpscale and users import from this
package; its modules import one way: ``schema`` (the sections, every key and its meaning) <-
``validation`` (``validate``: one validator per section) <- ``load`` (YAML, presets, overrides), and ``resolved`` (the
config's YAML text, saving it, its plan labels). Names are imported on first use (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dpscale._lazy import lazy_dir, lazy_getattr

if TYPE_CHECKING:  # the types for checkers; at run time each name is imported on first use
    from dpscale.config.load import load_config, parse_override
    from dpscale.config.resolved import config_yaml, flat_config, plan_labels, save_config
    from dpscale.config.schema import (
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
    from dpscale.config.validation import (
        DATA_LOADERS,
        FEATURE_EXTRACTORS,
        LR_SCHEDULES,
        OPTIMIZERS,
        is_private_config,
        validate,
    )
    from dpscale.errors import ConfigError

_MODULE_OF = {
    **dict.fromkeys(("load_config", "parse_override", "ConfigError"), "load"),
    **dict.fromkeys(("config_yaml", "flat_config", "plan_labels", "save_config"), "resolved"),
    **dict.fromkeys(
        (
            "AugmentConfig",
            "Config",
            "DataConfig",
            "DPConfig",
            "EvalConfig",
            "FeaturesConfig",
            "ModelConfig",
            "OptimConfig",
            "RunConfig",
            "TrainConfig",
        ),
        "schema",
    ),
    **dict.fromkeys(
        (
            "DATA_LOADERS",
            "FEATURE_EXTRACTORS",
            "LR_SCHEDULES",
            "OPTIMIZERS",
            "is_private_config",
            "validate",
        ),
        "validation",
    ),
}
__all__ = [  # the names of _MODULE_OF, listed for checkers (tests/test_imports.py compares them)
    "AugmentConfig",
    "Config",
    "ConfigError",
    "DATA_LOADERS",
    "DPConfig",
    "DataConfig",
    "EvalConfig",
    "FEATURE_EXTRACTORS",
    "FeaturesConfig",
    "LR_SCHEDULES",
    "ModelConfig",
    "OPTIMIZERS",
    "OptimConfig",
    "RunConfig",
    "TrainConfig",
    "config_yaml",
    "flat_config",
    "is_private_config",
    "load_config",
    "parse_override",
    "plan_labels",
    "save_config",
    "validate",
]
__getattr__ = lazy_getattr(__name__, _MODULE_OF)
__dir__ = lazy_dir(_MODULE_OF, ("load", "resolved", "schema", "validation"))

"""Models: a name -> builder registry, whose built-in models register on the first name taken from
this package (PEP 562: ``import dpscale.models`` alone loads nothing)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dpscale._lazy import lazy_dir, lazy_getattr

if TYPE_CHECKING:  # the types for checkers; at run time each name is imported on first use
    from dpscale.models.activations import TemperedSigmoid, make_activation
    from dpscale.models.adapt import convert_batchnorm_to_groupnorm, freeze_block_groups
    from dpscale.models.registry import (
        build_model,
        count_parameters,
        default_input_shape,
        list_models,
        register_model,
    )

BUILT_IN = (
    "cnn",
    "resnet",
    "nfnet",
    "vit",
    "scatter",
)  # the modules whose import registers the zoo
_MODULE_OF = {
    "TemperedSigmoid": "activations",
    "build_model": "registry",
    "convert_batchnorm_to_groupnorm": "adapt",
    "count_parameters": "registry",
    "default_input_shape": "registry",
    "freeze_block_groups": "adapt",
    "list_models": "registry",
    "make_activation": "activations",
    "register_model": "registry",
}
__all__ = [  # the names of _MODULE_OF, listed for checkers (tests/test_imports.py compares them)
    "TemperedSigmoid",
    "build_model",
    "convert_batchnorm_to_groupnorm",
    "count_parameters",
    "default_input_shape",
    "freeze_block_groups",
    "list_models",
    "make_activation",
    "register_model",
]
_named = lazy_getattr(__name__, _MODULE_OF)
__dir__ = lazy_dir(_MODULE_OF, ("registry",))


def __getattr__(name: str) -> Any:
    """``name`` from its module, the built-in models registered first (a builder is found by name)."""
    if name in _MODULE_OF:
        for module in BUILT_IN:
            importlib.import_module(f"{__name__}.{module}")
    return _named(name)

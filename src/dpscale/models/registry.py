"""A plain name -> builder registry for models (timm style).

Every builder takes ``num_classes``, ``input_shape`` (C, H, W) and ``activation``
plus its own keyword options, and returns an ``nn.Module`` exposing
``forward_features``, ``forward_head`` and ``reset_head``.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, TypeVar

from torch import nn

from dpscale.errors import ConfigError

ModelBuilder = Callable[..., nn.Module]
_Builder = TypeVar("_Builder", bound=ModelBuilder)  # a decorated builder keeps its own signature
_REGISTRY: dict[str, ModelBuilder] = {}
_DEFAULT_INPUT: dict[str, tuple[int, int, int]] = {}


def register_model(
    name: str, input_shape: tuple[int, int, int] = (1, 28, 28)
) -> Callable[[_Builder], _Builder]:
    """Decorator adding a builder under ``name``; ``input_shape`` is its usual (C, H, W)."""

    def add(builder: _Builder) -> _Builder:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is already registered")
        _REGISTRY[name] = builder
        _DEFAULT_INPUT[name] = _chw(input_shape)
        return builder

    return add


def _chw(shape: tuple[int, int, int]) -> tuple[int, int, int]:
    """A fresh (C, H, W) tuple of ``shape`` (which a caller may pass as a list)."""
    c, h, w = shape
    return (c, h, w)


# Families named by a spec after a prefix, e.g. simplevgg-32(2)-64(2)-128(2)-128.
_FAMILIES: dict[str, tuple[Callable[..., nn.Module], tuple[int, int, int], str]] = {}


def register_family(
    prefix: str, example: str, input_shape: tuple[int, int, int]
) -> Callable[[Callable], Callable]:
    """Decorator for a builder taking ``spec`` (the name after ``prefix-``); ``example`` is listed."""

    def add(builder: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        _FAMILIES[prefix] = (builder, _chw(input_shape), example)
        return builder

    return add


def _timm_builder(
    num_classes: int, input_shape: tuple[int, int, int], activation: str, spec: str, **options: Any
) -> nn.Module:
    """``timm:<name>``: a timm model (optional; timm's CUDA wheels may not import on CPU torch).
    BatchNorm models are rejected at training time; convert them with
    ``dpscale.models.convert_batchnorm_to_groupnorm`` first. ``activation`` is timm's choice."""
    try:
        import timm
    except Exception as err:  # ImportError, or a binary mismatch with this torch build
        raise ValueError(
            f"timm:{spec} needs the timm package, which does not import here ({err})"
        ) from err
    return timm.create_model(spec, num_classes=num_classes, in_chans=input_shape[0], **options)


def _resolve(name: str) -> tuple[Callable[..., nn.Module], dict[str, Any]] | None:
    if name in _REGISTRY:
        return _REGISTRY[name], {}
    if name.startswith("timm:") and len(name) > 5:
        return _timm_builder, {"spec": name[5:]}
    for family, (builder, _, _) in _FAMILIES.items():
        if name.startswith(family + "-"):
            return builder, {"spec": name[len(family) + 1 :]}
    return None


def default_input_shape(name: str) -> tuple[int, int, int]:
    """The (C, H, W) a model is usually trained on (used for listings and parameter counts)."""
    if name in _DEFAULT_INPUT:
        return _DEFAULT_INPUT[name]
    if name.startswith("timm:"):
        return (3, 224, 224)
    for family, (_, shape, _) in _FAMILIES.items():
        if name.startswith(family + "-"):
            return shape
    raise ConfigError(f"unknown model {name!r}")


def list_models() -> list[str]:
    """Registered names, plus one example name per family (e.g. the simpleVGG of the papers)."""
    return sorted([*_REGISTRY, *(example for _, _, example in _FAMILIES.values())])


def build_model(
    name: str,
    num_classes: int,
    input_shape: tuple[int, int, int],
    activation: str = "tanh",
    **options: Any,
) -> nn.Module:
    """Instantiate a registered model.

    Args:
        name: registry name, e.g. "papernot-cnn".
        num_classes: logits size.
        input_shape: (C, H, W) of one example.
        activation: see ``dpscale.models.activations.ACTIVATION_HELP``.
        **options: builder-specific options (e.g. ``filters=[16, 32]``).

    Raises:
        ValueError: unknown name (with the closest known names) or bad options.
    """
    resolved = _resolve(name)
    if resolved is None:
        close = difflib.get_close_matches(name, list_models(), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"unknown model {name!r}.{hint} Known models: {', '.join(list_models())}")
    try:
        builder, spec = resolved
        return builder(
            num_classes=num_classes,
            input_shape=tuple(input_shape),
            activation=activation,
            **spec,
            **options,
        )
    except TypeError as err:
        raise ConfigError(f"bad options for model {name!r}: {err}") from err


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)

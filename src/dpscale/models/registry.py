"""A plain name -> builder registry for models (timm style).

Every builder takes ``num_classes``, ``input_shape`` (C, H, W) and ``activation``
plus its own keyword options, and returns an ``nn.Module`` exposing
``forward_features``, ``forward_head`` and ``reset_head``.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable

from torch import nn

ModelBuilder = Callable[..., nn.Module]
_REGISTRY: dict[str, ModelBuilder] = {}
_DEFAULT_INPUT: dict[str, tuple[int, int, int]] = {}


def register_model(name: str, input_shape: tuple[int, int, int] = (1, 28, 28)) -> Callable[[ModelBuilder], ModelBuilder]:
    """Decorator adding a builder under ``name``; ``input_shape`` is its usual (C, H, W)."""

    def add(builder: ModelBuilder) -> ModelBuilder:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is already registered")
        _REGISTRY[name] = builder
        _DEFAULT_INPUT[name] = tuple(input_shape)
        return builder

    return add


def default_input_shape(name: str) -> tuple[int, int, int]:
    """The (C, H, W) a model is usually trained on (used for listings and parameter counts)."""
    return _DEFAULT_INPUT[name]


def list_models() -> list[str]:
    return sorted(_REGISTRY)


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
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown model {name!r}.{hint} Known models: {', '.join(list_models())}")
    try:
        return _REGISTRY[name](num_classes=num_classes, input_shape=tuple(input_shape), activation=activation, **options)
    except TypeError as err:
        raise ValueError(f"bad options for model {name!r}: {err}") from err


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)

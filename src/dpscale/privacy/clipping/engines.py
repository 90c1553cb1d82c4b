"""The engine factory: an engine by name (``auto`` picks bk when every trainable layer has an
exact rule, else vmap). Its own module so that the engines (``per_example``: shared types and the
vmap engine; ``ghost``: the ghost/bk engines) import neither each other's factory nor this one."""

from __future__ import annotations

from torch import nn

from dpscale.choices import ENGINE_NAMES
from dpscale.privacy.clipping.bounds import resolve_clip_groups
from dpscale.clip_norms import MaxGradNorm, is_per_layer
from dpscale.privacy.clipping.autotune import MethodTuner, default_tuner
from dpscale.privacy.clipping.ghost.engine import GhostEngine
from dpscale.privacy.clipping.ghost.model import unsupported_modules
from dpscale.privacy.clipping.per_example import (
    LossFn,
    PerExampleEngine,
    VmapEngine,
    per_example_cross_entropy,
    trainable_params,
)
from dpscale.privacy.clipping.layer_refusals import (
    check_parameter_types,
    check_per_example_compatible,
)
from dpscale.privacy.clipping.precision import FP32, Precision


def make_engine(
    name: str,
    max_grad_norm: MaxGradNorm,
    model: nn.Module | None = None,
    loss_fn: LossFn = per_example_cross_entropy,
    views: int = 1,
    precision: Precision = FP32,
    tuner: MethodTuner | None = None,
    clip_gamma: float | None = None,
) -> tuple[PerExampleEngine, str | None]:
    """Engine by name, plus a one-line notice when "auto" had to fall back.

    Args:
        name: "auto" (bk when every trainable layer is supported, else vmap), "bk", "ghost" or "vmap".
        max_grad_norm: clipping norm C, per-layer bounds pattern -> C_g (per-tensor bounds are
            one group per tensor, ``dpscale.privacy.clipping.bounds.clip_bounds``; every engine clips
            any grouping, bk/ghost a layer split between groups tensor by tensor) or None (no clipping).
        model: needed by "auto" to check layer support (and by bk/ghost to fail early).
        loss_fn: per-example loss.
        views: augmentation multiplicity K (each example arrives as K views).
        precision: how the model computes (fp32, tf32, bf16, fp16 with a fixed loss scale).
        tuner: bk/ghost's per-layer method tuner (None: ``default_tuner()``, timing on this
            device, cached on disk; ``MethodTuner(enabled=False)`` for the shape rule).
        clip_gamma: automatic clipping's gamma (each gradient scaled by C / (||g|| + gamma), Bu et
            al. 2023); None: clip to C.

    Returns:
        (engine, notice or None).
    """
    if name not in ENGINE_NAMES:
        raise ValueError(
            f"unknown per-example engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}"
        )
    if views < 1:
        raise ValueError(f"views (augmentation multiplicity) must be >= 1, got {views}")
    if model is not None:  # layers no engine can take (refused before one fails inside torch)
        check_per_example_compatible(model)
        check_parameter_types(model)
    problems = unsupported_modules(model) if model is not None else []
    # every parameter in a group, each group used
    if model is not None and is_per_layer(max_grad_norm):
        resolve_clip_groups(max_grad_norm, list(trainable_params(model)))
    if name == "vmap" or (name == "auto" and problems):
        notice = (
            f"engine auto -> vmap: bk does not support {', '.join(problems)}"
            if name == "auto"
            else None
        )
        if model is not None:
            _check_vmap_runs(model, notice)
        return VmapEngine(
            max_grad_norm, loss_fn, views=views, precision=precision, clip_gamma=clip_gamma
        ), notice
    if problems:
        raise ValueError(
            f"engine {name} does not support {', '.join(problems)}; use engine=vmap or auto"
        )
    mode = "bk" if name == "auto" else name
    tuner = default_tuner() if tuner is None else tuner
    return GhostEngine(
        max_grad_norm,
        loss_fn,
        mode=mode,
        views=views,
        precision=precision,
        tuner=tuner,
        clip_gamma=clip_gamma,
    ), None


def _check_vmap_runs(model: nn.Module, notice: str | None) -> None:
    """Refuse layers that the vmap engine alone cannot run, saying why auto came to vmap.

    Args:
        model: the model to train.
        notice: auto's fallback notice (None: vmap was named).

    Raises:
        ValueError: one line naming the layer and the fix.
    """
    try:
        check_per_example_compatible(model, "vmap")
    except ValueError as err:
        if notice is None:
            raise
        raise ValueError(f"{err} ({notice})") from err


def supported_engines(model: nn.Module) -> list[str]:
    """Engines that can train ``model``: those ``make_engine`` neither refuses nor finds unsupported."""
    try:  # a layer that every engine refuses
        check_per_example_compatible(model)
    except ValueError:
        return []
    bk = [] if unsupported_modules(model) else ["bk", "ghost"]
    try:
        check_per_example_compatible(model, "vmap")
    except ValueError:
        return (["auto"] if bk else []) + bk
    return ["auto", "vmap"] + bk

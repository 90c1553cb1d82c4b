"""A run's clipping engine: named from train.engine (compiled with train.compile), verified before
the first step on the first few training examples, and the check its first real chunk gets."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from dpscale.config import Config
from dpscale.cpu_memory import keep_freed_memory
from dpscale.data.stream import StreamedData
from dpscale.errors import ConfigError
from dpscale.privacy.clipping.compiled import COMPILED_NOTE, compiled_choice, compiled_engine_name
from dpscale.privacy.clipping.per_example import (
    Batch,
    PerExampleEngine,
    ghost_per_user_notice,
    per_example_cross_entropy,
    user_engine_options,
)
from dpscale.privacy.clipping.precision import Precision, make_precision
from dpscale.privacy.clipping.self_check import SELF_CHECK_EXAMPLES, SelfCheckResult, checked_engine
from dpscale.privacy.plan.dp_plan import DPPlan
from dpscale.train.guards import FirstChunkCheck, independence_check
from dpscale.train.step import AugmentViews
from dpscale.train.units import first_users_chunk, rows_per_user

Log = Callable[[str], Any]


def run_engine(
    config: Config,
    plan: DPPlan,
    model: nn.Module,
    data: Any,
    device: torch.device,
    *,
    distributed: bool,
    log: Log,
) -> tuple[Precision, PerExampleEngine, SelfCheckResult | None, FirstChunkCheck | None]:
    """The precision and clipping engine the run's steps take, checked now.

    Args:
        config: the run's config (``train``, ``augment``, ``data.normalize``).
        plan: the run's DP plan (C, the unit, whether it is private).
        model: the model on ``device``; data: the training data (in memory or streamed).
        distributed: the run has several processes (the clip-method tuner then keeps the shape rule).
        log: prints a line of the run's report.

    Returns:
        The precision, the engine (compiled with train.compile), the set-up check's result (None:
        not checked) and the check of the first real training chunk (None: none).
    """
    precision = make_precision(config.train.precision, config.train.fp16_loss_scale)
    engine, self_check = _checked_engine(config, plan, model, data, device, precision, log)
    tuner = getattr(engine, "tuner", None)
    if distributed and tuner is not None:  # ranks timing apart could choose apart
        tuner.enabled = False  # (a resume pins rank 0's choices): the shape rule on every rank
    first_chunk_check: FirstChunkCheck | None = (
        independence_check if config.train.self_check and plan.is_private else None
    )
    # the eager engine built and checked above, compiled (its checks run eagerly)
    if config.train.compile:
        engine, first_chunk_check = compiled_choice(engine, first_chunk_check)
        log(COMPILED_NOTE)
    return precision, engine, self_check, first_chunk_check


def _checked_engine(
    config: Config,
    plan: DPPlan,
    model: nn.Module,
    data: Any,
    device: torch.device,
    precision: Precision,
    log: Log,
) -> tuple[PerExampleEngine, SelfCheckResult | None]:
    """The clipping engine, verified before the first step on the first few training examples
    (their K views drawn from a fixed generator: the run's streams are untouched)."""
    train = config.train
    chunk, views, loss_fn = _self_check_chunk(config, plan, data, device, log)
    name = _engine_name(config, precision, model)
    try:
        with precision.matmul_flags():  # as the steps will run (full float32 unless tf32)
            engine, notices, result = checked_engine(
                name,
                plan.max_grad_norm,
                model,
                chunk,
                views=views,
                loss_fn=loss_fn,
                # a non-private run claims no guarantee for the check to protect (and its unclipped,
                # cancelling gradient sums are where float32 reorderings look largest)
                check=train.self_check and plan.is_private,
                precision=precision,
                clip_gamma=plan.clip_gamma,
            )
    except ValueError as err:
        raise ConfigError(f"train.engine={train.engine}: {err}") from err
    checks = [result, result.independence] if result else []
    unit = (
        " (privacy unit user: each example above is one user's padded rows, its norm the user's)"
        if plan.user_level
        else ""
    )
    memory = [f"cpu memory: {keep_freed_memory()}"] if torch.device(device).type == "cpu" else []
    for note in (
        notices + [check.describe() + unit for check in checks if check is not None] + memory
    ):
        log(note)
    return engine, result


def _self_check_chunk(
    config: Config, plan: DPPlan, data: Any, device: torch.device, log: Log
) -> tuple[Batch, int, Callable]:
    """The set-up check's examples (at the user unit the first users' padded rows, one "example"
    per user) with their views, and the engine's views and loss for them."""
    train, augment = config.train, config.augment
    value_range = (-1.0, 1.0) if config.data.normalize else (0.0, 1.0)
    fixed = AugmentViews(
        augment.type,
        augment.multiplicity,
        torch.Generator().manual_seed(0),
        value_range,
        augment.padding,
    )
    augment_views = fixed if augment.multiplicity > 1 else None
    if plan.user_level:  # per-user quantities: the first users' padded rows, one "example" per user
        rows = rows_per_user(plan)
        chunk = first_users_chunk(
            data, SELF_CHECK_EXAMPLES, rows, augment.multiplicity, augment_views
        )
        # a stream's examples are read on the host
        chunk = (chunk[0].to(device), chunk[1].to(device))
        views, loss_fn = user_engine_options(rows, augment.multiplicity, None)
        notice = ghost_per_user_notice(train.engine, rows)
        if notice:
            log(f"WARNING: {notice}")
    else:
        k = min(SELF_CHECK_EXAMPLES, len(data.y_train))
        chunk = (
            data.head(k, device)
            if isinstance(data, StreamedData)
            else (data.x_train[:k], data.y_train[:k])
        )
        chunk = (augment_views(chunk[0]), chunk[1]) if augment_views else chunk
        views, loss_fn = augment.multiplicity, per_example_cross_entropy
    return chunk, views, loss_fn


def _engine_name(config: Config, precision: Precision, model: nn.Module) -> str:
    """train.engine, or with train.compile the engine it compiles (vmap), refused in one line where it does not apply."""
    if not config.train.compile:
        return config.train.engine
    try:
        return compiled_engine_name(config.train.engine, precision, model)
    except ValueError as err:
        raise ConfigError(f"train.compile=true: {err}") from err

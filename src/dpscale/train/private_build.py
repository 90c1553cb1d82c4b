"""What ``dpscale.make_private`` builds from its typed options: the DP plan (sigma calibrated when
given a target epsilon), the checked clipping engine, the chunk size and the
:class:`~dpscale.train.mechanism.DPMechanism` that takes every step. ``dpscale.train.private`` is
the door (its signature and checks) and imports this module when called, so that
``import dpscale; dpscale.make_private`` loads neither torch's engines nor the accountant.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Callable


import torch
from torch import nn

from dpscale.cpu_memory import keep_freed_memory
from dpscale.privacy.clipping.bounds import clip_bounds
from dpscale.clip_norms import MaxGradNorm
from dpscale.privacy.workload import Workload
from dpscale.privacy.clipping.compiled import compiled_choice, compiled_engine_name
from dpscale.privacy.noise.correlated import BandsRequest, strategy_cache_dir
from dpscale.privacy.clipping.engines import make_engine
from dpscale.data.user_ids import UserIndex
from dpscale.privacy.clipping.per_example import (
    Batch,
    PerExampleEngine,
    ghost_per_user_notice,
    per_example_cross_entropy,
    user_engine_options,
)
from dpscale.privacy.plan.options_flat import privacy_numbers
from dpscale.privacy.spelling import PYTHON
from dpscale.privacy.options import BandMF, Noise, PerformanceFlags
from dpscale.privacy.plan.dp_plan import DPPlan
from dpscale.privacy.plan.make_plan import make_dp_plan, steps_for
from dpscale.privacy.clipping.precision import make_precision
from dpscale.privacy.clipping.self_check import checked_engine
from dpscale.train.chunk_size import batch_chunk
from dpscale.train.seeds import run_seeds
from dpscale.train.mechanism import DPMechanism
from dpscale.train.guards import FirstChunkCheck, independence_check
from dpscale.train.private_options import Options, flat_settings
from dpscale.train.step import fixed_rows


def _engine_check(name: str, **engine_options: Any) -> FirstChunkCheck:
    """``make_private``'s first-chunk check without a ``check_batch``: the whole ``checked_engine``
    (independence, then the self-check on its first examples; ``auto`` may fall back to vmap)."""

    def check(engine: PerExampleEngine, model: nn.Module, chunk: Batch) -> PerExampleEngine:
        # the same tuner: the choices it holds (pinned by a loaded state) carry over
        tuner = getattr(engine, "tuner", None)
        chosen, notices, _ = checked_engine(
            name, engine.max_grad_norm, model, chunk, tuner=tuner, **engine_options
        )
        _tell(notices)
        return chosen

    return check


def _tell(notices: list[str]) -> None:
    """What the user should know of the engine make_private chose (auto's fallback and why)."""
    for notice in notices:
        warnings.warn(notice, UserWarning, stacklevel=3)


def per_example_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable:
    """``loss_fn`` checked at every call to return one loss per example, shape (B,): a mean or a
    sum over the batch would be clipped as if the batch were one example."""

    def checked(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = loss_fn(logits, targets)
        if not isinstance(out, torch.Tensor) or out.dim() != 1 or out.shape[0] != targets.shape[0]:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(
                f"loss_fn must return one loss per example, shape ({targets.shape[0]},), got {shape}: use "
                "reduction='none' (a loss averaged or summed over the batch cannot be clipped per example)"
            )
        return out

    return checked


def build_mechanism(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    options: Options,
    *,
    dataset_size: int,
    epochs: float | None,
    steps: int | None,
    accountant: str,
    loss_fn: Callable | None,
    augment_multiplicity: int,
    scheduler: Any,
    seed: int | None,
    secure_noise: bool,
    check: bool,
    check_batch: Batch | None,
) -> DPMechanism:
    """``make_private``'s mechanism from its checked options and keywords (see its docstring)."""
    flags, settings = options.performance, flat_settings(options)
    if any(p.device.type == "cpu" for p in model.parameters()):
        keep_freed_memory()  # fresh per-step tensors without page faults (dpscale.cpu_memory; opt out by env)
    max_grad_norm = _clip_bounds(model, settings["max_grad_norm"], settings["max_grad_norm_per"])
    users, units = _user_index(
        settings["user_ids"], settings["max_examples_per_user"], dataset_size, check_batch
    )
    total_steps = steps_for(epochs, steps, units, options.sampling.batch_size)
    numbers = privacy_numbers(
        options.sampling,
        options.clipping,
        max_grad_norm=max_grad_norm,
        delta=settings["delta"],
        target_epsilon=settings["target_epsilon"],
        noise_multiplier=settings["noise_multiplier"],
        accountant=accountant,
    )
    plan = make_dp_plan(
        numbers,
        dataset_size=units,
        steps=total_steps,
        seeded=seed is not None,
        privacy_unit="example" if users is None else "user",
        max_examples_per_user=settings["max_examples_per_user"],
        correlated=_bands_request(options.noise, model, optimizer, total_steps),
        spell=PYTHON,
    )
    plan = replace(plan, secure_noise=secure_noise, engine_unchecked=plan.is_private and not check)
    return _mechanism(
        model,
        optimizer,
        plan,
        flags,
        max_grad_norm,
        users=users,
        rows=settings["max_examples_per_user"] if users else None,
        loss_fn=loss_fn,
        augment_multiplicity=augment_multiplicity,
        scheduler=scheduler,
        seed=seed,
        check=check,
        check_batch=check_batch,
    )


def _mechanism(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: DPPlan,
    flags: PerformanceFlags,
    max_grad_norm: MaxGradNorm,
    *,
    users: UserIndex | None,
    rows: int | None,
    loss_fn: Callable | None,
    augment_multiplicity: int,
    scheduler: Any,
    seed: int | None,
    check: bool,
    check_batch: Batch | None,
) -> DPMechanism:
    """The mechanism of ``plan``: its engine (checked now on ``check_batch``, or at the first step),
    compiled with ``flags.compile``, the chunk size (measured for "auto") and the streams of ``seed``.

    Args:
        model, optimizer, plan: the user's model and optimizer, and the plan built for them.
        flags: the performance options; max_grad_norm: C as the plan takes it (``_clip_bounds``).
        users, rows: the user unit's users and k (None at the example unit).
        loss_fn, augment_multiplicity, scheduler, seed, check, check_batch: ``make_private``'s keywords.
    """
    engine = (
        compiled_engine_name(flags.engine, make_precision(flags.precision), model)
        if flags.compile
        else flags.engine
    )
    chosen, first_chunk_check = (
        _chosen_engine(  # a non-private run claims no guarantee for the checks to protect
            engine,
            max_grad_norm,
            model,
            loss_fn=loss_fn,
            views=augment_multiplicity,
            precision=flags.precision,
            check=check and plan.is_private,
            check_batch=check_batch,
            rows=rows,
            clip_gamma=plan.clip_gamma,
        )
    )
    if flags.compile:  # after the eager engine's checks: one shape compiled per chunk size
        chosen, first_chunk_check = compiled_choice(chosen, first_chunk_check)
    # "auto": measured with the engine that runs (compiled too), on check_batch's shape
    chunk = flags.max_physical_batch_size
    if isinstance(chunk, str):
        chunk = batch_chunk(chunk, chosen, model, plan, check_batch, augment_multiplicity)
    return DPMechanism(
        model,
        optimizer,
        plan,
        chosen,
        **_seed_streams(seed),
        scheduler=scheduler,
        users=users,
        max_physical_batch_size=chunk,
        first_chunk_check=first_chunk_check,
        views=augment_multiplicity,
        pad_rows=fixed_rows(plan, chunk, flags.fixed_shapes, flags.compile),
    )


def _seed_streams(seed: int | None) -> dict[str, int]:
    """The mechanism's sampler, noise and BandMF partition seeds from ``seed`` (None: fresh entropy)."""
    seeds = run_seeds(seed)
    return {
        "sampler_seed": seeds["sampler"],
        "noise_seed": seeds["noise"],
        "partition_seed": seeds["partition"],
    }


def _user_index(
    user_ids: Any, max_examples_per_user: int | None, dataset_size: int, check_batch: Batch | None
) -> tuple[UserIndex | None, int]:
    """``make_private``'s users (None at the example unit), checked against the dataset, and the
    plan's N (the users, or the examples)."""
    if user_ids is None:  # PerExample (PerUser always has both: typed_options)
        return None, dataset_size
    if check_batch is not None:
        raise ValueError(
            "check_batch is not taken with user_ids: the checks run on the first step's users instead"
        )
    users = UserIndex.from_ids(user_ids)
    if len(users.examples) != dataset_size:
        raise ValueError(
            f"user_ids holds {len(users.examples)} ids but dataset_size={dataset_size}: give one per dataset index"
        )
    return users, users.num_users


def _clip_bounds(model: nn.Module, max_grad_norm: MaxGradNorm, per: str) -> MaxGradNorm:
    """``max_grad_norm`` as the plan, the engines and the checks all take it: as given ("group"),
    or spelled out as one group per trainable tensor ("tensor", ``clip_bounds``).

    Args:
        model: whose trainable tensors, in ``named_parameters()`` order, get a bound each per tensor.
        max_grad_norm, per: ``make_private``'s ``max_grad_norm`` and ``max_grad_norm_per``.

    Returns:
        C, pattern -> C_g, or (per tensor) tensor name -> C_i; None without clipping.
    """
    return clip_bounds(
        max_grad_norm, per, [name for name, p in model.named_parameters() if p.requires_grad]
    )


def _bands_request(
    noise: Noise, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int
) -> BandsRequest | None:
    """BandMF's request for ``make_private`` (None for DP-SGD). Without ``BandMF.workload``: prefix
    sums with SGD's momentum at a constant learning rate (a scheduler's rates are the user's to give,
    ``Workload(lr_multipliers=...)``: ``dpscale train`` knows its schedule, ``make_private`` would have to
    run the user's scheduler, and a derived strategy would change the plan of earlier checkpoints)."""
    if not isinstance(noise, BandMF):
        return None
    workload = noise.workload
    if workload is None:  # torch's SGD has its momentum in its param groups
        sgd = isinstance(optimizer, torch.optim.SGD)
        workload = Workload(
            steps=steps,
            momentum=float(optimizer.param_groups[0].get("momentum", 0.0) or 0.0) if sgd else 0.0,
        )
    if workload.steps != steps:
        raise ValueError(f"BandMF.workload.steps={workload.steps} but the plan has {steps} steps")
    parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return BandsRequest(
        bands=noise.bands,
        workload=workload,
        max_bands=noise.max_bands,
        parameters=parameters,
        max_noise_memory_mb=noise.max_noise_memory_mb,
        cache_dir=str(strategy_cache_dir()),
    )


def _chosen_engine(
    engine: str,
    max_grad_norm: MaxGradNorm,
    model: nn.Module,
    *,
    loss_fn: Callable | None,
    views: int,
    precision: str,
    check: bool,
    check_batch: Batch | None,
    rows: int | None,
    clip_gamma: float | None = None,
) -> tuple[PerExampleEngine, FirstChunkCheck | None]:
    """``make_private``'s engine, checked now on ``check_batch`` or at the first step's first chunk;
    at the user unit (``rows`` = k) one that clips each user's ``user_rows`` as one example."""
    # user_sum_loss: None is cross-entropy with padding
    base = per_example_loss(loss_fn) if loss_fn else None
    if rows is not None:
        views, unit_loss = user_engine_options(rows, views, base)
        _tell([n for n in [ghost_per_user_notice(engine, rows)] if n])
    else:
        unit_loss = base or per_example_cross_entropy
    options: dict[str, Any] = {
        "views": views,
        "loss_fn": unit_loss,
        "precision": make_precision(precision),
        "clip_gamma": clip_gamma,
    }
    # make_engine refuses the layers no engine can clip per example (BatchNorm, ...) in every case
    if check and check_batch is not None:
        with options["precision"].matmul_flags():  # as at every step (full float32 unless tf32)
            chosen, notices, _ = checked_engine(
                engine, max_grad_norm, model, check_batch, **options
            )
        _tell(notices)
        return chosen, independence_check
    chosen, notice = make_engine(engine, max_grad_norm, model, **options)
    _tell([notice] if notice else [])
    return chosen, _engine_check(engine, **options) if check else None

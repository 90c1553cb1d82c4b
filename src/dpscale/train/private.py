"""``dpscale.make_private``: the one entry point for a user's own model, optimizer and loop.

It builds the DP plan (calibrating sigma when given a target epsilon), picks and checks the
clipping engine, and returns the :class:`~dpscale.train.mechanism.DPMechanism` that takes every
step. See the mechanism's module for the loop it expects.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Callable, Sequence

import numpy as np

import torch
from torch import nn

from dpscale.cpu_memory import keep_freed_memory
from dpscale.choices import MECHANISMS
from dpscale.privacy.clipping import MaxGradNorm, clip_bounds
from dpscale.privacy.adaptive import adaptive_clipping
from dpscale.privacy.bandmf import Workload
from dpscale.privacy.compiled import compiled_choice, compiled_engine_name
from dpscale.privacy.correlated import DEFAULT_MAX_BANDS, DEFAULT_MAX_NOISE_MEMORY_MB, BandsRequest
from dpscale.privacy.engines import make_engine
from dpscale.data.units import UserIndex
from dpscale.privacy.per_example import (
    Batch, PerExampleEngine, ghost_per_user_notice, per_example_cross_entropy, user_engine_options,
)  # fmt: skip
from dpscale.privacy.numbers import PrivacyNumbers
from dpscale.privacy.make_plan import make_dp_plan, steps_for
from dpscale.privacy.precision import make_precision
from dpscale.privacy.self_check import checked_engine
from dpscale.train.chunk_size import batch_chunk
from dpscale.train.seeds import run_seeds
from dpscale.train.mechanism import DPMechanism, FirstChunkCheck, independence_check
from dpscale.train.step import fixed_rows


def _engine_check(name: str, **engine_options: Any) -> FirstChunkCheck:
    """``make_private``'s first-chunk check without a ``check_batch``: the whole ``checked_engine``
    (independence, then the self-check on its first examples; ``auto`` may fall back to vmap)."""

    def check(engine: PerExampleEngine, model: nn.Module, chunk: Batch) -> PerExampleEngine:
        # the same tuner: the choices it holds (pinned by a loaded state) carry over
        tuner = getattr(engine, "tuner", None)
        chosen, notices, _ = checked_engine(name, engine.max_grad_norm, model, chunk, tuner=tuner, **engine_options)
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


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    dataset_size: int,
    batch_size: float,
    max_grad_norm: MaxGradNorm,
    max_grad_norm_per: str = "group",
    delta: float,
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    accountant: str = "pld",
    engine: str = "auto",
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    augment_multiplicity: int = 1,
    precision: str = "fp32",
    max_physical_batch_size: int | str | None = None,
    scheduler: Any = None,
    seed: int | None = None,
    secure_noise: bool = False,
    check: bool = True,
    check_batch: Batch | None = None,
    noise_mechanism: str = "dpsgd",
    bands: int | str = "auto",
    max_bands: int = DEFAULT_MAX_BANDS,
    max_noise_memory_mb: float = DEFAULT_MAX_NOISE_MEMORY_MB,
    workload: Workload | None = None,
    clipping: str = "fixed",
    clip_quantile: float = 0.5,
    clip_learning_rate: float = 0.2,
    clip_count_noise: float | None = None,
    clip_gamma: float = 0.01,
    user_ids: Sequence[Any] | np.ndarray | torch.Tensor | None = None,
    max_examples_per_user: int | None = None,
    sampling: str = "poisson",
    max_batch_size: int | str | None = None,
    compile: bool = False,
    fixed_shapes: bool | None = None,
) -> DPMechanism:
    """Make ``model``'s training with ``optimizer`` differentially private (DP-SGD with Poisson,
    capped Poisson, fixed-size or shuffled batches, or BandMF's correlated noise with cyclic Poisson
    sampling).

    Args:
        model, optimizer: the user's; the optimizer must hold the trainable parameters.
        dataset_size: N, the number of private training examples.
        batch_size: expected logical batch size B (q = B / N).
        max_grad_norm: C, the per-example clipping norm; or per-layer bounds, a mapping from
            parameter-name patterns to C_g (``{"conv*": 0.5, "fc*": 1.0}``: fnmatch, first match
            wins, every trainable parameter matched), the noise then scaled to sqrt(sum_g C_g^2).
        delta: the delta of the guarantee (use < 1/N).
        max_grad_norm_per: "group" (default): one C clips each example's whole gradient, and a
            mapping clips each pattern's tensors together to its C_g. "tensor": every trainable
            tensor (a weight, a bias) is clipped on its own to C, or to the C of the first pattern
            matching its name (Opacus' ``clipping="per_layer"``); the sensitivity is then
            sqrt(sum over the tensors of C_i^2), and the plan's ``max_grad_norm`` lists each tensor.
        target_epsilon: calibrate sigma so the planned steps spend exactly this (or give noise_multiplier).
        noise_multiplier: sigma (the noise std on the clipped sum is sigma * C, or sigma *
            sqrt(sum_g C_g^2) per layer, sigma * sqrt(sum_i C_i^2) per tensor).
        epochs, steps: the length of the plan (one of them).
        accountant: "pld" or "rdp".
        engine: "auto", "bk", "ghost" or "vmap" (docs/engines.md).
        loss_fn: per-example loss (logits, targets) -> (B,); default cross-entropy.
        augment_multiplicity: K views per example: inputs shaped (B, K, ...); an example's loss is the
            mean over its views, clipped once (TAN's AugMult).
        precision: "fp32", "tf32", "bf16" or "fp16" (docs/precision.md).
        max_physical_batch_size: examples per chunk in ``step(x, y)`` and ``data_loader``; "auto": the
            largest whose step fits 90% of the GPU's free memory or half the available RAM, measured
            on ``check_batch``'s shape (required) and cached (``dpscale.train.chunk_size``). The
            mechanism's ``max_physical_batch_size`` holds the number: pass it when resuming.
        scheduler: a learning-rate scheduler stepped after every optimizer step.
        seed: fixes the sampling and noise streams (research only: anyone who knows it can replay
            them); None draws fresh 128-bit OS entropy.
        secure_noise: draw the noise from the OS CSPRNG (``dpscale.rng.SecureRandom``): never
            reproducible, not even with ``seed``, and ``state_dict()`` holds no noise state.
        check: verify the model, the loss and the engine before anything is released (default):
            on the first step's first chunk (or ``check_batch``), each example's loss and norm must
            not depend on the other examples (train mode), and the engine must match a per-example
            loop (eval mode); ``auto`` falls back to vmap where only bk is wrong. False skips
            both, and the plan and every epsilon then say the run is unchecked.
        check_batch: (x, y) examples to run the checks on now, in ``make_private`` (the first
            step's chunk is still checked for batch independence).
        noise_mechanism: "dpsgd" or "bandmf" (banded matrix factorization, docs/correlated_noise.md:
            ``batches()`` then samples cyclically, and the accounting is amplified BandMF's).
        bands: BandMF's b, or "auto" (least expected error x sigma; needs target_epsilon).
        max_bands: the largest b "auto" tries; max_noise_memory_mb: refuse a b whose noise
            history, (b-1) x trainable parameters x 4 bytes, is larger (MB).
        workload: what the strategy is optimised for (``dpscale.privacy.bandmf.Workload``);
            default: prefix sums with the optimizer's SGD momentum (give the learning-rate
            multipliers here when ``scheduler`` changes the rate).
        clipping: "fixed" or "adaptive" (Andrew et al. 2021, docs/clipping.md): C starts at
            ``max_grad_norm`` and follows the ``clip_quantile`` of the per-example norms, moved by
            ``clip_learning_rate`` each step through a count released with noise ``clip_count_noise``
            (sigma_b, examples; None: batch_size / 20); sigma (calibrated or given) covers both.
            "automatic" (Bu et al. 2023): every per-example gradient scaled by C / (||g|| +
            ``clip_gamma``), norm below C (the sensitivity), so the learning rate absorbs C.
        user_ids: one id per dataset index, all ints or all strings (floats, bools, both types or a
            NUL character are refused: numpy's coercion would merge people): the guarantee protects a person
            (user-level DP, docs/privacy-units.md). ``dataset_size`` stays the number of examples;
            ``batch_size`` is the expected number of USERS per step (q = batch_size / users), epochs
            count passes over the users, and ``batches()``/``sample()`` give the indices of the drawn
            users' examples, each user's consecutive (chunks passed to ``step`` must end where a
            user's examples end: ``data_loader`` cuts them so).
        max_examples_per_user: k, required with ``user_ids``: a drawn user contributes at most k of
            its examples per step (a fresh random k-subset when it has more); the sum of their
            gradients (each example's the mean over its AugMult views) is clipped as one to C.
        sampling: "poisson" (default); "fixed": exactly ``batch_size`` distinct examples each step
            (accounted with RDP under replace-one adjacency); "shuffle": a permutation per epoch
            (accounted without amplification). docs/sampling.md.
        max_batch_size: cap Poisson batches at this many examples, or with ``user_ids`` users (a
            larger draw keeps a uniformly random subset; truncated Poisson, PLD), "auto" (the smallest
            cap within 1% of the uncapped epsilon) or None.
        compile: capture each chunk's forward, backward, norms, clipping and clipped sum with
            ``torch.compile`` (the vmap engine's arithmetic, built and checked eagerly first; noise
            and accounting outside): engine auto or vmap, precision fp32; each new chunk shape
            compiles again, so give chunks one size (docs/engines.md, "The compiled step").
        fixed_shapes: pad every chunk with zero rows, which weigh exactly nothing, to one size
            (``step.pad_rows_for``: the chunk size, or the cap or fixed batch size when smaller),
            so that every step has one shape; None: with ``compile`` where the sampling has a
            largest batch. The release and the epsilon are those of the unpadded run.

    Returns:
        The mechanism: ``batches()``, ``step(...)``, ``epsilon()``, ``state_dict()``.

    Raises:
        ValueError: a layer that mixes examples or cannot be clipped per example (BatchNorm, ...),
            bad privacy numbers, patterns that leave a parameter unmatched or a pattern unused;
            at the first step, a model or loss that mixes examples.
    """
    _check_one_of(epochs=epochs, steps=steps, target_epsilon=target_epsilon, noise_multiplier=noise_multiplier)
    if any(p.device.type == "cpu" for p in model.parameters()):
        keep_freed_memory()  # fresh per-step tensors without page faults (dpscale.cpu_memory; opt out by env)
    max_grad_norm = _clip_bounds(model, max_grad_norm, max_grad_norm_per)
    users, units = _user_index(user_ids, max_examples_per_user, dataset_size, check_batch)  # N: examples, or users
    total_steps = steps_for(epochs, steps, units, batch_size)
    adaptive = adaptive_clipping(clipping, quantile=clip_quantile, learning_rate=clip_learning_rate,
                                 count_noise=clip_count_noise, batch_size=batch_size)  # fmt: skip
    numbers = PrivacyNumbers(
        batch_size=batch_size, max_grad_norm=max_grad_norm, delta=delta, target_epsilon=target_epsilon,
        noise_multiplier=noise_multiplier, sampling=sampling, max_batch_size=max_batch_size, accountant=accountant,
        adaptive=adaptive, clip_gamma=clip_gamma if clipping == "automatic" else None,
    )  # fmt: skip
    plan = make_dp_plan(
        numbers, dataset_size=units, steps=total_steps, seeded=seed is not None,
        privacy_unit="example" if users is None else "user", max_examples_per_user=max_examples_per_user,
        correlated=_bands_request(noise_mechanism, model, optimizer, total_steps, bands=bands, max_bands=max_bands,
                                  max_noise_memory_mb=max_noise_memory_mb, workload=workload),
    )  # fmt: skip
    plan = replace(plan, secure_noise=secure_noise, engine_unchecked=plan.is_private and not check)
    if compile:  # its refusals in one line, before anything is built
        engine = compiled_engine_name(engine, make_precision(precision), model)
    chosen, first_chunk_check = _chosen_engine(  # a non-private run claims no guarantee for the checks to protect
        engine, max_grad_norm, model, loss_fn=loss_fn, views=augment_multiplicity, precision=precision,
        check=check and plan.is_private, check_batch=check_batch, rows=max_examples_per_user if users else None,
        clip_gamma=plan.clip_gamma,
    )  # fmt: skip
    if compile:  # after the eager engine's checks: one shape compiled per chunk size
        chosen, first_chunk_check = compiled_choice(chosen, first_chunk_check)
    chunk = max_physical_batch_size  # "auto": measured with the engine that runs (compiled too), on check_batch's shape
    if isinstance(chunk, str):
        chunk = batch_chunk(chunk, chosen, model, plan, check_batch, augment_multiplicity)
    return DPMechanism(model, optimizer, plan, chosen, **_seed_streams(seed), scheduler=scheduler, users=users,
                       max_physical_batch_size=chunk, first_chunk_check=first_chunk_check,
                       views=augment_multiplicity, pad_rows=fixed_rows(plan, chunk, fixed_shapes, compile))  # fmt: skip


def _seed_streams(seed: int | None) -> dict[str, int]:
    """The mechanism's sampler, noise and BandMF partition seeds from ``seed`` (None: fresh entropy)."""
    seeds = run_seeds(seed)
    return {"sampler_seed": seeds["sampler"], "noise_seed": seeds["noise"], "partition_seed": seeds["partition"]}


def _user_index(
    user_ids: Any, max_examples_per_user: int | None, dataset_size: int, check_batch: Batch | None
) -> tuple[UserIndex | None, int]:  # fmt: skip
    """``make_private``'s users (None at the example unit), checked against the dataset, and the
    plan's N (the users, or the examples)."""
    if user_ids is None:
        if max_examples_per_user is not None:
            raise ValueError("max_examples_per_user bounds a user's examples: give user_ids (one per dataset index) too")
        return None, dataset_size
    if max_examples_per_user is None:
        raise ValueError("user_ids need max_examples_per_user=k: the examples a drawn user contributes per step")
    if check_batch is not None:
        raise ValueError("check_batch is not taken with user_ids: the checks run on the first step's users instead")
    users = UserIndex.from_ids(user_ids)
    if len(users.examples) != dataset_size:
        raise ValueError(f"user_ids holds {len(users.examples)} ids but dataset_size={dataset_size}: give one per dataset index")
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
    return clip_bounds(max_grad_norm, per, [name for name, p in model.named_parameters() if p.requires_grad])


def _check_one_of(
    *, epochs: float | None, steps: int | None, target_epsilon: float | None, noise_multiplier: float | None
) -> None:  # fmt: skip
    """Refuse a length or a noise given twice or not at all."""
    if (epochs is None) == (steps is None):
        raise ValueError("give exactly one of epochs= and steps=")
    if (target_epsilon is None) == (noise_multiplier is None):
        raise ValueError("give exactly one of target_epsilon= (sigma is calibrated) and noise_multiplier=")


def _bands_request(
    mechanism: str, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, *, bands: int | str,
    max_bands: int, max_noise_memory_mb: float, workload: Workload | None,
) -> BandsRequest | None:  # fmt: skip
    """BandMF's request for ``make_private`` (None for DP-SGD)."""
    if mechanism not in MECHANISMS:
        raise ValueError(f"noise_mechanism must be one of {', '.join(MECHANISMS)}, got {mechanism!r}")
    if mechanism == "dpsgd":
        return None
    if workload is None:  # prefix sums, with SGD's momentum (torch's SGD has it in its param groups)
        workload = Workload(steps=steps, momentum=float(optimizer.param_groups[0].get("momentum", 0.0) or 0.0)
                            if isinstance(optimizer, torch.optim.SGD) else 0.0)  # fmt: skip
    if workload.steps != steps:
        raise ValueError(f"workload.steps={workload.steps} but the plan has {steps} steps")
    parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return BandsRequest(
        bands=bands, workload=workload, max_bands=max_bands, parameters=parameters,
        max_noise_memory_mb=max_noise_memory_mb,
    )  # fmt: skip


def _chosen_engine(
    engine: str, max_grad_norm: MaxGradNorm, model: nn.Module, *, loss_fn: Callable | None, views: int,
    precision: str, check: bool, check_batch: Batch | None, rows: int | None, clip_gamma: float | None = None,
) -> tuple[PerExampleEngine, FirstChunkCheck | None]:  # fmt: skip
    """``make_private``'s engine, checked now on ``check_batch`` or at the first step's first chunk;
    at the user unit (``rows`` = k) one that clips each user's ``user_rows`` as one example."""
    base = per_example_loss(loss_fn) if loss_fn else None  # user_sum_loss: None is cross-entropy with padding
    if rows is not None:
        views, unit_loss = user_engine_options(rows, views, base)
        _tell([n for n in [ghost_per_user_notice(engine, rows)] if n])
    else:
        unit_loss = base or per_example_cross_entropy
    options: dict[str, Any] = {"views": views, "loss_fn": unit_loss, "precision": make_precision(precision), "clip_gamma": clip_gamma}
    # make_engine refuses the layers no engine can clip per example (BatchNorm, ...) in every case
    if check and check_batch is not None:
        with options["precision"].matmul_flags():  # as at every step (full float32 unless tf32)
            chosen, notices, _ = checked_engine(engine, max_grad_norm, model, check_batch, **options)
        _tell(notices)
        return chosen, independence_check
    chosen, notice = make_engine(engine, max_grad_norm, model, **options)
    _tell([notice] if notice else [])
    return chosen, _engine_check(engine, **options) if check else None

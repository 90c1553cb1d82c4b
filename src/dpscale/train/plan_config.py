"""The DP plan from a run's config: the config's ``dp`` section unpacked into the plan's
keyword-only numbers (the plan itself, in ``dpscale.privacy.plan.dp_plan``, knows nothing of configs)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from dpscale.clip_norms import MaxGradNorm, describe_clip
from dpscale.config import Config, DPConfig, OptimConfig
from dpscale.config.validation import dp_options
from dpscale.errors import ConfigError
from dpscale.privacy.accounting.segments import AccountingSegment
from dpscale.privacy.workload import Workload
from dpscale.privacy.clipping.bounds import clip_bounds
from dpscale.privacy.noise.correlated import BandsRequest, strategy_cache_dir
from dpscale.privacy.plan.make_plan import check_plan_matches, make_dp_plan
from dpscale.privacy.plan.numbers import PrivacyNumbers
from dpscale.privacy.plan.options_flat import privacy_numbers
from dpscale.privacy.plan.dp_plan import DPPlan
from dpscale.privacy.plan.source_runs import SourceRunPrivacy
from dpscale.train.optim import lr_multiplier


def dp_numbers(dp: DPConfig, names: Sequence[str] | None = None) -> PrivacyNumbers:
    """The privacy numbers of a config's ``dp`` section (dp.epsilon is their target_epsilon).

    Args:
        dp: the config's ``dp`` section.
        names: the model's trainable tensors' names, in ``named_parameters()`` order, after
            model.peft and model.freeze_groups (None: planned without a model, which
            dp.max_grad_norm_per=tensor refuses).

    Returns:
        the numbers ``make_dp_plan`` takes; ``max_grad_norm`` as ``config_clip_bounds`` spells it out.
    """
    # make_private's typed options, through the translation both doors share
    sampling, clipping, _ = dp_options(dp)
    return privacy_numbers(
        sampling,
        clipping,
        max_grad_norm=config_clip_bounds(dp, names),
        delta=dp.delta,
        target_epsilon=dp.epsilon,
        noise_multiplier=dp.noise_multiplier,
        accountant=dp.accountant,
        simulated_batch_size=dp.simulated_batch_size,
    )


def refuse_per_tensor_without_model(dp: DPConfig) -> None:
    """Refuse dp.max_grad_norm_per=tensor where a plan is made without building the model (``dpscale
    tan simulate --dry-run``, ``tan privacy-search --config``): its bounds, and the noise's
    sensitivity sqrt(sum_i C_i^2), need the model's tensor names. Falling back to the group form
    would plan another mechanism."""
    if dp.max_grad_norm_per == "tensor":
        raise ConfigError(
            "dp.max_grad_norm_per=tensor needs the model's trainable tensor names (the noise is scaled to "
            "sqrt(sum_i C_i^2) over them), and this plan is made without building the model: sigma, S and epsilon "
            "do not depend on the bounds, so plan here with dp.max_grad_norm_per=group and train with tensor"
        )


def config_clip_bounds(dp: DPConfig, names: Sequence[str] | None) -> MaxGradNorm:
    """dp.max_grad_norm as the plan and its engine take it: as given (dp.max_grad_norm_per=group),
    or one bound per trainable tensor, full name -> C_i (tensor; ``clip_bounds``).

    Args:
        dp: the config's ``dp`` section.
        names: the trainable tensors' names (``dp_numbers``); None refuses "tensor".

    Returns:
        C, pattern -> C_g, or tensor name -> C_i; None without clipping.
    """
    if names is None:
        refuse_per_tensor_without_model(dp)
    try:
        return clip_bounds(dp.max_grad_norm, dp.max_grad_norm_per, names or ())
    except ValueError as err:
        raise ConfigError(f"dp.max_grad_norm_per={dp.max_grad_norm_per}: {err}") from err


def workload_for(optim: OptimConfig, steps: int) -> Workload:
    """What the optimizer does with the noisy gradients over ``steps`` steps, for BandMF's strategy:
    prefix sums, with SGD's momentum and the learning-rate schedule (Adam's update is not linear
    in the gradients: its strategy is optimised for the schedule's prefix sums)."""
    momentum = optim.momentum if optim.name == "sgd" else 0.0
    multipliers = None
    if optim.schedule != "constant" or optim.warmup_steps:
        multipliers = tuple(
            lr_multiplier(t, steps, optim.schedule, optim.warmup_steps, optim.min_lr_ratio)
            for t in range(steps)
        )
    return Workload(steps=steps, momentum=momentum, lr_multipliers=multipliers)


def bands_request(config: Config, steps: int, parameters: int | None = None) -> BandsRequest | None:
    """BandMF's request for a config (None for dp.mechanism=dpsgd).

    Args:
        steps: S; parameters: the model's trainable parameters (None: the noise memory is not checked).
    """
    dp = config.dp
    if dp.mechanism != "bandmf":
        return None
    return BandsRequest(
        bands=dp.bands,
        workload=workload_for(config.optim, steps),
        max_bands=dp.max_bands,
        parameters=parameters,
        max_noise_memory_mb=dp.max_noise_memory_mb,
        cache_dir=str(strategy_cache_dir()),
    )


def plan_from_config(
    dp: DPConfig,
    dataset_size: int,
    steps: int,
    releases: tuple[AccountingSegment, ...] = (),
    seeded: bool = False,
    extractor: SourceRunPrivacy | None = None,
    correlated: BandsRequest | None = None,
    names: Sequence[str] | None = None,
    privacy_unit: str = "example",
) -> DPPlan:
    """``make_dp_plan`` for a config's ``dp`` section (N, S and releases from the run; BandMF's
    request from ``bands_request``; ``names``: the trainable tensors', as ``dp_numbers``; at
    ``privacy_unit`` user, N counts users and dp.max_examples_per_user bounds each)."""
    return make_dp_plan(
        dp_numbers(dp, names),
        dataset_size=dataset_size,
        steps=steps,
        releases=releases,
        seeded=seeded,
        extractor=extractor,
        correlated=correlated,
        privacy_unit=privacy_unit,
        max_examples_per_user=dp.max_examples_per_user,
    )


def check_same_unit(plan: DPPlan, privacy_unit: str, max_examples_per_user: int | None) -> None:
    """Refuse to continue a run at another privacy unit, or another k, than its checkpoint's plan
    (its accounting describes the unit it ran at)."""
    if (plan.privacy_unit, plan.max_examples_per_user) != (privacy_unit, max_examples_per_user):
        raise ConfigError(
            f"the checkpoint's plan is at privacy unit {plan.privacy_unit} (k={plan.max_examples_per_user}) but the "
            f"config asks for {privacy_unit} (k={max_examples_per_user}); refusing to continue it"
        )


def check_plan_against_config(
    plan: DPPlan,
    dp: DPConfig,
    dataset_size: int,
    steps: int,
    releases: tuple[AccountingSegment, ...] = (),
    correlated: BandsRequest | None = None,
    names: Sequence[str] | None = None,
) -> None:
    """``check_plan_matches`` for a checkpoint's plan against a config's ``dp`` section, the
    clipping first (``check_same_clipping``).

    Args:
        plan: the checkpoint's plan; dp: the config's ``dp`` section now.
        dataset_size, steps, releases, correlated: as ``plan_from_config``.
        names: the trainable tensors' names now (as ``dp_numbers``).
    """
    numbers = dp_numbers(dp, names)
    check_same_clipping(plan.max_grad_norm, numbers.max_grad_norm, dp)
    check_plan_matches(
        plan,
        numbers,
        dataset_size=dataset_size,
        steps=steps,
        releases=releases,
        correlated=correlated,
    )


def check_same_clipping(saved: MaxGradNorm, now: MaxGradNorm, dp: DPConfig) -> None:
    """Refuse to continue a run under other clipping than its checkpoint's plan: another C, another
    mapping, its patterns in another order (first match wins), or another dp.max_grad_norm_per
    (one bound per tensor is spelled out in the plan, so the two forms compare as mappings).

    Args:
        saved: the checkpoint plan's ``max_grad_norm``; now: the config's, spelled out the same way.
        dp: the config's ``dp`` section (named in the message).
    """
    if _in_order(saved) == _in_order(now):
        return
    raise ConfigError(
        f"the checkpoint's DP plan clips {describe_clip(saved)}, but dp.max_grad_norm={dp.max_grad_norm!r} with "
        f"dp.max_grad_norm_per={dp.max_grad_norm_per} clips {describe_clip(now)}; the run's noise and accounting "
        "are for the checkpoint's clipping: resume with its dp.max_grad_norm and dp.max_grad_norm_per, or start a "
        "new run"
    )


def _in_order(max_grad_norm: MaxGradNorm) -> Any:
    """A bound to compare: a mapping as its (pattern, C) pairs in order (the first match wins)."""
    if isinstance(max_grad_norm, Mapping):
        return [(str(p), float(c)) for p, c in max_grad_norm.items()]
    return None if max_grad_norm is None else float(max_grad_norm)

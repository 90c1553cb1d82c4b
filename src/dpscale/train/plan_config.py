"""The DP plan from a run's config: the config's ``dp`` section unpacked into the plan's
keyword-only numbers (the plan itself, in ``dpscale.privacy.plan``, knows nothing of configs)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dpscale.config import Config, DPConfig, OptimConfig
from dpscale.errors import ConfigError
from dpscale.privacy.accountant import AccountingSegment
from dpscale.privacy.adaptive import AdaptiveClipping, adaptive_clipping
from dpscale.privacy.bandmf import Workload
from dpscale.privacy.correlated import BandsRequest
from dpscale.privacy.plan import DPPlan, SourceRunPrivacy, check_plan_matches, make_dp_plan
from dpscale.train.optim import lr_multiplier


def dp_numbers(dp: DPConfig) -> dict[str, Any]:
    """The privacy numbers of a config's ``dp`` section, as ``make_dp_plan`` takes them."""
    return {
        "batch_size": dp.batch_size, "max_grad_norm": dp.max_grad_norm, "delta": dp.delta,
        "target_epsilon": dp.epsilon, "noise_multiplier": dp.noise_multiplier,
        "simulated_batch_size": dp.simulated_batch_size, "sampling": dp.sampling, "accountant": dp.accountant,
        "adaptive": adaptive_request(dp),
    }  # fmt: skip


def adaptive_request(dp: DPConfig) -> AdaptiveClipping | None:
    """dp.clipping=adaptive's settings (None for fixed clipping)."""
    try:
        return adaptive_clipping(
            dp.clipping, quantile=dp.clip_quantile, learning_rate=dp.clip_learning_rate,
            count_noise=dp.clip_count_noise, batch_size=dp.batch_size,
        )  # fmt: skip
    except ValueError as err:
        raise ConfigError(str(err)) from err


def workload_for(optim: OptimConfig, steps: int) -> Workload:
    """What the optimizer does with the noisy gradients over ``steps`` steps, for BandMF's strategy:
    prefix sums, with SGD's momentum and the learning-rate schedule (Adam's update is not linear
    in the gradients: its strategy is optimised for the schedule's prefix sums)."""
    momentum = optim.momentum if optim.name == "sgd" else 0.0
    multipliers = None
    if optim.schedule != "constant" or optim.warmup_steps:
        multipliers = tuple(
            lr_multiplier(t, steps, optim.schedule, optim.warmup_steps, optim.min_lr_ratio) for t in range(steps)
        )
    return Workload(steps=steps, momentum=momentum, lr_multipliers=multipliers)


def strategy_cache_dir() -> Path:
    """Where optimised BandMF strategies are cached: ``$DPSCALE_CACHE_DIR/bandmf`` if set, else
    ``$XDG_CACHE_HOME/dpscale/bandmf`` (``~/.cache`` if unset). Any cached strategy is safe to
    use: the plan re-normalises it, and privacy needs only its bands and column norms."""
    if os.environ.get("DPSCALE_CACHE_DIR"):
        return Path(os.environ["DPSCALE_CACHE_DIR"]).expanduser() / "bandmf"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "dpscale" / "bandmf"


def bands_request(config: Config, steps: int, parameters: int | None = None) -> BandsRequest | None:
    """BandMF's request for a config (None for dp.mechanism=dpsgd).

    Args:
        steps: S; parameters: the model's trainable parameters (None: the noise memory is not checked).
    """
    dp = config.dp
    if dp.mechanism != "bandmf":
        return None
    return BandsRequest(
        bands=dp.bands, workload=workload_for(config.optim, steps), max_bands=dp.max_bands, parameters=parameters,
        max_noise_memory_mb=dp.max_noise_memory_mb, cache_dir=str(strategy_cache_dir()),
    )  # fmt: skip


def plan_from_config(
    dp: DPConfig,
    dataset_size: int,
    steps: int,
    releases: tuple[AccountingSegment, ...] = (),
    seeded: bool = False,
    extractor: SourceRunPrivacy | None = None,
    correlated: BandsRequest | None = None,
) -> DPPlan:
    """``make_dp_plan`` for a config's ``dp`` section (N, S and releases from the run; BandMF's
    request from ``bands_request``)."""
    return make_dp_plan(
        dataset_size=dataset_size, steps=steps, releases=releases, seeded=seeded, extractor=extractor,
        correlated=correlated, **dp_numbers(dp),
    )  # fmt: skip


def check_plan_against_config(
    plan: DPPlan, dp: DPConfig, dataset_size: int, steps: int, releases: tuple[AccountingSegment, ...] = (),
    correlated: BandsRequest | None = None,
) -> None:  # fmt: skip
    """``check_plan_matches`` for a checkpoint's plan against a config's ``dp`` section."""
    check_plan_matches(
        plan, dataset_size=dataset_size, steps=steps, releases=releases, correlated=correlated, **dp_numbers(dp)
    )

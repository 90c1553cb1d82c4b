"""The DP plan from a run's config: the config's ``dp`` section unpacked into the plan's
keyword-only numbers (the plan itself, in ``dpscale.privacy.plan``, knows nothing of configs)."""

from __future__ import annotations

from typing import Any

from dpscale.config import DPConfig
from dpscale.privacy.accountant import AccountingSegment
from dpscale.privacy.plan import DPPlan, SourceRunPrivacy, check_plan_matches, make_dp_plan


def dp_numbers(dp: DPConfig) -> dict[str, Any]:
    """The privacy numbers of a config's ``dp`` section, as ``make_dp_plan`` takes them."""
    return {
        "batch_size": dp.batch_size, "max_grad_norm": dp.max_grad_norm, "delta": dp.delta,
        "target_epsilon": dp.epsilon, "noise_multiplier": dp.noise_multiplier,
        "simulated_batch_size": dp.simulated_batch_size, "sampling": dp.sampling, "accountant": dp.accountant,
    }  # fmt: skip


def plan_from_config(
    dp: DPConfig,
    dataset_size: int,
    steps: int,
    releases: tuple[AccountingSegment, ...] = (),
    seeded: bool = False,
    extractor: SourceRunPrivacy | None = None,
) -> DPPlan:
    """``make_dp_plan`` for a config's ``dp`` section (N, S and releases from the run)."""
    return make_dp_plan(
        dataset_size=dataset_size, steps=steps, releases=releases, seeded=seeded, extractor=extractor, **dp_numbers(dp)
    )


def check_plan_against_config(
    plan: DPPlan, dp: DPConfig, dataset_size: int, steps: int, releases: tuple[AccountingSegment, ...] = ()
) -> None:
    """``check_plan_matches`` for a checkpoint's plan against a config's ``dp`` section."""
    check_plan_matches(plan, dataset_size=dataset_size, steps=steps, releases=releases, **dp_numbers(dp))

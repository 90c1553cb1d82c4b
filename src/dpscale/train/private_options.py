"""``make_private``'s typed options (``dpscale.privacy.options``) and the flat keywords they replace.

``typed_options`` takes what the caller gave: the typed objects, or the flat keywords of earlier
releases (``batch_size=``, ``max_grad_norm=``, ``clip_quantile=``, ...), which it translates into
the same objects with a ``DeprecationWarning`` that shows the new call. An option of a strategy not
chosen (``clip_quantile`` with fixed clipping, ``bands`` with DP-SGD) is refused rather than
ignored. ``flat_settings`` turns the objects into the settings the mechanism is built from.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from dpscale.privacy.options import (
    Budget,
    Clipping,
    Independent,
    Noise,
    NoiseMultiplier,
    PerExample,
    PerformanceFlags,
    PerLayer,
    PerUser,
    Sampling,
    TargetEpsilon,
    Unit,
)
from dpscale.privacy.plan.options_flat import (
    CLIPPING_SETTINGS,
    NOISE_SETTINGS,
    SAMPLING_SETTINGS,
    clipping_option,
    noise_option,
    sampling_option,
)

BUDGET_KEYWORDS = {"delta": None, "target_epsilon": None, "noise_multiplier": None}
UNIT_KEYWORDS = {"user_ids": None, "max_examples_per_user": None}
PERFORMANCE_KEYWORDS = {
    "engine": "auto",
    "precision": "fp32",
    "max_physical_batch_size": None,
    "compile": False,
    "fixed_shapes": None,
}


@dataclass(frozen=True)
class Options:
    """One call's privacy settings, typed."""

    sampling: Sampling
    clipping: Clipping
    budget: Budget
    noise: Noise
    unit: Unit
    performance: PerformanceFlags


def typed_options(
    sampling: Sampling | str | None,
    clipping: Clipping | str | None,
    budget: Budget | None,
    noise: Noise | None,
    unit: Unit | None,
    performance: PerformanceFlags | None,
    legacy: dict[str, Any],
) -> Options:
    """The call's options: the typed ones given, the flat keywords translated (with a DeprecationWarning).

    Raises:
        TypeError: an unknown keyword, a concern given both ways, or a required setting missing.
        ValueError: a flat keyword out of range (named by its class and field) or of a strategy not chosen.
    """
    known = {
        **SAMPLING_SETTINGS,
        **CLIPPING_SETTINGS,
        **BUDGET_KEYWORDS,
        **NOISE_SETTINGS,
        **UNIT_KEYWORDS,
        **PERFORMANCE_KEYWORDS,
    }
    unknown = sorted(set(legacy) - set(known))
    if unknown:
        raise TypeError(f"make_private() got an unexpected keyword argument {unknown[0]!r}")
    flat = isinstance(sampling, str) or isinstance(clipping, str) or bool(legacy)
    options = Options(
        sampling=_concern("sampling", sampling, legacy, SAMPLING_SETTINGS, _legacy_sampling, flat),
        clipping=_concern("clipping", clipping, legacy, CLIPPING_SETTINGS, _legacy_clipping, flat),
        budget=_concern("budget", budget, legacy, BUDGET_KEYWORDS, _legacy_budget, flat),
        noise=_concern("noise", noise, legacy, NOISE_SETTINGS, _legacy_noise, flat, Independent()),
        unit=_concern("unit", unit, legacy, UNIT_KEYWORDS, _legacy_unit, flat, PerExample()),
        performance=_concern(
            "performance",
            performance,
            legacy,
            PERFORMANCE_KEYWORDS,
            _legacy_performance,
            flat,
            PerformanceFlags(),
        ),
    )
    if flat:
        warnings.warn(deprecation_text(options), DeprecationWarning, stacklevel=3)
    return options


def _concern(
    name: str,
    given: Any,
    legacy: dict[str, Any],
    keywords: dict[str, Any],
    translate: Any,
    flat: bool,
    default: Any = None,
) -> Any:
    """One concern's typed option: ``given``, or the flat keywords' translation."""
    spelled = {k: legacy[k] for k in keywords if k in legacy}
    mode = given if isinstance(given, str) else None
    if given is not None and mode is None:
        if spelled:
            raise TypeError(
                f"make_private() got {name}= and the flat keyword {next(iter(spelled))}= it replaces: give one"
            )
        return given
    if not flat:
        if default is None:
            raise TypeError(f"make_private() needs {name}= (dpscale.{_EXAMPLE[name]})")
        return default
    return translate({**keywords, **spelled}, mode, set(spelled))


_EXAMPLE = {
    "sampling": "Poisson(batch_size=...)",
    "clipping": "Flat(max_grad_norm=...)",
    "budget": "TargetEpsilon(epsilon=..., delta=...) or NoiseMultiplier(sigma=..., delta=...)",
}


def _required(values: dict[str, Any], *keys: str) -> None:
    missing = [k for k in keys if values[k] is None]
    if missing:
        raise TypeError(f"make_private() missing required keyword argument: {missing[0]!r}")


def _legacy_sampling(values: dict[str, Any], mode: str | None, given: set[str]) -> Sampling:
    _required(values, "batch_size")
    return sampling_option(values, mode or "poisson")


def _legacy_clipping(values: dict[str, Any], mode: str | None, given: set[str]) -> Clipping:
    if "max_grad_norm" not in given:
        raise TypeError("make_private() missing required keyword argument: 'max_grad_norm'")
    return clipping_option(values, mode or "fixed", {k: values[k] for k in given})


def _legacy_budget(values: dict[str, Any], mode: str | None, given: set[str]) -> Budget:
    _required(values, "delta")
    if (values["target_epsilon"] is None) == (values["noise_multiplier"] is None):
        raise ValueError(
            "give exactly one of target_epsilon= (sigma is calibrated) and noise_multiplier="
        )
    if values["target_epsilon"] is not None:
        return TargetEpsilon(epsilon=values["target_epsilon"], delta=values["delta"])
    return NoiseMultiplier(sigma=values["noise_multiplier"], delta=values["delta"])


def _legacy_noise(values: dict[str, Any], mode: str | None, given: set[str]) -> Noise:
    return noise_option(values, {k: values[k] for k in given})


def _legacy_unit(values: dict[str, Any], mode: str | None, given: set[str]) -> Unit:
    ids, k = values["user_ids"], values["max_examples_per_user"]
    if ids is None and k is not None:
        raise ValueError(
            "max_examples_per_user bounds a user's examples: give user_ids (one per dataset index) too"
        )
    if ids is None:
        return PerExample()
    if k is None:
        raise ValueError(
            "user_ids need max_examples_per_user=k: the examples a drawn user contributes per step"
        )
    return PerUser(user_ids=ids, max_examples_per_user=k)


def _legacy_performance(
    values: dict[str, Any], mode: str | None, given: set[str]
) -> PerformanceFlags:
    return PerformanceFlags(**values)


def deprecation_text(options: Options) -> str:
    """The warning of a call with the flat keywords: the same call in the typed options."""
    parts = [
        f"sampling={options.sampling!r}",
        f"clipping={options.clipping!r}",
        f"budget={options.budget!r}",
    ]
    parts += [
        f"{name}={value!r}"
        for name, value in (
            ("noise", options.noise),
            ("unit", options.unit),
            ("performance", options.performance),
        )
        if value != _DEFAULTS[name]
    ]
    return (
        "make_private's flat privacy keywords (batch_size=, max_grad_norm=, delta=, ...) are deprecated and will be "
        f"removed in the next release; the same call with dpscale's typed options: make_private(model, optimizer, "
        f"dataset_size=..., {', '.join(parts)}, ...) (docs/own-loop.md)"
    )


_DEFAULTS: dict[str, Any] = {
    "noise": Independent(),
    "unit": PerExample(),
    "performance": PerformanceFlags(),
}


def flat_settings(options: Options) -> dict[str, Any]:
    """What ``make_private``'s body reads besides the options: the clipping's bounds and form, the
    budget's numbers and the users."""
    clipping, budget, unit = options.clipping, options.budget, options.unit
    return {
        "max_grad_norm": clipping.bounds
        if isinstance(clipping, PerLayer)
        else clipping.max_grad_norm,
        "max_grad_norm_per": getattr(clipping, "per", "group"),
        "delta": budget.delta,
        "target_epsilon": budget.epsilon if isinstance(budget, TargetEpsilon) else None,
        "noise_multiplier": budget.sigma if isinstance(budget, NoiseMultiplier) else None,
        "user_ids": unit.user_ids if isinstance(unit, PerUser) else None,
        "max_examples_per_user": unit.max_examples_per_user if isinstance(unit, PerUser) else None,
    }

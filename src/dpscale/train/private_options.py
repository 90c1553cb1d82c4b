"""``make_private``'s typed options (``dpscale.privacy.options``) and the flat keywords they replace.

``typed_options`` takes what the caller gave: the typed objects, or the flat keywords of earlier
releases (``batch_size=``, ``max_grad_norm=``, ``clip_quantile=``, ...), which it translates into
the same objects with a ``DeprecationWarning`` that shows the new call. An option of a strategy not
chosen (``clip_quantile`` with fixed clipping, ``bands`` with DP-SGD) is refused rather than
ignored. ``flat_settings`` turns the objects into the settings the mechanism is built from.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dpscale.choices import CLIPPINGS, DEFAULT_MAX_BANDS, DEFAULT_MAX_NOISE_MEMORY_MB, MECHANISMS
from dpscale.privacy.options import (
    Adaptive, Automatic, BandMF, Budget, Clipping, FixedSize, Flat, Independent, Noise, NoiseMultiplier, PerExample,
    PerformanceFlags, PerLayer, PerUser, Poisson, Sampling, Shuffle, TargetEpsilon, Unit,
)  # fmt: skip

# The flat keywords of each concern, with the defaults they had (an option of a strategy not chosen
# is accepted at its default: a call that spelled out the default still runs).
SAMPLING_KEYWORDS = {"batch_size": None, "max_batch_size": None}
CLIPPING_KEYWORDS = {"max_grad_norm": None, "max_grad_norm_per": "group", "clip_quantile": 0.5, "clip_learning_rate": 0.2,
                     "clip_count_noise": None, "clip_gamma": 0.01}  # fmt: skip
BUDGET_KEYWORDS = {"delta": None, "target_epsilon": None, "noise_multiplier": None}
NOISE_KEYWORDS = {"noise_mechanism": "dpsgd", "bands": "auto", "max_bands": DEFAULT_MAX_BANDS,
                  "max_noise_memory_mb": DEFAULT_MAX_NOISE_MEMORY_MB, "workload": None}  # fmt: skip
UNIT_KEYWORDS = {"user_ids": None, "max_examples_per_user": None}
PERFORMANCE_KEYWORDS = {"engine": "auto", "precision": "fp32", "max_physical_batch_size": None, "compile": False,
                        "fixed_shapes": None}  # fmt: skip
SAMPLING_MODES = {"poisson": Poisson, "fixed": FixedSize, "shuffle": Shuffle}


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
    sampling: Sampling | str | None, clipping: Clipping | str | None, budget: Budget | None, noise: Noise | None,
    unit: Unit | None, performance: PerformanceFlags | None, legacy: dict[str, Any],
) -> Options:  # fmt: skip
    """The call's options: the typed ones given, the flat keywords translated (with a DeprecationWarning).

    Raises:
        TypeError: an unknown keyword, a concern given both ways, or a required setting missing.
        ValueError: a flat keyword out of range (named by its class and field) or of a strategy not chosen.
    """
    known = {**SAMPLING_KEYWORDS, **CLIPPING_KEYWORDS, **BUDGET_KEYWORDS, **NOISE_KEYWORDS, **UNIT_KEYWORDS,
             **PERFORMANCE_KEYWORDS}  # fmt: skip
    unknown = sorted(set(legacy) - set(known))
    if unknown:
        raise TypeError(f"make_private() got an unexpected keyword argument {unknown[0]!r}")
    flat = isinstance(sampling, str) or isinstance(clipping, str) or bool(legacy)
    options = Options(
        sampling=_concern("sampling", sampling, legacy, SAMPLING_KEYWORDS, _legacy_sampling, flat),
        clipping=_concern("clipping", clipping, legacy, CLIPPING_KEYWORDS, _legacy_clipping, flat),
        budget=_concern("budget", budget, legacy, BUDGET_KEYWORDS, _legacy_budget, flat),
        noise=_concern("noise", noise, legacy, NOISE_KEYWORDS, _legacy_noise, flat, Independent()),
        unit=_concern("unit", unit, legacy, UNIT_KEYWORDS, _legacy_unit, flat, PerExample()),
        performance=_concern(
            "performance", performance, legacy, PERFORMANCE_KEYWORDS, _legacy_performance, flat, PerformanceFlags()
        ),  # fmt: skip
    )
    if flat:
        warnings.warn(deprecation_text(options), DeprecationWarning, stacklevel=3)
    return options


def _concern(name: str, given: Any, legacy: dict[str, Any], keywords: dict[str, Any], translate: Any, flat: bool,
             default: Any = None) -> Any:  # fmt: skip
    """One concern's typed option: ``given``, or the flat keywords' translation."""
    spelled = {k: legacy[k] for k in keywords if k in legacy}
    mode = given if isinstance(given, str) else None
    if given is not None and mode is None:
        if spelled:
            raise TypeError(f"make_private() got {name}= and the flat keyword {next(iter(spelled))}= it replaces: give one")
        return given
    if not flat:
        if default is None:
            raise TypeError(f"make_private() needs {name}= (dpscale.{_EXAMPLE[name]})")
        return default
    return translate({**keywords, **spelled}, mode, set(spelled))


_EXAMPLE = {"sampling": "Poisson(batch_size=...)", "clipping": "Flat(max_grad_norm=...)",
            "budget": "TargetEpsilon(epsilon=..., delta=...) or NoiseMultiplier(sigma=..., delta=...)"}  # fmt: skip


def _inactive(given: set[str], values: dict[str, Any], defaults: dict[str, Any], keys: tuple[str, ...], owner: str) -> None:
    """Refuse an option of a strategy not chosen, given with a value other than its default."""
    for key in keys:
        if key in given and values[key] != defaults[key]:
            raise ValueError(f"make_private: {key}={values[key]!r} applies to {owner} only; it is not taken here")


def _required(values: dict[str, Any], *keys: str) -> None:
    missing = [k for k in keys if values[k] is None]
    if missing:
        raise TypeError(f"make_private() missing required keyword argument: {missing[0]!r}")


def _legacy_sampling(values: dict[str, Any], mode: str | None, given: set[str]) -> Sampling:
    _required(values, "batch_size")
    mode = mode or "poisson"
    if mode not in SAMPLING_MODES:
        raise ValueError(f"make_private: sampling must be Poisson(...), FixedSize(...) or Shuffle(...) (or "
                         f"{', '.join(repr(m) for m in SAMPLING_MODES)}), got {mode!r}")  # fmt: skip
    if mode == "poisson":
        return Poisson(batch_size=values["batch_size"], max_batch_size=values["max_batch_size"])
    if values["max_batch_size"] is not None:
        raise ValueError(f"make_private: max_batch_size caps Poisson batches; sampling={mode!r} draws exactly batch_size")
    size = values["batch_size"]
    return SAMPLING_MODES[mode](batch_size=int(size) if isinstance(size, float) and size.is_integer() else size)


def _legacy_clipping(values: dict[str, Any], mode: str | None, given: set[str]) -> Clipping:
    mode = mode or "fixed"
    if mode not in CLIPPINGS:
        raise ValueError(f"make_private: clipping must be Flat(...), PerLayer(...), Adaptive(...) or Automatic(...) (or "
                         f"{', '.join(repr(c) for c in CLIPPINGS)}), got {mode!r}")  # fmt: skip
    if "max_grad_norm" not in given:
        raise TypeError("make_private() missing required keyword argument: 'max_grad_norm'")
    adaptive_keys = ("clip_quantile", "clip_learning_rate", "clip_count_noise") if mode != "adaptive" else ()
    _inactive(given, values, CLIPPING_KEYWORDS, adaptive_keys, "clipping='adaptive'")
    _inactive(given, values, CLIPPING_KEYWORDS, ("clip_gamma",) if mode != "automatic" else (), "clipping='automatic'")
    bound, per = values["max_grad_norm"], values["max_grad_norm_per"]
    if mode == "adaptive":
        if per != "group" or isinstance(bound, Mapping):
            raise ValueError("make_private: clipping='adaptive' starts from one norm C (Adaptive.max_grad_norm); not with per-layer bounds")
        return Adaptive(max_grad_norm=bound, quantile=values["clip_quantile"], learning_rate=values["clip_learning_rate"],
                        count_noise=values["clip_count_noise"])  # fmt: skip
    if mode == "automatic":
        return Automatic(max_grad_norm=bound, per=per, gamma=values["clip_gamma"])
    if per == "group" and not isinstance(bound, Mapping):
        return Flat(max_grad_norm=bound)
    return PerLayer(bounds=bound, per=per)


def _legacy_budget(values: dict[str, Any], mode: str | None, given: set[str]) -> Budget:
    _required(values, "delta")
    if (values["target_epsilon"] is None) == (values["noise_multiplier"] is None):
        raise ValueError("give exactly one of target_epsilon= (sigma is calibrated) and noise_multiplier=")
    if values["target_epsilon"] is not None:
        return TargetEpsilon(epsilon=values["target_epsilon"], delta=values["delta"])
    return NoiseMultiplier(sigma=values["noise_multiplier"], delta=values["delta"])


def _legacy_noise(values: dict[str, Any], mode: str | None, given: set[str]) -> Noise:
    mechanism = values["noise_mechanism"]
    if mechanism not in MECHANISMS:
        raise ValueError(f"make_private: noise_mechanism must be one of {', '.join(repr(m) for m in MECHANISMS)}, got {mechanism!r}")
    if mechanism == "dpsgd":
        _inactive(given, values, NOISE_KEYWORDS, ("bands", "max_bands", "max_noise_memory_mb", "workload"), "noise_mechanism='bandmf'")
        return Independent()
    return BandMF(bands=values["bands"], max_bands=values["max_bands"], max_noise_memory_mb=values["max_noise_memory_mb"],
                  workload=values["workload"])  # fmt: skip


def _legacy_unit(values: dict[str, Any], mode: str | None, given: set[str]) -> Unit:
    ids, k = values["user_ids"], values["max_examples_per_user"]
    if ids is None and k is not None:
        raise ValueError("max_examples_per_user bounds a user's examples: give user_ids (one per dataset index) too")
    if ids is None:
        return PerExample()
    if k is None:
        raise ValueError("user_ids need max_examples_per_user=k: the examples a drawn user contributes per step")
    return PerUser(user_ids=ids, max_examples_per_user=k)


def _legacy_performance(values: dict[str, Any], mode: str | None, given: set[str]) -> PerformanceFlags:
    return PerformanceFlags(**values)


def deprecation_text(options: Options) -> str:
    """The warning of a call with the flat keywords: the same call in the typed options."""
    parts = [f"sampling={options.sampling!r}", f"clipping={options.clipping!r}", f"budget={options.budget!r}"]
    parts += [f"{name}={value!r}" for name, value in (("noise", options.noise), ("unit", options.unit),
              ("performance", options.performance)) if value != _DEFAULTS[name]]  # fmt: skip
    return ("make_private's flat privacy keywords (batch_size=, max_grad_norm=, delta=, ...) are deprecated and will be "
            f"removed in the next release; the same call with dpscale's typed options: make_private(model, optimizer, "
            f"dataset_size=..., {', '.join(parts)}, ...) (docs/own-loop.md)")  # fmt: skip


_DEFAULTS: dict[str, Any] = {"noise": Independent(), "unit": PerExample(), "performance": PerformanceFlags()}


def flat_settings(options: Options) -> dict[str, Any]:
    """The settings the mechanism is built from (``make_private``'s body), from the typed options."""
    sampling, clipping, budget, noise, unit = options.sampling, options.clipping, options.budget, options.noise, options.unit
    bound = clipping.bounds if isinstance(clipping, PerLayer) else clipping.max_grad_norm
    return {
        "batch_size": sampling.batch_size, "sampling": sampling.mode,
        "max_batch_size": sampling.max_batch_size if isinstance(sampling, Poisson) else None,
        "max_grad_norm": bound, "max_grad_norm_per": getattr(clipping, "per", "group"), "clipping": clipping.mode,
        "adaptive": clipping if isinstance(clipping, Adaptive) else None,
        "clip_gamma": clipping.gamma if isinstance(clipping, Automatic) else None,
        "delta": budget.delta, "target_epsilon": budget.epsilon if isinstance(budget, TargetEpsilon) else None,
        "noise_multiplier": budget.sigma if isinstance(budget, NoiseMultiplier) else None,
        "bands": noise if isinstance(noise, BandMF) else None,
        "user_ids": unit.user_ids if isinstance(unit, PerUser) else None,
        "max_examples_per_user": unit.max_examples_per_user if isinstance(unit, PerUser) else None,
    }  # fmt: skip

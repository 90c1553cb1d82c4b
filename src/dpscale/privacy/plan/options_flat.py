"""The flat privacy settings (a config's ``dp`` section; ``make_private``'s keywords of earlier
releases) as the typed options of ``dpscale.privacy.options``: one translation for both doors,
and the privacy numbers built from the options in one place.

An option of a strategy not chosen, set to something other than its default (``clip_quantile`` with
fixed clipping, ``bands`` with DP-SGD), is refused: it was accepted and ignored, out of range too.
A door names its settings in its own words (``Spelling``): ``clip_quantile=5.0`` for Python
callers, ``dp.clip_quantile=5.0`` for the config, and rewords the options' own field errors
(``OptionError``) likewise. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
import warnings
from typing import Any

from dpscale.choices import CLIPPINGS, DEFAULT_MAX_BANDS, DEFAULT_MAX_NOISE_MEMORY_MB, MECHANISMS
from dpscale.privacy.clipping.adaptive import adaptive_clipping, adaptive_refusal
from dpscale.privacy.plan.numbers import PrivacyNumbers
from dpscale.privacy.options import (
    Adaptive,
    Automatic,
    BandMF,
    Clipping,
    FixedSize,
    Flat,
    Independent,
    Noise,
    PerLayer,
    Poisson,
    Sampling,
    Shuffle,
)
from dpscale.privacy.spelling import PYTHON, Spelling

# The flat settings of each concern with their defaults (a setting of a strategy not chosen is
# accepted at its default: a call or a config that spells the default out still runs).
SAMPLING_SETTINGS: dict[str, Any] = {"batch_size": None, "max_batch_size": None}
CLIPPING_SETTINGS: dict[str, Any] = {
    "max_grad_norm": None,
    "max_grad_norm_per": "group",
    "clip_quantile": 0.5,
    "clip_learning_rate": 0.2,
    "clip_count_noise": None,
    "clip_gamma": 0.01,
}
NOISE_SETTINGS: dict[str, Any] = {
    "noise_mechanism": "dpsgd",
    "bands": "auto",
    "max_bands": DEFAULT_MAX_BANDS,
    "max_noise_memory_mb": DEFAULT_MAX_NOISE_MEMORY_MB,
    "workload": None,
}
SAMPLING_MODES: dict[str, type] = {"poisson": Poisson, "fixed": FixedSize, "shuffle": Shuffle}
ADAPTIVE_SETTINGS = ("clip_quantile", "clip_learning_rate", "clip_count_noise")
BANDMF_SETTINGS = ("bands", "max_bands", "max_noise_memory_mb", "workload")


def _inactive(
    given: Mapping[str, Any],
    defaults: Mapping[str, Any],
    keys: tuple[str, ...],
    owner: str,
    spell: Spelling,
) -> None:
    """Refuse a setting of a strategy not chosen, given with a value other than its default (the
    config warns: ``Spelling.warn_unused``)."""
    for key in keys:
        if key in given and given[key] != defaults[key]:
            text = f"{spell.said(key, given[key])} applies to {owner} only; it is not taken here"
            if not spell.warn_unused:
                raise spell.refusal(text)
            warnings.warn(text, UserWarning, stacklevel=2)


def sampling_option(values: Mapping[str, Any], mode: str, spell: Spelling = PYTHON) -> Sampling:
    """``Poisson``/``FixedSize``/``Shuffle`` from a sampling name and ``SAMPLING_SETTINGS``."""
    if mode not in SAMPLING_MODES:
        typed = (
            " (or dpscale.Poisson(...), FixedSize(...), Shuffle(...))" if spell.typed_names else ""
        )
        raise spell.refusal(
            f"{spell.key('sampling')} must be {', '.join(repr(m) for m in SAMPLING_MODES)}{typed}, got {mode!r}"
        )
    if mode == "poisson":
        return spell.built(
            lambda: Poisson(
                batch_size=values["batch_size"], max_batch_size=values["max_batch_size"]
            )
        )
    if values["max_batch_size"] is not None:
        raise spell.refusal(
            f"{spell.key('max_batch_size')} caps Poisson batches; {spell.said('sampling', mode)} draws exactly B"
        )
    size = values["batch_size"]
    size = int(size) if isinstance(size, float) and size.is_integer() else size
    return spell.built(lambda: SAMPLING_MODES[mode](batch_size=size))


def clipping_option(
    values: Mapping[str, Any], mode: str, given: Mapping[str, Any], spell: Spelling = PYTHON
) -> Clipping:
    """``Flat``/``PerLayer``/``Adaptive``/``Automatic`` from a clipping name and ``CLIPPING_SETTINGS``
    (``given``: the settings spelled out, checked against their defaults when their strategy is not chosen)."""
    if mode not in CLIPPINGS:
        raise spell.refusal(
            f"{spell.key('clipping')} must be {', '.join(repr(c) for c in CLIPPINGS)}, got {mode!r}"
        )
    adaptive_keys = ADAPTIVE_SETTINGS if mode != "adaptive" else ()
    _inactive(given, CLIPPING_SETTINGS, adaptive_keys, spell.said("clipping", "adaptive"), spell)
    _inactive(
        given,
        CLIPPING_SETTINGS,
        ("clip_gamma",) if mode != "automatic" else (),
        spell.said("clipping", "automatic"),
        spell,
    )
    bound, per = values["max_grad_norm"], values["max_grad_norm_per"]
    if mode == "adaptive":
        if per != "group" or isinstance(bound, Mapping):
            clash = (
                spell.said("max_grad_norm_per", per)
                if per != "group"
                else f"per-layer {spell.key('max_grad_norm')}"
            )
            raise adaptive_refusal(spell, clash)
        return spell.built(
            lambda: Adaptive(
                max_grad_norm=bound,
                quantile=values["clip_quantile"],
                learning_rate=values["clip_learning_rate"],
                count_noise=values["clip_count_noise"],
            )
        )
    if mode == "automatic":
        return spell.built(
            lambda: Automatic(max_grad_norm=bound, per=per, gamma=values["clip_gamma"])
        )
    if per == "group" and not isinstance(bound, Mapping):
        return spell.built(lambda: Flat(max_grad_norm=bound))
    return spell.built(lambda: PerLayer(bounds=bound, per=per))


def noise_option(
    values: Mapping[str, Any], given: Mapping[str, Any], spell: Spelling = PYTHON
) -> Noise:
    """``Independent``/``BandMF`` from a mechanism name and ``NOISE_SETTINGS``."""
    mechanism = values["noise_mechanism"]
    if mechanism not in MECHANISMS:
        raise spell.refusal(
            f"{spell.key('noise_mechanism')} must be {', '.join(repr(m) for m in MECHANISMS)}, got {mechanism!r}"
        )
    if mechanism == "dpsgd":
        _inactive(
            given, NOISE_SETTINGS, BANDMF_SETTINGS, spell.said("noise_mechanism", "bandmf"), spell
        )
        return Independent()
    return spell.built(
        lambda: BandMF(
            bands=values["bands"],
            max_bands=values["max_bands"],
            max_noise_memory_mb=values["max_noise_memory_mb"],
            workload=values["workload"],
        )
    )


def privacy_numbers(
    sampling: Sampling,
    clipping: Clipping,
    *,
    max_grad_norm: Any,
    delta: float,
    target_epsilon: float | None,
    noise_multiplier: float | None,
    accountant: str,
    simulated_batch_size: float | None = None,
) -> PrivacyNumbers:
    """The numbers ``make_dp_plan`` takes, from the typed sampling and clipping (both doors).

    Args:
        max_grad_norm: the clipping's bounds as the plan takes them (per tensor: spelled out per tensor).
        delta, target_epsilon, noise_multiplier: the budget (the config may give both epsilon and sigma).
        accountant: "pld" or "rdp"; simulated_batch_size: a TAN simulation's batch, or None.
    """
    adaptive = None
    if isinstance(clipping, Adaptive):  # sigma_b's default (B / 20) lives in adaptive_clipping
        adaptive = adaptive_clipping(
            "adaptive",
            quantile=clipping.quantile,
            learning_rate=clipping.learning_rate,
            count_noise=clipping.count_noise,
            batch_size=sampling.batch_size,
        )
    return PrivacyNumbers(
        batch_size=sampling.batch_size,
        max_grad_norm=max_grad_norm,
        delta=delta,
        target_epsilon=target_epsilon,
        noise_multiplier=noise_multiplier,
        sampling=type(sampling).mode,
        accountant=accountant,
        adaptive=adaptive,
        max_batch_size=sampling.max_batch_size if isinstance(sampling, Poisson) else None,
        clip_gamma=clipping.gamma if isinstance(clipping, Automatic) else None,
        simulated_batch_size=simulated_batch_size,
    )

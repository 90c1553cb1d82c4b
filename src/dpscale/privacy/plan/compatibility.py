"""The rules between the privacy settings, in one place: ``make_dp_plan`` asks them first, for every door.

Clipping and a private budget, automatic and adaptive clipping, the privacy unit, the batch against
N, the sampling and its cap, BandMF; and whether a simulated batch size asks for a TAN simulation.
"""

from __future__ import annotations

from dpscale.clip_norms import MaxGradNorm, check_clip_gamma, check_max_grad_norm, is_per_layer
from dpscale.errors import ConfigError
from dpscale.privacy.accounting.group_privacy import check_privacy_unit
from dpscale.privacy.clipping.adaptive import AdaptiveClipping, adaptive_refusal
from dpscale.privacy.noise.correlated import BandsRequest, check_bandmf_settings
from dpscale.privacy.plan.numbers import PrivacyNumbers
from dpscale.privacy.plan.sampling_plan import check_sampling_settings
from dpscale.privacy.spelling import CONFIG, Spelling, clipping_needed


def check_compatible(
    numbers: PrivacyNumbers,
    *,
    dataset_size: int,
    correlated: BandsRequest | None = None,
    privacy_unit: str = "example",
    max_examples_per_user: int | None = None,
    spell: Spelling = CONFIG,
) -> None:
    """The rules between the settings, in one place (``make_dp_plan`` asks first, for every door):
    clipping and a private budget, automatic and adaptive clipping, the privacy unit, the batch
    against N, the sampling and its cap, BandMF.

    Args:
        numbers: the settings; dataset_size: N; correlated: BandMF's request (None: DP-SGD);
        privacy_unit, max_examples_per_user: as ``make_dp_plan``; spell: the door's words.

    Raises:
        ConfigError: the first rule broken, in one line.
    """
    max_grad_norm, noise_multiplier, adaptive = (
        numbers.max_grad_norm,
        numbers.noise_multiplier,
        numbers.adaptive,
    )
    check_max_grad_norm(max_grad_norm)
    if max_grad_norm is None and (noise_multiplier is None or noise_multiplier > 0):
        # a review found make_private(max_grad_norm=None) planned, then failed at step 1
        raise clipping_needed(spell)
    simulated = is_simulation(numbers.batch_size, numbers.simulated_batch_size)
    _check_automatic(numbers.clip_gamma, max_grad_norm, adaptive)
    _check_adaptive(adaptive, max_grad_norm, correlated, simulated, spell)
    check_privacy_unit(
        privacy_unit,
        max_examples_per_user,
        simulated=simulated,
        sampling=numbers.sampling,
        spell=spell,
    )
    if numbers.batch_size > dataset_size:
        units = "users" if privacy_unit == "user" else "the training set"
        raise spell.refusal(
            f"{spell.key('batch_size')}={numbers.batch_size} is larger than {units} (N={dataset_size})"
        )
    check_sampling_settings(
        numbers.sampling,
        numbers.max_batch_size,
        batch_size=numbers.batch_size,
        adaptive=adaptive is not None,
        simulated=simulated,
        bandmf=correlated is not None,
        spell=spell,
    )
    if correlated is not None:
        check_bandmf_settings(
            sampling=numbers.sampling,
            simulated=simulated,
            noise_multiplier=noise_multiplier,
            bands=correlated.bands,
            spell=spell,
        )


def _check_automatic(
    clip_gamma: float | None, max_grad_norm: MaxGradNorm, adaptive: AdaptiveClipping | None
) -> None:
    """Refuse automatic clipping without a C to scale to, beside adaptive clipping, or with a bad gamma."""
    if clip_gamma is None:
        return
    try:
        check_clip_gamma(clip_gamma)
    except ValueError as err:
        raise ConfigError(f"dp.clip_gamma: {err}") from err
    if max_grad_norm is None or adaptive is not None:
        raise ConfigError(
            "automatic clipping (dp.clipping=automatic) scales each gradient to norm < C: it needs "
            "dp.max_grad_norm and is not adaptive clipping"
        )


def _check_adaptive(
    adaptive: AdaptiveClipping | None,
    max_grad_norm: MaxGradNorm,
    correlated: BandsRequest | None,
    simulated: bool,
    spell: Spelling,
) -> None:
    """Refuse adaptive clipping where its accounting is not written: with per-layer norms,
    BandMF's correlated noise or a TAN simulation."""
    if adaptive is None:
        return
    clash = (
        f"per-layer {spell.key('max_grad_norm')}"
        if is_per_layer(max_grad_norm)
        else f"no clipping ({spell.key('max_grad_norm')}={'None' if spell.typed_names else 'null'})"
        if max_grad_norm is None
        else spell.said("noise_mechanism", "bandmf")
        if correlated is not None
        else f"a TAN simulation ({spell.key('simulated_batch_size')})"
        if simulated
        else None
    )
    if clash:
        raise adaptive_refusal(spell, clash)


def is_simulation(batch_size: float, simulated_batch_size: float | None) -> bool:
    """Whether a simulated batch size asks for a TAN simulation (one equal to the batch size is
    the reference run itself, with its guarantee)."""
    return simulated_batch_size is not None and simulated_batch_size != batch_size

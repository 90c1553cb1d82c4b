"""Correlated noise in the DP plan: which banded matrix factorization (BandMF) a run uses.

A run with ``dp.mechanism=bandmf`` adds sigma*C*(C_s^{-1} Z)_t to step t's clipped sum, where C_s
is a b-banded lower-triangular Toeplitz strategy with maximum column norm 1
(``dpscale.privacy.noise.bandmf``), and samples with cyclic Poisson sampling (the N examples split once
into b groups; step t samples group t mod b with probability p = b*B/N). Under that sampling the
columns an example touches never overlap, and the run is accounted as DP-SGD with ceil(S/b)
steps at sampling probability p and the same sigma (amplified BandMF: Choquette-Choo et al.
2023; jax_privacy's ``amplified_bandmf_event``). b = 1 is DP-SGD exactly.

This module picks b (``dp.bands``) and writes down why; the plan (``dpscale.privacy.plan.dp_plan``)
derives the sampler, the noise and the accounting from what it records.
"""

from __future__ import annotations

import math
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from dpscale.choices import DEFAULT_MAX_BANDS, DEFAULT_MAX_NOISE_MEMORY_MB
from dpscale.privacy.sampling.modes import RATE_TOLERANCE
from dpscale.privacy.spelling import CONFIG, Spelling

if TYPE_CHECKING:  # bandmf needs torch; the plan (and dpscale account for DP-SGD) does not
    from dpscale.privacy.noise.bandmf import BandedStrategy
    from dpscale.privacy.workload import Workload

NOISE_STATE_BYTES = 4  # the history holds float32 vectors, one per parameter and band


@dataclass(frozen=True)
class BandsRequest:
    """What a run asks of BandMF (``dp.bands``, ``dp.max_bands``, ``dp.max_noise_memory_mb``).

    Attributes:
        bands: "auto" or a fixed number of bands b >= 1.
        workload: what the optimizer does with the noisy gradients (the strategy is optimised for it).
        max_bands: the largest b that "auto" tries.
        parameters: trainable parameters of the model (None: the noise memory is not checked).
        max_noise_memory_mb: refuse a b whose noise history needs more (MB).
        cache_dir: where optimised strategies are cached (None: in this process only).
    """

    bands: int | str
    workload: Workload
    max_bands: int = DEFAULT_MAX_BANDS
    parameters: int | None = None
    max_noise_memory_mb: float = DEFAULT_MAX_NOISE_MEMORY_MB
    cache_dir: str | None = None


@dataclass(frozen=True)
class BandedNoisePlan:
    """The BandMF strategy a plan runs with (all numbers: two plans with different strategies differ).

    Attributes:
        bands: b (1: DP-SGD's noise).
        coefficients: c_0..c_{b-1} of the strategy's first column (max column norm 1).
        relative_error: the strategy's expected error (RMSE on the workload) relative to DP-SGD's
            at the same sigma.
        workload: the workload it was optimised for, in words.
        reason: why this b, in a few words ("dp.bands=4, fixed", or auto's verdict).
        candidates: dp.bands=auto's table (each b's expected error x sigma relative to DP-SGD's); "" when fixed.
        noise_state_mb: the noise history's size, (b-1) x parameters x 4 bytes (None: unknown).
    """

    bands: int
    coefficients: tuple[float, ...]
    relative_error: float
    workload: str
    reason: str
    candidates: str = ""
    noise_state_mb: float | None = None

    def __post_init__(self) -> None:
        # a list when read back
        object.__setattr__(self, "coefficients", tuple(float(c) for c in self.coefficients))
        if len(self.coefficients) != self.bands or not self.coefficients[0] > 0:
            raise ValueError(
                f"a banded strategy needs {self.bands} coefficients with c_0 > 0, got {self.coefficients}"
            )

    def describe(self) -> str:
        """One clause for the plan's header."""
        memory = (
            f", noise history {self.noise_state_mb:.1f} MB"
            if self.noise_state_mb is not None
            else ""
        )
        table = f" [{self.candidates}]" if self.candidates else ""
        return (
            f"BandMF b={self.bands} ({self.reason}{table}; expected error {self.relative_error:.3f}x DP-SGD's at "
            f"equal sigma on {self.workload}{memory})"
        )

    def short(self) -> str:
        """The strategy for a result line: b and why."""
        return f"BandMF b={self.bands} ({self.reason})"


def check_bandmf_settings(
    *,
    sampling: str,
    simulated: bool,
    noise_multiplier: float | None,
    bands: int | str,
    spell: Spelling = CONFIG,
) -> None:
    """Refuse settings BandMF's accounting does not describe (config validation and the plan both ask;
    in ``spell``'s words, the config's by default).

    Raises:
        ConfigError: shuffle sampling, a TAN simulation, no noise, or dp.bands=auto with a fixed sigma.
    """
    bandmf = spell.said("noise_mechanism", "bandmf")

    def cli(flag: str) -> str:  # dpscale account plans in the config's words: its flags too
        return "" if spell.typed_names else f",{flag}"

    if sampling != "poisson":
        raise spell.refusal(
            f"{bandmf} is accounted for cyclic Poisson sampling (b-min-separation: an example joins only the steps of its "
            f"group, every b-th step); {spell.said('sampling', sampling)} does not give that: use {spell.said('sampling', 'poisson')}"
        )
    if simulated:
        raise spell.refusal(
            f"a TAN simulation ({spell.key('simulated_batch_size')}) scales DP-SGD's independent noise with the batch size; "
            "BandMF's correlated noise and its amplification over b groups are not what TAN's analysis models, so "
            f"a simulation would predict nothing: simulate the DP-SGD run ({spell.said('noise_mechanism', 'dpsgd')}) instead"
        )
    if noise_multiplier == 0:
        raise spell.refusal(
            f"{bandmf} correlates the noise of a private run; {spell.said('noise_multiplier', 0)} adds none"
        )
    if bands == "auto" and noise_multiplier is not None:
        raise spell.refusal(
            f"{spell.said('bands', 'auto')} compares each b at the sigma that spends the target epsilon for it, and sigma is "
            f"fixed here: give a target epsilon instead ({spell.key('target_epsilon')}{cli(' --target-epsilon')}), or a number "
            f"of bands ({spell.key('bands')}=N{cli(' --bands N')})"
        )


def noise_state_mb(bands: int, parameters: int | None) -> float | None:
    """Size of the noise history, (b-1) x parameters x 4 bytes, in MB (None when unknown)."""
    return None if parameters is None else (bands - 1) * parameters * NOISE_STATE_BYTES / 2**20


def band_candidates(request: BandsRequest, *, steps: int, sample_rate: float) -> list[int]:
    """The b that ``dp.bands=auto`` compares: 1, 2, 4, ... up to min(S, max_bands), each with
    p = b*q <= 1 and a noise history within the memory limit (b = 1 always qualifies)."""
    candidates, bands = [], 1
    while bands <= min(steps, request.max_bands):
        if bands == 1 or _refusal(request, bands, steps=steps, sample_rate=sample_rate) is None:
            candidates.append(bands)
        bands *= 2
    return candidates


def _refusal(
    request: BandsRequest, bands: int, *, steps: int, sample_rate: float, spell: Spelling = CONFIG
) -> str | None:
    """Why b bands cannot run (None: they can), in ``spell``'s words."""
    b, limit = spell.said("bands", bands), spell.key("max_noise_memory_mb")
    if bands > steps:
        return f"{b} is more than the run's {steps} steps"
    if bands * sample_rate > 1.0 + RATE_TOLERANCE:
        return (
            f"{b} needs the sampling probability b*q = {bands}*{sample_rate:.6g} = "
            f"{bands * sample_rate:.6g} <= 1 (each of the b groups holds N/b examples and must yield B on average): "
            f"lower {spell.key('bands')} or {spell.key('batch_size')}"
        )
    memory = noise_state_mb(bands, request.parameters)
    if memory is not None and memory > request.max_noise_memory_mb:
        return (
            f"{b}: the correlated noise keeps the last b-1 noise vectors, (b-1) x {request.parameters} parameters x 4 "
            f"bytes = {memory:.1f} MB > {limit}={request.max_noise_memory_mb:g}; lower {spell.key('bands')} or raise {limit}"
        )
    return None


# sigma for b bands (calibrated to the target epsilon at p = b*q over ceil(S/b) steps, or given),
# and whether it was calibrated
SigmaFor = Callable[[int], tuple[float, bool]]


def choose_bands(
    request: BandsRequest,
    *,
    steps: int,
    sample_rate: float,
    sigma_for: SigmaFor,
    spell: Spelling = CONFIG,
) -> tuple[BandedNoisePlan, float, bool]:
    """The strategy a run uses, with its sigma.

    A fixed b is checked and optimised. ``auto`` optimises a strategy for each candidate b and
    takes the one with the least expected error x sigma (RMSE on the workload, in units of C):
    b = 1 (DP-SGD) wins unless a banded strategy beats it after its own sigma.

    Args:
        request: dp.bands and its limits; steps: S; sample_rate: q = B / N.
        sigma_for: sigma for b bands (see ``SigmaFor``).

    Returns:
        (the strategy, sigma, whether sigma was calibrated).

    Raises:
        ConfigError: a fixed b that cannot run (more bands than steps, b*q > 1, memory).
    """
    if request.bands != "auto":
        bands = int(request.bands)
        refusal = _refusal(request, bands, steps=steps, sample_rate=sample_rate, spell=spell)
        if refusal is not None:
            raise spell.refusal(refusal)
        strategy = _optimize(request, bands)
        sigma, calibrated = sigma_for(bands)
        return _noise_plan(request, strategy, f"dp.bands={bands}, fixed", ""), sigma, calibrated
    scored = []
    for bands in band_candidates(request, steps=steps, sample_rate=sample_rate):
        strategy = _optimize(request, bands)
        sigma, calibrated = sigma_for(bands)
        scored.append((strategy.rmse * sigma, bands, strategy, sigma, calibrated))
    best = min(scored, key=lambda entry: (entry[0], entry[1]))  # ties: the fewer bands
    return _noise_plan(request, best[2], *_auto_reason(scored, best)), best[3], best[4]


def _auto_reason(scored: list[tuple], best: tuple) -> tuple[str, str]:
    """dp.bands=auto's verdict, and its table: each b's expected error x sigma relative to DP-SGD's."""
    baseline = scored[0][0]  # b = 1
    table = "error x sigma relative to DP-SGD: " + ", ".join(
        f"b={b} {score / baseline:.3f}" for score, b, *_ in scored
    )
    if best[1] == 1:
        return (
            "dp.bands=auto: no banded strategy beat DP-SGD after calibrating its own sigma",
            table,
        )
    return f"dp.bands=auto: least expected error x sigma, {best[0] / baseline:.3f}x DP-SGD's", table


def _optimize(request: BandsRequest, bands: int) -> BandedStrategy:
    from dpscale.privacy.noise.bandmf import optimize_strategy

    return optimize_strategy(request.workload, bands, cache_dir=request.cache_dir)


def _noise_plan(
    request: BandsRequest, strategy: BandedStrategy, reason: str, candidates: str
) -> BandedNoisePlan:
    return BandedNoisePlan(
        bands=strategy.bands,
        coefficients=strategy.coefficients,
        relative_error=strategy.relative_error,
        workload=request.workload.describe(),
        reason=reason,
        candidates=candidates,
        noise_state_mb=noise_state_mb(strategy.bands, request.parameters),
    )


def compositions(steps: int, bands: int) -> int:
    """Amplified BandMF's compositions after ``steps`` steps: ceil(steps / b) (a started band counts whole)."""
    return math.ceil(steps / bands)


def strategy_cache_dir() -> Path:
    """Where optimised BandMF strategies are cached, for every door (``dpscale train``, ``make_private``):
    ``cache_path("bandmf")``. Any cached strategy is safe to use: the plan re-normalises it, and
    privacy needs only its bands and column norms."""
    # local: dpscale account plans BandMF without torch (_io needs it)
    from dpscale._io import cache_path

    return cache_path("bandmf")

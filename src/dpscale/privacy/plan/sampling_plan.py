"""A plan's batch sampler: which settings go together, which accountant composes it, and the
batch cap ``dp.max_batch_size`` resolves to (torch-free; ``dpscale.privacy.accounting.batch_sampling`` has the
samplers' accounting)."""

from __future__ import annotations

from dpscale.privacy.sampling.modes import SAMPLING_MODES
from dpscale.errors import ConfigError
from dpscale.privacy.accounting.accountant import smallest_free_cap
from dpscale.privacy.accounting.batch_sampling import ACCOUNTANTS_OF
from dpscale.privacy.accounting.segments import AccountingSegment
from dpscale.privacy.spelling import CONFIG, Spelling

AUTO_CAP = "auto"


def accountant_for(sampling: str, max_batch_size: int | str | None, requested: str) -> str:
    """The accountant a plan uses: ``requested``, unless dp_accounting composes the sampler with
    another only (fixed-size batches: RDP; capped Poisson batches: PLD)."""
    mode = "truncated" if sampling == "poisson" and max_batch_size is not None else sampling
    kinds = ACCOUNTANTS_OF.get(mode, (requested,))
    return requested if requested in kinds else kinds[0]


def check_sampling_settings(
    sampling: str,
    max_batch_size: int | str | None,
    *,
    batch_size: float,
    adaptive: bool,
    simulated: bool,
    bandmf: bool,
    spell: Spelling = CONFIG,
) -> None:
    """Refuse a sampler the plan cannot account, in one line (in ``spell``'s words: the config's by default).

    Raises:
        ConfigError: an unknown sampling; a cap other than a positive integer, "auto" or null, or one
            with fixed-size or shuffled batches, BandMF or a TAN simulation; fixed-size batches of a
            fractional B; fixed-size or shuffled batches with adaptive clipping or a TAN simulation.
    """
    if sampling not in SAMPLING_MODES:
        raise ConfigError(
            f"dp.sampling must be one of {', '.join(SAMPLING_MODES)}, got {sampling!r}"
        )
    if max_batch_size is not None:
        _check_cap(sampling, max_batch_size, bandmf=bandmf, simulated=simulated, spell=spell)
    if sampling == "poisson":
        return
    said = spell.said("sampling", sampling)
    if batch_size != int(batch_size):
        raise spell.refusal(
            f"{said} draws exactly B examples: {spell.key('batch_size')} must be an integer, got {batch_size}"
        )
    simulation = f"a TAN simulation ({spell.key('simulated_batch_size')})"
    clash = spell.said("clipping", "adaptive") if adaptive else simulation if simulated else None
    if clash:
        raise spell.refusal(
            f"{said} is accounted under replace-one adjacency, which {clash} is not written for; use {spell.said('sampling', 'poisson')}"
        )


def _check_cap(
    sampling: str, cap: int | str, *, bandmf: bool, simulated: bool, spell: Spelling
) -> None:
    """Refuse a batch cap that is not a positive integer or "auto", or that caps no Poisson batch."""
    if cap != AUTO_CAP and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise spell.refusal(
            f"{spell.key('max_batch_size')} must be a positive integer, {AUTO_CAP} or null, got {cap!r}"
        )
    clash = (
        f"{spell.said('sampling', sampling)} (its batches are exactly B already)"
        if sampling != "poisson"
        else f"{spell.said('noise_mechanism', 'bandmf')} (cyclic Poisson sampling)"
        if bandmf
        else f"a TAN simulation ({spell.key('simulated_batch_size')})"
        if simulated
        else None
    )
    if clash:
        raise spell.refusal(
            f"{spell.key('max_batch_size')} caps Poisson batches (truncated Poisson sampling); not with {clash}"
        )


def resolve_batch_cap(
    max_batch_size: int | str | None,
    *,
    dataset_size: int,
    batch_size: float,
    steps: int,
    delta: float,
    releases: tuple[AccountingSegment, ...],
    noise_multiplier: float | None,
) -> int | None:
    """The batch cap a plan runs with.

    Args:
        max_batch_size: a cap, "auto" or None (uncapped).
        dataset_size, batch_size, steps, delta, releases: the plan's N, B, S, delta and releases.
        noise_multiplier: sigma, at which "auto" compares caps (None for a given cap).

    Returns:
        the cap M, or None where nothing is cut (no cap asked, or one of N or more). "auto": the
        smallest cap whose epsilon is within 1% of uncapped Poisson sampling's at ``noise_multiplier``.

    Raises:
        ConfigError: "auto" for a non-private run.
    """
    if max_batch_size is None:
        return None
    if max_batch_size == AUTO_CAP:
        if not (noise_multiplier or 0) > 0:
            raise ConfigError(
                "dp.max_batch_size=auto chooses a cap for a private run; a non-private one needs none"
            )
        max_batch_size = smallest_free_cap(
            dataset_size=dataset_size,
            batch_size=batch_size,
            noise_multiplier=noise_multiplier,
            steps=steps,
            delta=delta,
            releases=releases,
        ).max_batch_size
    # a string but "auto" (_check_cap refuses it): no cap to compare with N
    if isinstance(max_batch_size, str):
        raise TypeError(
            f"dp.max_batch_size must be a positive integer, {AUTO_CAP} or null, got {max_batch_size!r}"
        )
    return None if max_batch_size >= dataset_size else int(max_batch_size)


def truncation_rate(dataset_size: int, sample_rate: float, cap: int) -> float:
    """P(a Poisson batch has more than ``cap`` examples) = P(Binomial(N, q) > cap): the share of
    steps whose batch the cap cuts."""
    from scipy.stats import binom  # scipy: dp_accounting's dependency already

    return float(binom.sf(cap, dataset_size, sample_rate))


def cap_cost_text(capped: float, uncapped: float, *, percent: bool) -> str:
    """What a batch cap does to epsilon, in words: "the cap costs epsilon 0.012" or, for a cap
    below B (a smaller-batch training, cheaper), "the cap saves 48.7%" (it read "costs -48.7%").

    Args:
        capped, uncapped: the capped and the uncapped Poisson epsilon.
        percent: the change relative to ``uncapped`` in percent (else epsilon's difference).
    """
    change = capped / uncapped - 1 if percent else capped - uncapped
    amount = f"{100 * abs(change):.1f}%" if percent else f"epsilon {abs(change):.3g}"
    return f"the cap {'costs' if change >= 0 else 'saves'} {amount}"

"""The PLD side of the accountant: a history's privacy loss distribution and its delta(epsilon) profile.

PLD accounting discretises the privacy loss on a grid (1e-4 nats). Little noise (epsilon in the
hundreds and more) makes the loss range so wide that this grid would need arrays of tens of GiB; the
grid is then coarsened (``pld_grid``), which keeps epsilon a valid upper bound, only a looser one.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import numpy as np
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution, privacy_loss_mechanism

from dpscale.privacy.accounting.batch_sampling import (
    ACCOUNTANTS_OF,
    REPLACE_ONE,
    BatchSampling,
    replace_one_noise,
)
from dpscale.privacy.accounting.pld_epsilon import pld_epsilons
from dpscale.privacy.accounting.pld_gaussian import gaussian_pld, truncated_gaussian_pld
from dpscale.privacy.accounting.segments import AccountingSegment, adjacency_of

# PLD discretisation: 1e-4 is dp_accounting's default. Results are pessimistic (upper
# bounds) at any grid; a coarser grid is ~10x faster and over-reports by < 0.5%, which
# calibration uses for its search before confirming on the fine grid.
PLD_VALUE_DISCRETIZATION = 1e-4
PLD_COARSE_DISCRETIZATION = 1e-3

# Caps on the sizes (points) of the PLD arrays. Small noise multipliers (large epsilons) make the
# privacy loss range wide: sigma = 0.065 over 14062 steps at q = 0.0043 needs 1.5e8 points on the
# 1e-4 grid and a 42 GiB FFT. Past a cap the grid is coarsened (by powers of 2, so cached step
# PLDs are reused): a pessimistic PLD is an upper bound at any grid, so only tightness is lost,
# and at large epsilon the coarser grid's relative cost is tiny. Building a step PLD takes ~1 s per
# 1e5 points and composing 2**21 points ~1 s and ~0.5 GiB. All usual runs (epsilon <~ 50 at
# q = 0.004, 14062 steps: 2.2e5 and 1.4e6 points) stay on the requested grid.
PLD_MAX_STEP_POINTS = 2**18
PLD_MAX_COMPOSED_POINTS = 2**21
# dp_accounting's PrivacyLossDistribution.self_compose default: each composition moves this much
# tail mass into the infinite-loss bucket, so no epsilon exists for a delta at or below it.
PLD_TAIL_MASS_TRUNCATION = 1e-15
# Smallest delta the PLD accountant reports: below ~1e-13 the truncated tail mass dominates and
# epsilon jumps (q = 0.0043, sigma = 1, 14062 steps: 4.94 at 1e-12, 8.43 at 1e-13, inf at 1e-15).
PLD_MIN_DELTA = 1e-12
# Coarsest grid (nats) a history may need under the caps (rounded up to a power of 2 it can reach
# twice that), so composed losses up to ~2e6 nats. A history needing more has epsilon in the millions
# (q = 0.0043, 14062 steps: sigma < 0.0056), where a PLD means nothing and dp_accounting overflows
# (exp of the grid) or runs for minutes; PLDRangeError says so.
PLD_MAX_GRID = 1.0
# Points of the cheap probe PLD that estimates the composed width (above dp_accounting's 1000-point
# sparse threshold, so the probe is a dense array).
_PROBE_POINTS = 1024


class PLDRangeError(ValueError):
    """The PLD accountant cannot represent a history: its privacy loss is too wide for any sane grid."""


@functools.lru_cache(maxsize=32)
def _step_pld(
    sample_rate: float, noise_multiplier: float, discretization: float
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """PLD of one Poisson-subsampled Gaussian step (add/remove adjacency, pessimistic).

    Building it dominates PLD accounting (~0.05 s; 0.3 s with dp_accounting's own inversion,
    ``pld_gaussian``); composing it over many steps is an FFT.
    Caching it makes per-epoch epsilon logging cheap. The construction is exactly what
    ``dp_accounting.pld.PLDAccountant`` does for a ``PoissonSampledDpEvent(GaussianDpEvent)``
    (a test checks the two agree).
    """
    return gaussian_pld(
        noise_multiplier, sampling_prob=sample_rate, value_discretization_interval=discretization
    )


@functools.lru_cache(maxsize=32)
def _full_batch_pld(
    noise_multiplier: float, steps: int, discretization: float
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """PLD of ``steps`` Gaussian mechanisms without subsampling: exactly one Gaussian with
    sigma / sqrt(steps) (cached: calibration evaluates the same releases many times)."""
    return gaussian_pld(
        noise_multiplier / math.sqrt(steps), value_discretization_interval=discretization
    )


def _step_loss_range(sample_rate: float, noise_multiplier: float) -> float:
    """Width (in nats) of the privacy-loss range dp_accounting discretises for one Gaussian step,
    the wider of its add and remove sides (a closed form: no PLD is built)."""
    width = 0.0
    for adjacency in (
        privacy_loss_mechanism.AdjacencyType.REMOVE,
        privacy_loss_mechanism.AdjacencyType.ADD,
    ):
        bounds = privacy_loss_mechanism.GaussianPrivacyLoss(
            noise_multiplier, sampling_prob=sample_rate, adjacency_type=adjacency
        ).connect_dots_bounds()
        width = max(width, bounds.epsilon_upper - bounds.epsilon_lower)
    return width


def _composed_loss_width(
    sample_rate: float, noise_multiplier: float, steps: int, step_range: float
) -> float:
    """Width (in nats) of the support dp_accounting keeps when composing ``steps`` steps.

    dp_accounting truncates the composition where a Chernoff bound puts less than
    PLD_TAIL_MASS_TRUNCATION outside; its orders are spread over the step's loss range, so the
    bound in nats hardly depends on the grid, and a ~1000-point probe PLD (~0.05 s) predicts it.

    Returns:
        the width in nats (steps * step_range, the untruncated width, if the probe cannot be read).
    """
    grid = step_range / _PROBE_POINTS
    probe = gaussian_pld(
        noise_multiplier, sampling_prob=sample_rate, value_discretization_interval=grid
    )
    width = 0.0
    try:  # private attributes of dp_accounting 0.4-0.6; the fallback is a valid (loose) width
        for pmf in (probe._pmf_remove, probe._pmf_add):
            lower, upper = pld_common.compute_self_convolve_bounds(
                pmf.to_dense_pmf()._probs, steps, PLD_TAIL_MASS_TRUNCATION
            )
            width = max(width, (upper - lower) * grid)
    except AttributeError:
        return steps * step_range
    return width


@functools.lru_cache(maxsize=256)
def _segment_widths(sample_rate: float, noise_multiplier: float, steps: int) -> tuple[float, float]:
    """(width of one step's PLD, width of the segment's composed PLD), in nats."""
    if sample_rate == 1.0:  # a release: one Gaussian with sigma / sqrt(steps), never self-composed
        width = _step_loss_range(1.0, noise_multiplier / math.sqrt(steps))
        return width, width
    step_range = _step_loss_range(sample_rate, noise_multiplier)
    # past the cap: the probe could overflow
    if steps == 1 or step_range > PLD_MAX_GRID * PLD_MAX_STEP_POINTS:
        return step_range, step_range
    return step_range, _composed_loss_width(sample_rate, noise_multiplier, steps, step_range)


def _widths_of(seg: AccountingSegment, replace_one: bool) -> tuple[float, float]:
    """``_segment_widths`` of a segment as ``_segment_pld`` builds it (a truncated step's range
    taken as the uncapped Poisson step's: the cap only narrows the output's sum)."""
    sigma = replace_one_noise(seg.noise_multiplier) if replace_one else seg.noise_multiplier
    if seg.batches.mode == "shuffle":
        return _segment_widths(1.0, sigma, seg.compositions)
    # the replace-one Gaussian at sigma/2 on the M/N kept dominates each step
    if _cuts_every_batch(seg):
        return _segment_widths(
            seg.batches.max_batch_size / seg.batches.dataset_size, sigma / 2, seg.steps
        )
    return _segment_widths(seg.sample_rate, sigma, seg.steps)


def _cuts_every_batch(seg: AccountingSegment) -> bool:
    """A capped segment at q = 1 with a cap below N: every batch is a random M-subset of the data,
    so its steps are truncated steps, not the full-batch Gaussian a q = 1 segment otherwise is."""
    return (
        seg.batches.mode == "truncated"
        and seg.sample_rate == 1.0
        and seg.batches.max_batch_size < seg.batches.dataset_size
    )


def pld_grid(
    segments: tuple[AccountingSegment, ...], requested: float = PLD_VALUE_DISCRETIZATION
) -> float:
    """The PLD discretisation used for a history: ``requested``, or a power-of-2 multiple of it where
    the requested grid would exceed PLD_MAX_STEP_POINTS per step PLD or PLD_MAX_COMPOSED_POINTS for
    the composition (the epsilon is then a valid but looser upper bound). A request coarser than
    PLD_VALUE_DISCRETIZATION asks for a cheaper evaluation (calibration's search): its caps shrink
    in proportion.

    Args:
        segments: the history (DP-SGD segments and releases); composed widths add up.
        requested: the grid asked for, in nats.

    Returns:
        the grid, in nats, >= requested.

    Raises:
        PLDRangeError: the history would need a grid above PLD_MAX_GRID at the full caps.
    """
    widths = [_widths_of(s, adjacency_of(segments) == REPLACE_ONE) for s in segments]
    needed = max(
        max(step for step, _ in widths) / PLD_MAX_STEP_POINTS,
        sum(composed for _, composed in widths) / PLD_MAX_COMPOSED_POINTS,
    )
    # judged at the full caps, so the limit does not depend on ``requested``
    if needed > PLD_MAX_GRID:
        sigma = min(s.noise_multiplier for s in segments)
        raise PLDRangeError(
            f"the PLD accountant cannot represent noise multiplier {sigma:.3g} over this history: its privacy "
            f"loss spans ~{needed * PLD_MAX_COMPOSED_POINTS:.3g} nats, more than the "
            f"{PLD_MAX_GRID * PLD_MAX_COMPOSED_POINTS:.3g} it handles (epsilon would be of that order: no "
            "guarantee); use more noise or fewer steps, the rdp accountant, or noise multiplier 0 for a "
            "non-private baseline"
        )
    needed /= min(1.0, PLD_VALUE_DISCRETIZATION / requested)
    if needed <= requested:
        return requested
    return requested * 2.0 ** math.ceil(math.log2(needed / requested))


def composed_pld(
    segments: list[AccountingSegment], discretization: float
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """PLD of the whole history on the grid ``pld_grid`` picks for it (the last few kept: a run's
    summary asks for its epsilon, then its privacy profile, of the same history).

    Args:
        segments: the history, under one adjacency.
        discretization: the grid asked for, in nats (``pld_grid`` may coarsen it).

    Returns:
        the composed (pessimistic) privacy loss distribution.
    """
    return _composed_pld_of(tuple(segments), discretization)


@functools.lru_cache(maxsize=4)
def _composed_pld_of(
    segments: tuple[AccountingSegment, ...], discretization: float
) -> privacy_loss_distribution.PrivacyLossDistribution:
    grid = pld_grid(segments, discretization)
    replace_one = adjacency_of(segments) == REPLACE_ONE
    total = None
    for seg in segments:
        composed = _segment_pld(seg, grid, replace_one)
        total = composed if total is None else total.compose(composed)
    return total


def _segment_pld(
    seg: AccountingSegment, grid: float, replace_one: bool
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """PLD of one segment on ``grid``: a Poisson or truncated-Poisson step self-composed, or Gaussians
    on every example it touches (releases; shuffled epochs), whose noise multiplier is halved in a
    replace-one history (``replace_one_noise``)."""
    mode = seg.batches.mode
    if "pld" not in ACCOUNTANTS_OF[mode]:
        raise ValueError(
            f"{mode} sampling is accounted with the {'/'.join(ACCOUNTANTS_OF[mode])} accountant only"
        )
    sigma = replace_one_noise(seg.noise_multiplier) if replace_one else seg.noise_multiplier
    if (seg.sample_rate == 1.0 and not _cuts_every_batch(seg)) or mode == "shuffle":
        return _full_batch_pld(sigma, seg.compositions, grid)
    if mode == "truncated":
        return _truncated_step_pld(seg.batches, seg.sample_rate, sigma, grid).self_compose(
            seg.steps
        )
    return _step_pld(seg.sample_rate, sigma, grid).self_compose(seg.steps)


@functools.lru_cache(maxsize=16)
def _truncated_step_pld(
    batches: BatchSampling, sample_rate: float, noise_multiplier: float, discretization: float
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """PLD of one truncated-Poisson step: what dp_accounting's PLDAccountant composes for a
    ``TruncatedSubsampledGaussianDpEvent`` (add/remove adjacency), bit for bit, built ~7x faster
    (``truncated_gaussian_pld``: 0.5 s against 3.7 at N = 1000, q = 0.05, cap 55, grid 1e-4)."""
    return truncated_gaussian_pld(
        batches.dataset_size, sample_rate, batches.max_batch_size, noise_multiplier, discretization
    )


def pld_epsilon_of(segments: list[AccountingSegment], delta: float, discretization: float) -> float:
    """Epsilon of a history at ``delta`` by PLD.

    Args:
        segments: the history, under one adjacency.
        delta: the delta, in (0, 1).
        discretization: the grid asked for, in nats.

    Returns:
        epsilon (float, >= 0).
    """
    return pld_epsilons(composed_pld(segments, discretization), [delta])[0]


def pld_profile(
    pld: privacy_loss_distribution.PrivacyLossDistribution,
) -> Callable[[np.ndarray], np.ndarray]:
    """delta(epsilon) of a PLD for sorted arrays of epsilons >= 0, vectorised.

    dp_accounting's own ``get_delta_for_epsilon`` walks the loss support in a Python loop (0.5 s
    for a 24-step run, per call); this takes the same sums, inf mass + sum_{L > eps} p(L) -
    e^eps sum_{L > eps} p(L) e^-L, as suffix sums in numpy (a test compares the two), and falls
    back to the library where its PMF internals differ (another dp_accounting version)."""
    pmfs = [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]
    try:
        parts = [_pmf_profile(pmf.to_dense_pmf()) for pmf in pmfs]
    except AttributeError:
        return lambda eps: np.asarray(
            pld.get_delta_for_epsilon(np.asarray(eps, dtype=np.float64)), dtype=np.float64
        )
    return lambda eps: np.max([part(np.asarray(eps, dtype=np.float64)) for part in parts], axis=0)


def _pmf_profile(dense: Any) -> Callable[[np.ndarray], np.ndarray]:
    """The hockey-stick divergence of one dense PMF (its losses sorted ascending) at epsilons >= 0."""
    losses = (np.arange(dense.size) + dense._lower_loss) * dense._discretization
    probs = np.asarray(dense._probs, dtype=np.float64)
    # only losses > eps >= 0 enter a sum: clamping the rest keeps e^-L finite
    upper = np.append(np.cumsum(probs[::-1])[::-1], 0.0)
    lower = np.append(np.cumsum((probs * np.exp(-np.maximum(losses, 0.0)))[::-1])[::-1], 0.0)
    infinity = float(dense._infinity_mass)

    def delta(eps: np.ndarray) -> np.ndarray:
        above = np.searchsorted(losses, eps, side="right")  # the first loss > eps
        return np.clip(infinity + upper[above] - np.exp(eps) * lower[above], 0.0, 1.0)

    return delta

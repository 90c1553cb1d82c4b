"""Privacy accounting for DP-SGD on top of Google's ``dp-accounting`` library.

DP-SGD with Poisson sampling is the repeated Poisson-subsampled Gaussian mechanism.
We never write RDP/PLD maths ourselves: every epsilon comes from ``dp_accounting`` (one routine
of it, the Gaussian's inverse privacy loss, runs vectorised in ``pld_gaussian``, bit-identical).
What we own is the *history* of (sample_rate q, noise_multiplier sigma, steps) that
actually ran, so epsilon can be recomputed for any delta, checkpointed and resumed
without ever counting a step twice.

Besides DP-SGD steps the history holds one-off *releases* computed from the private data
before training, e.g. the two Gaussian sums of private Data Normalization (Tramer & Boneh,
Algorithm 2). They are Gaussian mechanisms on the whole dataset (q = 1), composed with the
DP-SGD steps by ``dp_accounting`` exactly like the steps themselves.

PLD accounting discretises the privacy loss on a grid (1e-4 nats). Little noise (epsilon in the
hundreds and more) makes the loss range so wide that this grid would need arrays of tens of GiB; the
grid is then coarsened (``pld_grid``), which keeps epsilon a valid upper bound, only a looser one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

import dp_accounting
import numpy as np
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution, privacy_loss_mechanism

from dpscale.choices import ACCOUNTANT_KINDS
from dpscale.privacy.accounting.pld_epsilon import pld_epsilons
from dpscale.privacy.accounting.pld_gaussian import gaussian_pld, truncated_gaussian_pld
from dpscale.privacy.accounting.rdp_composed import ComposedRdp, composed_rdp
from dpscale.privacy.accounting.batch_sampling import (
    ACCOUNTANTS_OF,
    POISSON,
    REPLACE_ONE,
    BatchSampling,
    history_adjacency,
    replace_one_noise,
)

DP_SGD = "dp-sgd"  # label of DP-SGD steps; any other label is a one-off release

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


@dataclass(frozen=True)
class AccountingSegment:
    """A run of ``steps`` identical Gaussian mechanisms on a Poisson sample of the data.

    Attributes:
        sample_rate: Poisson sampling probability q = B / N, in (0, 1] (1: the whole dataset).
        noise_multiplier: sigma; the noise std is sigma * C on a sum of terms clipped to norm C.
        steps: number of mechanisms (logical DP-SGD steps, or releases) with these parameters.
        label: "dp-sgd" for training steps; anything else names a one-off release
            (e.g. "data-norm"), which does not count as a training step.
        batches: how the steps' batches were drawn (``dpscale.privacy.accounting.batch_sampling``): Poisson
            unless the run sampled fixed-size, shuffled or capped batches.
    """

    sample_rate: float
    noise_multiplier: float
    steps: int
    label: str = DP_SGD
    batches: BatchSampling = POISSON

    def __post_init__(self) -> None:
        if isinstance(self.batches, dict):  # read back from a plan's dataclasses.asdict
            object.__setattr__(self, "batches", BatchSampling(**self.batches))

    @property
    def compositions(self) -> int:
        """Gaussian mechanisms one example can enter (the epochs of a shuffled segment, else steps)."""
        return self.batches.compositions(self.sample_rate, self.steps)


class PLDRangeError(ValueError):
    """The PLD accountant cannot represent a history: its privacy loss is too wide for any sane grid."""


def _check_mechanism(sample_rate: float, noise_multiplier: float, steps: int) -> None:
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate q must be in (0, 1], got {sample_rate}")
    if not noise_multiplier > 0.0 or not math.isfinite(noise_multiplier):
        raise ValueError(f"noise_multiplier must be a positive finite number for a private run, got {noise_multiplier}")
    if int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps}")


def _check_delta(delta: float, kind: str = "rdp") -> None:
    """Refuse a delta outside (0, 1), or one the PLD accountant cannot resolve (see PLD_MIN_DELTA)."""
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if kind == "pld" and delta < PLD_MIN_DELTA:
        raise ValueError(
            f"delta={delta:g} is below {PLD_MIN_DELTA:g}, the smallest delta the PLD accountant resolves (it "
            f"truncates {PLD_TAIL_MASS_TRUNCATION:g} of probability mass into an infinite-loss bucket, so epsilon "
            f"would be inflated or infinite); use a delta below 1/N (N the training-set size) but >= "
            f"{PLD_MIN_DELTA:g}, e.g. 1e-5 to 1e-10, or the rdp accountant for a smaller delta"
        )


def dp_sgd_event(sample_rate: float, noise_multiplier: float, steps: int) -> dp_accounting.DpEvent:
    """The ``dp_accounting`` event describing ``steps`` Poisson-sampled Gaussian steps."""
    _check_mechanism(sample_rate, noise_multiplier, steps)
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    step_event = gaussian if sample_rate == 1.0 else dp_accounting.PoissonSampledDpEvent(sample_rate, gaussian)
    return dp_accounting.SelfComposedDpEvent(step_event, int(steps))


@functools.lru_cache(maxsize=32)
def _step_pld(sample_rate: float, noise_multiplier: float, discretization: float) -> privacy_loss_distribution.PrivacyLossDistribution:
    """PLD of one Poisson-subsampled Gaussian step (add/remove adjacency, pessimistic).

    Building it dominates PLD accounting (~0.05 s; 0.3 s with dp_accounting's own inversion,
    ``pld_gaussian``); composing it over many steps is an FFT.
    Caching it makes per-epoch epsilon logging cheap. The construction is exactly what
    ``dp_accounting.pld.PLDAccountant`` does for a ``PoissonSampledDpEvent(GaussianDpEvent)``
    (a test checks the two agree).
    """
    return gaussian_pld(noise_multiplier, sampling_prob=sample_rate, value_discretization_interval=discretization)


@functools.lru_cache(maxsize=32)
def _full_batch_pld(noise_multiplier: float, steps: int, discretization: float) -> privacy_loss_distribution.PrivacyLossDistribution:
    """PLD of ``steps`` Gaussian mechanisms without subsampling: exactly one Gaussian with
    sigma / sqrt(steps) (cached: calibration evaluates the same releases many times)."""
    return gaussian_pld(noise_multiplier / math.sqrt(steps), value_discretization_interval=discretization)


def _step_loss_range(sample_rate: float, noise_multiplier: float) -> float:
    """Width (in nats) of the privacy-loss range dp_accounting discretises for one Gaussian step,
    the wider of its add and remove sides (a closed form: no PLD is built)."""
    width = 0.0
    for adjacency in (privacy_loss_mechanism.AdjacencyType.REMOVE, privacy_loss_mechanism.AdjacencyType.ADD):
        bounds = privacy_loss_mechanism.GaussianPrivacyLoss(
            noise_multiplier, sampling_prob=sample_rate, adjacency_type=adjacency
        ).connect_dots_bounds()
        width = max(width, bounds.epsilon_upper - bounds.epsilon_lower)
    return width


def _composed_loss_width(sample_rate: float, noise_multiplier: float, steps: int, step_range: float) -> float:
    """Width (in nats) of the support dp_accounting keeps when composing ``steps`` steps.

    dp_accounting truncates the composition where a Chernoff bound puts less than
    PLD_TAIL_MASS_TRUNCATION outside; its orders are spread over the step's loss range, so the
    bound in nats hardly depends on the grid, and a ~1000-point probe PLD (~0.05 s) predicts it.

    Returns:
        the width in nats (steps * step_range, the untruncated width, if the probe cannot be read).
    """
    grid = step_range / _PROBE_POINTS
    probe = gaussian_pld(noise_multiplier, sampling_prob=sample_rate, value_discretization_interval=grid)
    width = 0.0
    try:  # private attributes of dp_accounting 0.4-0.6; the fallback is a valid (loose) width
        for pmf in (probe._pmf_remove, probe._pmf_add):
            lower, upper = pld_common.compute_self_convolve_bounds(pmf.to_dense_pmf()._probs, steps, PLD_TAIL_MASS_TRUNCATION)
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
    if steps == 1 or step_range > PLD_MAX_GRID * PLD_MAX_STEP_POINTS:  # past the cap: the probe could overflow
        return step_range, step_range
    return step_range, _composed_loss_width(sample_rate, noise_multiplier, steps, step_range)


def _widths_of(seg: AccountingSegment, replace_one: bool) -> tuple[float, float]:
    """``_segment_widths`` of a segment as ``_segment_pld`` builds it (a truncated step's range
    taken as the uncapped Poisson step's: the cap only narrows the output's sum)."""
    sigma = replace_one_noise(seg.noise_multiplier) if replace_one else seg.noise_multiplier
    if seg.batches.mode == "shuffle":
        return _segment_widths(1.0, sigma, seg.compositions)
    if _cuts_every_batch(seg):  # the replace-one Gaussian at sigma/2 on the M/N kept dominates each step
        return _segment_widths(seg.batches.max_batch_size / seg.batches.dataset_size, sigma / 2, seg.steps)
    return _segment_widths(seg.sample_rate, sigma, seg.steps)


def _cuts_every_batch(seg: AccountingSegment) -> bool:
    """A capped segment at q = 1 with a cap below N: every batch is a random M-subset of the data,
    so its steps are truncated steps, not the full-batch Gaussian a q = 1 segment otherwise is."""
    return seg.batches.mode == "truncated" and seg.sample_rate == 1.0 and seg.batches.max_batch_size < seg.batches.dataset_size


def pld_grid(segments: tuple[AccountingSegment, ...], requested: float = PLD_VALUE_DISCRETIZATION) -> float:
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
    widths = [_widths_of(s, _adjacency(segments) == REPLACE_ONE) for s in segments]
    needed = max(
        max(step for step, _ in widths) / PLD_MAX_STEP_POINTS,
        sum(composed for _, composed in widths) / PLD_MAX_COMPOSED_POINTS,
    )
    if needed > PLD_MAX_GRID:  # judged at the full caps, so the limit does not depend on ``requested``
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


def _composed_pld(segments: list[AccountingSegment], discretization: float) -> privacy_loss_distribution.PrivacyLossDistribution:
    """PLD of the whole history on the grid ``pld_grid`` picks for it (the last few kept: a run's
    summary asks for its epsilon, then its privacy profile, of the same history)."""
    return _composed_pld_of(tuple(segments), discretization)


@functools.lru_cache(maxsize=4)
def _composed_pld_of(segments: tuple[AccountingSegment, ...], discretization: float) -> privacy_loss_distribution.PrivacyLossDistribution:
    grid = pld_grid(segments, discretization)
    replace_one = _adjacency(segments) == REPLACE_ONE
    total = None
    for seg in segments:
        composed = _segment_pld(seg, grid, replace_one)
        total = composed if total is None else total.compose(composed)
    return total


def _adjacency(segments: Sequence[AccountingSegment]) -> str:
    """The adjacency every segment of a history is accounted under (ValueError if they differ)."""
    return history_adjacency([s.batches for s in segments], [s.sample_rate < 1.0 for s in segments])


def _segment_pld(seg: AccountingSegment, grid: float, replace_one: bool) -> privacy_loss_distribution.PrivacyLossDistribution:
    """PLD of one segment on ``grid``: a Poisson or truncated-Poisson step self-composed, or Gaussians
    on every example it touches (releases; shuffled epochs), whose noise multiplier is halved in a
    replace-one history (``replace_one_noise``)."""
    mode = seg.batches.mode
    if "pld" not in ACCOUNTANTS_OF[mode]:
        raise ValueError(f"{mode} sampling is accounted with the {'/'.join(ACCOUNTANTS_OF[mode])} accountant only")
    sigma = replace_one_noise(seg.noise_multiplier) if replace_one else seg.noise_multiplier
    if (seg.sample_rate == 1.0 and not _cuts_every_batch(seg)) or mode == "shuffle":
        return _full_batch_pld(sigma, seg.compositions, grid)
    if mode == "truncated":
        return _truncated_step_pld(seg.batches, seg.sample_rate, sigma, grid).self_compose(seg.steps)
    return _step_pld(seg.sample_rate, sigma, grid).self_compose(seg.steps)


@functools.lru_cache(maxsize=16)
def _truncated_step_pld(
    batches: BatchSampling, sample_rate: float, noise_multiplier: float, discretization: float
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """PLD of one truncated-Poisson step: what dp_accounting's PLDAccountant composes for a
    ``TruncatedSubsampledGaussianDpEvent`` (add/remove adjacency), bit for bit, built ~7x faster
    (``truncated_gaussian_pld``: 0.5 s against 3.7 at N = 1000, q = 0.05, cap 55, grid 1e-4)."""
    return truncated_gaussian_pld(batches.dataset_size, sample_rate, batches.max_batch_size, noise_multiplier, discretization)


def _pld_epsilon(segments: list[AccountingSegment], delta: float, discretization: float) -> float:
    return pld_epsilons(_composed_pld(segments, discretization), [delta])[0]


RDP_PROFILE_POINTS = 256  # RDP's delta(eps) is evaluated at this many epsilons (0.2 ms each)


def _rdp_profile(segments: tuple[AccountingSegment, ...]) -> Callable[[np.ndarray], np.ndarray]:
    """RDP's delta(eps) on a grid of ``RDP_PROFILE_POINTS`` from 0 to the largest epsilon asked,
    each epsilon taking the delta of the grid point at or below it: delta is non-increasing in
    epsilon, so that is a valid (slightly larger) delta there."""

    def delta(eps: np.ndarray) -> np.ndarray:
        eps = np.asarray(eps, dtype=np.float64)
        points, values = _rdp_deltas(segments, float(eps.max(initial=0.0)))
        return values[np.clip(np.searchsorted(points, eps, side="right") - 1, 0, None)]

    return delta


@functools.lru_cache(maxsize=8)  # a run's evaluations and summary ask for the same history's profile
def _rdp_deltas(segments: tuple[AccountingSegment, ...], largest: float) -> tuple[np.ndarray, np.ndarray]:
    accountant = _rdp_accountant(list(segments))
    points = np.linspace(0.0, largest, RDP_PROFILE_POINTS)
    return points, np.array([min(1.0, float(accountant.get_delta(float(e)))) for e in points])


def pld_profile(pld: privacy_loss_distribution.PrivacyLossDistribution) -> Callable[[np.ndarray], np.ndarray]:
    """delta(epsilon) of a PLD for sorted arrays of epsilons >= 0, vectorised.

    dp_accounting's own ``get_delta_for_epsilon`` walks the loss support in a Python loop (0.5 s
    for a 24-step run, per call); this takes the same sums, inf mass + sum_{L > eps} p(L) -
    e^eps sum_{L > eps} p(L) e^-L, as suffix sums in numpy (a test compares the two), and falls
    back to the library where its PMF internals differ (another dp_accounting version)."""
    pmfs = [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]  # noqa: SLF001
    try:
        parts = [_pmf_profile(pmf.to_dense_pmf()) for pmf in pmfs]
    except AttributeError:
        return lambda eps: np.asarray(pld.get_delta_for_epsilon(np.asarray(eps, dtype=np.float64)), dtype=np.float64)
    return lambda eps: np.max([part(np.asarray(eps, dtype=np.float64)) for part in parts], axis=0)


def _pmf_profile(dense: Any) -> Callable[[np.ndarray], np.ndarray]:
    """The hockey-stick divergence of one dense PMF (its losses sorted ascending) at epsilons >= 0."""
    losses = (np.arange(dense.size) + dense._lower_loss) * dense._discretization  # noqa: SLF001
    probs = np.asarray(dense._probs, dtype=np.float64)  # noqa: SLF001
    # only losses > eps >= 0 enter a sum: clamping the rest keeps e^-L finite
    upper = np.append(np.cumsum(probs[::-1])[::-1], 0.0)
    lower = np.append(np.cumsum((probs * np.exp(-np.maximum(losses, 0.0)))[::-1])[::-1], 0.0)
    infinity = float(dense._infinity_mass)  # noqa: SLF001

    def delta(eps: np.ndarray) -> np.ndarray:
        above = np.searchsorted(losses, eps, side="right")  # the first loss > eps
        return np.clip(infinity + upper[above] - np.exp(eps) * lower[above], 0.0, 1.0)

    return delta


class _DropOrderExclusionNotices(logging.Filter):
    """dp_accounting logs one warning per fractional RDP order whose series does not converge
    (small sigma, e.g. TAN simulations) and leaves that order out. epsilon is then the minimum
    over the remaining orders: still a valid bound, so the dozens of lines are noise to a user."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


@contextlib.contextmanager
def quiet_order_notices() -> Iterator[None]:
    """Composing into an RDP accountant without dp_accounting's per-order convergence notices."""
    quiet = _DropOrderExclusionNotices()
    absl_logger = logging.getLogger("absl")
    absl_logger.addFilter(quiet)
    try:
        yield
    finally:
        absl_logger.removeFilter(quiet)


def _rdp_accountant(segments: list[AccountingSegment]) -> ComposedRdp:
    """The history's RDP under its one adjacency (``_adjacency``): the library accountant's numbers,
    each distinct step's RDP computed once (``rdp_composed``)."""
    for seg in segments:
        if "rdp" not in ACCOUNTANTS_OF[seg.batches.mode]:
            raise ValueError(f"{seg.batches.mode} sampling is accounted with the pld accountant only")
    if _adjacency(segments) != REPLACE_ONE:
        relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
        events = [dp_sgd_event(seg.sample_rate, seg.noise_multiplier, seg.steps) for seg in segments]
    else:
        relation = dp_accounting.NeighboringRelation.REPLACE_ONE
        events = [_replace_one_event(seg) for seg in segments]
    with quiet_order_notices():
        return composed_rdp(events, relation)


def _replace_one_event(seg: AccountingSegment) -> dp_accounting.DpEvent:
    """The dp_accounting event of a segment under replace-one adjacency (noise multiplier sigma/2):
    fixed-size batches sampled without replacement, or Gaussians on every example it touches."""
    _check_mechanism(seg.sample_rate, seg.noise_multiplier, seg.steps)
    gaussian = dp_accounting.GaussianDpEvent(replace_one_noise(seg.noise_multiplier))
    if seg.batches.mode == "fixed" and seg.sample_rate < 1.0:
        sampled = dp_accounting.SampledWithoutReplacementDpEvent(
            seg.batches.dataset_size, seg.batches.batch_size(seg.sample_rate), gaussian
        )
        return dp_accounting.SelfComposedDpEvent(sampled, seg.steps)
    return dp_accounting.SelfComposedDpEvent(gaussian, seg.compositions)


def _check_kind(kind: str) -> None:
    if kind not in ACCOUNTANT_KINDS:
        raise ValueError(f"unknown accountant {kind!r}; choose one of {', '.join(ACCOUNTANT_KINDS)}")


def compute_epsilon(
    *,
    sample_rate: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    kind: str = "pld",
    pld_discretization: float = PLD_VALUE_DISCRETIZATION,
    releases: tuple[AccountingSegment, ...] = (),
    batches: BatchSampling = POISSON,
) -> float:
    """Epsilon of ``steps`` DP-SGD steps (Poisson sampling, add/remove adjacency, unless
    ``batches`` says otherwise), composed with any one-off ``releases`` made before training.

    Every argument is keyword-only: q, sigma, steps and delta are all numbers, so a call that
    swaps two of them by position would return a plausible but wrong epsilon.

    Args:
        sample_rate: q = B / N.
        noise_multiplier: sigma (noise std / clipping norm).
        steps: number of noisy steps.
        delta: target delta, in (0, 1).
        kind: "pld" (tightest, default) or "rdp" (what the papers report).
        pld_discretization: PLD grid (smaller is tighter and slower).
        releases: other mechanisms on the same data (see ``gaussian_release``).
        batches: the batch sampler (``dpscale.privacy.accounting.batch_sampling``); fixed-size and shuffled
            batches are accounted under replace-one adjacency, releases included.

    Returns:
        epsilon (float, >= 0); 0.0 for zero steps and no releases.
    """
    return history_accountant(sample_rate=sample_rate, noise_multiplier=noise_multiplier, steps=steps, kind=kind,
                              releases=releases, pld_discretization=pld_discretization,
                              batches=batches).epsilon(delta)  # fmt: skip


def history_accountant(
    *, sample_rate: float, noise_multiplier: float, steps: int, kind: str = "pld",
    releases: Sequence[AccountingSegment] = (), pld_discretization: float = PLD_VALUE_DISCRETIZATION,
    batches: BatchSampling = POISSON,
) -> "PrivacyAccountant":  # fmt: skip
    """An accountant holding ``releases`` then ``steps`` DP-SGD steps (q, sigma, drawn by
    ``batches``): a planned run's history, for its epsilon, its group bound or its attacker's odds."""
    accountant = PrivacyAccountant(kind, pld_discretization)
    for release in releases_under(releases, batches):
        accountant.record(release)
    accountant.step(sample_rate=sample_rate, noise_multiplier=noise_multiplier, num_steps=steps, batches=batches)
    return accountant


def gaussian_release(label: str, noise_multiplier: float, count: int = 1) -> AccountingSegment:
    """``count`` Gaussian mechanisms on the whole dataset, each a sum of per-example terms
    clipped to norm C plus N(0, (noise_multiplier * C)^2) noise (sensitivity C under add/remove).

    Args:
        label: what was released (e.g. "data-norm"); must not be "dp-sgd".
        noise_multiplier: sigma of each mechanism (noise std / clipping norm), > 0.
        count: number of such sums released.
    """
    if label == DP_SGD:
        raise ValueError(f"{DP_SGD!r} is reserved for training steps; name the release")
    _check_mechanism(1.0, noise_multiplier, count)
    return AccountingSegment(1.0, float(noise_multiplier), int(count), label)


DATA_NORM = "data-norm"  # label of private Data Normalization's two Gaussian sums (Tramer Algorithm 2)
FEATURE_MEAN = "feature-mean"  # label of private centring's one Gaussian sum (features.center)


def data_norm_release(noise_multiplier: float) -> AccountingSegment:
    """The accounting event of PrivDataNorm: two Gaussian sums with noise multiplier sigma_norm."""
    return gaussian_release(DATA_NORM, noise_multiplier, 2)


def feature_mean_release(noise_multiplier: float) -> AccountingSegment:
    """The accounting event of private centring: one Gaussian sum with noise multiplier sigma_center."""
    return gaussian_release(FEATURE_MEAN, noise_multiplier, 1)


def feature_releases(data_norm_noise: float | None, feature_mean_noise: float | None) -> tuple[AccountingSegment, ...]:
    """The releases a run's feature normalisation makes before training, in the order it draws
    them (Data Normalization, then centring); a None noise multiplier means that release is not made.
    The one list both a run's DP plan and ``dpscale account`` compose."""
    releases: tuple[AccountingSegment, ...] = ()
    if data_norm_noise is not None:
        releases += (data_norm_release(data_norm_noise),)
    if feature_mean_noise is not None:
        releases += (feature_mean_release(feature_mean_noise),)
    return releases


@functools.lru_cache(maxsize=256)
def _cached_epsilon(kind: str, discretization: float, segments: tuple[AccountingSegment, ...], delta: float) -> float:
    """Epsilon of a history (a pure function of its arguments, so safe to memoise)."""
    if kind == "pld":
        return _pld_epsilon(list(segments), delta, discretization)
    return float(_rdp_accountant(list(segments)).get_epsilon(delta))


class PrivacyAccountant:
    """Keeps the history of DP-SGD steps that ran and turns it into epsilon.

    Consecutive steps with the same (q, sigma) are merged into one segment so the
    history stays short over millions of steps.

    Args:
        kind: "pld" (default, tightest) or "rdp".
        pld_discretization: PLD grid; keep the default for reported values.
    """

    def __init__(self, kind: str = "pld", pld_discretization: float = PLD_VALUE_DISCRETIZATION) -> None:
        _check_kind(kind)
        self.kind = kind
        self.pld_discretization = pld_discretization
        self._segments: list[AccountingSegment] = []

    @property
    def history(self) -> tuple[AccountingSegment, ...]:
        return tuple(self._segments)

    @property
    def steps(self) -> int:
        """Total number of accounted DP-SGD steps (releases are not steps)."""
        return sum(s.steps for s in self._segments if s.label == DP_SGD)

    @property
    def adjacency(self) -> str:
        """ "add/remove" or "replace-one": the neighbouring datasets the history's epsilon is about."""
        return _adjacency(self._segments)

    @property
    def releases(self) -> tuple[AccountingSegment, ...]:
        """The one-off releases recorded (everything that is not a DP-SGD step)."""
        return tuple(s for s in self._segments if s.label != DP_SGD)

    def step(self, *, sample_rate: float, noise_multiplier: float, num_steps: int = 1, batches: BatchSampling = POISSON) -> None:
        """Record ``num_steps`` steps run with sampling rate q and noise multiplier sigma.

        Args:
            sample_rate: sampling rate q = B / N, in (0, 1].
            noise_multiplier: sigma (noise std / clipping norm), > 0.
            num_steps: how many such steps ran, >= 0.
            batches: the sampler that drew the batches (Poisson by default).
        """
        self.record(AccountingSegment(float(sample_rate), float(noise_multiplier), int(num_steps), batches=batches))

    def record(self, segment: AccountingSegment) -> None:
        """Record a segment of steps or a release (merged with the previous one when identical).

        Raises:
            ValueError: an invalid mechanism, or one whose adjacency differs from the history's.
        """
        _check_mechanism(segment.sample_rate, segment.noise_multiplier, segment.steps)
        if segment.steps == 0:
            return
        _adjacency([*self._segments, segment])
        last = self._segments[-1] if self._segments else None
        if last and replace(last, steps=segment.steps) == segment:
            self._segments[-1] = replace(last, steps=last.steps + segment.steps)
        else:
            self._segments.append(segment)

    def epsilon(self, delta: float) -> float:
        """Epsilon spent so far at the given delta (0.0 before the first step). Cached per
        (history, delta): a run asks at every evaluation, the summary and the progress bar."""
        _check_delta(delta, self.kind)
        if not self._segments:
            return 0.0
        return _cached_epsilon(self.kind, self.pld_discretization, tuple(self._segments), float(delta))

    def epsilons(self, deltas: Sequence[float]) -> list[float]:
        """Epsilon at each of ``deltas`` (an epsilon-delta curve), the history composed once.

        Returns:
            one epsilon per delta (0.0 each before the first step); the same numbers as ``epsilon``.
        """
        for delta in deltas:
            _check_delta(delta, self.kind)
        if not self._segments:
            return [0.0 for _ in deltas]
        if self.kind == "rdp":
            accountant = _rdp_accountant(self._segments)
            return [float(accountant.get_epsilon(d)) for d in deltas]
        return pld_epsilons(_composed_pld(self._segments, self.pld_discretization), deltas)

    def delta(self, epsilon: float) -> float:
        """Smallest delta achieved at the given epsilon."""
        if not self._segments:
            return 0.0
        if self.kind == "rdp":
            return float(_rdp_accountant(self._segments).get_delta(epsilon))
        return float(_composed_pld(self._segments, self.pld_discretization).get_delta_for_epsilon(epsilon))

    def privacy_profile(self) -> Callable[[np.ndarray], np.ndarray]:
        """delta(epsilon) for an array of epsilons (nats), the history composed once: PLD's tight
        profile, or RDP's conversion of each epsilon (a valid, looser delta). Zeros before any step."""
        if not self._segments:
            return lambda eps: np.zeros_like(np.asarray(eps, dtype=np.float64))
        if self.kind == "rdp":
            return _rdp_profile(tuple(self._segments))
        return pld_profile(_composed_pld(self._segments, self.pld_discretization))

    def epsilon_by_label(self, delta: float) -> dict[str, float]:
        """Epsilon of each labelled part on its own (for reports; the parts compose to ``epsilon``)."""
        out = {}
        for label in dict.fromkeys(s.label for s in self._segments):
            part = PrivacyAccountant(self.kind, self.pld_discretization)
            for seg in self._segments:
                if seg.label == label:
                    part.record(seg)
            out[label] = part.epsilon(delta)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "history": [_history_entry(s) for s in self._segments],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace (never add to) the history, so a resume cannot double-count steps."""
        if state.get("kind") != self.kind:
            raise ValueError(f"checkpoint accountant is {state.get('kind')!r}, this run uses {self.kind!r}")
        self._segments = []
        for entry in state["history"]:  # [q, sigma, steps], [..., label] or [..., label, mode, N, cap]
            batches = BatchSampling(entry[4], int(entry[5]), int(entry[6])) if len(entry) > 4 else POISSON
            label = entry[3] if len(entry) > 3 else DP_SGD  # [q, sigma, steps]: the oldest form, DP-SGD steps
            self.record(AccountingSegment(float(entry[0]), float(entry[1]), int(entry[2]), label, batches=batches))

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "PrivacyAccountant":
        accountant = cls(state["kind"])
        accountant.load_state_dict(state)
        return accountant


def _history_entry(seg: AccountingSegment) -> list[Any]:
    """A segment as a checkpoint stores it: [q, sigma, steps, label], plus [mode, N, cap] when its
    batches were not Poisson (so older checkpoints read back unchanged)."""
    entry = [seg.sample_rate, seg.noise_multiplier, seg.steps, seg.label]
    if seg.batches != POISSON:
        entry += [seg.batches.mode, seg.batches.dataset_size, seg.batches.max_batch_size]
    return entry


def releases_under(releases: Sequence[AccountingSegment], batches: BatchSampling) -> tuple[AccountingSegment, ...]:
    """``releases`` labelled with a run's sampling, so that a replace-one run (fixed-size or
    shuffled batches) accounts its full-data releases under replace-one too (noise multiplier
    sigma/2), also when they are reported apart (``epsilon_by_label``).

    Raises:
        ValueError: a subsampled (Poisson) release, e.g. a source run's steps, in a replace-one run.
    """
    if batches.adjacency != REPLACE_ONE:
        return tuple(releases)
    tagged = tuple(replace(r, batches=batches) if r.sample_rate == 1.0 else r for r in releases)
    _adjacency(tagged)  # a source run's Poisson steps cannot join a replace-one history
    return tagged


@dataclass(frozen=True)
class TruncatedPoissonResult:
    """What capping Poisson batches at ``max_batch_size`` costs (add/remove adjacency, PLD)."""

    max_batch_size: int
    epsilon: float
    poisson_epsilon: float
    profile: Callable[[np.ndarray], np.ndarray]


def truncated_poisson_epsilon(
    *, dataset_size: int, batch_size: float, max_batch_size: int, noise_multiplier: float, steps: int, delta: float,
    releases: Sequence[AccountingSegment] = (), discretization: float = PLD_VALUE_DISCRETIZATION,
) -> TruncatedPoissonResult:  # fmt: skip
    """Epsilon of ``steps`` DP-SGD steps whose Poisson batches (rate B/N) are cut to at most
    ``max_batch_size`` examples (a uniformly random subset of a larger draw), composed with the
    one-off Gaussian ``releases``: dp_accounting's ``TruncatedSubsampledGaussianDpEvent`` (PLD,
    add/remove adjacency, pessimistic), beside the uncapped Poisson epsilon of the same steps.

    A cap near B costs much (N = 60000, B = 256, sigma = 1.1, 2000 steps: 0.847 uncapped and capped
    at 400, 2.08 capped at 300); ``smallest_free_cap`` finds the smallest that costs < 1%.

    Raises:
        ValueError: a cap below 1 or a delta the PLD accountant cannot resolve.
    """
    _check_mechanism(batch_size / dataset_size, noise_multiplier, steps)
    _check_delta(delta, "pld")
    if int(max_batch_size) != max_batch_size or max_batch_size < 1:
        raise ValueError(f"the batch cap must be a positive integer, got {max_batch_size}")
    return _truncated_poisson(int(dataset_size), float(batch_size), int(max_batch_size), float(noise_multiplier),
                              int(steps), float(delta), tuple(releases), float(discretization))  # fmt: skip


@functools.lru_cache(maxsize=64)  # a cap search and its report share them
def _truncated_poisson(
    dataset_size: int, batch_size: float, max_batch_size: int, noise_multiplier: float, steps: int, delta: float,
    releases: tuple[AccountingSegment, ...], discretization: float,
) -> TruncatedPoissonResult:  # fmt: skip
    run = functools.partial(history_accountant, sample_rate=batch_size / dataset_size, noise_multiplier=noise_multiplier,
                            steps=steps, kind="pld", releases=releases, pld_discretization=discretization)  # fmt: skip
    capped = run(batches=BatchSampling("truncated", dataset_size, max_batch_size))
    poisson = run().epsilon(delta)
    return TruncatedPoissonResult(max_batch_size, capped.epsilon(delta), poisson, capped.privacy_profile())


FREE_CAP_TOLERANCE = 0.01  # ``smallest_free_cap``: epsilon within 1% of uncapped Poisson's


def smallest_free_cap(**plan: Any) -> TruncatedPoissonResult:
    """The smallest batch cap of at least B whose truncated-Poisson epsilon is within ``FREE_CAP_TOLERANCE``
    of the uncapped one (``truncated_poisson_epsilon``'s arguments but the cap). Caps below the expected
    batch size B are not searched: they cut most batches (a smaller-batch training, whose epsilon can
    be lower, not a free cap). Caps grown by 1.25x from B until one is free, then bisected above B
    (epsilon falls as the cap grows there), ~10 PLD evaluations on the
    coarse grid (~10x cheaper); the cap found is then confirmed on the requested grid (grown by 5%
    steps in the rare case it is not free there).

    Returns:
        that cap's result on the requested grid (the cap N, no truncation at all, if no smaller one is free).
    """
    size, batch = int(plan["dataset_size"]), float(plan["batch_size"])
    fine = plan.pop("discretization", PLD_VALUE_DISCRETIZATION)

    def at(cap: int, grid: float = max(fine, PLD_COARSE_DISCRETIZATION)) -> TruncatedPoissonResult:
        return truncated_poisson_epsilon(**plan, max_batch_size=cap, discretization=grid)

    def free(result: TruncatedPoissonResult) -> bool:
        return result.epsilon <= (1 + FREE_CAP_TOLERANCE) * result.poisson_epsilon

    cap = max(1, math.ceil(batch))
    low = cap - 1  # the largest cap known not to be free, or not searched
    result = at(cap)
    while not free(result) and cap < size:
        low, cap = cap, min(size, math.ceil(cap * 1.25))
        result = at(cap)
    while cap - low > 1:
        middle = (low + cap) // 2
        low, cap = (low, middle) if free(at(middle)) else (middle, cap)
    result = at(cap, fine)
    while not free(result) and cap < size:
        cap = min(size, math.ceil(cap * 1.05))
        result = at(cap, fine)
    return result

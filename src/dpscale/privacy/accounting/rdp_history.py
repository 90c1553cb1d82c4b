"""The RDP side of the accountant: a history's dp_accounting events, their RDP and its delta(epsilon) profile."""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Callable, Iterator

import dp_accounting
import numpy as np

from dpscale.privacy.accounting.batch_sampling import ACCOUNTANTS_OF, REPLACE_ONE, replace_one_noise
from dpscale.privacy.accounting.rdp_composed import ComposedRdp, composed_rdp
from dpscale.privacy.accounting.segments import AccountingSegment, adjacency_of, check_mechanism


def dp_sgd_event(sample_rate: float, noise_multiplier: float, steps: int) -> dp_accounting.DpEvent:
    """The ``dp_accounting`` event describing ``steps`` Poisson-sampled Gaussian steps."""
    check_mechanism(sample_rate, noise_multiplier, steps)
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    step_event = (
        gaussian
        if sample_rate == 1.0
        else dp_accounting.PoissonSampledDpEvent(sample_rate, gaussian)
    )
    return dp_accounting.SelfComposedDpEvent(step_event, int(steps))


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


def rdp_accountant(segments: list[AccountingSegment]) -> ComposedRdp:
    """The history's RDP under its one adjacency (``adjacency_of``): the library accountant's numbers,
    each distinct step's RDP computed once (``rdp_composed``).

    Args:
        segments: the history, under one adjacency.

    Returns:
        the composed RDP, whose ``get_epsilon`` and ``get_delta`` convert it.

    Raises:
        ValueError: a segment whose sampling only the PLD accountant accounts.
    """
    for seg in segments:
        if "rdp" not in ACCOUNTANTS_OF[seg.batches.mode]:
            raise ValueError(
                f"{seg.batches.mode} sampling is accounted with the pld accountant only"
            )
    if adjacency_of(segments) != REPLACE_ONE:
        relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
        events = [
            dp_sgd_event(seg.sample_rate, seg.noise_multiplier, seg.steps) for seg in segments
        ]
    else:
        relation = dp_accounting.NeighboringRelation.REPLACE_ONE
        events = [_replace_one_event(seg) for seg in segments]
    with quiet_order_notices():
        return composed_rdp(events, relation)


def _replace_one_event(seg: AccountingSegment) -> dp_accounting.DpEvent:
    """The dp_accounting event of a segment under replace-one adjacency (noise multiplier sigma/2):
    fixed-size batches sampled without replacement, or Gaussians on every example it touches."""
    check_mechanism(seg.sample_rate, seg.noise_multiplier, seg.steps)
    gaussian = dp_accounting.GaussianDpEvent(replace_one_noise(seg.noise_multiplier))
    if seg.batches.mode == "fixed" and seg.sample_rate < 1.0:
        sampled = dp_accounting.SampledWithoutReplacementDpEvent(
            seg.batches.dataset_size, seg.batches.batch_size(seg.sample_rate), gaussian
        )
        return dp_accounting.SelfComposedDpEvent(sampled, seg.steps)
    return dp_accounting.SelfComposedDpEvent(gaussian, seg.compositions)


RDP_PROFILE_POINTS = 256  # RDP's delta(eps) is evaluated at this many epsilons (0.2 ms each)


def rdp_profile(segments: tuple[AccountingSegment, ...]) -> Callable[[np.ndarray], np.ndarray]:
    """RDP's delta(eps) on a grid of ``RDP_PROFILE_POINTS`` from 0 to the largest epsilon asked,
    each epsilon taking the delta of the grid point at or below it: delta is non-increasing in
    epsilon, so that is a valid (slightly larger) delta there.

    Args:
        segments: the history, under one adjacency.

    Returns:
        delta as a function of an array of epsilons (nats).
    """

    def delta(eps: np.ndarray) -> np.ndarray:
        eps = np.asarray(eps, dtype=np.float64)
        points, values = _rdp_deltas(segments, float(eps.max(initial=0.0)))
        return values[np.clip(np.searchsorted(points, eps, side="right") - 1, 0, None)]

    return delta


# a run's evaluations and summary ask for the same history's profile
@functools.lru_cache(maxsize=8)
def _rdp_deltas(
    segments: tuple[AccountingSegment, ...], largest: float
) -> tuple[np.ndarray, np.ndarray]:
    accountant = rdp_accountant(list(segments))
    points = np.linspace(0.0, largest, RDP_PROFILE_POINTS)
    return points, np.array([min(1.0, float(accountant.get_delta(float(e)))) for e in points])

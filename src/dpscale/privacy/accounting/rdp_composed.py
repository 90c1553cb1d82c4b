"""The RDP of a composed history, each distinct step's RDP computed once.

dp_accounting's ``RdpAccountant`` computes a step's RDP at its 156 orders on every ``compose``:
0.3-0.5 s for a Poisson-subsampled Gaussian at q near 0.5, where the fractional orders' series
converges slowly. A run asks for epsilon (and the attacker's odds) at every evaluation, each time
with one more step of the same (q, sigma), so it paid that again and again. The library's
composition is ``rdp += count * rdp(step)`` per event, in order; this does the same additions
with each step's vector taken from a cache, so every epsilon and delta is the library's, bit for
bit (tests/test_rdp_composed.py composes the library's accountant beside it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant


@dataclass(frozen=True)
class ComposedRdp:
    """A history's RDP curve: ``rdp[i]`` at order ``orders[i]`` (nats)."""

    orders: np.ndarray
    rdp: np.ndarray

    def get_epsilon(self, delta: float) -> float:
        """The smallest epsilon (nats) the RDP curve gives at ``delta``."""
        return float(rdp_privacy_accountant.compute_epsilon(self.orders, self.rdp, delta)[0])

    def get_delta(self, epsilon: float) -> float:
        """The smallest delta the RDP curve gives at ``epsilon`` (nats)."""
        return float(rdp_privacy_accountant.compute_delta(self.orders, self.rdp, epsilon)[0])


# a calibration's bisection asks for ~50 sigmas once each; a run, one
@functools.lru_cache(maxsize=64)
def _event_rdp(
    event: dp_accounting.DpEvent, relation: dp_accounting.NeighboringRelation
) -> tuple[np.ndarray, np.ndarray]:
    """(orders, RDP of one ``event``), read-only, from the library's own accountant."""
    accountant = rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)
    accountant.compose(event)  # raises the library's error for an event RDP cannot compose
    orders, curve = accountant.orders, accountant.rdp
    orders.flags.writeable = curve.flags.writeable = False
    return orders, curve


def _peeled(event: dp_accounting.DpEvent) -> tuple[dp_accounting.DpEvent, int]:
    """``event`` without its SelfComposed layers, and the count they multiply to (the library's order)."""
    count = 1
    while isinstance(event, dp_accounting.SelfComposedDpEvent):
        count, event = event.count * count, event.event
    return event, count


def composed_rdp(
    events: Sequence[dp_accounting.DpEvent],
    relation: dp_accounting.NeighboringRelation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
) -> ComposedRdp:
    """The RDP of ``events`` composed in order, as ``RdpAccountant(neighboring_relation=relation)``
    composing each of them gives it.

    Args:
        events: the history, e.g. ``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), steps)``.
        relation: the adjacency the events are accounted under.

    Returns:
        The composed curve; its epsilons and deltas equal the library accountant's exactly.
    """
    orders = np.array(rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
    total = np.zeros_like(orders, dtype=np.float64)  # the library's start, whatever is composed
    for event in events:
        inner, count = _peeled(event)
        if count < 1:  # the library refuses it; a negative count would subtract privacy loss
            raise ValueError(f"`count` must be positive, got {count} in {event}")
        orders, curve = _event_rdp(inner, relation)
        total += count * curve
    return ComposedRdp(orders, total)

"""epsilon(delta) of a privacy loss distribution, for one delta or many, bit for bit dp_accounting's.

``PrivacyLossDistribution.get_epsilon_for_delta`` walks each dense PMF from its largest loss down
in a Python loop (the module function its PMFs call: one ``math.exp``, two additions and a
``math.log`` test per grid point), 0.1-0.2 s a call on a composed PLD on the 2-core AVX2 VM;
`dpscale plot`'s epsilon-delta curve asks 42 deltas of two PMFs (16.7 s of its 20.6 s).

``pld_epsilons`` does the same walk a chunk of grid points at a time: the losses by the same
repeated subtraction (``itertools.count`` adds its step; ``np.cumsum`` adds in order, too), the
running masses by ``np.cumsum`` continued from the previous chunk (sequential additions in the
library's order), each term ``math.exp(-loss) * prob`` as the library computes it, and the
loop's two stopping tests evaluated on the whole chunk, the first one that holds ending the
walk. The log in the first test is numpy's, re-taken with ``math.log`` wherever the two could
decide it differently, so every epsilon equals the library's (tests/test_pld_epsilon.py). The
running masses are kept, so later deltas reuse them. A PMF that is not dense, or a
dp_accounting without the attributes read here, is left to the library.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from dp_accounting.pld import pld_pmf

# Grid points the walk adds per chunk (doubling): the loop usually stops within the top few
# thousand of a composed PMF's 10^4-10^6 points, so a chunk costs about what the loop would.
FIRST_CHUNK = 2048
# |numpy log - loss| below this (relative) re-takes the log with math.log (numpy's float64 log
# may differ from libm's by an ulp, ~2e-16 relative).
LOG_RECHECK = 1e-12


def pld_epsilons(pld: Any, deltas: Sequence[float]) -> list[float]:
    """dp_accounting's ``pld.get_epsilon_for_delta(delta)`` for each of ``deltas``, the same numbers.

    Args:
        pld: a ``dp_accounting.pld.privacy_loss_distribution.PrivacyLossDistribution``.
        deltas: target deltas (each in [0, 1]).

    Returns:
        one epsilon (nats) per delta: the smallest epsilon >= 0 whose hockey-stick divergence is
        at most delta, ``math.inf`` where none is finite.
    """
    try:
        pmfs = [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]
        walks = [_Walk(pmf) for pmf in pmfs]
    except (AttributeError, TypeError, ValueError):
        return [float(pld.get_epsilon_for_delta(delta)) for delta in deltas]
    return [float(max(walk.epsilon(float(delta)) for walk in walks)) for delta in deltas]


class _Walk:
    """One dense PMF's walk from its largest loss down, with the running masses computed so far."""

    def __init__(self, dense: Any) -> None:
        if not isinstance(dense, pld_pmf.DensePLDPmf) or len(dense._probs) == 0:
            raise TypeError("not a non-empty dense PMF")
        self.infinity = dense._infinity_mass
        self.probs = np.flip(np.asarray(dense._probs, dtype=np.float64))
        upper_loss = (dense._lower_loss + len(dense._probs) - 1) * dense._discretization
        steps = np.full(len(self.probs), -dense._discretization)
        steps[0] = upper_loss
        self.losses = np.cumsum(steps)  # itertools.count(upper_loss, -discretization)
        # Running masses before grid point k (index k) and after the last (index n): the loop's
        # mass_upper (from the infinity mass) and mass_lower (from 0).
        self.upper = np.empty(len(self.probs) + 1)
        self.lower = np.empty(len(self.probs) + 1)
        self.upper[0], self.lower[0] = self.infinity, 0.0
        self.done = 0  # grid points whose masses are summed
        # the first point whose exp(-loss) overflows (math.exp raises there)
        self.overflow = len(self.probs)

    def epsilon(self, delta: float) -> float:
        """The library's ``_get_epsilon_for_delta`` for this PMF."""
        if self.infinity > delta:
            return math.inf
        start, n = 0, len(self.probs)
        while start < n:
            end = min(n, max(2 * start, FIRST_CHUNK))
            self._sum_through(end)
            stop = self._first_stop(delta, start, end)
            if stop is not None:
                return stop
            start = end
        self._check_reached(n)
        return self._final(self.upper[n], self.lower[n], delta)

    def _check_reached(self, added: int) -> None:
        """The library's error where its walk adds a term whose exp(-loss) overflows (a loss
        below -709.78 reached before the walk stops): computed ahead here, raised only if reached."""
        if self.overflow < added:
            raise OverflowError("math range error")

    def _sum_through(self, end: int) -> None:
        """The running masses through grid point ``end`` (continuing the sequential sums)."""
        a = self.done
        if end <= a:
            return
        exps = [_exp_or_inf(-loss) for loss in self.losses[a:end].tolist()]
        if math.inf in exps:
            self.overflow = min(self.overflow, a + exps.index(math.inf))
        # past an overflow, never used (see _check_reached)
        with np.errstate(invalid="ignore", over="ignore"):
            terms = np.array(exps) * self.probs[a:end]
            self.upper[a + 1 : end + 1] = np.cumsum(
                np.concatenate(([self.upper[a]], self.probs[a:end]))
            )[1:]
            self.lower[a + 1 : end + 1] = np.cumsum(np.concatenate(([self.lower[a]], terms)))[1:]
        self.done = end

    def _first_stop(self, delta: float, start: int, end: int) -> float | None:
        """The walk's result if it stops at a grid point in [start, end), else None. At point k
        the loop first breaks if log((upper - delta) / lower) >= loss (masses before k), then,
        after adding k, returns max(0, loss) if upper >= delta while lower is still 0."""
        upper, lower, losses = self.upper[start:end], self.lower[start:end], self.losses[start:end]
        breaks = (upper > delta) & (lower > 0)
        # points the loop never reaches
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            ratio = (upper - delta) / lower
            logs = np.log(ratio)
        close = breaks & (np.abs(logs - losses) <= LOG_RECHECK * np.maximum(1.0, np.abs(losses)))
        for k in np.flatnonzero(close):
            logs[k] = math.log(ratio[k])
        breaks &= logs >= losses
        zero = (self.upper[start + 1 : end + 1] >= delta) & (self.lower[start + 1 : end + 1] == 0)
        size = end - start  # positions below are within the chunk
        first_break = int(np.argmax(breaks)) if breaks.any() else size
        first_zero = int(np.argmax(zero)) if zero.any() else size
        if first_zero < first_break:  # at the same point the break test comes first
            self._check_reached(start + first_zero + 1)
            return float(max(0, losses[first_zero].item()))
        if first_break < size:
            self._check_reached(start + first_break)
            return self._final(upper[first_break], lower[first_break], delta)
        return None

    @staticmethod
    def _final(upper: float, lower: float, delta: float) -> float:
        if upper <= lower + delta:
            return 0.0
        return math.log((upper - delta) / lower)


def _exp_or_inf(x: float) -> float:
    """``math.exp(x)``, inf where it would overflow (the caller raises if the walk gets there)."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf

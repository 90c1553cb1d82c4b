"""The privacy cost of hyper-parameter tuning by random repetition (Papernot & Steinke 2022,
"Hyperparameter tuning with Renyi differential privacy", ICLR).

The procedure the bound covers: draw the number of runs K from a known distribution, run K
trainings, each with hyper-parameters drawn independently and uniformly from the candidates (and
fresh randomness), and release only the best run (by a score the run itself computes), never K:
the bound's gain comes from the adversary not knowing how many runs were made. If every
run has the same RDP curve, the released run is RDP with the curve of their Theorem 2 (K from a
truncated negative binomial: logarithmic eta = 0, geometric eta = 1) or Theorem 6 (K Poisson,
possibly 0). ``dp_accounting`` implements both (``RepeatAndSelectDpEvent``); as everywhere in
dpscale, the maths is theirs and the tests compare it with the paper's closed forms.

The result is an RDP bound, converted to (epsilon, delta): a run accounted with PLD is
re-accounted with RDP here, so its tuned epsilon exceeds its PLD epsilon by more than the tuning.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from dp_accounting import dp_event, rdp

from dpscale.privacy.accounting.rdp_history import dp_sgd_event, quiet_order_notices
from dpscale.privacy.accounting.segments import AccountingSegment

TUNING_DISTRIBUTIONS = ("poisson", "geometric", "logarithmic", "negbin")
TUNING_SYNTAX = "poisson:MEAN, geometric:MEAN, logarithmic:MEAN or negbin:ETA:MEAN"


@dataclass(frozen=True)
class TuningDistribution:
    """The distribution of the number of runs K.

    Attributes:
        kind: "poisson" (K >= 0), "geometric" (eta = 1), "logarithmic" (eta = 0) or "negbin"
            (truncated negative binomial with shape ``eta``); all but Poisson have K >= 1.
        mean: E[K], >= 1 (dp_accounting's bounds need it; for Poisson, Theorem 6's log(mean) term).
        eta: the shape of "negbin" (> 0; ignored otherwise).
    """

    kind: str
    mean: float
    eta: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in TUNING_DISTRIBUTIONS:
            raise ValueError(f"unknown tuning distribution {self.kind!r}; use {TUNING_SYNTAX}")
        if not self.mean >= 1 or not math.isfinite(self.mean):
            raise ValueError(f"the mean number of runs must be a number >= 1, got {self.mean}")
        if self.kind == "negbin" and not self.eta > 0:
            raise ValueError(f"negbin needs a shape eta > 0, got {self.eta}")

    @property
    def shape(self) -> float:
        """dp_accounting's shape: inf for Poisson, else eta."""
        return {"poisson": math.inf, "geometric": 1.0, "logarithmic": 0.0}.get(self.kind, self.eta)

    def describe(self) -> str:
        eta = f", eta={self.eta:g}" if self.kind == "negbin" else ""
        return f"K ~ {self.kind}(mean={self.mean:g}{eta})"

    def gamma(self) -> float:
        """The truncated negative binomial's gamma with this mean (1 for a mean of 1: K = 1 surely)."""
        return _gamma_for_mean(self.mean, self.shape)

    def sample(self, rng: np.random.Generator) -> int:
        """One draw of K."""
        if self.kind == "poisson":
            return int(rng.poisson(self.mean))
        gamma = self.gamma()
        if gamma >= 1:
            return 1
        if self.kind == "geometric":
            return int(rng.geometric(gamma))
        if self.kind == "logarithmic":
            return int(rng.logseries(1 - gamma))
        return _negbin_inverse_cdf(float(rng.random()), self.eta, gamma)


def _negbin_inverse_cdf(u: float, eta: float, gamma: float) -> int:
    """The K >= 1 with P[K < k] <= u < P[K <= k] under D_{eta, gamma} (Definition 1), walking the
    pmf by its ratio P[k + 1] / P[k] = (1 - gamma)(k + eta) / (k + 1)."""
    k, pmf = 1, (1 - gamma) * eta / (gamma**-eta - 1)
    total = pmf
    while total <= u and pmf > 0:
        pmf *= (1 - gamma) * (k + eta) / (k + 1)
        total += pmf
        k += 1
    return k


@functools.lru_cache(maxsize=64)
def _gamma_for_mean(mean: float, eta: float) -> float:
    """Bisection for gamma: the mean of D_{eta, gamma} falls as gamma rises."""
    if mean == 1:
        return 1.0
    low, high = 1e-12, 1.0
    for _ in range(200):
        mid = (low + high) / 2
        if truncated_negbin_mean(mid, eta) > mean:
            low = mid
        else:
            high = mid
    return high


def truncated_negbin_mean(gamma: float, eta: float) -> float:
    """E[K] of the truncated negative binomial D_{eta, gamma} (Papernot & Steinke, Definition 1)."""
    if gamma >= 1:
        return 1.0
    if eta == 0:
        return (1 / gamma - 1) / math.log(1 / gamma)
    return eta * (1 - gamma) / (gamma * (1 - gamma**eta))


def parse_tuning_distribution(text: str) -> TuningDistribution:
    """``poisson:10``, ``geometric:5``, ``logarithmic:5`` or ``negbin:0.5:10`` -> the distribution."""
    parts = [p.strip() for p in text.split(":")]
    try:
        if parts[0] == "negbin" and len(parts) == 3:
            return TuningDistribution("negbin", float(parts[2]), float(parts[1]))
        if len(parts) == 2:
            return TuningDistribution(parts[0], float(parts[1]))
    except ValueError as err:
        raise ValueError(f"private tuning {text!r}: {err}") from err
    raise ValueError(f"private tuning {text!r}: use {TUNING_SYNTAX}")


def repeat_and_select(
    event: dp_event.DpEvent, tuning: TuningDistribution, orders: list[float] | None = None
) -> rdp.RdpAccountant:
    """An RDP accountant (default orders, or ``orders``) holding ``event`` repeated K ~ ``tuning``
    times with only the best output released."""
    accountant = rdp.RdpAccountant(orders) if orders is not None else rdp.RdpAccountant()
    with quiet_order_notices():
        accountant.compose(dp_event.RepeatAndSelectDpEvent(event, tuning.mean, tuning.shape))
    return accountant


def run_event(history: tuple[AccountingSegment, ...]) -> dp_event.DpEvent:
    """One run's whole accounting history (releases and DP-SGD steps) as one dp_accounting event."""
    events = [dp_sgd_event(seg.sample_rate, seg.noise_multiplier, seg.steps) for seg in history]
    return events[0] if len(events) == 1 else dp_event.ComposedDpEvent(events)


def tuned_epsilon(
    history: tuple[AccountingSegment, ...], delta: float, tuning: TuningDistribution
) -> float:
    """Epsilon at ``delta`` of releasing the best of K runs, each with this accounting ``history``.

    Args:
        history: one run's releases and DP-SGD steps (every candidate run's must be the same).
        delta: the delta of the guarantee.
        tuning: the distribution of K.

    Returns:
        epsilon (RDP, converted by dp_accounting's Canonne-Kamath-Steinke conversion).
    """
    if not history:
        raise ValueError("a run with no accounting history (not private) has no finite tuning cost")
    return float(repeat_and_select(run_event(history), tuning).get_epsilon(delta))

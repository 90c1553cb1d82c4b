"""The guarantee as an attacker's odds (issue 45): membership-test power from the privacy profile.

A run that is (epsilon, delta(epsilon))-DP for every epsilon >= 0 (its privacy profile, from the
accountant's composed PLD or RDP curve) bounds every test of "was this one image (or user) in the
training set?" run on its output: at false-positive rate a, the true-positive rate is at most

    TPR(a) <= inf over epsilon of min(e^eps a + delta(eps), 1 - e^-eps (1 - delta(eps) - a))

(Kairouz, Oh & Viswanath 2015; each (eps, delta) pair bounds the test on its own, both
directions because the profile covers add and remove). The infimum is taken over a grid of
epsilon; a grid point only ever gives a valid bound, so a coarse grid errs on the attacker's side.

``gdp_mu`` reads the same profile as mu-GDP (Dong, Roth & Su 2022): the smallest mu whose
Gaussian profile delta_mu(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) lies above the
run's on the grid, so the Gaussian trade-off curve TPR = Phi(Phi^-1(a) + mu) is a readable summary
(for one Gaussian mechanism of noise multiplier sigma it is exactly mu = 1/sigma).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np
from scipy.stats import norm

# The false-positive rates every output reports (0.1%, 1%, 10%).
REPORTED_FPRS: tuple[float, ...] = (0.001, 0.01, 0.1)
# Epsilon grid for the infimum: dense near 0 (small epsilons), up to 60 nats.
EPSILON_GRID = np.unique(np.concatenate([np.linspace(0.0, 4.0, 801), np.linspace(4.0, 60.0, 561)]))

# The odds fields where a guarantee has none to report (same keys as ``attacker_odds``).
NO_ODDS: dict[str, Any] = {"tpr_at_fpr": None, "gdp_mu": None, "odds_from": None, "odds": None}

Profile = Callable[[np.ndarray], np.ndarray]  # epsilons (nats) -> delta at each


def tpr_at_fpr(profile: Profile, fprs: Sequence[float] = REPORTED_FPRS) -> dict[float, float]:
    """The largest true-positive rate any membership test can reach at each false-positive rate.

    Args:
        profile: the run's privacy profile, epsilons -> deltas (vectorised).
        fprs: false-positive rates in [0, 1].

    Returns:
        FPR -> maximal TPR, in [FPR, 1].
    """
    eps = EPSILON_GRID
    delta = np.clip(np.asarray(profile(eps), dtype=np.float64), 0.0, 1.0)
    out = {}
    for a in fprs:
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"false-positive rate must be in [0, 1], got {a}")
        bound = np.minimum(np.exp(eps) * a + delta, 1.0 - np.exp(-eps) * (1.0 - delta - a))
        out[float(a)] = float(min(1.0, max(a, bound.min())))
    return out


def gaussian_profile(mu: float, eps: np.ndarray) -> np.ndarray:
    """delta(eps) of mu-GDP (the Gaussian mechanism with sensitivity / sigma = mu)."""
    if mu <= 0:
        return np.zeros_like(eps)
    return norm.cdf(-eps / mu + mu / 2) - np.exp(eps) * norm.cdf(-eps / mu - mu / 2)


def gdp_mu(profile: Profile, tolerance: float = 1e-4) -> float:
    """The smallest mu whose mu-GDP profile is at least the run's at every grid epsilon.

    Returns:
        mu (>= 0; inf when no Gaussian profile up to mu = 50 covers it).
    """
    eps = EPSILON_GRID
    delta = np.asarray(profile(eps), dtype=np.float64)
    covers = lambda mu: bool(np.all(gaussian_profile(mu, eps) >= delta - 1e-12))  # noqa: E731
    low, high = 0.0, 50.0
    if not covers(high):
        return math.inf
    while high - low > tolerance * max(1.0, high):
        mid = (low + high) / 2
        low, high = (low, mid) if covers(mid) else (mid, high)
    return high


def gaussian_tpr(mu: float, fpr: float) -> float:
    """TPR = Phi(Phi^-1(FPR) + mu): the trade-off curve of mu-GDP."""
    return float(norm.cdf(norm.ppf(fpr) + mu))


def odds_sentence(tpr: dict[float, float], unit: str = "image", replace_one: bool = False) -> str:
    """One plain sentence for reports: the 1% false-positive row (under replace-one adjacency the
    test tells which of two images was used, the other in its place)."""
    at_one = tpr.get(0.01)
    if at_one is None:
        return ""
    question = (
        f"which of two {unit}s was used (one in the other's place)"
        if replace_one
        else f"whether any one {unit} was used"
    )
    return (
        f"no membership test can tell {question} with better than "
        f"{100 * at_one:.1f}% true positives at 1% false positives"
    )


def attacker_odds(accountant: Any, unit: str = "image") -> dict[str, Any]:
    """The reported reading of an accountant's guarantee (``summary.json``, ``dpscale account --json``).

    Args:
        accountant: a ``PrivacyAccountant`` (its ``privacy_profile`` and ``kind``).
        unit: what one protected record is ("image", "person").

    Returns:
        {"tpr_at_fpr": {"0.001": TPR, "0.01": ..., "0.1": ...}, "gdp_mu", "odds_from", "odds"}: the
        maximal membership-test TPR at each reported FPR, the mu-GDP reading, where both come from
        (the PLD's profile is tight; the RDP curve's deltas are valid but looser), the sentence.
    """
    return profile_odds(
        accountant.privacy_profile(), accountant.kind, unit, accountant.adjacency == "replace-one"
    )


def profile_odds(
    profile: Profile, kind: str, unit: str = "image", replace_one: bool = False
) -> dict[str, Any]:
    """``attacker_odds`` of a privacy profile computed by ``kind`` ("pld" or "rdp"), under
    replace-one adjacency when ``replace_one``."""
    deltas = np.asarray(profile(EPSILON_GRID), dtype=np.float64)  # evaluated once for both readings
    tpr = tpr_at_fpr(lambda eps: deltas)
    source = (
        "the composed PLD's privacy profile"
        if kind == "pld"
        else "the RDP curve (valid, looser than PLD)"
    )
    return {
        "tpr_at_fpr": {f"{a:g}": t for a, t in tpr.items()},
        "gdp_mu": gdp_mu(lambda eps: deltas),
        "odds_from": source,
        "odds": odds_sentence(tpr, unit, replace_one),
    }


def format_odds(odds: dict[str, Any]) -> str:
    """One report line: the TPR bounds at the reported FPRs and mu."""
    rates = ", ".join(
        f"{100 * t:.2f}% at {100 * float(a):g}%" for a, t in odds["tpr_at_fpr"].items()
    )
    return f"membership-test power (true positives at false positives): {rates}; mu-GDP mu = {odds['gdp_mu']:.3f}"

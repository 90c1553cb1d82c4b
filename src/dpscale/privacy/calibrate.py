"""Calibrate DP-SGD parameters to a target (epsilon, delta).

Both searches bracket the answer and then shrink the bracket by Illinois-modified
regula falsi in log-log space, where epsilon is nearly linear in log sigma and log
steps, so a PLD calibration needs a handful of accountant calls instead of ~20
bisections. Every epsilon comes from ``compute_epsilon`` (``dp_accounting``).

Guarantees: the returned sigma's epsilon is *at most* the target and within
``rel_tol`` of it; the returned step count is the largest whose epsilon does not
exceed the target. A run configured from these never overspends its budget.
"""

from __future__ import annotations

import math
from typing import Callable

from dpscale.privacy.accountant import (
    PLD_COARSE_DISCRETIZATION,
    PLD_VALUE_DISCRETIZATION,
    AccountingSegment,
    PrivacyAccountant,
    compute_epsilon,
)

# Upper end of the noise search; beyond this the run is pure noise.
MAX_NOISE_MULTIPLIER = 1e4


def _tan_sigma_guess(target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """Invert eps_TAN = eta^2 + 2 eta sqrt(log 1/delta) (TAN eq. 4) for a first sigma guess."""
    log_term = math.log(1.0 / delta)
    eta = math.sqrt(log_term + target_epsilon) - math.sqrt(log_term)
    return max(0.3, sample_rate * math.sqrt(steps) / (math.sqrt(2.0) * eta))


def _interpolate(lo: float, f_lo: float, hi: float, f_hi: float) -> float:
    """Root of the secant through (lo, f_lo), (hi, f_hi); f_lo and f_hi have opposite signs."""
    return hi - f_hi * (hi - lo) / (f_hi - f_lo)


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    kind: str = "pld",
    rel_tol: float = 1e-3,
    releases: tuple[AccountingSegment, ...] = (),
) -> float:
    """Noise multiplier sigma so that ``steps`` DP-SGD steps cost at most ``target_epsilon``,
    together with ``releases`` (e.g. private Data Normalization) when given.

    Args:
        target_epsilon: epsilon budget, > 0.
        delta: delta, in (0, 1).
        sample_rate: Poisson sampling rate q = B / N.
        steps: number of noisy steps, >= 1.
        kind: accountant, "pld" or "rdp".
        rel_tol: the returned sigma's epsilon lies in [target * (1 - rel_tol), target].
        releases: one-off mechanisms on the same data, composed with the steps.

    Returns:
        noise multiplier sigma.

    Raises:
        ValueError: on invalid arguments, when the releases alone spend the budget, or when
            even sigma = 1e4 exceeds it.
    """
    if not target_epsilon > 0 or not math.isfinite(target_epsilon):
        raise ValueError(f"target epsilon must be a positive finite number, got {target_epsilon}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1 to calibrate noise, got {steps}")
    _check_releases_fit(target_epsilon, delta, kind, releases)

    def epsilon_fn(discretization: float) -> Callable[[float], float]:
        return lambda sigma: compute_epsilon(sample_rate, sigma, steps, delta, kind, discretization, releases)

    guess = _tan_sigma_guess(target_epsilon, delta, sample_rate, steps)
    initial_step = 0.25
    if kind == "pld":
        # Search on the coarse grid (~10x cheaper), then finish on the reporting grid
        # starting from a tight bracket around the coarse answer.
        guess = _solve_sigma(epsilon_fn(PLD_COARSE_DISCRETIZATION), target_epsilon, guess, initial_step, rel_tol)
        initial_step = 0.005
    try:
        return _solve_sigma(epsilon_fn(PLD_VALUE_DISCRETIZATION), target_epsilon, guess, initial_step, rel_tol)
    except _OutOfRange as err:
        raise ValueError(
            f"cannot reach epsilon={target_epsilon} at delta={delta} with q={sample_rate}, steps={steps}: "
            f"even noise multiplier {MAX_NOISE_MULTIPLIER:g} is not enough"
        ) from err


class _OutOfRange(ValueError):
    pass


def _check_releases_fit(target_epsilon: float, delta: float, kind: str, releases: tuple[AccountingSegment, ...]) -> None:
    """Refuse a budget that the one-off releases already use up (no step could then fit)."""
    if not releases:
        return
    accountant = PrivacyAccountant(kind)
    for release in releases:
        accountant.record(release)
    spent = accountant.epsilon(delta)
    if spent >= target_epsilon:
        names = ", ".join(dict.fromkeys(r.label for r in releases))
        raise ValueError(
            f"{names} alone spends epsilon={spent:.4g} >= the target {target_epsilon} at delta={delta}; "
            "raise its noise or the budget"
        )


def _solve_sigma(
    epsilon: Callable[[float], float], target: float, guess: float, initial_step: float, rel_tol: float
) -> float:
    """Largest-epsilon sigma within budget, epsilon in [target (1 - rel_tol), target]; epsilon decreasing."""
    log_target = math.log(target)

    def f(log_sigma: float) -> float:  # decreasing; <= 0 means within budget
        eps = epsilon(math.exp(log_sigma))
        return math.log(eps) - log_target if eps > 0 else -math.inf

    # Bracket [lo, hi] in log sigma: f(lo) > 0 (over budget), f(hi) <= 0 (within budget).
    x = math.log(guess)
    fx = f(x)
    step = math.log1p(initial_step)
    if fx <= 0:
        hi, f_hi = x, fx
        lo, f_lo = x - step, f(x - step)
        while f_lo <= 0:
            if lo < math.log(1e-3):
                return math.exp(lo)  # absurdly generous budget: any noise fits
            hi, f_hi, step = lo, f_lo, step * 2
            lo, f_lo = hi - step, f(hi - step)
    else:
        lo, f_lo = x, fx
        hi, f_hi = x + step, f(x + step)
        while f_hi > 0:
            if hi > math.log(MAX_NOISE_MULTIPLIER):
                raise _OutOfRange
            lo, f_lo, step = hi, f_hi, step * 2
            hi, f_hi = lo + step, f(lo + step)

    tolerance = -math.log1p(-rel_tol)  # f(hi) in [-tolerance, 0] <=> eps in [target(1-rel_tol), target]
    side = 0
    for _ in range(100):
        if f_hi >= -tolerance or hi - lo < 1e-12:
            break
        x = _interpolate(lo, f_lo if math.isfinite(f_lo) else 1.0, hi, f_hi if math.isfinite(f_hi) else -1.0)
        if not lo < x < hi:
            x = 0.5 * (lo + hi)
        fx = f(x)
        if fx <= 0:
            hi, f_hi = x, fx
            if side == 1:  # Illinois: the same end moved twice, halve the other end's weight
                f_lo *= 0.5
            side = 1
        else:
            lo, f_lo = x, fx
            if side == -1:
                f_hi *= 0.5
            side = -1
    return math.exp(hi)


def calibrate_steps(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    noise_multiplier: float,
    kind: str = "pld",
    max_steps: int = 10**8,
    releases: tuple[AccountingSegment, ...] = (),
) -> int:
    """Largest number of steps whose epsilon (with ``releases``) stays at most ``target_epsilon``.

    Args:
        target_epsilon: epsilon budget, > 0.
        delta: delta, in (0, 1).
        sample_rate: q = B / N.
        noise_multiplier: sigma.
        kind: "pld" or "rdp".
        max_steps: search cap.
        releases: one-off mechanisms on the same data, composed with the steps.

    Returns:
        steps (int, >= 0). 0 means not even one step fits in the budget.
    """
    if not target_epsilon > 0 or not math.isfinite(target_epsilon):
        raise ValueError(f"target epsilon must be a positive finite number, got {target_epsilon}")
    log_target = math.log(target_epsilon)

    def f_at(discretization: float) -> Callable[[int], float]:
        def f(steps: int) -> float:  # increasing; <= 0 means within budget
            eps = compute_epsilon(sample_rate, noise_multiplier, steps, delta, kind, discretization, releases)
            return math.log(eps) - log_target if eps > 0 else -math.inf

        return f

    f = f_at(PLD_VALUE_DISCRETIZATION)
    if f(1) > 0:
        return 0
    # First guess from eps_TAN: S = 2 sigma^2 eta^2 / q^2, refined on the cheap coarse PLD grid.
    log_term = math.log(1.0 / delta)
    eta = math.sqrt(log_term + target_epsilon) - math.sqrt(log_term)
    guess = min(max_steps, max(1, round(2 * (noise_multiplier * eta / sample_rate) ** 2)))
    if kind == "pld":
        # RDP is a valid (looser) bound and ~50x cheaper than PLD at millions of steps: if it
        # already certifies max_steps we are done, else its answer is a lower bound to start from.
        rdp_steps = calibrate_steps(target_epsilon, delta, sample_rate, noise_multiplier, "rdp", max_steps, releases)
        if rdp_steps >= max_steps:
            return max_steps
        guess = max(1, _search_steps(f_at(PLD_COARSE_DISCRETIZATION), max(guess, rdp_steps), max_steps, growth=1.5))
        return _search_steps(f, guess, max_steps, growth=1.01)
    return _search_steps(f, guess, max_steps, growth=1.5)


def _search_steps(f: Callable[[int], float], guess: int, max_steps: int, growth: float) -> int:
    """Largest s in [1, max_steps] with f(s) <= 0 (f increasing, f(1) <= 0 assumed), from a guess."""
    guess = min(max_steps, max(1, guess))
    f_guess = f(guess)
    if f_guess <= 0:
        lo, f_lo = guess, f_guess
        while True:
            if lo >= max_steps:
                return max_steps
            hi = min(max_steps, max(lo + 1, round(lo * growth)))
            f_hi = f(hi)
            if f_hi > 0:
                break
            lo, f_lo = hi, f_hi
            growth = growth * growth  # widen geometrically when the guess was far off
    else:
        hi, f_hi = guess, f_guess
        while True:
            lo = max(1, min(hi - 1, round(hi / growth)))
            f_lo = f(lo)
            if f_lo <= 0:
                break
            hi, f_hi = lo, f_lo
            growth = growth * growth
    return _bisect_steps(f, lo, hi, f_lo, f_hi)


def _bisect_steps(
    f: Callable[[int], float], lo: int, hi: int, f_lo: float | None = None, f_hi: float | None = None
) -> int:
    """Largest integer in [lo, hi) with f <= 0, given f(lo) <= 0 < f(hi); interpolates in log steps."""
    f_lo = f(lo) if f_lo is None else f_lo
    f_hi = f(hi) if f_hi is None else f_hi
    while hi - lo > 1:
        if math.isfinite(f_lo) and math.isfinite(f_hi):
            guess = math.exp(_interpolate(math.log(lo), f_lo, math.log(hi), f_hi))
        else:
            guess = math.sqrt(lo * hi)
        mid = min(hi - 1, max(lo + 1, round(guess)))
        f_mid = f(mid)
        if f_mid <= 0:
            lo, f_lo = mid, f_mid
        else:
            hi, f_hi = mid, f_mid
    return lo

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
from typing import Callable, TypedDict

from dpscale.privacy.accounting.accountant import PrivacyAccountant, compute_epsilon
from dpscale.privacy.accounting.batch_sampling import ACCOUNTANTS_OF, POISSON, BatchSampling
from dpscale.privacy.accounting.pld_history import (
    PLD_COARSE_DISCRETIZATION,
    PLD_VALUE_DISCRETIZATION,
    PLDRangeError,
)
from dpscale.privacy.accounting.segments import AccountingSegment, releases_under

# Upper end of the noise search; beyond this the run is pure noise.
MAX_NOISE_MULTIPLIER = 1e4
# How closely (in log sigma) the search locates the smallest sigma the PLD accountant represents
# before giving up on a budget beyond it (epsilon ~1e6 and more: bisecting further buys nothing).
_WALL_RESOLUTION = math.log1p(0.01)


class _NoiseRun(TypedDict):
    """A noise search's run: ``compute_epsilon``'s arguments but noise_multiplier, steps and the grid."""

    sample_rate: float
    delta: float
    kind: str
    releases: tuple[AccountingSegment, ...]
    batches: BatchSampling


class _StepsRun(TypedDict):
    """A step search's run: the arguments ``compute_epsilon`` and ``calibrate_steps`` share with it."""

    sample_rate: float
    noise_multiplier: float
    delta: float
    releases: tuple[AccountingSegment, ...]
    batches: BatchSampling


def _tan_sigma_guess(target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """Invert eps_TAN = eta^2 + 2 eta sqrt(log 1/delta) (TAN eq. 4) for a first sigma guess."""
    log_term = math.log(1.0 / delta)
    eta = math.sqrt(log_term + target_epsilon) - math.sqrt(log_term)
    return max(0.3, sample_rate * math.sqrt(steps) / (math.sqrt(2.0) * eta))


def _tan_steps_guess(
    target_epsilon: float, delta: float, sample_rate: float, noise_multiplier: float
) -> int:
    """A first guess at the steps that fit, from eps_TAN (TAN eq. 4): S = 2 sigma^2 eta^2 / q^2 (>= 1)."""
    log_term = math.log(1.0 / delta)
    eta = math.sqrt(log_term + target_epsilon) - math.sqrt(log_term)
    return max(1, round(2 * (noise_multiplier * eta / sample_rate) ** 2))


def _interpolate(lo: float, f_lo: float, hi: float, f_hi: float) -> float:
    """Root of the secant through (lo, f_lo), (hi, f_hi); f_lo and f_hi have opposite signs."""
    return hi - f_hi * (hi - lo) / (f_hi - f_lo)


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    kind: str = "pld",
    rel_tol: float = 1e-3,
    releases: tuple[AccountingSegment, ...] = (),
    batches: BatchSampling = POISSON,
) -> float:
    """Noise multiplier sigma so that ``steps`` DP-SGD steps cost at most ``target_epsilon``,
    together with ``releases`` (e.g. private Data Normalization) when given. Keyword-only
    arguments, like ``compute_epsilon``'s: the privacy numbers have no natural order.

    Args:
        target_epsilon: epsilon budget, > 0.
        delta: delta, in (0, 1).
        sample_rate: Poisson sampling rate q = B / N.
        steps: number of noisy steps, >= 1.
        kind: accountant, "pld" or "rdp".
        rel_tol: the returned sigma's epsilon lies in [target * (1 - rel_tol), target].
        releases: one-off mechanisms on the same data, composed with the steps.
        batches: the batch sampler the steps use (``compute_epsilon``'s).

    Returns:
        noise multiplier sigma.

    Raises:
        ValueError: on invalid arguments (a delta below the PLD's PLD_MIN_DELTA too), when the
            releases alone spend the budget, when even sigma = 1e4 exceeds it (the message names
            the least reachable epsilon), or when the budget needs less noise than the PLD
            accountant represents (epsilon in the millions). Each message is one line.
    """
    if not target_epsilon > 0 or not math.isfinite(target_epsilon):
        raise ValueError(f"target epsilon must be a positive finite number, got {target_epsilon}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1 to calibrate noise, got {steps}")
    releases = releases_under(releases, batches)
    _check_releases_fit(target_epsilon, delta, kind, releases)
    run: _NoiseRun = {
        "sample_rate": sample_rate,
        "delta": delta,
        "kind": kind,
        "releases": releases,
        "batches": batches,
    }

    def epsilon_fn(grid: float) -> Callable[[float], float]:
        return lambda sigma: compute_epsilon(
            **run, noise_multiplier=sigma, steps=steps, pld_discretization=grid
        )

    # Beyond the cap the answer is refused anyway: start there (one evaluation to find out).
    guess = min(_tan_sigma_guess(target_epsilon, delta, sample_rate, steps), MAX_NOISE_MULTIPLIER)
    initial_step = 0.25
    try:
        if kind == "pld":
            # Search on the coarse grid (~10x cheaper), then finish on the reporting grid
            # starting from a tight bracket around the coarse answer.
            guess, initial_step = _coarse_start(
                epsilon_fn(PLD_COARSE_DISCRETIZATION), target_epsilon, guess, rel_tol
            )
        return _solve_sigma(
            epsilon_fn(PLD_VALUE_DISCRETIZATION), target_epsilon, guess, initial_step, rel_tol
        )
    except (_OutOfRange, _BeyondPLD) as err:
        coarse = epsilon_fn(PLD_COARSE_DISCRETIZATION)
        raise ValueError(_no_sigma_message(err, target_epsilon, steps, run, coarse)) from err


def _no_sigma_message(
    err: ValueError,
    target_epsilon: float,
    steps: int,
    run: _NoiseRun,
    coarse: Callable[[float], float],
) -> str:
    """The one-line refusal of a noise search that found no sigma.

    Args:
        err: _OutOfRange (even the cap overspends) or _BeyondPLD (too little noise for a PLD).
        run: compute_epsilon's arguments but noise_multiplier and steps.
        coarse: epsilon as a function of sigma on the coarse PLD grid (its values are cached).
    """
    delta, sample_rate = run["delta"], run["sample_rate"]
    if isinstance(err, _BeyondPLD):
        sigma = err.args[0]  # evaluated by the coarse search
        return _beyond_pld_message(target_epsilon, delta, sample_rate, steps, sigma, coarse(sigma))

    def at_cap(num_steps: int) -> float:
        return compute_epsilon(**run, noise_multiplier=MAX_NOISE_MULTIPLIER, steps=num_steps)

    return _unreachable_message(target_epsilon, delta, sample_rate, steps, at_cap)


def _coarse_start(
    epsilon: Callable[[float], float], target_epsilon: float, guess: float, rel_tol: float
) -> tuple[float, float]:
    """Where the fine-grid search starts.

    Args:
        epsilon: epsilon as a function of sigma on the coarse PLD grid.
        target_epsilon: the budget.
        guess: first sigma tried.
        rel_tol: as in ``calibrate_noise_multiplier``.

    Returns:
        (sigma, relative first step): the coarse grid's answer and a tight step, or ``guess`` and a
        wide step when the coarse grid cannot meet the budget (an epsilon of the order of its 1e-3
        grid, which its over-estimate alone can exceed).
    """
    try:
        return _solve_sigma(epsilon, target_epsilon, guess, 0.25, rel_tol), 0.005
    except _OutOfRange:
        return guess, 0.25


class _OutOfRange(ValueError):
    """The budget is not met even at MAX_NOISE_MULTIPLIER (the caller words the message)."""


class _BeyondPLD(ValueError):
    """The budget needs less noise than the PLD accountant can represent (args: the least sigma it can)."""


def _unreachable_message(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    at_cap: Callable[[int], float],
) -> str:
    """One line: which budget cannot be met, the least epsilon the noise cap reaches, and what would work.

    Args:
        target_epsilon: the budget asked for.
        delta: its delta.
        sample_rate: q = B / N.
        steps: number of DP-SGD steps.
        at_cap: epsilon of a number of steps at MAX_NOISE_MULTIPLIER (with any releases).
    """
    floor = at_cap(steps)
    # At large sigma epsilon grows about like sqrt(steps) (TAN eq. 4 with eta small): a first guess at
    # the steps that fit at the cap, suggested only once the accountant confirms it.
    fit = int(steps * (target_epsilon / floor) ** 2) if math.isfinite(floor) and floor > 0 else 0
    fewer = (
        f"train at most {fit} steps"
        if 1 <= fit < steps and at_cap(fit) <= target_epsilon
        else "train fewer steps"
    )
    return (
        f"cannot reach epsilon={target_epsilon:g} at delta={delta:g} with q={sample_rate:.4g} over {steps} steps: "
        f"even noise multiplier {MAX_NOISE_MULTIPLIER:g} (the search's cap: the updates are then pure noise) "
        f"spends epsilon={floor:.4g}; raise the target epsilon to at least {_round_up(floor):.3g}, or {fewer} or "
        "with a smaller sampling rate q = B/N"
    )


def _beyond_pld_message(
    target_epsilon: float, delta: float, sample_rate: float, steps: int, sigma: float, spent: float
) -> str:
    """One line for a budget past what the PLD accountant represents: ``sigma`` is the least noise
    it can account for (found to within 1%), ``spent`` that sigma's epsilon."""
    return (
        f"cannot calibrate epsilon={target_epsilon:g} at delta={delta:g} with q={sample_rate:.4g} over {steps} "
        f"steps: it needs a noise multiplier below {sigma:.3g}, where the PLD accountant cannot represent the "
        f"privacy loss (sigma={sigma:.3g} already spends epsilon={spent:.3g}); an epsilon this large promises "
        "nothing: for a non-private baseline train with noise multiplier 0 and no epsilon, or ask for a smaller "
        "epsilon, or use the rdp accountant"
    )


def _round_up(value: float, digits: int = 3) -> float:
    """``value`` rounded up to ``digits`` significant digits (a suggested budget must not fall short)."""
    if not (math.isfinite(value) and value > 0):
        return value
    unit = 10.0 ** (math.floor(math.log10(value)) - digits + 1)
    return math.ceil(value / unit) * unit


def _check_releases_fit(
    target_epsilon: float, delta: float, kind: str, releases: tuple[AccountingSegment, ...]
) -> None:
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
            f"{names} alone spends epsilon={spent:.4g} >= the target {target_epsilon} at delta={delta}; raise its noise or the budget"
        )


def _solve_sigma(
    epsilon: Callable[[float], float],
    target: float,
    guess: float,
    initial_step: float,
    rel_tol: float,
) -> float:
    """Sigma whose epsilon lies in [target (1 - rel_tol), target] (epsilon decreasing in sigma).

    Args:
        epsilon: epsilon as a function of sigma (may raise PLDRangeError at tiny sigma).
        target: the budget.
        guess: first sigma tried.
        initial_step: first relative move of sigma while bracketing.
        rel_tol: relative width of the accepted band under the target.

    Returns:
        sigma (always one whose epsilon was evaluated at most ``target``).

    Raises:
        _OutOfRange: even MAX_NOISE_MULTIPLIER overspends.
        _BeyondPLD: the band lies below the smallest sigma the PLD accountant represents.
    """
    tolerance = -math.log1p(-rel_tol)  # log eps in [log target - tolerance, log target]: accepted
    # Aim at the middle of that band, not at its edge: PLD epsilons are multiples of the grid (a
    # staircase), and a secant aimed at the edge stalls on a step just above the target.
    f = _log_excess(epsilon, math.log(target) - tolerance / 2)  # <= tolerance / 2: within budget
    lo, f_lo, hi, f_hi = _bracket(f, math.log(guess), math.log1p(initial_step), tolerance / 2)
    side = 0
    for _ in range(100):
        if f_hi >= -tolerance / 2 or hi - lo < 1e-12:
            break
        # the target lies past what the PLD represents
        if f_lo == math.inf and hi - lo < _WALL_RESOLUTION:
            raise _BeyondPLD(math.exp(hi))
        # Bisect while an end has no finite value (epsilon 0, or too wide for the PLD): interpolating
        # against a stand-in value stalls, as the Illinois halving cannot act on an infinity.
        finite = math.isfinite(f_lo) and math.isfinite(f_hi)
        x = _interpolate(lo, f_lo, hi, f_hi) if finite else 0.5 * (lo + hi)
        if not lo < x < hi:
            x = 0.5 * (lo + hi)
        fx = f(x)
        if 0 < fx <= tolerance / 2:  # above the aim but inside the band: within budget, done
            return math.exp(x)
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


def _log_excess(epsilon: Callable[[float], float], log_aim: float) -> Callable[[float], float]:
    """log(epsilon / aim) as a function of log sigma (decreasing); +inf where the PLD cannot represent
    so little noise (epsilon is then astronomical, over any sane budget), -inf at epsilon 0."""

    def f(log_sigma: float) -> float:
        try:
            eps = epsilon(math.exp(log_sigma))
        except PLDRangeError:
            return math.inf
        return math.log(eps) - log_aim if eps > 0 else -math.inf

    return f


def _bracket(
    f: Callable[[float], float], x: float, step: float, accept: float
) -> tuple[float, float, float, float]:
    """(lo, f(lo), hi, f(hi)) in log sigma with f(lo) > 0 >= f(hi), f decreasing, searched from x
    with steps doubling from ``step``; lo = hi = x when |f(x)| <= accept (already in the band), and
    lo = hi below sigma 1e-3 (any noise fits).

    Raises:
        _OutOfRange: f > 0 even past MAX_NOISE_MULTIPLIER.
    """
    fx = f(x)
    if abs(fx) <= accept:  # e.g. the coarse grid's answer checked on the fine grid
        return x, fx, x, fx
    if fx <= 0:
        hi, f_hi = x, fx
        lo, f_lo = x - step, f(x - step)
        while f_lo <= 0:
            if lo < math.log(1e-3):
                return lo, f_lo, lo, f_lo  # absurdly generous budget: any noise fits
            hi, f_hi, step = lo, f_lo, step * 2
            lo, f_lo = hi - step, f(hi - step)
        return lo, f_lo, hi, f_hi
    lo, f_lo = x, fx
    hi, f_hi = x + step, f(x + step)
    while f_hi > 0:
        if hi > math.log(MAX_NOISE_MULTIPLIER):
            raise _OutOfRange
        lo, f_lo, step = hi, f_hi, step * 2
        hi, f_hi = lo + step, f(lo + step)
    return lo, f_lo, hi, f_hi


def calibrate_steps(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    noise_multiplier: float,
    kind: str = "pld",
    max_steps: int = 10**8,
    releases: tuple[AccountingSegment, ...] = (),
    batches: BatchSampling = POISSON,
) -> int:
    """Largest number of steps whose epsilon (with ``releases``) stays at most ``target_epsilon``
    (keyword-only arguments, like ``compute_epsilon``'s).

    Args:
        target_epsilon: epsilon budget, > 0.
        delta: delta, in (0, 1).
        sample_rate: q = B / N.
        noise_multiplier: sigma.
        kind: "pld" or "rdp".
        max_steps: search cap.
        releases: one-off mechanisms on the same data, composed with the steps.
        batches: the batch sampler the steps use (``compute_epsilon``'s).

    Returns:
        steps (int, >= 0). 0 means not even one step fits in the budget.
    """
    if not target_epsilon > 0 or not math.isfinite(target_epsilon):
        raise ValueError(f"target epsilon must be a positive finite number, got {target_epsilon}")
    # else "no step fits" would blame the steps
    _check_releases_fit(target_epsilon, delta, kind, releases)
    log_target = math.log(target_epsilon)
    run: _StepsRun = {
        "sample_rate": sample_rate,
        "noise_multiplier": noise_multiplier,
        "delta": delta,
        "releases": releases,
        "batches": batches,
    }

    def f_at(discretization: float) -> Callable[[int], float]:
        def f(steps: int) -> float:  # increasing; <= 0 means within budget
            try:
                eps = compute_epsilon(
                    **run, steps=steps, kind=kind, pld_discretization=discretization
                )
            except PLDRangeError:  # so many steps at so little noise that epsilon is astronomical
                return math.inf
            return math.log(eps) - log_target if eps > 0 else -math.inf

        return f

    f = f_at(PLD_VALUE_DISCRETIZATION)
    if f(1) > 0:
        return 0
    guess = min(max_steps, _tan_steps_guess(target_epsilon, delta, sample_rate, noise_multiplier))
    if kind == "pld" and "rdp" in ACCOUNTANTS_OF[batches.mode]:
        # RDP is a valid (looser) bound and ~50x cheaper than PLD at millions of steps: if it
        # already certifies max_steps we are done, else its answer is a lower bound to start from.
        rdp_steps = calibrate_steps(
            **run, target_epsilon=target_epsilon, kind="rdp", max_steps=max_steps
        )
        if rdp_steps >= max_steps:
            return max_steps
        guess = max(
            1,
            _search_steps(
                f_at(PLD_COARSE_DISCRETIZATION), max(guess, rdp_steps), max_steps, growth=1.5
            ),
        )
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
    f: Callable[[int], float],
    lo: int,
    hi: int,
    f_lo: float | None = None,
    f_hi: float | None = None,
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

"""The statistics of a one-run privacy audit (Steinke, Nasr & Jagielski 2023, "Privacy auditing
with one (1) training run"): from how many membership guesses about m canaries were right, an
epsilon that the run provably exceeds with probability at most 1 - confidence.

Set-up of the theorem: each of m canaries is included independently with probability 1/2; after
training, an auditor guesses "in" or "out" for r of them (abstaining on the rest) and v guesses
are right. If training is (epsilon, delta)-DP, the number of right guesses is stochastically
dominated by Binomial(r, e^eps / (1 + e^eps)) up to a delta term (their Theorem 3.1 with the
delta correction of their Section 5 / Algorithm 2):

    P[W >= v] <= P[Bin(r, p) >= v] + 2 m delta max_{1 <= i <= v} P[v - i <= Bin(r, p) < v] / i

The lower bound is the largest epsilon whose p-value is still below 1 - confidence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import optimize, stats


def audit_p_value(
    *, canaries: int, guesses: int, correct: int, epsilon: float, delta: float
) -> float:
    """Probability of at least ``correct`` right guesses out of ``guesses`` under (epsilon, delta)-DP.

    Args:
        canaries: m, canaries each included with probability 1/2.
        guesses: r, membership guesses made (the others abstained).
        correct: v, right guesses.
        epsilon, delta: the DP guarantee under test (the null hypothesis).

    Returns:
        the p-value, in [0, 1].
    """
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(
            f"need 0 <= correct ({correct}) <= guesses ({guesses}) <= canaries ({canaries})"
        )
    if epsilon < 0 or not 0 <= delta <= 1:
        raise ValueError(f"need epsilon >= 0 and 0 <= delta <= 1, got {epsilon}, {delta}")
    p = 1.0 / (1.0 + math.exp(-epsilon))  # the accuracy of epsilon-DP randomised response
    tail = float(stats.binom.sf(correct - 1, guesses, p))  # P[Bin(r, p) >= v]
    if delta == 0 or correct == 0:
        return min(1.0, tail)
    # P[v - i <= Bin < v] for i = 1..v, each divided by i: the worst "spread" of delta's mass
    below = stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, p)
    spread = float(np.max(np.cumsum(below) / np.arange(1, correct + 1)))
    return min(1.0, tail + 2 * canaries * delta * spread)


def epsilon_lower_bound(
    *, canaries: int, guesses: int, correct: int, delta: float, confidence: float = 0.95
) -> float:
    """The largest epsilon that ``correct`` right guesses reject at ``confidence``: the run's
    true epsilon (at ``delta``) is at least this, unless an event of probability at most
    1 - confidence happened.

    Args:
        canaries, guesses, correct: m, r, v as in ``audit_p_value``.
        delta: the delta of the guarantee under test (the run's).
        confidence: e.g. 0.95.

    Returns:
        epsilon >= 0 (0 when not even epsilon = 0 is rejected).
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    alpha = 1 - confidence

    def excess(eps: float) -> float:
        return (
            audit_p_value(
                canaries=canaries, guesses=guesses, correct=correct, epsilon=eps, delta=delta
            )
            - alpha
        )

    if excess(0.0) >= 0:
        return 0.0
    high = 1.0
    # the p-value rises with epsilon, to 1 at infinity (or stays below when v = r, delta = 0)
    while excess(high) < 0:
        high *= 2
        if high > 1e4:
            return math.inf
    root = float(optimize.brentq(excess, 0.0, high, xtol=1e-9, rtol=1e-12))
    # brentq may land just past the crossing: stay on the rejected side
    while root > 0 and excess(root) >= 0:
        root = max(0.0, root - 1e-9)
    return root


@dataclass(frozen=True)
class GuessOutcome:
    """The membership guesses of one (k+, k-) rule and what they prove.

    Attributes:
        guess_in, guess_out: k+ highest scores guessed included, k- lowest guessed excluded.
        guesses, correct: r = k+ + k- and the right ones, v.
        eps_lower_bound: the bound at the confidence this rule was given.
    """

    guess_in: int
    guess_out: int
    guesses: int
    correct: int
    eps_lower_bound: float


def score_guesses(
    scores: np.ndarray, included: np.ndarray, guess_in: int, guess_out: int
) -> tuple[int, int]:
    """Guess "in" for the ``guess_in`` highest scores and "out" for the ``guess_out`` lowest.

    Args:
        scores: one score per canary (higher: more likely included); ties are broken by index.
        included: the truth, one bool per canary.
        guess_in, guess_out: k+ and k- (k+ + k- <= m).

    Returns:
        (guesses made, right guesses).
    """
    m = len(scores)
    if guess_in < 0 or guess_out < 0 or guess_in + guess_out > m:
        raise ValueError(f"need k+ ({guess_in}) and k- ({guess_out}) >= 0 with k+ + k- <= m ({m})")
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    truth = np.asarray(included, dtype=bool)[order]
    right = int(truth[:guess_in].sum()) + int((~truth[m - guess_out :]).sum() if guess_out else 0)
    return guess_in + guess_out, right


def default_guess_rules(canaries: int) -> list[tuple[int, int]]:
    """The (k+, k-) rules an audit tries by default: 5 to 50% of the canaries guessed "in", with
    no "out" guesses or as many (an included canary that was never sampled looks excluded, so
    "out" guesses can only hurt when sampling is sparse)."""
    rules = []
    for share in (0.05, 0.1, 0.2, 0.3, 0.5):
        k = max(1, int(round(share * canaries)))
        rules += [(k, 0)] + ([(k, k)] if 2 * k <= canaries else [])
    return sorted(set(rules))


def best_guesses(
    scores: np.ndarray,
    included: np.ndarray,
    *,
    delta: float,
    confidence: float = 0.95,
    rules: Sequence[tuple[int, int]] | None = None,
) -> GuessOutcome:
    """The best lower bound over several guessing rules, each evaluated at confidence
    1 - (1 - confidence) / len(rules): by the union bound, the best one still holds at
    ``confidence`` (trying rules and reporting the best, uncorrected, would overstate it).

    Args:
        scores, included: one score and one truth per canary.
        delta: the run's delta.
        confidence: of the reported bound.
        rules: (k+, k-) pairs; default ``default_guess_rules(m)``.

    Returns:
        the rule with the highest bound (the first of equals), with its counts.
    """
    rules = list(rules) if rules else default_guess_rules(len(scores))
    each = 1 - (1 - confidence) / len(rules)
    best: GuessOutcome | None = None
    for k_in, k_out in rules:
        r, v = score_guesses(scores, included, k_in, k_out)
        bound = epsilon_lower_bound(
            canaries=len(scores), guesses=r, correct=v, delta=delta, confidence=each
        )
        outcome = GuessOutcome(k_in, k_out, r, v, bound)
        if best is None or outcome.eps_lower_bound > best.eps_lower_bound:
            best = outcome
    assert best is not None
    return best


def audit_ceiling(
    canaries: int,
    *,
    delta: float,
    confidence: float = 0.95,
    rules: Sequence[tuple[int, int]] | None = None,
) -> float:
    """The largest bound these guessing rules can give, every guess right: a claimed epsilon above it
    cannot be refuted by this audit, whatever the run does (the delta term 2 m delta caps it, so
    more canaries do not lift it past about 5.4 at delta = 1e-5).

    Args:
        canaries: m.
        delta, confidence, rules: as for ``best_guesses``.

    Returns:
        epsilon.
    """
    rules = list(rules) if rules else default_guess_rules(canaries)
    each = 1 - (1 - confidence) / len(rules)
    return max(
        epsilon_lower_bound(
            canaries=canaries,
            guesses=k_in + k_out,
            correct=k_in + k_out,
            delta=delta,
            confidence=each,
        )
        for k_in, k_out in rules
    )

"""Group privacy: what an example-level (epsilon, delta) guarantee promises a person with k images,
and the words that name a guarantee's privacy unit (one image, or one person).

An example-level DP-SGD run protects adding or removing *one* image. A person with k images in
the training set differs from the dataset without them by k such steps, and (epsilon, delta)-DP
chains over them (Dwork & Roth 2014, Theorem 2.2 for delta = 0; Vadhan 2017, Lemma 2.2 with
delta): if P[M(x_i) in S] <= e^eps P[M(x_{i+1}) in S] + delta for every neighbouring pair, then

    P[M(x_0) in S] <= e^(k eps) P[M(x_k) in S] + delta (1 + e^eps + ... + e^((k-1) eps)),

so M is (k eps, delta_k)-DP for groups of k, delta_k = delta sum_{i<k} e^(i eps) (at most the
textbook k e^((k-1) eps) delta). That is an *upper bound*: the true guarantee for the group may
be better, but it is all the example-level analysis promises. The run's epsilon(delta') curve
gives a choice of delta': ``best_group_bound`` searches it for the smallest k epsilon(delta')
whose delta_k meets the delta asked for.

A user-level run (each step samples people, and clips each person's summed gradient to C)
protects a person directly, whatever their number of images; its epsilon is that of q = people per
step / people. Everything here is pure arithmetic: no accountant, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from dpscale.choices import PRIVACY_UNITS
from dpscale.privacy.spelling import Spelling

UNITS = PRIVACY_UNITS  # the names live in dpscale.choices
GROUP_PRIVACY_SOURCE = "Dwork & Roth 2014, Thm 2.2; Vadhan 2017, Lemma 2.2"
# The smallest delta' a group-bound search tries with the RDP accountant (the PLD one stops at its
# PLD_MIN_DELTA, the smallest it resolves): RDP's epsilon(delta) is a closed form down to any delta.
RDP_MIN_DELTA = 1e-100


def search_floor(accountant: str) -> float:
    """The smallest delta' ``best_group_bound`` may try for a history composed by ``accountant``."""
    from dpscale.privacy.accounting.pld_history import PLD_MIN_DELTA

    return PLD_MIN_DELTA if accountant == "pld" else RDP_MIN_DELTA


GROUP_PRIVACY_LABEL = "group privacy: an upper bound, what the example-level guarantee promises; the true guarantee may be better"


def group_epsilon(*, epsilon: float, group_size: int) -> float:
    """Epsilon for a group of ``group_size`` examples: k * epsilon (group privacy).

    Args:
        epsilon: the example-level epsilon (>= 0).
        group_size: k, the examples one person holds (>= 1).

    Returns:
        k * epsilon.
    """
    _check_group(epsilon=epsilon, group_size=group_size)
    return group_size * epsilon


def group_delta(*, epsilon: float, delta: float, group_size: int) -> float:
    """Delta for a group of k examples: delta * (1 + e^eps + ... + e^((k-1) eps)) (group privacy).

    Computed in log space (e^(k eps) may overflow); at most k e^((k-1) eps) delta.

    Args:
        epsilon: the example-level epsilon (>= 0; inf gives inf).
        delta: the example-level delta, in [0, 1].
        group_size: k (>= 1).

    Returns:
        delta_k (may exceed 1: then the bound promises nothing; inf when it overflows).
    """
    _check_group(epsilon=epsilon, group_size=group_size)
    if not 0.0 <= delta <= 1.0:
        raise ValueError(f"delta must be in [0, 1], got {delta}")
    if delta == 0.0:
        return 0.0
    if epsilon == 0.0 or group_size == 1:
        return group_size * delta
    if math.isinf(epsilon):
        return math.inf
    k_eps = group_size * epsilon  # log of sum_{i<k} e^(i eps) = log(e^(k eps) - 1) - log(e^eps - 1)
    log_sum = k_eps + math.log1p(-math.exp(-k_eps)) - epsilon - math.log1p(-math.exp(-epsilon))
    log_delta = math.log(delta) + log_sum
    return math.exp(log_delta) if log_delta < 700.0 else math.inf


@dataclass(frozen=True)
class GroupBound:
    """A group-privacy guarantee for a person with ``group_size`` images.

    Attributes:
        group_size: k.
        epsilon: k * example_epsilon, the group's epsilon.
        delta: the group's delta, delta_k of ``group_delta``.
        example_epsilon: the run's (example-level) epsilon at ``example_delta``.
        example_delta: the delta' of the run's curve it was derived from.
    """

    group_size: int
    epsilon: float
    delta: float
    example_epsilon: float
    example_delta: float


def direct_group_bound(*, epsilon: float, delta: float, group_size: int) -> GroupBound:
    """The group bound straight from the run's (epsilon, delta): (k epsilon, delta_k).

    Args:
        epsilon: the run's epsilon at ``delta``.
        delta: the run's delta.
        group_size: k (>= 1).

    Returns:
        the GroupBound with example_delta = delta.
    """
    return GroupBound(
        group_size=group_size,
        epsilon=group_epsilon(epsilon=epsilon, group_size=group_size),
        delta=group_delta(epsilon=epsilon, delta=delta, group_size=group_size),
        example_epsilon=epsilon,
        example_delta=delta,
    )


def best_group_bound(
    *,
    epsilons_at: Callable[[Sequence[float]], Sequence[float]],
    target_delta: float,
    group_size: int,
    min_delta: float,
    rounds: int = 3,
    points: int = 16,
    extra_deltas: Sequence[float] = (),
) -> GroupBound | None:
    """The smallest group epsilon k * eps(delta') over the run's curve whose delta_k meets ``target_delta``.

    delta_k >= k delta', so a log-spaced grid over [min_delta, target_delta / k] is refined above its
    best point. Every candidate is checked with ``group_delta``: the answer always meets the target.

    Args:
        epsilons_at: the run's epsilon at each of several deltas (``PrivacyAccountant.epsilons``).
        target_delta: the group's delta, in (0, 1).
        group_size: k (>= 1).
        min_delta: the smallest delta' the accountant resolves (> 0).
        rounds: grid refinements (the first grid has 4 points per decade).
        points: points per refinement.
        extra_deltas: deltas' to try besides the grid (the run's own delta: then the answer is never
            worse than ``direct_group_bound`` where that meets the target).

    Returns:
        the GroupBound (delta = target_delta), or None when no delta' >= min_delta meets it.
    """
    if not 0.0 < target_delta < 1.0 or not min_delta > 0.0:
        raise ValueError(
            f"need 0 < min_delta and 0 < target_delta < 1, got {min_delta} and {target_delta}"
        )
    top = target_delta / group_size
    if top < min_delta:
        return None
    decades = math.log10(top / min_delta)
    grid = _log_grid(min_delta, top, max(2, math.ceil(4 * decades) + 1))
    grid = sorted({*grid, *(d for d in extra_deltas if min_delta <= d <= top)})
    best: tuple[float, float] | None = None  # (example_epsilon, example_delta)
    for _ in range(rounds):
        found = _best_feasible(grid, epsilons_at(grid), target_delta, group_size)
        if found is None:
            break
        if best is None or found[0] < best[0]:
            best = found
        above = [d for d in grid if d > found[1]]
        if not above:
            break
        grid = _log_grid(found[1], min(above), points + 2)[1:-1]
    if best is None:
        return None
    return GroupBound(group_size, group_size * best[0], target_delta, best[0], best[1])


def _log_grid(low: float, high: float, count: int) -> list[float]:
    """``count`` log-spaced deltas from ``low`` to ``high`` (both included when count >= 2)."""
    if count < 2 or low == high:
        return [high]
    step = math.log(high / low) / (count - 1)
    return [low * math.exp(i * step) for i in range(count - 1)] + [high]


def _best_feasible(
    deltas: Sequence[float], epsilons: Sequence[float], target_delta: float, group_size: int
) -> tuple[float, float] | None:
    """(epsilon, delta') of the smallest epsilon among the deltas' whose group delta meets the target."""
    feasible = [
        (float(e), d)
        for d, e in zip(deltas, epsilons)
        if group_delta(epsilon=float(e), delta=d, group_size=group_size) <= target_delta
    ]
    return min(feasible, key=lambda pair: (pair[0], -pair[1])) if feasible else None


def unit_text(unit: str, *, group_size: int | None = None) -> str:
    """Who a guarantee protects, in words: "any one training image", "any one person's k training
    images" (group privacy of an example-level run) or "any one person's training images (all of
    them together)" (a user-level run).

    Args:
        unit: "example" or "user".
        group_size: k, for an example-level guarantee read for a person with k images.

    Returns:
        the noun phrase, after "adding or removing".
    """
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
    if unit == "user":
        return "any one person's training images (all of them together)"
    if group_size is None or group_size == 1:
        return "any one training image"
    return f"any one person's {group_size} training images"


def meaning(*, epsilon: float, delta: float, unit_words: str, replace_one: bool = False) -> str:
    """The guarantee in plain words, for the privacy unit ``unit_words`` (``unit_text``).

    With unit_words = unit_text("example") it is word for word ``DPPlan.meaning`` of a private run.

    Args:
        epsilon: the guarantee's epsilon.
        delta: its delta.
        unit_words: who it protects.
        replace_one: the guarantee is under replace-one adjacency (fixed-size or shuffled batches):
            "replacing ... by another" instead of "adding or removing".

    Returns:
        "What it means: adding or removing ... except with probability delta = ...".
    """
    factor = math.exp(min(epsilon, 700.0))  # beyond, a float overflows (and means nothing)
    factor_text = f"{factor:.3g}" if factor < 1e6 else f"{factor:.1e}"
    return (
        f"What it means: {'replacing' if replace_one else 'adding or removing'} {unit_words}"
        f"{' by another' if replace_one else ''} changes the probability of any outcome of "
        f"training (the model's weights and all computed from them) by at most a factor e^epsilon = {factor_text}, "
        f"except with probability delta = {delta:g}."
    )


def check_privacy_unit(
    unit: str,
    max_examples_per_user: int | None,
    *,
    sampling: str,
    simulated: bool,
    spell: Spelling | None = None,
) -> None:
    """Refuse a privacy unit a plan cannot describe, in one line (config validation and
    ``make_dp_plan`` both ask here).

    Args:
        unit: data.privacy_unit; max_examples_per_user: dp.max_examples_per_user (k).
        sampling: dp.sampling; simulated: the plan is a TAN simulation.
        spell: the door's words for the settings (default: the config's).

    Raises:
        ConfigError: an unknown unit, k without the user unit or missing with it, or a sampling
            or TAN simulation the user unit does not cover.
    """
    from dpscale.errors import ConfigError  # torch-free, as this module
    from dpscale.privacy.spelling import CONFIG

    spell = spell or CONFIG
    if unit not in UNITS:
        raise ConfigError(f"data.privacy_unit must be one of {', '.join(UNITS)}, got {unit!r}")
    if unit == "example":
        if max_examples_per_user is not None:
            raise ConfigError(
                "dp.max_examples_per_user bounds a user's examples: it needs data.privacy_unit=user"
            )
        return
    k = max_examples_per_user
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(
            f"data.privacy_unit=user needs dp.max_examples_per_user, an integer >= 1, got {k!r}"
        )
    if sampling != "poisson":
        unit_said = "PerUser" if spell.typed_names else "data.privacy_unit=user"
        raise spell.refusal(
            f"{unit_said} samples users by Poisson sampling: use {spell.said('sampling', 'poisson')}"
        )
    if simulated:
        raise spell.refusal(
            f"a TAN simulation ({spell.key('simulated_batch_size')}) runs at the example unit only"
        )


def _check_group(*, epsilon: float, group_size: int) -> None:
    if int(group_size) != group_size or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size}")
    if not epsilon >= 0.0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")

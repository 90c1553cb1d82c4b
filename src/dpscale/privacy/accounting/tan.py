"""Total Amount of Noise (TAN), Sander et al. 2023 ("TAN without a burn").

eta^2 = q^2 S / (2 sigma^2)  (Definition 3.1; TAN is 1 / eta), and the closed form
eps_TAN = eta^2 + 2 eta sqrt(log(1/delta))  (equation 4). eps_TAN approximates the
RDP epsilon only for sigma >= 2 (the "privacy wall"); it is a planning aid, never the
reported guarantee.

Three ways of moving (q, sigma, S) that this module makes exact:

* **Simulation at constant eta_step** (Section 3.4): a run at (B_ref, sigma_ref, S) is
  predicted by a cheap run at B < B_ref with sigma = sigma_ref * B / B_ref and the same S.
  The noise on the averaged update, sigma * C / B, is unchanged, so the optimisation sees the
  same noise; the cheap run's own epsilon is much larger (it carries no useful guarantee).
* **Privacy-parameter search at constant eta** (Section 4.3): at fixed sigma, (B, S) ->
  (B / sqrt(m), m S) keeps q^2 S, hence eta and eps_TAN; the learning rate is scaled by 1/m.
* **More data** (Section 4.4, Table 5): N -> beta N at fixed (B, sigma, S) divides q and eta
  by beta (and TAN divides delta by beta too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Below this noise multiplier eps_TAN under-estimates epsilon badly (TAN Section 3.2).
PRIVACY_WALL_SIGMA = 2.0
# The wall warning fires when the accountant's epsilon exceeds eps_TAN by more than this factor.
PRIVACY_WALL_EXCESS = 1.10


def tan_eta(sample_rate: float, noise_multiplier: float, steps: int) -> float:
    """Individual signal-to-noise ratio eta = q sqrt(S) / (sqrt(2) sigma)."""
    if noise_multiplier <= 0:
        return math.inf
    return sample_rate * math.sqrt(steps) / (math.sqrt(2.0) * noise_multiplier)


def eta_step(sample_rate: float, noise_multiplier: float) -> float:
    """Per-step signal-to-noise ratio eta_step = q / (sqrt(2) sigma) (TAN Figure 4)."""
    if noise_multiplier <= 0:
        return math.inf
    return sample_rate / (math.sqrt(2.0) * noise_multiplier)


def total_amount_of_noise(sample_rate: float, noise_multiplier: float, steps: int) -> float:
    """TAN Sigma = 1 / eta."""
    eta = tan_eta(sample_rate, noise_multiplier, steps)
    return math.inf if eta == 0 else 1.0 / eta


def eps_tan_from_eta(eta: float, delta: float) -> float:
    """eps_TAN(eta) = eta^2 + 2 eta sqrt(log(1/delta)) (TAN equation 4)."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    return eta * eta + 2.0 * eta * math.sqrt(math.log(1.0 / delta))


def eta_for_eps_tan(epsilon: float, delta: float) -> float:
    """The eta whose eps_TAN is ``epsilon``: the positive root of eta^2 + 2 eta L - epsilon, L = sqrt(log 1/delta)."""
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon}")
    root_log = math.sqrt(math.log(1.0 / delta))
    return -root_log + math.sqrt(root_log * root_log + epsilon)


def eps_tan(sample_rate: float, noise_multiplier: float, steps: int, delta: float) -> float:
    """eps_TAN = eta^2 + 2 eta sqrt(log(1/delta)) (TAN equation 4)."""
    return eps_tan_from_eta(tan_eta(sample_rate, noise_multiplier, steps), delta)


def simulated_noise_multiplier(
    reference_noise: float, reference_batch_size: float, batch_size: float
) -> float:
    """sigma = sigma_ref * B / B_ref: the noise of a run at batch B with the reference's eta_step.

    q / sigma = (B / N) / (sigma_ref B / B_ref) = q_ref / sigma_ref, and the std of the noise on
    the averaged update, sigma C / B = sigma_ref C / B_ref, is the reference's.
    """
    if not (reference_batch_size > 0 and batch_size > 0):
        raise ValueError(f"batch sizes must be > 0, got {reference_batch_size} and {batch_size}")
    return reference_noise * batch_size / reference_batch_size


def privacy_wall_warning(
    epsilon: float, noise_multiplier: float, eps_tan_value: float
) -> str | None:
    """The "privacy wall" warning (TAN Section 3.2), or None.

    Fires when sigma < 2 and the accountant's epsilon exceeds eps_TAN by more than 10%: the same
    eta (so, TAN predicts, about the same accuracy) is reachable at a larger batch and sigma for
    much less privacy.
    """
    if (
        noise_multiplier <= 0
        or noise_multiplier >= PRIVACY_WALL_SIGMA
        or not math.isfinite(eps_tan_value)
    ):
        return None
    if epsilon <= PRIVACY_WALL_EXCESS * eps_tan_value:
        return None
    return (
        f"privacy wall: sigma={noise_multiplier:.3g} < {PRIVACY_WALL_SIGMA:g} makes epsilon={epsilon:.4g} "
        f"{epsilon / eps_tan_value:.2f}x eps_TAN={eps_tan_value:.4g}. Scaling the batch size and sigma up by the "
        "same factor (same steps) keeps eta_step, and so typically the accuracy, at a lower epsilon; see "
        "`dpscale tan wall` and `dpscale tan privacy-search`"
    )


@dataclass(frozen=True)
class PrivacySearchPair:
    """One (B, S) pair at the reference's sigma and eta (TAN Section 4.3).

    Attributes:
        steps_factor: m = S / S_ref.
        batch_size: expected batch size B = B_ref / sqrt(m) (Poisson sampling; need not be an integer).
        steps: S = m S_ref.
        noise_multiplier: sigma (unchanged).
        lr_scale: 1 / m = S_ref / S: TAN scales the learning rate inversely to S.
        sample_rate: q = B / N.
        eta: TAN eta (equal to the reference's).
    """

    steps_factor: float
    batch_size: float
    steps: int
    noise_multiplier: float
    lr_scale: float
    sample_rate: float
    eta: float


def privacy_search_pairs(
    dataset_size: int,
    batch_size: float,
    noise_multiplier: float,
    steps: int,
    steps_factors: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0),
) -> list[PrivacySearchPair]:
    """(B, S) pairs at fixed sigma and fixed eta (TAN Section 4.3, Tables 3-4).

    S = round(m S_ref) (at least 1) and then B = B_ref sqrt(S_ref / S), so eta is kept exactly even
    when m S_ref is not an integer; B is the expected batch size of Poisson sampling.

    Args:
        dataset_size: N.
        batch_size: reference expected batch size B_ref.
        noise_multiplier: sigma (kept fixed).
        steps: reference steps S_ref.
        steps_factors: the factors m on S (pairs whose B would exceed N are left out).

    Returns:
        pairs in the order of ``steps_factors``, duplicates (after rounding S) removed.
    """
    if not 0 < batch_size <= dataset_size:
        raise ValueError(f"need 0 < batch size <= N, got {batch_size} and N={dataset_size}")
    if steps < 1 or noise_multiplier <= 0:
        raise ValueError(f"need steps >= 1 and sigma > 0, got {steps} and {noise_multiplier}")
    pairs, seen = [], set()
    for factor in steps_factors:
        if not factor > 0:
            raise ValueError(f"steps factors must be > 0, got {factor}")
        new_steps = max(1, round(factor * steps))
        new_batch = batch_size * math.sqrt(steps / new_steps)
        if new_steps in seen or new_batch > dataset_size:
            continue
        seen.add(new_steps)
        q = new_batch / dataset_size
        pairs.append(
            PrivacySearchPair(
                steps_factor=new_steps / steps,
                batch_size=new_batch,
                steps=new_steps,
                noise_multiplier=noise_multiplier,
                lr_scale=steps / new_steps,
                sample_rate=q,
                eta=tan_eta(q, noise_multiplier, new_steps),
            )
        )
    return pairs


def wall_curve_points(
    eta: float, steps: int, noise_multipliers: tuple[float, ...]
) -> list[tuple[float, float]]:
    """(sigma, q) along a constant-eta curve at ``steps`` steps: q = sqrt(2) sigma eta / sqrt(S).

    Points where q would exceed 1 are left out.
    """
    points = []
    for sigma in noise_multipliers:
        q = math.sqrt(2.0) * sigma * eta / math.sqrt(steps)
        if 0 < q <= 1:
            points.append((sigma, q))
    return points

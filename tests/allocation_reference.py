"""An independent reference for random allocation's privacy (issue 65): the privacy loss of one
example, simulated. Each epoch of t steps releases t Gaussian sums; the example's unit gradient is in
one of them, uniformly at random (k = 1). With sensitivity 1 and noise sigma, the likelihood ratio of
an epoch's outputs o is mean_s exp((2 o_s - 1) / (2 sigma^2)), and epochs compose by adding the log
ratios. delta(eps) is E[(1 - e^(eps - L))_+] over the outputs with the example (remove) and
E[(1 - e^(eps + L))_+] over those without it (add); the larger is the mechanism's (the dominating
pair the accountants bound). Plain Monte Carlo, with an empirical-Bernstein bound (Maurer & Pontil
2009) on each mean, so a test can say at what confidence an accountant's epsilon holds."""

from __future__ import annotations

import math

import numpy as np


def _log_ratios(outputs: np.ndarray, sigma: float) -> np.ndarray:
    """log mean_s exp((2 o_s - 1) / (2 sigma^2)) along the last axis, summed over epochs (axis 1)."""
    z = (2.0 * outputs - 1.0) / (2.0 * sigma**2)
    top = z.max(axis=-1, keepdims=True)
    per_epoch = top[..., 0] + np.log(np.exp(z - top).mean(axis=-1))
    return per_epoch.sum(axis=1)


def _bernstein_upper(values: np.ndarray, confidence: float) -> float:
    """An upper bound on E[values] (each in [0, 1]) holding with probability ``confidence``."""
    n, log_term = values.size, math.log(2.0 / (1.0 - confidence))
    var = float(values.var(ddof=1))
    return (
        float(values.mean())
        + math.sqrt(2.0 * var * log_term / n)
        + 7.0 * log_term / (3.0 * (n - 1))
    )


def allocation_delta(
    epsilon: float,
    *,
    sigma: float,
    steps: int,
    epochs: int,
    samples: int,
    seed: int,
    confidence: float = 0.999,
) -> tuple[float, float]:
    """delta(epsilon) of k = 1 random allocation, simulated.

    Args:
        epsilon: where delta is read.
        sigma: the noise multiplier (sensitivity 1).
        steps: t, steps per epoch.
        epochs: how many epochs compose.
        samples: Monte-Carlo draws per direction.
        seed: the draws' seed.
        confidence: of the upper bound.

    Returns:
        (estimate, upper bound at ``confidence``), each the larger of the remove and add directions.
    """
    rng = np.random.default_rng(seed)
    noise = rng.normal(0.0, sigma, size=(2, samples, epochs, steps))
    present = noise[0]
    chosen = rng.integers(0, steps, size=(samples, epochs))
    np.put_along_axis(
        present, chosen[..., None], np.take_along_axis(present, chosen[..., None], -1) + 1.0, -1
    )
    remove = np.clip(1.0 - np.exp(epsilon - _log_ratios(present, sigma)), 0.0, None)
    add = np.clip(1.0 - np.exp(epsilon + _log_ratios(noise[1], sigma)), 0.0, None)
    estimates = [(float(v.mean()), _bernstein_upper(v, confidence)) for v in (remove, add)]
    return max(e for e, _ in estimates), max(u for _, u in estimates)

"""Total Amount of Noise (TAN), Sander et al. 2023 ("TAN without a burn").

eta^2 = q^2 S / (2 sigma^2)  (Definition 3.1; TAN is 1 / eta), and the closed form
eps_TAN = eta^2 + 2 eta sqrt(log(1/delta))  (equation 4). eps_TAN approximates the
RDP epsilon only for sigma >= 2 (the "privacy wall"); it is a planning aid, never the
reported guarantee.
"""

from __future__ import annotations

import math

# Below this noise multiplier eps_TAN under-estimates epsilon badly (TAN Section 3.2).
PRIVACY_WALL_SIGMA = 2.0


def tan_eta(sample_rate: float, noise_multiplier: float, steps: int) -> float:
    """Individual signal-to-noise ratio eta = q sqrt(S) / (sqrt(2) sigma)."""
    if noise_multiplier <= 0:
        return math.inf
    return sample_rate * math.sqrt(steps) / (math.sqrt(2.0) * noise_multiplier)


def total_amount_of_noise(sample_rate: float, noise_multiplier: float, steps: int) -> float:
    """TAN Sigma = 1 / eta."""
    eta = tan_eta(sample_rate, noise_multiplier, steps)
    return math.inf if eta == 0 else 1.0 / eta


def eps_tan(sample_rate: float, noise_multiplier: float, steps: int, delta: float) -> float:
    """eps_TAN = eta^2 + 2 eta sqrt(log(1/delta)) (TAN equation 4)."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    eta = tan_eta(sample_rate, noise_multiplier, steps)
    return eta * eta + 2.0 * eta * math.sqrt(math.log(1.0 / delta))

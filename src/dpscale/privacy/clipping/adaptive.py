"""Adaptive clipping (Andrew et al. 2021, "Differentially private learning with adaptive clipping").

The clipping norm C_t follows a target quantile gamma of the per-example gradient norms. At each
step, besides the noisy gradient sum, the mechanism releases a noisy count of the examples that
were *not* clipped:

    b~_t = ( sum_i (1[||g_i|| <= C_t] - 1/2) + N(0, sigma_b^2) ) / B + 1/2

(an example's term lies in [-1/2, 1/2], so the count has sensitivity 1/2 under adding or removing
one example, and dividing by the *expected* batch size B keeps it a function of the release), and
then moves geometrically towards the quantile:

    C_{t+1} = C_t * exp(-eta * (b~_t - gamma)).

C_{t+1} is a function of released values only (post-processing). The two releases of a step come
from the same Poisson sample, so together they are one Gaussian mechanism on the vector
(gradient sum / C_t, count / (1/2)) with noise multipliers sigma_grad and 2 sigma_b: its privacy
is that of one Gaussian mechanism with

    sigma^-2 = sigma_grad^-2 + (2 sigma_b)^-2          (Andrew et al., Theorem 1),

so the accountant records the plan's sigma as for DP-SGD, and the gradient gets the larger
sigma_grad = (sigma^-2 - (2 sigma_b)^-2)^(-1/2): the count's cost is paid in gradient noise,
and a calibrated sigma already includes it.

The optimizer takes the released mean in C_0's units, times C_0 / C_t (``normalised_update``): a
clipped gradient's norm and the noise (std sigma_grad C_t / B) both scale with C_t, so without it
the update grows and shrinks with C (C climbing 60x made training diverge, C collapsing stalled
it: docs/clipping.md). With it the step's scale is lr x C_0 whatever C_t does, as for fixed
clipping at C_0 (the noise std sigma_grad C_0 / B throughout), and C_t decides only which
examples are clipped. It multiplies released values by a released number: post-processing, the
accounting is unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dpscale.choices import CLIPPINGS
from dpscale.privacy.spelling import Spelling

# the plan imports this module and never needs torch (dpscale account loads without it)
if TYPE_CHECKING:
    from dpscale.rng import DPRandom


@dataclass(frozen=True)
class AdaptiveClipping:
    """The adaptive-clipping part of a DP plan.

    Attributes:
        quantile: gamma, the share of examples that should end up unclipped (0 < gamma < 1).
        learning_rate: eta, the geometric step of C per unit of quantile error (> 0).
        count_noise: sigma_b, the std of the Gaussian on the unclipped count (in examples; > 0).

    C_0 is the plan's max_grad_norm.
    """

    quantile: float
    learning_rate: float
    count_noise: float

    def __post_init__(self) -> None:
        if not 0 < self.quantile < 1:
            raise ValueError(
                f"adaptive clipping: dp.clip_quantile must be in (0, 1), got {self.quantile}"
            )
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(
                f"adaptive clipping: dp.clip_learning_rate must be > 0, got {self.learning_rate}"
            )
        if not (self.count_noise > 0 and math.isfinite(self.count_noise)):
            raise ValueError(
                f"adaptive clipping: dp.clip_count_noise must be > 0, got {self.count_noise}"
            )

    def gradient_noise_multiplier(self, sigma: float) -> float:
        """sigma_grad = (sigma^-2 - (2 sigma_b)^-2)^(-1/2), the gradient's share of the plan's sigma.

        Raises:
            ValueError: 2 sigma_b <= sigma (the count alone would spend the whole budget).
        """
        if sigma <= 0:
            return 0.0
        rest = sigma**-2 - (2 * self.count_noise) ** -2
        if rest <= 0:
            raise ValueError(
                f"adaptive clipping: the count noise sigma_b={self.count_noise:g} is too small for sigma={sigma:.5g} "
                f"(it needs 2 sigma_b > sigma, and about 10x more to cost little); raise dp.clip_count_noise"
            )
        return rest**-0.5

    def describe(self, sigma: float) -> str:
        return (
            f"adaptive clipping (Andrew et al. 2021): C follows quantile {self.quantile:g} "
            f"at eta={self.learning_rate:g}, count noise sigma_b={self.count_noise:g}, gradient sigma "
            f"{self.gradient_noise_multiplier(sigma):.5g}"
        )


def adaptive_refusal(spell: Spelling, clash: str) -> ValueError:
    """The one refusal of adaptive clipping where its accounting is not written (per-layer or
    per-tensor bounds, no clipping, BandMF, a TAN simulation), in the door's words.

    Args:
        spell: the door's ``Spelling``; clash: what it is asked with, in those words.
    """
    said = spell.said("clipping", "adaptive")
    lead = said if spell.typed_names else f"adaptive clipping ({said})"
    return spell.refusal(f"{lead} needs one starting norm C and DP-SGD; not with {clash}")


def adaptive_clipping(
    clipping: str,
    *,
    quantile: float,
    learning_rate: float,
    count_noise: float | None,
    batch_size: float,
) -> AdaptiveClipping | None:
    """The adaptive-clipping settings for ``clipping`` ("fixed": None).

    Args:
        clipping: "fixed" or "adaptive".
        quantile, learning_rate: gamma and eta.
        count_noise: sigma_b; None: B / 20, Andrew et al.'s recommendation (it then costs about
            0.1% more gradient noise at sigma ~ 1 and B in the thousands).
        batch_size: expected B.

    Raises:
        ValueError: an unknown ``clipping`` or out-of-range settings.
    """
    if clipping not in CLIPPINGS:
        raise ValueError(f"clipping must be one of {', '.join(CLIPPINGS)}, got {clipping!r}")
    if clipping != "adaptive":  # fixed C, or automatic clipping (the engines' clip_gamma)
        return None
    sigma_b = float(count_noise) if count_noise is not None else batch_size / 20
    return AdaptiveClipping(
        quantile=float(quantile), learning_rate=float(learning_rate), count_noise=sigma_b
    )


def noisy_unclipped_fraction(
    unclipped: float,
    examples: float,
    *,
    expected_batch_size: float,
    count_noise: float,
    generator: DPRandom,
) -> float:
    """b~: the released share of unclipped examples.

    Args:
        unclipped: examples of the logical batch whose norm was <= C_t (non-finite ones count as clipped).
        examples: examples in the logical batch.
        expected_batch_size: B.
        count_noise: sigma_b.
        generator: the mechanism's noise generator (one standard normal drawn).
    """
    import torch

    noise = float(generator.normal((1,), dtype=torch.float64)[0]) * count_noise
    return (unclipped - examples / 2 + noise) / expected_batch_size + 0.5


def normalised_update(gradient: dict[str, Any], clip: float, initial_clip: float) -> dict[str, Any]:
    """The released mean (noisy clipped sum / B, clipped to C_t) in C_0's units: times C_0 / C_t.

    Args:
        gradient: parameter name -> released mean gradient (tensors).
        clip: C_t, this step's clipping norm.
        initial_clip: C_0 (the plan's max_grad_norm).

    Returns:
        the same names, each tensor times C_0 / C_t.
    """
    ratio = initial_clip / clip
    return {name: value * ratio for name, value in gradient.items()}


def next_clip(clip: float, noisy_fraction: float, adaptive: AdaptiveClipping) -> float:
    """C_{t+1} = C_t * exp(-eta * (b~ - gamma))."""
    return clip * math.exp(-adaptive.learning_rate * (noisy_fraction - adaptive.quantile))

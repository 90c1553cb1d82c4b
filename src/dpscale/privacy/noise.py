"""Gaussian noise for DP-SGD, drawn from an injected 128-bit-seeded generator (``DPRandom``)."""

from __future__ import annotations

import torch

from dpscale.rng import DPRandom, require_dprandom

Params = dict[str, torch.Tensor]


def add_gaussian_noise(grad_sum: Params, std: float, generator: DPRandom) -> Params:
    """Return grad_sum + N(0, std^2 I), one independent draw per coordinate.

    Args:
        grad_sum: sum of clipped per-example gradients, by parameter name.
        std: noise standard deviation, sigma * C (0 returns the input unchanged).
        generator: the run's noise RNG (checkpointed for bit-exact resume). Draws are made on
            the host and copied to each gradient's device: the same noise on CPU and CUDA.

    Returns:
        a new dict; inputs are not modified.
    """
    if std < 0:
        raise ValueError(f"noise std must be >= 0, got {std}")
    if std == 0:
        return dict(grad_sum)
    require_dprandom(generator, "DP-SGD noise")
    noisy = {}
    # Sorted names make the draw order independent of dict construction order.
    for name in sorted(grad_sum):
        g = grad_sum[name]
        noise = generator.normal(g.shape, dtype=g.dtype, device=g.device)
        noisy[name] = g + std * noise
    return noisy

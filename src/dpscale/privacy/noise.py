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
    # Sorted names make the draw order independent of dict construction order.
    names = sorted(grad_sum)
    tensors = [grad_sum[name] for name in names]
    if len({(t.dtype, t.device) for t in tensors}) == 1:
        # One draw for the whole step, cut in parameter order: the host generator draws a large
        # block in parallel (see dpscale.rng.PARALLEL_CHUNK) and copies it to the device once.
        flat = generator.normal((sum(t.numel() for t in tensors),), dtype=tensors[0].dtype, device=tensors[0].device)
        noises = [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
    else:
        noises = [generator.normal(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    return {name: t + std * noise for name, t, noise in zip(names, tensors, noises)}

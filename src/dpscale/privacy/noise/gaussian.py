"""Gaussian noise for DP-SGD, drawn from an injected 128-bit-seeded generator (``DPRandom``)."""

from __future__ import annotations

import torch

from dpscale.rng import DPRandom, require_dprandom

# parameter name -> tensor: the one definition (per_example re-exports it)
Params = dict[str, torch.Tensor]


def draw_noise(like: Params, generator: DPRandom) -> Params:
    """Standard normals shaped like each tensor of ``like`` (its dtype and device), drawn in
    sorted-name order as one block: the draw ``add_gaussian_noise`` makes, available on its own
    so that a step can draw its noise while its gradient is being computed.

    Args:
        like: tensors by parameter name (only shapes, dtypes and devices are read).
        generator: the run's noise RNG (128-bit seeded, checkpointed).

    Returns:
        standard normal tensors by name.
    """
    require_dprandom(generator, "DP-SGD noise")
    # Sorted names make the draw order independent of dict construction order.
    names = sorted(like)
    tensors = [like[name] for name in names]
    if len({(t.dtype, t.device) for t in tensors}) == 1:
        # One draw for the whole step, cut in parameter order: the host generator draws a large
        # block in parallel (see dpscale.rng.PARALLEL_CHUNK) and copies it to the device once;
        # one operator cuts it into the tensors' shapes (a view each by hand was one per tensor).
        flat = generator.normal(
            (sum(t.numel() for t in tensors),), dtype=tensors[0].dtype, device=tensors[0].device
        )
        noises = list(torch._C._nn.unflatten_dense_tensors(flat, tensors))
    else:
        noises = [generator.normal(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    return dict(zip(names, noises))


def add_gaussian_noise(
    grad_sum: Params, std: float, generator: DPRandom, noise: Params | None = None
) -> Params:
    """Return grad_sum + N(0, std^2 I), one independent draw per coordinate.

    Args:
        grad_sum: sum of clipped per-example gradients, by parameter name.
        std: noise standard deviation, sigma * C (0 returns the input unchanged).
        generator: the run's noise RNG (checkpointed for bit-exact resume). Draws are made on
            the host and copied to each gradient's device: the same noise on CPU and CUDA.
        noise: standard normals already drawn by ``draw_noise(grad_sum, generator)`` (the same
            values it would draw now); None draws them here.

    Returns:
        a new dict; inputs are not modified.
    """
    if std < 0:
        raise ValueError(f"noise std must be >= 0, got {std}")
    if std == 0:
        return dict(grad_sum)
    noise = draw_noise(grad_sum, generator) if noise is None else noise
    names = sorted(grad_sum)
    return dict(
        zip(names, with_scaled_noise([grad_sum[n] for n in names], std, [noise[n] for n in names]))
    )


def with_scaled_noise(
    totals: list[torch.Tensor], std: float, noise: list[torch.Tensor]
) -> list[torch.Tensor]:
    """``totals[i] + std * noise[i]`` as new tensors, in two multi-tensor operators (the arithmetic
    of ``t + std * z`` tensor by tensor: the product rounded, then the sum); no input is written.

    Args:
        totals: clipped sums.
        std: noise standard deviation sigma * C (> 0).
        noise: standard normals shaped like ``totals``.

    Returns:
        the noisy sums.
    """
    return list(torch._foreach_add(totals, torch._foreach_mul(noise, std)))

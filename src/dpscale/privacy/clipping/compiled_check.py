"""Does a compiled step compute what the eager vmap engine does: the comparison each new shape's first chunk passes.

Its clipped sums, per-example norms and losses are compared with the eager engine's on the same
rows at ``tolerance_for``'s tolerance; where float32 results differ, with the float64 loop's (two
float32 computations may route a max-pool's gradient to different ones of two inputs within
rounding of each other, as the self-check allows for, ``dpscale.privacy.clipping.self_check``). A capture
that computes something else is then refused: torch 2.13's inductor with
``layout_optimization=False`` gave tramer-cifar-cnn's per-example conv weight gradients 1-1.5%
wrong (their norms right) at B = 4, which this comparison caught.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpscale.clip_norms import MaxGradNorm, clip_sensitivity
from dpscale.privacy.clipping.per_example import RELATIVE_ERROR_FLOOR, Batch, LossFn, tolerance_for
from dpscale.privacy.noise.gaussian import Params
from dpscale.privacy.clipping.reference import float64_reference

Result = tuple[Params, torch.Tensor, torch.Tensor]  # (clipped sums, norms (B,), losses (B,))


def capture_mismatch(
    got: Result,
    want: Result,
    *,
    model: nn.Module,
    params: Params,
    kept: Batch,
    max_grad_norm: MaxGradNorm,
    loss_fn: LossFn,
    views: int,
    clip_gamma: float | None,
) -> str:
    """What differs between a capture's results and the eager engine's on the same rows ("" if
    nothing), or, where float32 results differ, between the capture's and the float64 loop's.

    Args:
        got: the capture's results on the rows ``kept``; want: the eager vmap engine's.
        model, params, kept: the model, its trainable tensors and the rows (x, y) compared.
        max_grad_norm, loss_fn, views, clip_gamma: the engine's settings, for the float64 loop.

    Returns:
        each difference beyond the tolerance, named with its relative size, joined by "; ".
    """
    scale = release_scale(want[1], clip_sensitivity(max_grad_norm), clip_gamma)
    differs = _differences(got, want, _sizes(want[0], scale), got[1].dtype)
    if not differs or got[1].dtype != torch.float32:
        return differs
    options: dict[str, Any] = {
        "loss_fn": loss_fn,
        "views": views,
        "names": list(params),
        "clip_gamma": clip_gamma,
    }
    exact = float64_reference(model, kept, max_grad_norm, **options)
    sizes = _sizes(exact.clipped_sum, scale, exact.clipped_norm_sums)
    return _differences(got, (exact.clipped_sum, exact.norms, want[2]), sizes, torch.float32)


def release_scale(norms: torch.Tensor, sensitivity: float | None, gamma: float | None) -> float:
    """A bound on the sum of the examples' clipped norms (a clipped sum's size without
    cancellation, the scale of float32's reordering): min(norm, C) each, C each with automatic
    clipping (which scales every norm to below C), the norms themselves without clipping."""
    finite = norms.detach().double()
    finite = finite[torch.isfinite(finite)]
    if sensitivity is None:
        return float(finite.sum())
    return (
        sensitivity * finite.numel()
        if gamma is not None
        else float(finite.clamp(max=sensitivity).sum())
    )


def _differences(got: Result, want: Result, sizes: dict[str, float], dtype: torch.dtype) -> str:
    """What differs between the compiled and the expected results beyond ``tolerance_for(dtype)``
    ("" if nothing): norms and losses relative to themselves (floored at a share of the largest),
    each clipped sum relative to its size in ``sizes`` (``_sizes``)."""
    tol = tolerance_for(dtype)
    found = []
    for what, a, b in (("norms", got[1], want[1]), ("losses", got[2], want[2])):
        a, b = a.detach().double(), b.detach().double()
        if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
            found.append(f"{what}: not finite in different rows")
            continue
        finite = torch.isfinite(b)
        a, b = a[finite], b[finite]
        floor = RELATIVE_ERROR_FLOOR * float(b.abs().max()) if b.numel() else 0.0
        error = (
            float(((a - b).abs() / b.abs().clamp(min=floor + 1e-300)).max()) if b.numel() else 0.0
        )
        if error > tol:
            found.append(f"{what} {error:.2g}")
    for name, g in want[0].items():
        error = float(torch.linalg.vector_norm((got[0][name] - g).double()))
        if error > tol * sizes[name]:
            found.append(f"clipped sum of {name} {error / max(sizes[name], 1e-300):.2g}")
    return "; ".join(found)


def _sizes(
    sums: Params, scale: float, norm_sums: dict[str, float] | None = None
) -> dict[str, float]:
    """Each clipped sum's size, the measure of its error: its norm, or the sum of its examples'
    clipped norms where known (``norm_sums``: its size without cancellation), floored at a share of
    the whole step's ``scale`` (``release_scale``) so that a sum that cancels to nearly zero is not
    judged by its float noise; a parameter's own size, so that an error in one small tensor of a
    large model (a capture that permutes a weight's gradient) is not lost in the step's."""
    floor = RELATIVE_ERROR_FLOOR * scale
    known = norm_sums or {}
    return {
        name: max(float(torch.linalg.vector_norm(g.double())), known.get(name, 0.0), floor)
        for name, g in sums.items()
    }

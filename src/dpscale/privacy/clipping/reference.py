"""DP-SGD's clipped sum by its definition: one example at a time, plain autograd.

For each example alone: forward pass, loss (the mean over its views with augmentation
multiplicity), backward pass, the norm of its whole gradient, clipped to C, summed. Every clipping
engine (vmap, ghost, bk) is judged against this, at start-up by ``dpscale.privacy.clipping.self_check`` and
in the tests, so it must share none of their code paths: no hooks, no ``torch.func``/vmap, no
per-layer records, nothing batched across examples.

``per_example_reference`` runs the model it is given (its dtype, its train/eval mode: the caller
picks the function to compare); ``float64_reference`` runs a float64 copy, for comparisons that
must not depend on the CPU's float32 kernels.
"""

from __future__ import annotations

import math
from copy import deepcopy
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Mapping, Sequence, cast

import torch
from torch import nn

from dpscale.privacy.clipping.bounds import clip_dtype, clip_margin
from dpscale.clip_norms import MaxGradNorm
from dpscale.privacy.clipping.per_example import (
    Batch,
    LossFn,
    mean_over_views,
    per_example_cross_entropy,
)
from dpscale.privacy.clipping.bounds import CLIP_EPS
from dpscale.privacy.noise.gaussian import Params
from dpscale.privacy.clipping.precision import FP32, Precision, at_least_fp32


@dataclass(frozen=True)
class PerExampleReference:
    """The per-example loop's results for B examples.

    Attributes:
        clipped_sum: sum over the examples of each clipped per-example gradient, by parameter name
            (in the parameter's own dtype, or float32 for a 16-bit one).
        norms: (B,) float64, each example's gradient norm before clipping.
        layer_sq_norms: (B,) float64 by layer (the parameter name less its last part; "" for a
            parameter of the root module): the squared norm of that layer's share of each gradient.
        clipped_norm_sums: by parameter, the sum over the examples of the norm of its clipped
            gradient (the clipped sum's size without cancellation).
        clipped_max_abs: by parameter, 0-d float64: the largest absolute entry of its clipped
            gradient over the examples (the scale of one example's contribution).
    """

    clipped_sum: Params
    norms: torch.Tensor
    layer_sq_norms: dict[str, torch.Tensor]
    clipped_norm_sums: dict[str, float]
    clipped_max_abs: dict[str, torch.Tensor]


def per_example_reference(
    model: nn.Module,
    batch: Batch,
    max_grad_norm: MaxGradNorm,
    *,
    loss_fn: LossFn = per_example_cross_entropy,
    views: int = 1,
    names: list[str] | None = None,
    precision: Precision = FP32,
    release_dtype: torch.dtype | None = None,
    unit_offsets: Sequence[int] | torch.Tensor | None = None,
    clip_gamma: float | None = None,
) -> PerExampleReference:
    """Clipped sum and per-example norms of ``model`` on ``batch``, one batch-of-one backward
    pass per example, through the model as it is (dtype and train/eval mode unchanged; no
    gradient is left in ``.grad``). With ``unit_offsets`` the privacy unit is a user: the
    gradients of a user's examples are summed, and that sum is clipped as one vector.

    Args:
        model: the model; a trainable parameter that does not reach an example's loss has a zero
            gradient for it.
        batch: (x, y); x is (B, ...), or (B, K, ...) with K = ``views`` > 1.
        max_grad_norm: C, the clipping norm (the factor is min(1, C (1 - m) / (norm + CLIP_EPS)),
            m the engines' margin for rounding, ``clip_margin``), or a per-layer mapping
            pattern -> C_g; None: no clipping.
        loss_fn: per-example loss (logits, targets) -> (B,).
        views: augmentation multiplicity K: an example's loss is the mean over its K views.
        names: the parameters to differentiate (default: those with requires_grad).
        precision: the forward pass in this precision (autocast) and, for fp16, its fixed loss
            scale, undone on the gradients, so that a 16-bit engine is judged on its own arithmetic.
        release_dtype: the type the judged engine clips in, whose margin m applies (default: the
            gradients' type, float32 or wider).
        unit_offsets: (m + 1,) unit j (a user) holds examples ``offsets[j]:offsets[j + 1]`` of the
            batch (default: every example its own unit).
        clip_gamma: automatic clipping: the factor is C (1 - m) / (norm + gamma), uncapped (Bu et
            al. 2023); None: clip to C.

    Returns:
        the ``PerExampleReference``, its norms and layer norms per unit.
    """
    live: Params = dict(model.named_parameters())
    names = [n for n, p in live.items() if p.requires_grad] if names is None else list(names)
    x, y = batch
    count = x.shape[0]
    total = {n: torch.zeros_like(live[n]) for n in names}
    norm_sums = {n: 0.0 for n in names}
    max_abs = {n: torch.zeros((), dtype=torch.float64, device=live[n].device) for n in names}
    norms: list[torch.Tensor] = []
    layer_sq: dict[str, list[float | torch.Tensor]] = {}  # per layer, each unit's squared norm
    bounds = range(count + 1) if unit_offsets is None else [int(o) for o in unit_offsets]
    count = len(bounds) - 1
    for i in range(count):
        grads = _unit_gradients(
            model,
            live,
            names,
            (x[bounds[i] : bounds[i + 1]], y[bounds[i] : bounds[i + 1]]),
            loss_fn,
            views,
            precision,
        )
        for n, g in zip(names, grads):
            layer_sq.setdefault(n.rpartition(".")[0], [0.0] * count)[i] += g.double().square().sum()
        # a sum of tensors (cast: without parameters it is the int 0, which torch.sqrt refuses)
        norm = torch.sqrt(cast(torch.Tensor, sum(g.double().square().sum() for g in grads)))
        margin = clip_margin(release_dtype or (grads[0].dtype if grads else torch.float32))
        factors = _reference_factors(
            dict(zip(names, grads)), float(norm), max_grad_norm, margin, clip_gamma
        )
        for n, g in zip(names, grads):
            factor = factors[n]
            total[n] += factor * g
            norm_sums[n] += factor * float(g.double().norm())
            if g.numel():  # (abs is exact: the largest entry times the factor, in float64)
                max_abs[n] = torch.maximum(max_abs[n], g.abs().max().double() * factor)
        norms.append(norm)
    per_layer = {
        layer: torch.stack([torch.as_tensor(v) for v in sq]) for layer, sq in layer_sq.items()
    }
    empty = torch.zeros(0, dtype=torch.float64)
    return PerExampleReference(
        total, torch.stack(norms) if norms else empty, per_layer, norm_sums, max_abs
    )


def _reference_factors(
    grads: dict[str, torch.Tensor],
    norm: float,
    max_grad_norm: MaxGradNorm,
    margin: float,
    gamma: float | None = None,
) -> dict[str, float]:
    """One example's clip factor for each parameter, written out in float64 Python arithmetic
    (independently of the engines' ``clip_units``): min(1, C (1 - m) / (||g|| + CLIP_EPS)), or per
    layer min(1, C_g (1 - m) / (||g restricted to group g|| + CLIP_EPS)), the group the first
    matching pattern, m = ``margin``; with automatic clipping (``gamma``) C (1 - m) / (||g|| + gamma)."""
    if max_grad_norm is None:
        return {n: 1.0 for n in grads}

    def scale(limit: float, size: float) -> float:
        return limit / (size + gamma) if gamma is not None else min(1.0, limit / (size + CLIP_EPS))

    if not isinstance(max_grad_norm, Mapping):
        return {n: scale(float(max_grad_norm) * (1 - margin), norm) for n in grads}
    group = {n: next(p for p in max_grad_norm if fnmatchcase(n, p)) for n in grads}
    group_sq = {p: 0.0 for p in max_grad_norm}
    for n, g in grads.items():
        group_sq[group[n]] += float(g.double().square().sum())
    bound = {p: float(c) * (1 - margin) for p, c in max_grad_norm.items()}
    return {n: scale(bound[group[n]], math.sqrt(group_sq[group[n]])) for n in grads}


def _example_gradients(
    model: nn.Module,
    live: Params,
    names: list[str],
    example: Batch,
    loss_fn: LossFn,
    views: int,
    precision: Precision,
) -> list[torch.Tensor]:
    """One example's gradient of each parameter in ``names`` (zeros where it does not reach the
    loss), detached, float32 or wider, the loss scale undone."""
    x, y = example
    with precision.forward(x.device):
        loss = at_least_fp32(mean_over_views(loss_fn, model, x, y, views)[0])
    if loss.requires_grad:  # scaled by fp16's fixed loss scale, undone on the gradients
        raw = torch.autograd.grad(
            loss * precision.loss_scale, [live[n] for n in names], allow_unused=True
        )
        grads: list[torch.Tensor | None] = [
            None if g is None else at_least_fp32(g) / precision.loss_scale for g in raw
        ]
    else:  # no trainable parameter reaches the loss
        grads = [None] * len(names)
    return [torch.zeros_like(live[n]) if g is None else g.detach() for n, g in zip(names, grads)]


def _unit_gradients(
    model: nn.Module,
    live: Params,
    names: list[str],
    unit: Batch,
    loss_fn: LossFn,
    views: int,
    precision: Precision,
) -> list[torch.Tensor]:
    """The sum of a unit's examples' gradients, each example's taken alone (a batch of one)."""
    x, y = unit
    total = [torch.zeros_like(at_least_fp32(live[n])) for n in names]
    for j in range(x.shape[0]):
        for t, g in zip(
            total,
            _example_gradients(
                model, live, names, (x[j : j + 1], y[j : j + 1]), loss_fn, views, precision
            ),
        ):
            t += g
    return total


def float64_copy(model: nn.Module, batch: Batch) -> tuple[nn.Module, Batch]:
    """A float64 deep copy of ``model`` and ``batch`` (integer inputs, e.g. tokens, and the
    labels unchanged); ``model`` itself is untouched.

    Raises:
        whatever ``copy.deepcopy`` raises for a model that cannot be copied.
    """
    x, y = batch
    return deepcopy(model).double(), (x.double() if x.is_floating_point() else x, y)


def float64_reference(
    model: nn.Module, batch: Batch, max_grad_norm: MaxGradNorm, **options
) -> PerExampleReference:
    """``per_example_reference`` on a float64 copy of ``model`` and ``batch`` (same mode; the
    parameters that require gradients in ``model``), for comparisons that must not depend on the
    float32 kernels a CPU picks for a batch of one.

    Args:
        model, batch, max_grad_norm, options: as for ``per_example_reference``; the margin is
            that of ``model``'s own type unless ``release_dtype`` is given.

    Returns:
        the ``PerExampleReference``, its tensors in float64.
    """
    copy, copied_batch = float64_copy(model, batch)
    # the margin of the engine being judged: it clips in the model's own type (float32 at least)
    options = {"release_dtype": clip_dtype(model.parameters()), **options}
    return per_example_reference(copy, copied_batch, max_grad_norm, **options)

"""What "clipping norm" means: one bound C on an example's whole gradient, or per-layer bounds.

Per-layer clipping splits the trainable parameters into groups by name pattern and clips each
example's gradient *within* each group to C_g. The clipped per-example gradient then has L2 norm
at most sqrt(sum_g C_g^2), the sensitivity that the noise std sigma * sensitivity is scaled to.

``max_grad_norm`` is therefore ``float`` (C), ``Mapping[str, float]`` (pattern -> C_g; a
parameter belongs to the first pattern, in the mapping's order, that ``fnmatch`` matches to its
name, e.g. ``{"features.*": 0.5, "*": 1.0}``) or None (no clipping, non-private runs only).

``max_grad_norm_per="tensor"`` (Opacus' ``clipping="per_layer"``, McMahan et al. 2018) clips
every tensor on its own instead: ``clip_bounds`` spells it out as one group per tensor, a mapping
literal name -> C_i (``per_tensor_bounds``), so that every engine, the plan and the reference
loop take it as they take any per-layer mapping; its sensitivity is sqrt(sum_i C_i^2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Iterable, Mapping, Sequence

import torch

from dpscale.clip_norms import (
    MaxGradNorm,
    check_clip_gamma,
    check_max_grad_norm,
    check_max_grad_norm_per,
    is_per_layer,
    literal_pattern,
)

# Added to norms before dividing so that a zero gradient gets factor 1, and so that
# the clipped norm norm * C / (norm + eps) stays strictly below C.
CLIP_EPS = 1e-6

# ---------------------------------------------------------------- the clip bound, by construction
#
# An example's released contribution is what the engine's arithmetic makes of c * g, not c * g
# itself: its norm is measured with rounding, the factor is rounded, and the release (a scaling,
# or a matmul / convolution / index_add accumulating an example's positions) rounds again. With
# u the unit roundoff of the type the clip arithmetic runs in (float32 in every train.precision:
# 16-bit gradients are taken to float32 first) and gamma_n = n u / (1 - n u) the standard bound
# on a sum of n rounded terms in any order (Higham, Accuracy and Stability, 3.1), dpscale clips to
#
#     factor = min(1, C (1 - m) / (B + CLIP_EPS)),   B = sqrt(sum_units (N_unit + s_unit)^2)
#
# N_unit the measured norm of a unit's (layer's / parameter's) gradient, s_unit >= 0 the slack of
# an accumulating release (``release_slack``), m the margin of ``clip_margin``: the released
# contribution is then <= C under the worst-case rounding of every kernel that satisfies the
# standard model (docs/precision.md derives it; tests/test_clip_bound.py shows each term is needed).

# Explicit per-example gradients are measured in blocks of at most this many values (a float32
# vector_norm per block, the blocks' squares summed in float64): see ``blocked_sq_norms``.
NORM_BLOCK = 4096
# Roundings allowed around one block's sum of squares: a scaled norm (x / s, then s * sqrt),
# the square, the sqrt, and the norm squared again.
_NORM_EXTRA_ROUNDINGS = 5
# float64 accumulations inside the bound (a unit's blocks, the units, the factor) are allowed up
# to this many terms (2^20 blocks of 4096: 4e9 values in one unit).
_FLOAT64_TERMS = 2**20


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: the largest relative error of one rounding in ``dtype`` (2^-24 for float32)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype) -> float:
    """gamma_n = n u / (1 - n u): relative bound on n successive roundings in ``dtype``."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"no rounding bound for {n} terms in {dtype} (n u >= 1)")
    return nu / (1 - nu)


def clip_margin(dtype: torch.dtype) -> float:
    """The relative margin m by which the clip arithmetic in ``dtype`` aims below C.

    Covers, with u = ``unit_roundoff(dtype)``: a measured squared norm as low as
    (1 - gamma_{NORM_BLOCK + 5}) of the exact one (blocked sums of squares), the factor's
    cast from float64 to ``dtype`` (1 + u), the release's scaling by it (1 + u), and the float64
    arithmetic of the bound and factor (gamma_{2^20} in float64). float32: m = 1.224e-4.

    Args:
        dtype: the type the norms, factor and release are computed in (float32 or float64).

    Returns:
        m in (0, 1): factors are min(1, C (1 - m) / (bound + CLIP_EPS)).
    """
    measured = math.sqrt(1 - gamma(NORM_BLOCK + _NORM_EXTRA_ROUNDINGS, dtype))
    arithmetic = (1 + unit_roundoff(dtype)) ** 2 * (1 + gamma(_FLOAT64_TERMS, torch.float64))
    return 1 - measured / arithmetic


def clip_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    """The type an engine's clip arithmetic (norms, factor, release) runs in for a model with
    these parameters: float64 for a float64 model, else float32 (16-bit gradients are taken to
    float32 first). Its ``clip_margin`` is the one that applies."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def release_slack(terms: int, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """How far an accumulating release can land from c * G, per unit of c: gamma_{terms+1} * W.

    A release sum_t fl(c g_t) a_t^T of ``terms`` products per entry (an example's positions and
    views, through a matmul, a convolution's weight gradient or an index_add) errs entrywise by at
    most gamma_{terms+1} c sum_t |g_t| |a_t|^T, whose Frobenius norm is at most
    gamma_{terms+1} c W with W = sum_t ||g_t|| ||a_t||. When the terms cancel (||G|| << W) this is
    far more than any relative margin: a contrived two-token model released 1.0000016 C on an
    AVX-512 CPU without it.

    Args:
        terms: products accumulated into each entry of one example's release.
        weight: W per example (B,), any float type.
        dtype: the type the release is computed in.

    Returns:
        (B,) float64 slack s, added to the unit's measured norm before clipping.
    """
    return gamma(terms + 1, dtype) * (weight if weight.dtype == torch.float64 else weight.double())


def blocked_sq_norms(t: torch.Tensor) -> torch.Tensor:
    """Per-example squared L2 norms of a (B, ...) tensor, without a squared temporary.

    torch's float32 ``vector_norm`` over millions of values underestimates the squared norm by
    up to ~6e-5 (measured on 2M values; an underestimate lets a clipped contribution exceed C),
    so norms are taken over blocks of at most ``NORM_BLOCK`` values and the blocks' squares
    summed in float64 (error ~1e-9, at ~1.1x the time): never below (1 - gamma_{NORM_BLOCK + 5})
    of the exact value, whatever the kernel's order of summation (``clip_margin`` covers it)."""
    blocks = block_norms(t)
    # one block (at most NORM_BLOCK values, within clip_margin's rounding): its square
    if blocks.shape[1] == 1:
        return blocks[:, 0].square()
    return blocks.square().sum(1, dtype=torch.float64).to(t.dtype)


def block_norms(t: torch.Tensor) -> torch.Tensor:
    """The L2 norms (B, n_blocks) of each example's values of a (B, ...) tensor in blocks of at most
    ``NORM_BLOCK`` (one block when it has no more), in ``t``'s type: ``blocked_sq_norms`` before its
    float64 sum of their squares."""
    size = math.prod(t.shape[1:])  # from the shape: ``t[0].numel()`` would launch an operator
    if size <= NORM_BLOCK:
        return torch.linalg.vector_norm(
            t if t.dim() == 2 else t.reshape(t.shape[0], -1), dim=1, keepdim=True
        )
    return torch.linalg.vector_norm(t.reshape(t.shape[0], -1, math.gcd(size, NORM_BLOCK)), dim=2)


def clip_factors(
    bounds: torch.Tensor,
    max_grad_norm: float | None,
    *,
    release_dtype: torch.dtype | None = None,
    gamma: float | None = None,
) -> torch.Tensor:
    """Per-example scale min(1, C (1 - m) / (bound + CLIP_EPS)), or with automatic clipping
    (``gamma``) C (1 - m) / (bound + gamma); all ones when ``max_grad_norm`` is None (no clipping).

    Args:
        bounds: per-example bounds on the release's norm (B,) (``clip_units``: float64).
        max_grad_norm: C, or None.
        release_dtype: the type the release is computed in, whose ``clip_margin`` m applies
            (default: the bounds' type).
        gamma: automatic clipping's stabiliser (Bu et al. 2023), > 0; None: clip to C.

    Returns:
        (B,) factors in the bounds' type.
    """
    if max_grad_norm is None:
        return torch.ones_like(bounds)
    margin = clip_margin(release_dtype or bounds.dtype)
    return _scale(max_grad_norm * (1 - margin), bounds, gamma, release_dtype or bounds.dtype)


def _scale(
    limit: float | torch.Tensor,
    bounds: torch.Tensor,
    gamma: float | None,
    release_dtype: torch.dtype,
) -> torch.Tensor:
    """limit / (bound + CLIP_EPS) capped at 1 (clip to the limit), or, automatic clipping, limit /
    (bound + gamma): every gradient is scaled to norm limit * bound / (bound + gamma) < limit.

    The automatic factor is capped at the largest finite value of ``release_dtype``: C / gamma
    can overflow it (C = 1e30, gamma = 1e-12), and inf times a zero gradient would release NaN. A
    smaller factor only shrinks the release, so the cap never raises a norm past the limit."""
    if gamma is None:
        return (limit / (bounds + CLIP_EPS)).clamp(max=1.0)
    # an engine made without a plan: the floor that keeps norms within gamma
    check_clip_gamma(gamma)
    return (limit / (bounds + gamma)).clamp(max=torch.finfo(release_dtype).max)


def group_clip_factors(
    bounds: Sequence[float],
    group_bounds: torch.Tensor,
    *,
    release_dtype: torch.dtype | None = None,
    gamma: float | None = None,
) -> torch.Tensor:
    """Per-group, per-example factors min(1, C_g (1 - m) / (bound_g + CLIP_EPS)), (G, B), from
    the groups' C_g and each group's per-example bound on its release's norm (G, B); m and
    ``gamma`` (automatic clipping: C_g (1 - m) / (bound_g + gamma)) as in ``clip_factors``."""
    column = group_bounds.new_tensor([float(c) for c in bounds]).unsqueeze(1)
    margin = clip_margin(release_dtype or group_bounds.dtype)
    return _scale(column * (1 - margin), group_bounds, gamma, release_dtype or group_bounds.dtype)


@dataclass(frozen=True)
class ClipGroups:
    """Per-layer clipping resolved against the trainable parameters.

    Attributes:
        norms: C_g of each group, in the mapping's order.
        group_of: parameter name -> index of its group.
    """

    norms: tuple[float, ...]
    group_of: dict[str, int]


def resolve_clip_groups(max_grad_norm: Mapping[str, float], names: Sequence[str]) -> ClipGroups:
    """Assign each trainable parameter to the first pattern that matches its name.

    Args:
        max_grad_norm: pattern -> C_g (``fnmatch`` patterns, matched against whole names such as
            "features.0.weight").
        names: the trainable parameters' names.

    Raises:
        ValueError: a parameter that no pattern matches, or a pattern that is left with no
            parameter (its C_g would add to the sensitivity, and so to the noise, for nothing):
            one that matches none, or one shadowed by earlier patterns that take all it matches.
    """
    patterns = list(max_grad_norm)
    group_of: dict[str, int] = {}
    for name in names:
        index = next((i for i, p in enumerate(patterns) if fnmatchcase(name, p)), None)
        if index is None:
            raise ValueError(
                f"per-layer max_grad_norm: no pattern of {patterns} matches trainable parameter {name!r}; "
                "add one (a last '*' catches the rest)"
            )
        group_of[name] = index
    unused = [p for i, p in enumerate(patterns) if i not in group_of.values()]
    if unused:
        raise ValueError(f"per-layer max_grad_norm: {_why_unused(unused, patterns, group_of)}")
    return ClipGroups(tuple(float(max_grad_norm[p]) for p in patterns), group_of)


def _why_unused(unused: list[str], patterns: list[str], group_of: dict[str, int]) -> str:
    """Why each pattern in ``unused`` has no parameter: it matches none (the trainable names are
    listed), or earlier patterns, tried first, take every parameter it matches (named)."""
    reasons, unmatched, shadowed = [], False, False
    for pattern in unused:
        matched = [n for n in group_of if fnmatchcase(n, pattern)]
        # earlier ones, in order
        takers = list(dict.fromkeys(repr(patterns[group_of[n]]) for n in matched))
        if takers:
            shadowed = True
            plural = len(takers) > 1
            reasons.append(
                f"pattern {pattern!r} is shadowed by the earlier pattern{'s' if plural else ''} {', '.join(takers)}, "
                f"which take{'' if plural else 's'} {_count(len(matched), 'parameter')} it matches"
            )
        else:
            unmatched = True
            reasons.append(f"pattern {pattern!r} matches no trainable parameter")
    why = " (an unused pattern's norm would raise the noise for nothing)"
    order = "; patterns are tried in order, the first match wins: put specific ones first, a catch-all '*' last"
    names = f"; trainable parameters: {list(group_of)}" if unmatched else ""
    return "; ".join(reasons) + why + (order if shadowed else "") + names


def _count(n: int, noun: str) -> str:
    """ "the 1 parameter" or "all 4 parameters", for the messages."""
    return f"the 1 {noun}" if n == 1 else f"all {n} {noun}s"


def per_tensor_bounds(
    max_grad_norm: float | Mapping[str, float], names: Sequence[str]
) -> dict[str, float]:
    """Each trainable tensor's own bound, as a per-layer mapping with one group per tensor.

    Args:
        max_grad_norm: C for every tensor, or pattern -> C (each tensor takes the C of the first
            pattern matching its name, as ``resolve_clip_groups``; the same refusals).
        names: the trainable parameters' names, in ``model.named_parameters()`` order.

    Returns:
        ``literal_pattern(name) -> C_i`` for each name in order: clipped as groups, each tensor is
        clipped on its own, and the sensitivity is sqrt(sum_i C_i^2).
    """
    if not is_per_layer(max_grad_norm):
        return {literal_pattern(n): float(max_grad_norm) for n in names}  # type: ignore[arg-type]
    groups = resolve_clip_groups(max_grad_norm, names)
    return {literal_pattern(n): groups.norms[groups.group_of[n]] for n in names}


def clip_bounds(max_grad_norm: MaxGradNorm, per: str, names: Sequence[str]) -> MaxGradNorm:
    """The ``max_grad_norm`` that engines and plans take for a bound and its form.

    Args:
        max_grad_norm: C, pattern -> C or None (no clipping).
        per: "group" (``max_grad_norm`` as given: one C on the whole gradient, or each pattern's
            tensors clipped together) or "tensor" (each tensor on its own: ``per_tensor_bounds``).
        names: the trainable parameters' names, in ``model.named_parameters()`` order.

    Returns:
        ``max_grad_norm`` itself for "group"; for "tensor" the mapping literal name -> C_i of
        ``per_tensor_bounds`` (its sensitivity, ``clip_sensitivity``, is sqrt(sum_i C_i^2)).

    Raises:
        ValueError: a bad ``per`` or bound (one line), and the refusals of ``resolve_clip_groups``.
    """
    check_max_grad_norm_per(per, max_grad_norm)
    if per == "group":  # as given (the plan checks it)
        return max_grad_norm
    check_max_grad_norm(max_grad_norm)
    if not names:
        raise ValueError("max_grad_norm_per='tensor': the model has no trainable tensor to clip")
    return per_tensor_bounds(max_grad_norm, names)  # type: ignore[arg-type]

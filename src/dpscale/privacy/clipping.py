"""What "clipping norm" means: one bound C on an example's whole gradient, or per-layer bounds.

Per-layer clipping (Opacus' list ``max_grad_norm``, McMahan et al. 2018) splits the trainable
parameters into groups by name pattern and clips each example's gradient *within* each group
to C_g. The clipped per-example gradient then has L2 norm at most sqrt(sum_g C_g^2), the
sensitivity that the noise std sigma * sensitivity is scaled to.

``max_grad_norm`` is therefore ``float`` (C), ``Mapping[str, float]`` (pattern -> C_g; a
parameter belongs to the first pattern, in the mapping's order, that ``fnmatch`` matches to its
name, e.g. ``{"features.*": 0.5, "*": 1.0}``) or None (no clipping, non-private runs only).
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Mapping, Sequence

import torch

from dpscale.clip_norms import (  # noqa: F401  (re-exported: the privacy core's names for them)
    MaxGradNorm,
    check_max_grad_norm,
    clip_sensitivity,
    describe_clip,
    is_per_layer,
)

# Added to norms before dividing so that a zero gradient gets factor 1, and so that
# the clipped norm norm * C / (norm + eps) stays strictly below C.
CLIP_EPS = 1e-6


def clip_factors(norms: torch.Tensor, max_grad_norm: float | None) -> torch.Tensor:
    """Per-example scale min(1, C / ||g_i||); all ones when ``max_grad_norm`` is None (no clipping)."""
    if max_grad_norm is None:
        return torch.ones_like(norms)
    return (max_grad_norm / (norms + CLIP_EPS)).clamp(max=1.0)


@dataclass(frozen=True)
class ClipGroups:
    """Per-layer clipping resolved against the trainable parameters.

    Attributes:
        norms: C_g of each group, in the mapping's order.
        group_of: parameter name -> index of its group.
    """

    norms: tuple[float, ...]
    group_of: dict[str, int]


def group_clip_factors(bounds: Sequence[float], group_sq_norms: torch.Tensor) -> torch.Tensor:
    """Per-group, per-example factors min(1, C_g / ||g_i,g||), (G, B), from the groups' bounds C_g
    and per-group squared norms (G, B)."""
    column = group_sq_norms.new_tensor([float(c) for c in bounds]).unsqueeze(1)
    return (column / (group_sq_norms.sqrt() + CLIP_EPS)).clamp(max=1.0)


def resolve_clip_groups(max_grad_norm: Mapping[str, float], names: Sequence[str]) -> ClipGroups:
    """Assign each trainable parameter to the first pattern that matches its name.

    Args:
        max_grad_norm: pattern -> C_g (``fnmatch`` patterns, matched against whole names such as
            "features.0.weight").
        names: the trainable parameters' names.

    Raises:
        ValueError: a parameter that no pattern matches, or a pattern that matches no parameter
            (its C_g would add to the sensitivity, and so to the noise, for nothing).
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
        raise ValueError(
            f"per-layer max_grad_norm: pattern(s) {unused} match no trainable parameter (their norms would "
            f"raise the noise for nothing); trainable parameters: {list(names)}"
        )
    return ClipGroups(tuple(float(max_grad_norm[p]) for p in patterns), group_of)

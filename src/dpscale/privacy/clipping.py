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

import math
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Mapping, Sequence, Union

import torch

MaxGradNorm = Union[float, Mapping[str, float], None]

# Added to norms before dividing so that a zero gradient gets factor 1, and so that
# the clipped norm norm * C / (norm + eps) stays strictly below C.
CLIP_EPS = 1e-6


def clip_factors(norms: torch.Tensor, max_grad_norm: float | None) -> torch.Tensor:
    """Per-example scale min(1, C / ||g_i||); all ones when ``max_grad_norm`` is None (no clipping)."""
    if max_grad_norm is None:
        return torch.ones_like(norms)
    return (max_grad_norm / (norms + CLIP_EPS)).clamp(max=1.0)


def is_per_layer(max_grad_norm: MaxGradNorm) -> bool:
    """Whether ``max_grad_norm`` gives per-layer (per-group) bounds."""
    return isinstance(max_grad_norm, Mapping)


def clip_sensitivity(max_grad_norm: MaxGradNorm) -> float | None:
    """The L2 bound on one example's clipped gradient: C, or sqrt(sum_g C_g^2) per layer; None
    without clipping."""
    if is_per_layer(max_grad_norm):
        return math.sqrt(sum(float(c) ** 2 for c in max_grad_norm.values()))  # type: ignore[union-attr]
    return None if max_grad_norm is None else float(max_grad_norm)  # type: ignore[arg-type]


def describe_clip(max_grad_norm: MaxGradNorm) -> str:
    """"C=1" or "C per layer {conv*: 0.5, fc*: 1} (sensitivity 1.118)" for plans and logs."""
    if not is_per_layer(max_grad_norm):
        return f"C={max_grad_norm:g}" if max_grad_norm is not None else "C=none"
    groups = ", ".join(f"{p}: {float(c):g}" for p, c in max_grad_norm.items())  # type: ignore[union-attr]
    return f"C per layer {{{groups}}} (sensitivity {clip_sensitivity(max_grad_norm):.6g})"


def check_max_grad_norm(max_grad_norm: Any) -> None:
    """Raise ValueError unless ``max_grad_norm`` is None, one positive number, or a non-empty
    mapping from name patterns (str) to positive numbers."""
    if max_grad_norm is None:
        return
    if is_per_layer(max_grad_norm):
        bad = {p: c for p, c in max_grad_norm.items() if not isinstance(p, str) or not _positive(c)}
        if max_grad_norm and not bad:
            return
        raise ValueError(
            "per-layer max_grad_norm maps parameter-name patterns to positive norms, e.g. "
            f"{{'conv*': 0.5, '*': 1.0}}; got {dict(max_grad_norm)!r}" + (f" (bad entries {bad!r})" if bad else "")
        )
    if not _positive(max_grad_norm):
        hint = " (a list is Opacus' per-layer form: give a mapping pattern -> C)" if isinstance(max_grad_norm, (list, tuple)) else ""
        raise ValueError(
            f"max_grad_norm must be one positive number C, the L2 bound on each example's whole gradient, or a "
            f"mapping from parameter-name patterns to per-layer bounds, got {max_grad_norm!r}{hint}; "
            "e.g. max_grad_norm=1.0 or max_grad_norm={'conv*': 0.5, '*': 1.0}"
        )


def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@dataclass(frozen=True)
class ClipGroups:
    """Per-layer clipping resolved against the trainable parameters.

    Attributes:
        norms: C_g of each group, in the mapping's order.
        group_of: parameter name -> index of its group.
    """

    norms: tuple[float, ...]
    group_of: dict[str, int]

    def factors(self, group_sq_norms: torch.Tensor) -> torch.Tensor:
        """Per-group, per-example factors (G, B) from per-group squared norms (G, B)."""
        bounds = group_sq_norms.new_tensor(self.norms).unsqueeze(1)
        return (bounds / (group_sq_norms.sqrt() + CLIP_EPS)).clamp(max=1.0)


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

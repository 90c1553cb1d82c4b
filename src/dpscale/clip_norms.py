"""The clipping-norm values of a config or ``make_private`` (``dp.max_grad_norm``): one number C,
or per-layer bounds pattern -> C_g (``dpscale.privacy.clipping`` has what clips with them).

Kept free of torch (like ``dpscale.choices``): the config validates these values, and loading a
config must not import torch.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Union

MaxGradNorm = Union[float, Mapping[str, float], None]


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



"""The clipping-norm values of a config or ``make_private`` (``dp.max_grad_norm``): one number C,
or per-layer bounds pattern -> C_g (``dpscale.privacy.clipping.bounds`` has what clips with them), and
the two forms a bound can take (``max_grad_norm_per``): per group of parameters, or per tensor.

Kept free of torch (like ``dpscale.choices``): the config validates these values, and loading a
config must not import torch.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping, TypeGuard, Union

from dpscale.errors import ConfigError

MaxGradNorm = Union[float, Mapping[str, float], None]

# "group": each pattern's tensors clipped together (one C on a float: the whole gradient);
# "tensor": every tensor clipped on its own (Opacus' clipping="per_layer").
MAX_GRAD_NORM_PER = ("group", "tensor")

# fnmatch's special characters, and a pattern made of plain characters and one-character
# classes ("[*]"): such a pattern matches exactly one name.
_SPECIAL = re.compile(r"([*?\[])")
_LITERAL = re.compile(r"(?:[^*?\[]|\[[*?\[]\])*")
# a per-tensor header lists each tensor up to this many; beyond, the count at each C
_LISTED_TENSORS = 12


def is_per_layer(max_grad_norm: MaxGradNorm) -> TypeGuard[Mapping[str, float]]:
    """Whether ``max_grad_norm`` gives per-layer (per-group) bounds."""
    return isinstance(max_grad_norm, Mapping)


def literal_pattern(name: str) -> str:
    """The fnmatch pattern that matches ``name`` and nothing else (``*``, ``?`` and ``[`` put in
    one-character classes)."""
    return _SPECIAL.sub(r"[\1]", name)


def is_per_tensor(max_grad_norm: MaxGradNorm) -> TypeGuard[Mapping[str, float]]:
    """Whether every group of a per-layer ``max_grad_norm`` is one tensor: each pattern a literal
    name (``literal_pattern``), which matches that tensor alone."""
    return is_per_layer(max_grad_norm) and all(_LITERAL.fullmatch(p) for p in max_grad_norm)


def check_same_tensors(max_grad_norm: MaxGradNorm, trainable: list[str]) -> None:
    """Refuse per-tensor bounds whose tensors are no longer the trainable ones.

    Args:
        max_grad_norm: the plan's C (per tensor: a mapping of literal tensor names).
        trainable: the names of the model's trainable tensors now.

    Raises:
        ValueError: a tensor frozen or unfrozen since the bounds were fixed.
    """
    if is_per_tensor(max_grad_norm) and set(trainable) != set(max_grad_norm):
        raise ValueError(
            "max_grad_norm_per='tensor' fixed one bound per trainable tensor when the mechanism was made, and the "
            f"trainable tensors have changed since (now {len(trainable)}, planned {len(max_grad_norm)}): freeze or "
            "unfreeze before make_private, or call it again"
        )


def clip_sensitivity(max_grad_norm: MaxGradNorm) -> float | None:
    """The L2 bound on one example's clipped gradient: C, or sqrt(sum_g C_g^2) per layer (per
    tensor: over the tensors); None without clipping."""
    if isinstance(max_grad_norm, Mapping):  # is_per_layer, spelled out so that the type narrows
        return math.sqrt(sum(float(c) ** 2 for c in max_grad_norm.values()))
    return None if max_grad_norm is None else float(max_grad_norm)


def describe_clip(max_grad_norm: MaxGradNorm) -> str:
    """ "C=1", "C per layer {conv*: 0.5, fc*: 1} (sensitivity 1.118)" or, when every group is one
    tensor, "C per tensor {conv1.weight: 0.5, ...} (8 tensors, sensitivity 2.236)" (beyond 12
    tensors, the count at each C), for plans and logs."""
    if not is_per_layer(max_grad_norm):
        return f"C={max_grad_norm:g}" if max_grad_norm is not None else "C=none"
    sensitivity = f"sensitivity {clip_sensitivity(max_grad_norm):.6g}"
    bounds = {p: float(c) for p, c in max_grad_norm.items()}
    if not is_per_tensor(max_grad_norm):
        return (
            f"C per layer {{{', '.join(f'{p}: {c:g}' for p, c in bounds.items())}}} ({sensitivity})"
        )
    if len(bounds) <= _LISTED_TENSORS:
        listed = ", ".join(f"{p}: {c:g}" for p, c in bounds.items())
        return f"C per tensor {{{listed}}} ({len(bounds)} tensors, {sensitivity})"
    # a deep model: how many tensors at each C (the plan's max_grad_norm has each one)
    counts = {c: sum(1 for v in bounds.values() if v == c) for c in bounds.values()}
    listed = ", ".join(f"{n} at {c:g}" for c, n in counts.items())
    return f"C per tensor ({len(bounds)} tensors: {listed}; {sensitivity})"


def check_max_grad_norm(max_grad_norm: Any) -> None:
    """Refuse a clipping norm that is neither None (no clipping), one positive number C, nor a
    non-empty mapping from name patterns (str) to positive numbers (per-layer C_g).

    Raises:
        ConfigError (a ValueError): a list (Opacus' per-layer form), a string, zero, a negative
            number, an empty mapping, in one line.
    """
    if max_grad_norm is None:
        return
    if is_per_layer(max_grad_norm):
        bad = {p: c for p, c in max_grad_norm.items() if not isinstance(p, str) or not _positive(c)}
        if max_grad_norm and not bad:
            return
        raise ConfigError(
            "per-layer max_grad_norm maps parameter-name patterns to positive norms, e.g. "
            f"{{'conv*': 0.5, '*': 1.0}}; got {dict(max_grad_norm)!r}"
            + (f" (bad entries {bad!r})" if bad else "")
        )
    if not _positive(max_grad_norm):
        listed = isinstance(max_grad_norm, (list, tuple))
        hint = (
            (
                " (a list is Opacus' clipping='per_layer' form: give a mapping pattern -> C with "
                "max_grad_norm_per='tensor', docs/clipping.md)"
            )
            if listed
            else ""
        )
        raise ConfigError(
            f"max_grad_norm must be one positive number C, the L2 bound on each example's whole gradient, or a "
            f"mapping from parameter-name patterns to per-layer bounds, got {max_grad_norm!r}{hint}; "
            "e.g. max_grad_norm=1.0 or max_grad_norm={'conv*': 0.5, '*': 1.0}"
        )


def check_max_grad_norm_per(per: Any, max_grad_norm: Any) -> None:
    """Raise ValueError unless ``per`` is one of ``MAX_GRAD_NORM_PER``, and "tensor" comes with a
    norm to give each tensor (not None).

    Args:
        per: the form of the bound ("group" or "tensor").
        max_grad_norm: the bound it applies to (checked by ``check_max_grad_norm``).
    """
    if per not in MAX_GRAD_NORM_PER:
        raise ValueError(
            f"max_grad_norm_per must be 'group' (each pattern's tensors clipped together; one C clips the whole "
            f"gradient) or 'tensor' (each tensor clipped on its own, Opacus' clipping='per_layer'), got {per!r}"
        )
    if per == "tensor" and max_grad_norm is None:
        raise ValueError(
            "max_grad_norm_per='tensor' clips each tensor to its norm: give max_grad_norm (C or a mapping)"
        )


def _positive(value: Any) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and value > 0
    )


# Automatic clipping scales a gradient g by C / (||g|| + gamma), up to C / gamma for a tiny one, so
# its release stays below C only if ||g|| is measured to within gamma. float32 does not measure it
# below its normal range: a square (or a ghost engine's Gram product) under 2^-126 rounds to a
# subnormal or 0, an absolute error up to 2^-150 each, so over P terms ||g|| can read up to
# sqrt(P 2^-150) short (8e-19 at P = 1e9; a gradient of entries 1e-24 reads 0). gamma = 1e-30 let
# such an example release 1.5e6 C, and below ~1e-38 C / gamma is inf in float32 and a zero gradient
# released NaN (issue 62). At the floor that error is a million times below gamma.
MIN_CLIP_GAMMA = 1e-12


def check_clip_gamma(gamma: float | None) -> None:
    """Refuse an automatic-clipping gamma that is not a finite number >= ``MIN_CLIP_GAMMA``
    (None: fixed clipping).

    Raises:
        ValueError: one line.
    """
    if gamma is not None and (
        isinstance(gamma, bool)
        or not isinstance(gamma, (int, float))
        or not MIN_CLIP_GAMMA <= gamma < math.inf
    ):
        raise ValueError(
            f"automatic clipping's gamma must be a positive number of at least {MIN_CLIP_GAMMA:g} (below it "
            f"float32 cannot measure a tiny gradient's norm to within gamma, docs/clipping.md), got {gamma!r}"
        )

"""The ghost engines' per-layer record, and the Gram numerics and method tuning its layer rules share.

A layer rule (``dpscale.privacy.clipping.ghost.rules``, ``dpscale.privacy.clipping.ghost.conv``) reads a layer's
``Record`` (its input, output gradient and views) to give the per-example squared norms, keeping
on the record what the clipped sum will need; the helpers here are common to several rules.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import nn

from dpscale.privacy.clipping.autotune import MethodTuner
from dpscale.privacy.clipping.autotune_timing import Candidate
from dpscale.privacy.clipping.bounds import NORM_BLOCK, block_norms, blocked_sq_norms
from dpscale.privacy.noise.gaussian import Params


@dataclass
class Record:
    """What one forward pass leaves behind for one layer."""

    module: nn.Module
    name: str
    trainable: dict[str, bool]  # local param name -> requires_grad
    inputs: torch.Tensor | None = None
    output: torch.Tensor | None = None
    out_grad: torch.Tensor | None = None
    calls: int = 0
    cache: dict[str, torch.Tensor] = field(default_factory=dict)
    # Augmentation multiplicity K: the forward pass sees K consecutive rows per example, and an
    # example's gradient is the sum over its rows (the 1/K of the mean loss is already in g).
    views: int = 1
    # ghost mode: weight norms from Gram matrices only (no per-example gradient materialised).
    gram_only: bool = False
    # Version counters of the recorded tensors right after the call: a later in-place change
    # (ReLU(inplace=True), z += y) would make the records describe another tensor.
    versions: tuple[int, int] = (0, 0)
    # Per-example slack (B,) of a release that accumulates an example's positions (a matmul,
    # convolution or index_add from the records, not from a cached per-example gradient): its
    # worst-case rounding, added to the layer's norm before clipping (``release_slack``). Only a
    # weight's release accumulates (biases, gains and the rest come from cached per-example
    # gradients, scaled): a layer clipped tensor by tensor adds it to its weight alone.
    slack: torch.Tensor | None = None
    # Each trainable parameter's per-example squared norms (B,) by local name, as the rule added
    # them into the layer's: per-tensor groups clip a layer's tensors on their own.
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    # Times the exact weight-norm methods of a layer the first time its shapes are seen (None: the
    # shape rule decides; see ``dpscale.privacy.clipping.autotune``).
    tuner: MethodTuner | None = None
    # The cached conv weight gradients' columns run (kh, kw, C_in) (channels-last patches), not the
    # weight's (C_in, kh, kw): the clipped sum is reordered.
    kernel_major: bool = False
    # Set by the engine: small cached per-example gradients (biases, norm layers' affine parameters)
    # leave their squared norms to one batched pass over every layer (``small_part``), listed in
    # ``deferred``; their squares then never enter the layer's norm here.
    defer: bool = False
    deferred: list[str] = field(default_factory=list)
    # ... and instantiated weight gradients their block norms (``cached_norms``): squared and added
    # in the same pass (the gradients themselves are released by their rule).
    squares: list[torch.Tensor] = field(default_factory=list)


def cached_norms(r: Record, local: str = "weight") -> torch.Tensor | None:
    """The squared norms (B,) of the instantiated per-example gradient ``r.cache[local]``; or, when
    the engine batches (``r.defer``), None: its block norms join ``r.squares``, which the engine
    squares and sums in float64 with every layer's (``blocked_sq_norms``' arithmetic, with its
    float32 squares exact in float64; four operators fewer a layer, issue 63)."""
    if not r.defer:
        return blocked_sq_norms(r.cache[local])
    r.squares.append(block_norms(r.cache[local]))
    return None


def part(r: Record, local: str, sq: torch.Tensor | None) -> torch.Tensor | None:
    """Keep parameter ``local``'s per-example squared norms (B,) on its layer's record, and
    return them (for the rule to add into the layer's)."""
    if sq is not None:  # None: left to the engine's batched pass (no parts are read then)
        r.parts[local] = sq
    return sq


def plus(total: torch.Tensor | None, sq: torch.Tensor | None) -> torch.Tensor | None:
    """``total + sq``, or the one that is not None (0 + sq is sq: one operator fewer per layer than
    starting from zeros, issue 63); None for a term left to the batched pass."""
    return sq if total is None else total if sq is None else total + sq


def or_zeros(
    r: Record, total: torch.Tensor | None, like: torch.Tensor, rows: int
) -> torch.Tensor | None:
    """A rule's squared norms ``total``; when it had no term, None if the batched pass adds its
    deferred ones (``small_part``), else (rows,) zeros of ``like``'s type."""
    return like.new_zeros(rows) if total is None and not (r.deferred or r.squares) else total


# The batched pass sums each layer's deferred squares with at most this many values per example, so
# that its float64 sum stays within the blocked norms' error (``blocked_sq_norms``, ``clip_margin``).
DEFERRED_MAX_VALUES = NORM_BLOCK


def small_part(r: Record, local: str) -> torch.Tensor | None:
    """The squared norms (B,) of the cached per-example gradient ``r.cache[local]``, kept as the
    parameter's part; or, when the engine batches (``r.defer``) and the layer's deferred values
    stay within ``DEFERRED_MAX_VALUES``, None: ``local`` joins ``r.deferred`` and the engine adds
    its squares, with every layer's, in a few operators (``ghost.GhostEngine``; issue 63)."""
    t = r.cache[local]
    taken = sum(math.prod(r.cache[name].shape[1:]) for name in r.deferred)
    if r.defer and taken + math.prod(t.shape[1:]) <= DEFERRED_MAX_VALUES:
        r.deferred.append(local)
        return None
    return part(r, local, blocked_sq_norms(t))


def per_example(r: Record, t: torch.Tensor) -> torch.Tensor:
    """Sum a per-row tensor (B*K, ...) over each example's K view rows -> (B, ...)."""
    return t if r.views == 1 else t.reshape(-1, r.views, *t.shape[1:]).sum(1)


def row_factors(r: Record, c: torch.Tensor) -> torch.Tensor:
    """Per-example clip factors (B,) repeated for each example's K view rows (B*K,)."""
    return c if r.views == 1 else c.repeat_interleave(r.views)


def gram_sq_norms(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """||sum_t g_t a_t^T||^2 per example from Gram matrices: sum over the leading dims of
    <a a^T, g g^T>, for a (..., L, d_in) and g (..., L, d_out), dims after the first summed;
    and W = sum_t ||a_t|| ||g_t|| (over groups: the root of their W^2 summed), float64, from
    which the release's slack follows.

    The Gram form cancels: when an example's per-position terms nearly cancel, float32 loses
    every digit (the review measured a norm read as ~0 and a released contribution of 3455 C).
    So the products run in float64 and a rigorous bound on their rounding error is added, which
    makes the result an upper bound of the exact squared norm (never an underestimate, so a
    clipped contribution never exceeds C): each Gram entry is off by at most
    gamma_d ||x_t|| ||x_s|| (d the inner dimension) and the final sum by gamma_{L^2} times its
    terms, so the error is at most ~(d_in + d_out + L^2) u W^2 with W = sum_t ||a_t|| ||g_t||,
    a relative 1e-11 in float64 where float32 would have needed 1e-3 to 4e-2."""
    a64, g64 = a.double(), g.double()
    # einsums: one operator each where transposes, matmuls and the sums were seven (issue 63)
    grams = (
        torch.einsum("...ld,...md->...lm", a64, a64),
        torch.einsum("...ld,...md->...lm", g64, g64),
    )
    gram = torch.einsum("b...lm,b...lm->b", *grams)
    # (B, ...)
    weight = torch.einsum(
        "...l,...l->...",
        torch.linalg.vector_norm(a64, dim=-1),
        torch.linalg.vector_norm(g64, dim=-1),
    )
    upper = upper_bound(gram, a.shape[-1] + g.shape[-1], a.shape[-2], weight).to(a.dtype)
    return upper, weight if weight.dim() == 1 else weight.square().reshape(len(gram), -1).sum(
        1
    ).sqrt()


def upper_bound(gram: torch.Tensor, inner: int, length: int, weight: torch.Tensor) -> torch.Tensor:
    """A float64 Gram squared norm (B,) plus the rigorous bound on its rounding error,
    2 (inner + L^2 + 4) u W^2 (W = ``weight``, summed over any group dims): never below the exact value."""
    unit = torch.finfo(torch.float64).eps / 2
    scale = 2.0 * (inner + length * length + 4) * unit
    # gram is within the term of the exact value, so gram + term is at least it even where the
    # computed gram is negative (no clamp needed); one operator for the term's product and sum,
    # rounded in float64, far inside its factor 2
    if weight.dim() == 1:
        return torch.addcmul(gram, weight, weight, value=scale)
    return gram + scale * weight.square().reshape(len(gram), -1).sum(1)


# Gram matrices are multiplied in float64 (see gram_sq_norms): on CPU about twice float32's cost.
FLOAT64_GRAM_COST = 2


def use_ghost(length: int, d_in: int, d_out: int, overhead: float = 0.0) -> bool:
    """Mixed rule: Gram matrices cost ~T^2 (d_in + d_out) float64 multiply-adds per example
    (+ ``overhead``), the explicit per-example gradient ~T d_in d_out; pick the cheaper."""
    return FLOAT64_GRAM_COST * length * length * (d_in + d_out) + overhead < length * d_in * d_out


# A Gram form's norm is inflated by its float32 release's worst-case rounding, gamma_{L+1} W
# (``release_slack``): ~1e-5 W at 256 positions, 2e-4 W at an AugMult 3 x 32 x 32 (clipped sums 1e-3
# off the float64 loop on wrn16-4). The tuner offers Gram forms only up to this many positions per
# example (the rule's own choice stays), so that timing never trades accuracy for speed.
TUNED_GRAM_MAX_POSITIONS = 256


def accurate_enough(
    costs: dict[str, tuple[float, float]], rule: str, length: int
) -> dict[str, tuple[float, float]]:
    """``costs`` without the Gram forms the tuner may not take at ``length`` positions (bk mode)."""
    if length <= TUNED_GRAM_MAX_POSITIONS:
        return costs
    return {
        name: cost
        for name, cost in costs.items()
        if name == rule or name not in ("gram", "pixel-gram")
    }


def tuned(
    r: Record,
    signature: str,
    rule: str,
    costs: dict[str, tuple[float, float]],
    methods: dict[str, Callable],
    args: tuple,
    rows: tuple,
    sums: Callable,
    examples: int,
) -> str:
    """The method for ``r``'s weight: ``rule`` without a tuner, else the tuner's choice among the
    exact candidates (name -> (multiply-adds per example, Gram bytes for the chunk)), each timed as
    its norms plus the clipped sum on a scratch copy of the record (the record itself untouched)."""
    if r.tuner is None:
        return rule
    signature = f"{signature}|{args[0].device.type}"
    known = r.tuner.remembered(r.name, signature)
    if known is not None:  # the steps after the first: no candidates built
        return known

    def runner(name: str) -> Callable[[], Any]:
        def run() -> Any:
            scratch = replace(
                r,
                trainable={"weight": True},
                cache={},
                parts={},
                slack=None,
                tuner=None,
                kernel_major=False,
                defer=False,
                deferred=[],
                squares=[],
            )
            methods[name](scratch, *args)
            # made when timed (not on every chunk)
            return sums(scratch, *rows, args[0].new_ones(examples))

        return run

    candidates = [Candidate(name, macs, gram, runner(name)) for name, (macs, gram) in costs.items()]
    return r.tuner.choose(r.name, signature, args[0].device, rule, candidates, examples)


def cached_sums(
    r: Record, a: torch.Tensor | None, g: torch.Tensor | None, c: torch.Tensor
) -> Params:
    """sum_i c_i * (per-example gradient), for rules that cache every parameter's per-example gradient
    (``a`` and ``g`` unused: the engine drops them once the norms are taken)."""
    params = dict(r.module.named_parameters(recurse=False))
    return {
        n: torch.tensordot(c, t, dims=1).reshape(params[n].shape)
        for n, t in r.cache.items()
        if n in params and r.trainable.get(n)
    }

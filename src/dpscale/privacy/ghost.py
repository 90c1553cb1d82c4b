"""Per-example clipping without per-example gradients: ghost norms and book-keeping.

One forward pass records each trainable layer's input ``a`` and output; one backward pass
computes only the gradients ``g`` with respect to those outputs (no parameter gradients).
For every supported layer the per-example gradient is a simple function of (a_i, g_i), so

* its squared norm comes either from Gram matrices, ||g_i^T a_i||^2 = <a_i a_i^T, g_i g_i^T>
  (the "ghost" norm, cheap when the sequence/spatial length T is small), or from the explicit
  per-example gradient (cheap when the layer is small); the "mixed" rule picks the cheaper
  by a cost estimate from shapes;
* the clipped sum sum_i c_i g_i^T a_i is one weight-gradient product with g scaled by the
  per-example clip factors c_i (book-keeping, Bu et al. 2023), from the same records as the
  norms in both modes, so a route the records miss can never be released unclipped.

``ghost`` mode takes every norm of a weight from Gram matrices (never materialising a per-example
gradient); ``bk`` picks the cheaper of the two per layer.

Supported: Linear (any leading dims), Conv1d/Conv2d (stride, padding, dilation, groups; zero
padding), GroupNorm/LayerNorm affine parameters, Embedding, scaled weight-standardised Conv2d
and scalar gains (NF-ResNet), and their biases. Nothing is stored on tensors or modules: hooks
live for one call only.

The records are exact only if each trainable parameter reaches the loss through its own
module's single call and nothing else. Support is therefore judged by parameters: a module is
supported only if its trainable parameter names are exactly those its rule knows; tied
parameters (one tensor under two names) are refused; a parameter used outside its own module's
forward (a tied head ``F.linear(h, fc.weight)``, a ``pos_embed`` added by the parent) is found by
watching the first forward pass; and a recorded output or input changed in place afterwards
(``ReLU(inplace=True)``, ``z += y``) is detected by its version counter and recorded from a copy.
Any other route (a copy of a parameter kept elsewhere, a replaced ``forward``, a global hook) is
caught by the route check: on the first pass in each training mode and after every change of the
trainable parameter set, the unclipped sum of the records' per-example gradients must equal the
parameters' autograd gradient (for a bf16/fp16/tf32 engine, on an extra float32 pass of that
chunk: routes do not depend on the precision, 16-bit rounding would hide or fake one). A route taken only on some inputs, never on a checked pass, is
beyond these checks (see docs/engines.md).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from dpscale.layers import ClassTokenPositionEmbedding, LoRADownConv2d, LoRADownLinear, ScalarGain, ScaledStdConv2d
from dpscale.privacy.autotune import Candidate, MethodTuner
from dpscale.privacy.clipping import (
    MaxGradNorm,
    blocked_sq_norms,
    clip_dtype,
    is_per_layer,
    release_slack,
    resolve_clip_groups,
)
from dpscale.privacy.per_example import (
    Batch,
    ClippedSumMixin,
    LossFn,
    RELATIVE_ERROR_FLOOR,
    Params,
    clip_units,
    mean_over_views,
    per_example_cross_entropy,
    refuse_units,
    tolerance_for,
)
from dpscale.privacy.precision import FP32, Precision, at_least_fp32, exact_float32, needs_zeroing, zero_rows

# ----------------------------------------------------------------------------- layer rules


@dataclass
class _Record:
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
    # shape rule decides; see ``dpscale.privacy.autotune``).
    tuner: MethodTuner | None = None


def _part(r: _Record, local: str, sq: torch.Tensor) -> torch.Tensor:
    """Keep parameter ``local``'s per-example squared norms (B,) on its layer's record, and
    return them (for the rule to add into the layer's)."""
    r.parts[local] = sq
    return sq


def _per_example(r: _Record, t: torch.Tensor) -> torch.Tensor:
    """Sum a per-row tensor (B*K, ...) over each example's K view rows -> (B, ...)."""
    return t if r.views == 1 else t.reshape(-1, r.views, *t.shape[1:]).sum(1)


def _row_factors(r: _Record, c: torch.Tensor) -> torch.Tensor:
    """Per-example clip factors (B,) repeated for each example's K view rows (B*K,)."""
    return c if r.views == 1 else c.repeat_interleave(r.views)


# Convolutions need im2col patches for Gram matrices; on CPU materialising them costs about as
# much as this many multiply-adds per patch element (measured on the paper CNNs).
IM2COL_COST = 32
# Explicit conv per-example gradients take im2col + bmm (not grouped convolution) for layers
# with at most SHORT_OUTPUT output positions and at least LARGE_LAYER weights per group.
SHORT_OUTPUT = 64
LARGE_LAYER = 32768


def _gram_sq_norms(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    gram = (torch.matmul(a64, a64.transpose(-1, -2)) * torch.matmul(g64, g64.transpose(-1, -2))).flatten(1).sum(1)
    weight = (torch.linalg.vector_norm(a64, dim=-1) * torch.linalg.vector_norm(g64, dim=-1)).sum(-1)  # (B, ...)
    upper = _upper_bound(gram, a.shape[-1] + g.shape[-1], a.shape[-2], weight).to(a.dtype)
    return upper, weight.square().reshape(len(gram), -1).sum(1).sqrt()


def _upper_bound(gram: torch.Tensor, inner: int, length: int, weight: torch.Tensor) -> torch.Tensor:
    """A float64 Gram squared norm (B,) plus the rigorous bound on its rounding error,
    2 (inner + L^2 + 4) u W^2 (W = ``weight``, summed over any group dims): never below the exact value."""
    unit = torch.finfo(torch.float64).eps / 2
    return gram.clamp(min=0) + 2.0 * (inner + length * length + 4) * unit * weight.square().reshape(len(gram), -1).sum(1)


# Gram matrices are multiplied in float64 (see _gram_sq_norms): on CPU about twice float32's cost.
FLOAT64_GRAM_COST = 2


def _use_ghost(length: int, d_in: int, d_out: int, overhead: float = 0.0) -> bool:
    """Mixed rule: Gram matrices cost ~T^2 (d_in + d_out) float64 multiply-adds per example
    (+ ``overhead``), the explicit per-example gradient ~T d_in d_out; pick the cheaper."""
    return FLOAT64_GRAM_COST * length * length * (d_in + d_out) + overhead < length * d_in * d_out


def _linear_weight_gram(r: _Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Weight norms from Gram matrices, a (B, T, d_in) and g (B, T, d_out); the release sums T products."""
    gram, weight = _gram_sq_norms(a, g)
    r.slack = release_slack(a.shape[1], weight, a.dtype)
    return gram


def _linear_weight_bmm(r: _Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Weight norms from each example's instantiated gradient (B, out, in), kept for the release."""
    r.cache["weight"] = torch.bmm(g.transpose(1, 2), a)
    return blocked_sq_norms(r.cache["weight"])


LINEAR_WEIGHT_METHODS = {"gram": _linear_weight_gram, "bmm": _linear_weight_bmm}


def _linear_weight_method(r: _Record, a: torch.Tensor, g: torch.Tensor, rows: tuple) -> str:
    """The rule's choice for a sequence Linear (ghost: Gram only), or the tuner's among the exact
    methods; ``rows`` = the record's (inputs, output grads) as the release takes them."""
    t, d_in, d_out = a.shape[1], a.shape[2], g.shape[2]
    rule = "gram" if r.gram_only or _use_ghost(t, d_in, d_out) else "bmm"
    costs = {"gram": (FLOAT64_GRAM_COST * t * t * (d_in + d_out), 2 * 8.0 * t * t * len(a))}
    if not r.gram_only:
        costs["bmm"] = (t * d_in * d_out, 0.0)
        costs = _accurate_enough(costs, rule, t)
    signature = f"Linear|t={t}|in={d_in}|out={d_out}|views={r.views}|{a.dtype}"
    return _tuned(r, signature, rule, costs, LINEAR_WEIGHT_METHODS, (a, g), rows, _linear_sums, len(a))


def _linear_norms(r: _Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    b = a.shape[0] // r.views  # an example's K views are consecutive rows: fold them into its sequence
    a3, g3 = a.reshape(b, -1, a.shape[-1]), g.reshape(b, -1, g.shape[-1])
    sq = a.new_zeros(b)
    if r.trainable.get("weight"):
        if a3.shape[1] == 1:  # ||g a^T|| = ||g|| ||a||; the release is one product per entry
            # each factor summed in float64 and taken back to the records' type, so that an input
            # whose square overflows it (3e38 in float32) still makes the example non-finite (zeroed)
            sq_a, sq_g = (v.double().square().sum(1).to(a.dtype).double() for v in (a3[:, 0], g3[:, 0]))
            product = sq_a * sq_g
            sq = sq + _part(r, "weight", product.to(a.dtype))
            r.slack = release_slack(1, product.sqrt(), a.dtype)
        else:
            method = _linear_weight_method(r, a3, g3, (a, g))
            sq = sq + _part(r, "weight", LINEAR_WEIGHT_METHODS[method](r, a3, g3))
    if r.trainable.get("bias"):
        r.cache["bias"] = g3.sum(1)
        sq = sq + _part(r, "bias", blocked_sq_norms(r.cache["bias"]))
    return sq


# A Gram form's norm is inflated by its float32 release's worst-case rounding, gamma_{L+1} W
# (``release_slack``): ~1e-5 W at 256 positions, 2e-4 W at an AugMult 3 x 32 x 32 (clipped sums 1e-3
# off the float64 loop on wrn16-4). The tuner offers Gram forms only up to this many positions per
# example (the rule's own choice stays), so that timing never trades accuracy for speed.
TUNED_GRAM_MAX_POSITIONS = 256


def _accurate_enough(costs: dict[str, tuple[float, float]], rule: str, length: int) -> dict[str, tuple[float, float]]:
    """``costs`` without the Gram forms the tuner may not take at ``length`` positions (bk mode)."""
    if length <= TUNED_GRAM_MAX_POSITIONS:
        return costs
    return {name: cost for name, cost in costs.items() if name == rule or name not in ("gram", "pixel-gram")}


def _tuned(
    r: _Record, signature: str, rule: str, costs: dict[str, tuple[float, float]], methods: dict[str, Callable],
    args: tuple, rows: tuple, sums: Callable, examples: int,
) -> str:  # fmt: skip
    """The method for ``r``'s weight: ``rule`` without a tuner, else the tuner's choice among the
    exact candidates (name -> (multiply-adds per example, Gram bytes for the chunk)), each timed as
    its norms plus the clipped sum on a scratch copy of the record (the record itself untouched)."""
    if r.tuner is None:
        return rule
    signature = f"{signature}|{args[0].device.type}"
    known = r.tuner.remembered(r.name, signature)
    if known is not None:  # the steps after the first: no candidates built
        return known
    ones = args[0].new_ones(examples)

    def runner(name: str) -> Callable[[], Any]:
        def run() -> Any:
            scratch = replace(r, trainable={"weight": True}, cache={}, parts={}, slack=None, tuner=None)
            methods[name](scratch, *args)
            return sums(scratch, *rows, ones)

        return run

    candidates = [Candidate(name, macs, gram, runner(name)) for name, (macs, gram) in costs.items()]
    return r.tuner.choose(r.name, signature, args[0].device, rule, candidates, examples)


def _linear_sums(r: _Record, a: torch.Tensor, g: torch.Tensor, c: torch.Tensor) -> Params:
    out: Params = {}
    if r.trainable.get("weight"):
        if "weight" in r.cache:
            out["weight"] = torch.tensordot(c, r.cache["weight"], dims=1)
        else:
            rows = _row_factors(r, c)
            gc = (g * rows.view(-1, *([1] * (g.dim() - 1)))).reshape(-1, g.shape[-1])
            out["weight"] = gc.t() @ a.reshape(-1, a.shape[-1])
    if r.trainable.get("bias"):
        out["bias"] = c @ r.cache["bias"]
    return out


def _conv_geometry(m: nn.Module) -> tuple[tuple[int, int], ...]:
    """(kernel, stride, padding, dilation) as 2-D pairs; Conv1d is a 1 x k Conv2d."""
    if isinstance(m, nn.Conv1d):
        (k,), (s,), (p,), (d,) = m.kernel_size, m.stride, m.padding, m.dilation
        return (1, k), (1, s), (0, p), (1, d)
    return (m.kernel_size, m.stride, m.padding, m.dilation)  # type: ignore[return-value]


def _conv_unfold(r: _Record, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs as (B, groups, C_in/groups * k, L) patches and output grads as (B, groups, C_out/groups, L)."""
    m = r.module
    kernel, stride, padding, dilation = _conv_geometry(m)
    if isinstance(m, nn.Conv1d):
        a = a.unsqueeze(2)
    b, groups = a.shape[0], m.groups
    patches = F.unfold(a, kernel, dilation=dilation, padding=padding, stride=stride)
    patches = patches.reshape(b, groups, -1, patches.shape[-1])
    g = g.reshape(b, groups, m.out_channels // groups, -1)
    return patches, g


def _conv_per_example_grouped(r: _Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-example weight gradients as one grouped-convolution weight gradient with the examples
    folded into the groups (uses the fast convolution kernels instead of im2col + bmm). An
    example's K views go in the batch dimension, over which the weight gradient already sums."""
    m = r.module
    kernel, stride, padding, dilation = _conv_geometry(m)
    if isinstance(m, nn.Conv1d):
        a, g = a.unsqueeze(2), g.unsqueeze(2)
    views, groups = r.views, m.groups
    b = a.shape[0] // views

    def views_first(t: torch.Tensor) -> torch.Tensor:  # (B*K, C, H, W) -> (K, B*C, H, W)
        return t.reshape(b, views, *t.shape[1:]).transpose(0, 1).reshape(views, -1, *t.shape[2:])

    weight = torch.nn.grad.conv2d_weight(
        views_first(a),
        (b * m.out_channels, m.in_channels // groups, *kernel),
        views_first(g),
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=b * groups,
    )
    return weight.reshape(b, groups, m.out_channels // groups, -1)


def _fold_views(r: _Record, t: torch.Tensor) -> torch.Tensor:
    """(B*K, G, d, L) -> (B, G, d, K*L): an example's views side by side along the positions."""
    if r.views == 1:
        return t
    rows, groups, d, length = t.shape
    return (
        t.reshape(rows // r.views, r.views, groups, d, length).permute(0, 2, 3, 1, 4).reshape(rows // r.views, groups, d, r.views * length)
    )


def _bmm_is_faster(d_in: int, d_out: int, length: int) -> bool:
    """The shape rule between the two ways to per-example conv gradients. Measured (2-core AMD
    EPYC, torch 2.13): im2col + bmm wins for thin inputs (d_in < 32) and for short outputs of large
    layers; grouped convolution wins elsewhere, by up to 10x. (The tuner times both where it pays.)"""
    return d_in < 32 or (length <= SHORT_OUTPUT and d_in * d_out >= LARGE_LAYER)


def _conv_per_example_bmm(r: _Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Each example's weight gradient by im2col + bmm, (B, G, out/G, in/G * k), summed over its views."""
    patches, gg = _conv_unfold(r, a, g)
    patches, gg = _fold_views(r, patches), _fold_views(r, gg)  # sums over views in the bmm
    if r.module.groups == 1:  # plain bmm takes the transposed operand without a copy
        return torch.bmm(gg[:, 0], patches[:, 0].transpose(1, 2)).unsqueeze(1)
    return torch.matmul(gg, patches.transpose(2, 3))


def _conv_per_example(r: _Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Each example's weight gradient, (B, G, out/G, in/G * k), summed over its K views (by the shape rule)."""
    m = r.module
    length = g[0, 0].numel() * r.views
    d_in, d_out = m.in_channels // m.groups * m.weight[0, 0].numel(), m.out_channels // m.groups
    if _bmm_is_faster(d_in, d_out, length):
        return _conv_per_example_bmm(r, a, g)
    return _conv_per_example_grouped(r, a, g)


# The pixel Gram's k x k strided slices of a (B, L', L') float64 tensor cost about this many
# multiply-adds per element summed (memory-bound; measured on a 16 x 16 layer of tramer-cifar-cnn,
# 2-core AMD EPYC): added to its estimate when the tuner decides what to time.
PIXEL_SLICE_COST = 16


def _pixel_gram_eligible(m: nn.Module) -> bool:
    """Whether ``_pixel_gram_sq_norms`` applies: a plain 2-D convolution (one group, zero padding
    given as numbers; any stride and dilation)."""
    return type(m) is nn.Conv2d and m.groups == 1 and isinstance(m.padding, tuple) and m.padding_mode == "zeros"


def _pixel_gram_cost(m: nn.Module, a: torch.Tensor, length: int, views: int) -> float:
    """Multiply-adds per example of ``_pixel_gram_sq_norms``: the padded pixels' Gram, the k x k
    shifted block sums and the output gradients' Gram (float64: ``FLOAT64_GRAM_COST``)."""
    (kh, kw), (ph, pw) = m.kernel_size, m.padding
    pixels = views * (a.shape[-2] + 2 * ph) * (a.shape[-1] + 2 * pw)
    return FLOAT64_GRAM_COST * (pixels * pixels * m.in_channels + length * length * m.out_channels) + kh * kw * length * length


def _pixel_gram_sq_norms(r: _Record, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_gram_sq_norms`` of a convolution without im2col: the patch Gram <a_t, a_s> is the sum
    over the k x k kernel offsets o of <x_{st+do}, x_{ss+do}> (stride s, dilation d), entries of
    the Gram of the zero-padded input's pixels (C_in deep instead of C_in k^2), and ||a_t||^2 the
    same sum over the pixels' squared norms. The same float64 products, reordered: each
    patch-Gram entry is off by at most gamma_{C_in + k^2 + 1} ||a_t|| ||a_s|| (Cauchy-Schwarz over
    the offsets), which the bound covers with inner = max(d_in, C_in + k^2 + 1) + d_out. An
    example's K views are one sequence of positions, as for the unfolded Gram.

    Returns:
        (upper bound of each example's squared norm (B,), W = sum_t ||a_t|| ||g_t|| (B,)), float64 W.
    """
    m, views = r.module, r.views
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = _conv_geometry(m)
    x = F.pad(a.double(), (pw, pw, ph, ph))  # (B*K, C, Hp, Wp)
    rows, channels, hp, wp = x.shape
    b, ho, wo = rows // views, g.shape[-2], g.shape[-1]
    pixels = x.reshape(b, views, channels, hp * wp).transpose(2, 3).reshape(b, views * hp * wp, channels)
    full = torch.bmm(pixels, pixels.transpose(1, 2)).reshape(b, views, hp, wp, views, hp, wp)
    offsets = [  # the pixels under kernel tap (i, j) at every output position
        (slice(i * dh, i * dh + sh * (ho - 1) + 1, sh), slice(j * dw, j * dw + sw * (wo - 1) + 1, sw))
        for i in range(kh) for j in range(kw)
    ]  # fmt: skip
    patch = sum(full[:, :, hi, wi, :, hi, wi] for hi, wi in offsets).reshape(b, views * ho * wo, views * ho * wo)
    g64 = g.double().reshape(b, views, m.out_channels, ho * wo).transpose(2, 3).reshape(b, views * ho * wo, -1)
    gram = (patch * torch.bmm(g64, g64.transpose(1, 2))).flatten(1).sum(1)
    pixel_sq = x.square().sum(1)  # (B*K, Hp, Wp)
    box = sum(pixel_sq[:, hi, wi] for hi, wi in offsets)  # ||a_t||^2 (B*K, Ho, Wo)
    weight = (box.clamp(min=0).sqrt().reshape(b, -1) * torch.linalg.vector_norm(g64, dim=-1)).sum(1)
    inner = max(channels * kh * kw, channels + kh * kw + 1) + m.out_channels
    return _upper_bound(gram, inner, views * ho * wo, weight).to(a.dtype), weight


def _conv_weight_pixel_gram(r: _Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    gram, weight = _pixel_gram_sq_norms(r, a, g)
    r.slack = release_slack(g[0, 0].numel() * r.views, weight, a.dtype)  # the release sums every position
    return gram


def _conv_weight_gram(r: _Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    patches, gg = _conv_unfold(r, a, g)
    patches, gg = _fold_views(r, patches), _fold_views(r, gg)
    gram, weight = _gram_sq_norms(patches.transpose(2, 3), gg.transpose(2, 3))  # per group (B, G, L, d)
    # the release (a convolution weight gradient) sums an example's positions and views
    r.slack = release_slack(g[0, 0].numel() * r.views, weight, a.dtype)
    return gram


def _conv_weight_bmm(r: _Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    r.cache["weight"] = _conv_per_example_bmm(r, a, g)
    return blocked_sq_norms(r.cache["weight"])


def _conv_weight_grouped(r: _Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    r.cache["weight"] = _conv_per_example_grouped(r, a, g)
    return blocked_sq_norms(r.cache["weight"])


# A conv weight's exact per-example-norm methods: Gram forms (an upper bound with the release's
# slack) and instantiated gradients (kept for the release). Names appear in logs and checkpoints.
CONV_WEIGHT_METHODS = {
    "pixel-gram": _conv_weight_pixel_gram, "gram": _conv_weight_gram,
    "bmm": _conv_weight_bmm, "grouped": _conv_weight_grouped,
}  # fmt: skip


def _conv_weight_method(r: _Record, a: torch.Tensor, g: torch.Tensor) -> str:
    """The shape rule's method for a conv weight (ghost: Gram forms only), or the tuner's among
    the exact candidates."""
    m, b = r.module, a.shape[0] // r.views
    length = g[0, 0].numel() * r.views  # an example's positions, over all its views
    d_in, d_out = m.in_channels // m.groups * m.weight[0, 0].numel(), m.out_channels // m.groups
    explicit = length * d_in * d_out
    gram_cost = FLOAT64_GRAM_COST * length * length * (d_in + d_out) + IM2COL_COST * length * d_in
    costs = {"gram": (gram_cost, 16.0 * b * m.groups * length * length)}
    if _pixel_gram_eligible(m):
        pixels = r.views * (a.shape[-2] + 2 * m.padding[0]) * (a.shape[-1] + 2 * m.padding[1])
        taps = m.kernel_size[0] * m.kernel_size[1]  # + the k^2 strided L x L slices the tuner has seen cost
        pixel_cost = _pixel_gram_cost(m, a, length, r.views)
        costs["pixel-gram"] = (pixel_cost + PIXEL_SLICE_COST * taps * length * length,
                               8.0 * b * (pixels * pixels + 2 * length * length))  # fmt: skip
    if "pixel-gram" in costs and pixel_cost < min(explicit, gram_cost):  # the rule: without the slices' cost
        rule = "pixel-gram"
    elif r.gram_only or _use_ghost(length, d_in, d_out, overhead=IM2COL_COST * length * d_in):
        rule = "gram"
    else:
        rule = "bmm" if _bmm_is_faster(d_in, d_out, length) else "grouped"
    if not r.gram_only:
        costs.update(bmm=(explicit + IM2COL_COST * length * d_in, 0.0), grouped=(explicit, 0.0))
        costs = _accurate_enough(costs, rule, length)
    signature = (
        f"{type(m).__name__}|in={tuple(a.shape[1:])}|out={tuple(g.shape[1:])}|{_conv_geometry(m)}"
        f"|groups={m.groups}|views={r.views}|{a.dtype}"
    )
    return _tuned(r, signature, rule, costs, CONV_WEIGHT_METHODS, (a, g), (a, g), _conv_sums, b)


def _conv_norms(r: _Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    b = a.shape[0] // r.views
    sq = a.new_zeros(b)
    if r.trainable.get("weight"):
        method = _conv_weight_method(r, a, g)
        sq = sq + _part(r, "weight", CONV_WEIGHT_METHODS[method](r, a, g))
    if r.trainable.get("bias"):
        r.cache["bias"] = _per_example(r, g.reshape(g.shape[0], g.shape[1], -1).sum(2))
        sq = sq + _part(r, "bias", blocked_sq_norms(r.cache["bias"]))
    return sq


def _conv_sums(r: _Record, a: torch.Tensor, g: torch.Tensor, c: torch.Tensor) -> Params:
    m, out = r.module, {}
    if r.trainable.get("weight"):
        if "weight" in r.cache:
            out["weight"] = torch.tensordot(c, r.cache["weight"], dims=1).reshape(m.weight.shape)
        else:
            # sum_i c_i g_i^T a_i is the ordinary weight gradient with g scaled per example:
            # the library's convolution kernel, no im2col.
            kernel, stride, padding, dilation = _conv_geometry(m)
            scaled = g * _row_factors(r, c).view(-1, *([1] * (g.dim() - 1)))
            if isinstance(m, nn.Conv1d):
                a, scaled = a.unsqueeze(2), scaled.unsqueeze(2)
            weight = torch.nn.grad.conv2d_weight(
                a,
                (m.out_channels, m.in_channels // m.groups, *kernel),
                scaled,
                stride=stride,
                padding=padding,
                dilation=dilation,
                groups=m.groups,
            )
            out["weight"] = weight.reshape(m.weight.shape)
    if r.trainable.get("bias"):
        out["bias"] = c @ r.cache["bias"]
    return out


def _ws_conv_norms(r: _Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Scaled weight standardisation, W' = gain * u with u = (W - mean) / s per output filter,
    s = sqrt(n var + eps): from each example's gradient G with respect to W' (an ordinary conv
    per-example gradient), d/d gain = <u, G> and d/d W = gain / s * (G - mean(G) - u <u, G>)
    (the Jacobian of u is (P - u u^T) / s, P the centring projection). Needs the explicit
    per-example G in both modes."""
    m, b = r.module, a.shape[0] // r.views
    sq = a.new_zeros(b)
    if r.trainable.get("weight") or r.trainable.get("gain"):
        grad_w = _conv_per_example(r, a, g).reshape(b, m.out_channels, -1)  # (B, out, n)
        with torch.no_grad():
            u = m.standardized_weight().reshape(m.out_channels, -1).to(grad_w.dtype)
            w = m.weight.reshape(m.out_channels, -1)
            s = torch.sqrt(w.var(1, unbiased=False, keepdim=True) * w.shape[1] + m.eps).to(grad_w.dtype)
        along_u = (grad_w * u).sum(-1, keepdim=True)  # (B, out, 1)
        if r.trainable.get("gain"):
            r.cache["gain"] = along_u.reshape(b, *m.gain.shape)
            sq = sq + _part(r, "gain", blocked_sq_norms(r.cache["gain"]))
        if r.trainable.get("weight"):
            scale = (m.gain.detach().reshape(-1, 1) / s).to(grad_w.dtype)
            r.cache["weight"] = (grad_w - grad_w.mean(-1, keepdim=True) - u * along_u) * scale
            sq = sq + _part(r, "weight", blocked_sq_norms(r.cache["weight"]))
    if r.trainable.get("bias"):
        r.cache["bias"] = _per_example(r, g.reshape(g.shape[0], g.shape[1], -1).sum(2))
        sq = sq + _part(r, "bias", blocked_sq_norms(r.cache["bias"]))
    return sq


def _cached_sums(r: _Record, a: torch.Tensor, g: torch.Tensor, c: torch.Tensor) -> Params:
    """sum_i c_i * (per-example gradient), for rules that cache every parameter's per-example gradient."""
    params = dict(r.module.named_parameters(recurse=False))
    return {n: torch.tensordot(c, t, dims=1).reshape(params[n].shape)
            for n, t in r.cache.items() if n in params and r.trainable.get(n)}  # fmt: skip


def _scalar_gain_norms(r: _Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """y = scale * gain * x: the per-example gradient of the gain is scale * <x_i, g_i>."""
    if not r.trainable.get("gain"):
        return a.new_zeros(a.shape[0] // r.views)
    per_row = (a * g).reshape(a.shape[0], -1).sum(1) * r.module.scale
    r.cache["gain"] = _per_example(r, per_row)
    return _part(r, "gain", r.cache["gain"].square())


def _normalized(r: _Record, a: torch.Tensor) -> torch.Tensor:
    m = r.module
    if isinstance(m, nn.GroupNorm):
        return F.group_norm(a, m.num_groups, None, None, m.eps)
    return F.layer_norm(a, m.normalized_shape, None, None, m.eps)


def _affine_parts(r: _Record, a: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-example gradients of a norm layer's affine weight and bias, shaped (B, *param)."""
    m, b = r.module, a.shape[0]
    parts = {}
    if isinstance(m, nn.GroupNorm):  # params per channel (dim 1)
        reduce = lambda t: t.reshape(b, m.num_channels, -1).sum(2)  # noqa: E731
    else:  # LayerNorm: params over the trailing normalized_shape
        n = len(m.normalized_shape)
        reduce = lambda t: t.reshape(b, -1, *t.shape[t.dim() - n :]).sum(1)  # noqa: E731
    if r.trainable.get("weight"):
        parts["weight"] = reduce(g * _normalized(r, a))
    if r.trainable.get("bias"):
        parts["bias"] = reduce(g)
    return parts


def _norm_layer_norms(r: _Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    parts = {name: _per_example(r, t) for name, t in _affine_parts(r, a, g).items()}
    r.cache.update(parts)
    return sum((_part(r, n, blocked_sq_norms(t)) for n, t in parts.items()), a.new_zeros(a.shape[0] // r.views))


def _norm_layer_sums(r: _Record, a: torch.Tensor, g: torch.Tensor, c: torch.Tensor) -> Params:
    return {name: torch.tensordot(c, r.cache[name], dims=1)
            for name in ("weight", "bias") if name in r.cache and r.trainable.get(name)}  # fmt: skip


def _embedding_norms(r: _Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    b = a.shape[0] // r.views  # views folded into the sequence, as for Linear
    idx = a.reshape(b, -1)
    g = g.reshape(b, idx.shape[1], -1)
    if r.module.padding_idx is not None:  # torch gives the padding row no gradient
        g = g * (idx != r.module.padding_idx).unsqueeze(-1)
    r.cache["idx"], r.cache["g"] = idx, g
    # rows hit by both positions; in float64 with a rounding bound, as _gram_sq_norms and for its reason
    same = (idx.unsqueeze(2) == idx.unsqueeze(1)).to(torch.float64)
    g64 = g.double()
    gram = (same * torch.bmm(g64, g64.transpose(1, 2))).sum((1, 2))
    # a one-hot row of unit norm stands for a_t: W = sum_t ||g_t||, inner dimension d (the one-hot products are exact)
    weight = torch.linalg.vector_norm(g64, dim=-1).sum(1)
    # the release index_adds c g_t of an example's positions into the rows they hit
    r.slack = release_slack(idx.shape[1], weight, g.dtype)
    return _part(r, "weight", _upper_bound(gram, g.shape[-1], idx.shape[1], weight).to(g.dtype))


def _embedding_sums(r: _Record, a: torch.Tensor, g: torch.Tensor, c: torch.Tensor) -> Params:
    idx, gg = r.cache["idx"], r.cache["g"]
    weight = torch.zeros_like(r.module.weight)
    weight.index_add_(0, idx.reshape(-1), (gg * c.view(-1, 1, 1)).reshape(-1, gg.shape[-1]))
    return {"weight": weight}


def _tokens_norms(r: _Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    # out = [cls; tokens] + pos: d out / d pos = g (per example), d out / d cls = g[:, 0].
    g = r.cache["g"] = _per_example(r, g)
    sq = a.new_zeros(g.shape[0])
    if r.trainable.get("pos_embed"):
        sq = sq + _part(r, "pos_embed", blocked_sq_norms(g))
    if r.trainable.get("cls_token"):
        sq = sq + _part(r, "cls_token", blocked_sq_norms(g[:, 0]))
    return sq


def _tokens_sums(r: _Record, a: torch.Tensor, g: torch.Tensor, c: torch.Tensor) -> Params:
    g, out = r.cache["g"], {}
    if r.trainable.get("pos_embed"):
        out["pos_embed"] = torch.tensordot(c, g, dims=1).unsqueeze(0)
    if r.trainable.get("cls_token"):
        out["cls_token"] = (c @ g[:, 0]).view(1, 1, -1)
    return out


@dataclass(frozen=True)
class _Rule:
    norms: Callable[[_Record, torch.Tensor, torch.Tensor], torch.Tensor]
    sums: Callable[[_Record, torch.Tensor, torch.Tensor, torch.Tensor], Params]
    params: frozenset[str]  # the only parameter names the rule knows how to differentiate


_WEIGHT_BIAS = frozenset({"weight", "bias"})
_RULES: dict[type, _Rule] = {
    nn.Linear: _Rule(_linear_norms, _linear_sums, _WEIGHT_BIAS),
    LoRADownLinear: _Rule(_linear_norms, _linear_sums, frozenset({"weight"})),  # its output: A x alone
    nn.Conv1d: _Rule(_conv_norms, _conv_sums, _WEIGHT_BIAS),
    nn.Conv2d: _Rule(_conv_norms, _conv_sums, _WEIGHT_BIAS),
    LoRADownConv2d: _Rule(_conv_norms, _conv_sums, frozenset({"weight"})),
    nn.GroupNorm: _Rule(_norm_layer_norms, _norm_layer_sums, _WEIGHT_BIAS),
    nn.LayerNorm: _Rule(_norm_layer_norms, _norm_layer_sums, _WEIGHT_BIAS),
    nn.Embedding: _Rule(_embedding_norms, _embedding_sums, frozenset({"weight"})),
    ClassTokenPositionEmbedding: _Rule(_tokens_norms, _tokens_sums, frozenset({"pos_embed", "cls_token"})),
    ScaledStdConv2d: _Rule(_ws_conv_norms, _cached_sums, frozenset({"weight", "gain", "bias"})),
    ScalarGain: _Rule(_scalar_gain_norms, _cached_sums, frozenset({"gain"})),
}


def _why_unsupported(module: nn.Module, trainable: list[str], prefix: str) -> str | None:
    """None if the layer's trainable parameters (local names) can be handled, else the reason."""
    rule = _RULES.get(type(module))
    if rule is None:
        return f"{type(module).__name__}: no rule for its parameter(s) {', '.join(prefix + n for n in trainable)}"
    unknown = [prefix + n for n in trainable if n not in rule.params]
    if unknown:  # e.g. weight_norm's weight_g / weight_v, or an extra nn.Parameter attached to the layer
        return f"{type(module).__name__} with parameter(s) {', '.join(unknown)} that its rule does not know"
    if isinstance(module, (nn.Conv1d, nn.Conv2d)) and (isinstance(module.padding, str) or module.padding_mode != "zeros"):
        return f"{type(module).__name__} with padding={module.padding!r}, padding_mode={module.padding_mode!r}"
    if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.scale_grad_by_freq):
        return "Embedding with max_norm or scale_grad_by_freq"
    return None


def _tied_parameters(model: nn.Module) -> list[str]:
    """'a.weight = b.weight (tied parameter)' for every trainable tensor held by several layers
    (one layer registered under two names is one record, and not a tie)."""
    owners: dict[int, dict[tuple[int, str], str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for local, p in module.named_parameters(recurse=False):
            if p.requires_grad:
                name = f"{prefix}.{local}" if prefix else local
                owners.setdefault(id(p), {}).setdefault((id(module), local), name)
    return [f"{' = '.join(group.values())} (tied parameter)" for group in owners.values() if len(group) > 1]


def unsupported_modules(model: nn.Module) -> list[str]:
    """What the ghost/bk engines cannot handle exactly, found without running the model: layers
    without a rule, trainable parameters a layer's rule does not know, and tied parameters.

    Returns:
        one string per problem, naming the layer ("name (reason)") or the parameters.
    """
    if type(model).__name__ == "OptimizedModule" and "_orig_mod" in model._modules:  # without importing dynamo
        return ["<root> (a torch.compile'd model: its layers run inside the compiled graph, where hooks cannot record "
                "them; pass the uncompiled module)"]  # fmt: skip
    problems = []
    for name, module in model.named_modules():
        trainable = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if trainable:
            reason = _why_unsupported(module, trainable, f"{name}." if name else "")
            if reason is not None:
                problems.append(f"{name or '<root>'} ({reason})")
    return problems + _tied_parameters(model)


class _OutsideUseMonitor(TorchFunctionMode):
    """Watches one forward pass for trainable parameters of recorded layers that reach a
    differentiable operation outside their own layer's call (their gradient would then have a
    route the records do not see)."""

    def __init__(self, records: list[_Record]) -> None:
        super().__init__()
        self.owner: dict[int, tuple[str, nn.Module]] = {}
        for r in records:
            for local, p in r.module.named_parameters(recurse=False):
                if r.trainable.get(local):
                    self.owner[id(p)] = (f"{r.name}.{local}" if r.name else local, r.module)
        self.active: list[nn.Module] = []  # the recorded layers whose call is running
        self.outside: dict[str, None] = {}  # ordered set of parameter names

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if any(t.requires_grad for t in _tensors(out)):  # .shape, .detach() etc. carry no gradient
            current = self.active[-1] if self.active else None
            for t in _tensors((args, kwargs)):
                # a view of the parameter (``fc.weight.T`` kept by the parent) is the parameter too
                hit = self.owner.get(id(t)) or (self.owner.get(id(t._base)) if t._base is not None else None)
                if hit is not None and hit[1] is not current:
                    self.outside[hit[0]] = None
        return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors inside nested tuples/lists/dicts."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


@dataclass
class _ModelState:
    """What an engine learned about one model on its first calls."""

    # (training mode, support_key) pairs whose first pass passed the route checks: a route that
    # exists only in train mode, or a parameter unfrozen later, is checked when it first runs.
    checked: set[tuple] = field(default_factory=set)
    copied: set[str] = field(default_factory=set)  # layers whose tensors are changed in place later
    # unsupported_modules costs ~0.6 ms on a ResNet-50: its verdict is kept while the parameter
    # set and their requires_grad flags stay the same.
    support_key: tuple = ()
    problems: list[str] = field(default_factory=list)
    # the trainable layers (module, name, local parameter -> trainable), walked once per parameter set
    layers: list[tuple] = field(default_factory=list)
    layers_key: tuple | None = None

    def static_problems(self, model: nn.Module) -> list[str]:
        key = tuple((id(p), p.requires_grad) for p in model.parameters())
        if key != self.support_key:
            self.problems, self.support_key = unsupported_modules(model), key
        return self.problems

    def route_key(self, model: nn.Module) -> tuple:
        """Key of the routes a pass can take: training mode and the current parameter set."""
        self.static_problems(model)
        return (model.training, self.support_key)


def _full_name(layer: str, local: str) -> str:
    """A parameter's name in the model from its layer's name and its own."""
    return f"{layer}.{local}" if layer else local


@dataclass(frozen=True)
class _Units:
    """What ``clip_units`` clips for one pass: each layer as one unit (its norms come per
    layer), except the layers that per-layer clipping splits between groups (per-tensor clipping
    splits every layer with a weight and a bias), whose tensors are units of their own.

    Attributes:
        sq: unit -> per-example squared norms (B,): a layer's by its name, a tensor's by its full name.
        slack: unit -> slack (B,) of its release (``_Record.slack``: a split layer's goes to its weight).
        group_of: unit -> per-layer clipping group (None: one C for the whole gradient).
        split: the layers clipped tensor by tensor.
    """

    sq: dict[str, torch.Tensor]
    slack: dict[str, torch.Tensor]
    group_of: dict[str, int] | None
    split: frozenset[str]


def _clip_units(records: list[_Record], layer_sq: dict[str, torch.Tensor], max_grad_norm: MaxGradNorm, params: Params) -> _Units:
    """The units and groups of a pass; a split layer's entry in ``layer_sq`` is set to the sum
    of its tensors' norms (what is clipped is what the self-check compares).

    Raises:
        ValueError: a split layer whose rule gave no norm for one of its tensors.
    """
    slack = {r.name: r.slack for r in records if r.slack is not None}
    if not is_per_layer(max_grad_norm):
        return _Units(layer_sq, slack, None, frozenset())
    param_group = resolve_clip_groups(max_grad_norm, list(params)).group_of  # type: ignore[arg-type]
    sq, unit_slack, group_of, split = {}, {}, {}, set()
    for r in records:
        names = {local: _full_name(r.name, local) for local, trainable in r.trainable.items() if trainable}
        groups = {param_group[n] for n in names.values()}
        if len(groups) == 1:  # the layer's tensors clipped together, from its own norm
            sq[r.name], group_of[r.name] = layer_sq[r.name], groups.pop()
            if r.slack is not None:
                unit_slack[r.name] = r.slack
            continue
        missing = [n for local, n in names.items() if local not in r.parts]
        if missing or (r.slack is not None and "weight" not in names):
            raise ValueError(
                f"{type(r.module).__name__} {r.name!r}: its rule gives no norm of its own for "
                f"{', '.join(missing) or 'the weight'}, which per-layer clipping puts in a group apart; use engine=vmap"
            )
        split.add(r.name)
        for local, name in names.items():
            sq[name], group_of[name] = r.parts[local], param_group[name]
        if r.slack is not None:  # the weight's release alone accumulates positions
            unit_slack[names["weight"]] = r.slack
        layer_sq[r.name] = sum((r.parts[local] for local in names), torch.zeros_like(layer_sq[r.name]))
    return _Units(sq, unit_slack, group_of, frozenset(split))


def _released(r: _Record, factors: dict[str, torch.Tensor], units: _Units) -> Params:
    """A layer's clipped sums by local name: its rule's sums with the layer's factors, or for a
    split layer with each tensor's own (the rule run for that tensor alone)."""
    rule = _RULES[type(r.module)]
    if r.name not in units.split:
        return rule.sums(r, r.inputs, r.out_grad, factors[r.name])
    out: Params = {}
    for local, trainable in r.trainable.items():
        if trainable:
            alone = replace(r, trainable={n: n == local for n in r.trainable})
            out[local] = rule.sums(alone, r.inputs, r.out_grad, factors[_full_name(r.name, local)])[local]
    return out


def _true_gradients(model: nn.Module, params: Params) -> dict[str, torch.Tensor]:
    """The model's own trainable tensors named in ``params`` (which may hold detached copies)."""
    return {name: p for name, p in model.named_parameters() if name in params and p.requires_grad}


def _unscaled(t: torch.Tensor | None, scale: float) -> torch.Tensor | None:
    """A gradient of the loss times ``scale`` (fp16 loss scaling), as float32 of the loss itself."""
    return None if t is None else at_least_fp32(t) / scale if scale != 1.0 else at_least_fp32(t)


def _zero_examples(records: list[_Record], finite: torch.Tensor, views: int) -> None:
    """Set every record's rows (and cached per-example gradients) of the non-finite examples to
    exactly zero, so that their clipped contribution is zero rather than 0 * inf = NaN."""
    rows = finite.repeat_interleave(views) if views > 1 else finite
    for r in records:
        if r.inputs is not None and r.inputs.is_floating_point():
            r.inputs = zero_rows(r.inputs, rows)
        if r.out_grad is not None:
            r.out_grad = zero_rows(r.out_grad, rows)
        for name, t in r.cache.items():
            if t.is_floating_point():
                r.cache[name] = zero_rows(t, finite)


def _unseen_routes(records: list[_Record], true: dict[str, torch.Tensor | None], rows: torch.Tensor) -> list[str]:
    """Parameters whose autograd gradient differs from the unclipped sum of the records'
    per-example gradients: a route the records do not see (a view or copy of the parameter used
    elsewhere, a replaced ``forward``, a global hook changing an output).

    Args:
        records: the pass's records, norms already computed (caches filled).
        true: parameter name -> its gradient of the summed loss by autograd (None: unused).
        rows: ones, one per example (the clip factors of an unclipped sum).

    Returns:
        "name (records x off, relative)" for each such parameter, compared at the tolerance of its
        gradient's dtype (float32 for a 16-bit engine: its check runs on a float32 pass).
    """
    from_records: Params = {}
    for r in records:
        for local, s in _RULES[type(r.module)].sums(r, r.inputs, r.out_grad, rows).items():
            from_records[f"{r.name}.{local}" if r.name else local] = s
    sizes = {n: float(torch.linalg.vector_norm(t)) if t is not None else 0.0 for n, t in true.items()}
    scale = RELATIVE_ERROR_FLOOR * max(sizes.values(), default=0.0) + 1e-300
    unseen = []
    for name, t in true.items():
        got = from_records.get(name)
        if t is None and got is None:
            continue
        t = torch.zeros_like(got) if t is None else t
        error = float(torch.linalg.vector_norm(t - (torch.zeros_like(t) if got is None else got)))
        if error > tolerance_for(t.dtype) * max(sizes[name], scale):
            unseen.append(f"{name} (records {error / max(sizes[name], scale):.2g} off, relative)")
    return unseen


# ---------------------------------------------------------------------------------- engine


@dataclass(frozen=True)
class GhostEngine(ClippedSumMixin):
    """Book-keeping (``mode="bk"``) or ghost-norm (``mode="ghost"``) per-example clipping.

    Both take the clipped sum from the same per-layer records as the norms. ``bk`` computes each
    weight's per-example norm the cheaper way (Gram matrices or explicit per-example gradient);
    ``ghost`` always from Gram matrices.

    Args:
        max_grad_norm: clipping norm C, a per-layer mapping pattern -> C_g (a layer whose
            parameters fall in different groups, as with per-tensor bounds, is clipped tensor by
            tensor from each tensor's own norm); None = no clipping.
        loss_fn: per-example loss (logits, labels) -> (B,).
        mode: "bk" or "ghost".
        views: augmentation multiplicity K; chunks then hold x of shape (B, K, ...) and each
            example's loss is the mean over its K views, so its clipped gradient is the clip of
            the mean of the views' gradients (cross terms between views included).
        precision: how the model computes (``dpscale.privacy.precision``): in 16 bits the forward
            pass runs under autocast and every record is taken to float32 before its norms.
        tuner: times each layer shape's exact weight-norm methods on the device once and keeps
            the fastest (``dpscale.privacy.autotune``); None: the shape rule.

    Raises (from the clipping call), ValueError naming the parameter: a layer or parameter
    ``unsupported_modules`` lists, a layer called more than once, or a trainable parameter used
    outside its own layer's call.
    """

    max_grad_norm: MaxGradNorm
    loss_fn: LossFn = per_example_cross_entropy
    mode: str = "bk"
    views: int = 1
    precision: Precision = FP32
    tuner: MethodTuner | None = field(default=None, compare=False, repr=False)
    clip_gamma: float | None = None  # automatic clipping's gamma (None: clip to C)
    _models: Any = field(default_factory=weakref.WeakKeyDictionary, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in ("bk", "ghost"):
            raise ValueError(f"GhostEngine mode must be 'bk' or 'ghost', got {self.mode!r}")

    @property
    def name(self) -> str:
        return self.mode

    def clipped_sum_and_losses(self, model: nn.Module, params: Params, batch: Batch) -> tuple[Params, torch.Tensor, torch.Tensor]:
        refuse_units(batch, self.mode)
        x, _ = batch
        if x.shape[0] == 0:
            return self.empty_result(params, x)
        grad_sum, norms, losses, _ = self.clip_with_layer_norms(model, params, batch)
        return grad_sum, norms, losses

    def clip_with_layer_norms(
        self, model: nn.Module, params: Params, batch: Batch
    ) -> tuple[Params, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """As ``clipped_sum_and_losses`` plus each layer's per-example squared norms (B,) by
        layer name (for the start-up self-check, which names the layers that disagree)."""
        refuse_units(batch, self.mode)
        state = self._models.setdefault(model, _ModelState())
        problems = state.static_problems(model)
        if problems:
            raise ValueError(f"{self.mode} engine cannot handle: {'; '.join(problems)}; use engine=vmap")
        key = state.route_key(model)
        check = key not in state.checked  # first pass in this mode with this parameter set
        if check and self.precision.name != "fp32":
            self._check_routes_in_float32(model, params, batch)
            check = False  # this pass's 16-bit (or TF32) rounding is no evidence about routes
        records, losses = self._recorded_forward(model, params, batch, watch=check)
        losses, scale = at_least_fp32(losses), self.precision.loss_scale
        # Gradients w.r.t. the layer outputs only (and, on a checked pass, w.r.t. the parameters);
        # the list of outputs is not kept, so that each output can be freed once its layer is done.
        true = _true_gradients(model, params) if check and losses.requires_grad else {}
        targets = [r.output for r in records] + list(true.values())
        grads = list(torch.autograd.grad(losses.sum() * scale, targets, allow_unused=True)) if targets else []
        out_grads, true = grads[: len(records)], {n: _unscaled(t, scale) for n, t in zip(true, grads[len(records) :])}
        del targets, grads
        with exact_float32():  # the clip bound's arithmetic never in TF32
            layer_sq = self._layer_norms(records, out_grads, batch[0])
            units = _clip_units(records, layer_sq, self.max_grad_norm, params)
            # the type the release is computed in (never the tokens' int type)
            zeros = batch[0].new_zeros(batch[0].shape[0], dtype=clip_dtype(params.values()))
            factors, norms = clip_units(
                units.sq, self.max_grad_norm, units.group_of, zeros=zeros, unit_slack=units.slack, gamma=self.clip_gamma
            )
            finite = torch.isfinite(norms)
            # a non-finite example makes the autograd reference non-finite: this pass cannot tell
            # (a one-off pass: its host read is no cost)
            if check and bool(finite.all()) and self._check_routes(records, true, torch.ones_like(norms)):
                state.checked.add(key)
            # Every precision: a non-finite example (an overflow, a NaN from its own data) contributes
            # exactly zero, a function of that example alone; otherwise 0 * inf = NaN would spread
            # to the whole update and show that the example was in the batch.
            if needs_zeroing(finite):
                _zero_examples(records, finite, self.views)
            grad_sum = {name: torch.zeros_like(p) for name, p in params.items()}
            for r in records:
                for local, s in _released(r, factors, units).items():
                    grad_sum[_full_name(r.name, local)] = s
        return grad_sum, norms.detach(), losses.detach(), layer_sq

    def _layer_norms(self, records: list[_Record], out_grads: list[torch.Tensor | None], x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-example squared norms (B,) of the chunk ``x`` by layer, each layer's output freed
        once used. In 16-bit precision each record is first taken to float32 (its gradient
        unscaled)."""
        scale, low = self.precision.loss_scale, self.precision.low
        layer_sq: dict[str, torch.Tensor] = {}
        for i, r in enumerate(records):
            g, out_grads[i] = out_grads[i], None
            r.out_grad = torch.zeros_like(r.output) if g is None else g
            del g
            r.output = None  # only needed as a gradient target; free it now
            if low:
                r.out_grad = _unscaled(r.out_grad, scale)
                r.inputs = at_least_fp32(r.inputs) if r.inputs.is_floating_point() else r.inputs
            layer_sq[r.name] = _RULES[type(r.module)].norms(r, r.inputs, r.out_grad)
            if "weight" in r.cache or _RULES[type(r.module)].sums is _cached_sums:
                r.inputs = r.out_grad = None  # the clipped sum comes from the cache: drop the activations early
        return layer_sq

    def _check_routes_in_float32(self, model: nn.Module, params: Params, batch: Batch) -> None:
        """The route check of a 16-bit or TF32 engine, on a float32 pass of the same chunk.

        Which routes reach the loss does not depend on the precision, but 16-bit rounding does
        not stay small: the autograd reference of a gradient whose terms cancel (or that sums a
        long conv accumulation) differed from the records by 3-7% in bf16, beyond any tolerance
        that still sees a missed route. In float32, with full float32 matmuls (no TF32), the two
        agree to ~1e-6 and the float32 tolerance applies; the chunk is marked checked there.

        Args:
            model: the model (its trainable parameters, modes and hooks as in training).
            params: the trainable parameters by name.
            batch: the chunk this pass would have checked.

        Raises:
            ValueError: a parameter's gradient reaches the loss by a route the records miss.
        """
        with exact_float32():  # shares this engine's per-model state (the ``_models`` dictionary)
            replace(self, precision=FP32).clip_with_layer_norms(model, params, batch)

    def _check_routes(self, records: list[_Record], true: dict[str, torch.Tensor | None], ones: torch.Tensor) -> bool:
        """Refuse a route the records miss; False when this pass cannot tell (an autograd
        gradient is not finite), so that the next pass checks again."""
        if any(t is not None and not bool(torch.isfinite(t).all()) for t in true.values()):
            return False
        unseen = _unseen_routes(records, true, ones)
        if unseen:
            raise ValueError(
                f"{self.mode} engine: the gradient of {', '.join(unseen)} reaches the loss by a route the layer "
                "records do not see (a view or copy of the parameter used elsewhere, a replaced forward, a "
                "global hook changing an output?); use engine=vmap"
            )
        return True

    def _recorded_forward(self, model: nn.Module, params: Params, batch: Batch, watch: bool) -> tuple[list[_Record], torch.Tensor]:
        """One forward pass with every trainable layer's (input, output) recorded, checked for
        routes the records would miss (under the outside-use monitor when ``watch``). A layer
        whose recorded tensor is changed in place later is recorded from a copy, from then on
        (the pass is redone once when first found)."""
        state = self._models[model]
        for _ in range(2):
            records = self._records(model, params, self.views, self.mode == "ghost", self.tuner, state)
            losses, outside = self._forward(model, records, batch, state, watch)
            if outside:
                raise ValueError(
                    f"{self.mode} engine: parameter(s) {', '.join(outside)} reach the loss outside their own "
                    "layer's call (e.g. a tied head or a parameter used by the parent module); use engine=vmap"
                )
            for r in records:
                if r.calls > 1:
                    raise ValueError(f"layer {r.name!r} ran {r.calls} times in one forward pass (weight sharing?); use engine=vmap")
            records = [r for r in records if r.calls]  # a layer that did not run has zero gradient
            detached = [r.name for r in records if not r.output.requires_grad]
            if detached:  # run under no_grad, e.g. by reentrant activation checkpointing
                raise ValueError(
                    f"{self.mode} engine: the outputs of layer(s) {', '.join(detached)} carry no gradient when "
                    "recorded (torch.no_grad or checkpoint(..., use_reentrant=True)?); use use_reentrant=False"
                )
            rows = batch[0].shape[0] * self.views  # the forward pass sees an example's K views as rows
            shared = [r.name for r in records if r.inputs.shape[0] != rows or r.output.shape[0] != rows]
            if shared:  # e.g. a layer applied to one constant row broadcast to every example
                raise ValueError(
                    f"{self.mode} engine: layer(s) {', '.join(shared)} do not process the {rows} examples row by row "
                    "(their per-example gradients cannot be told apart); use engine=vmap"
                )
            changed = {r.name for r in records if (r.output._version, r.inputs._version) != r.versions}
            if not changed:
                return records, losses
            if changed <= state.copied:
                break
            state.copied |= changed
        raise ValueError(f"{self.mode} engine: the tensors of layer(s) {', '.join(sorted(changed))} change in place")

    def _forward(
        self, model: nn.Module, records: list[_Record], batch: Batch, state: _ModelState, watch: bool
    ) -> tuple[torch.Tensor, list[str]]:
        """The hooked forward pass: (per-example losses, parameters used outside their layer,
        when ``watch`` runs it under the outside-use monitor)."""
        x, y = batch
        monitor = _OutsideUseMonitor(records) if watch else None
        handles = []
        for r in records:
            if monitor is not None:
                handles.append(r.module.register_forward_pre_hook(lambda m, i: monitor.active.append(m)))
            # prepend: the layer's own output, before any user hook replaces it (the route through
            # such a hook is then part of the output gradient, as it should be).
            capture = self._capture(r, r.name in state.copied, monitor)
            handles.append(r.module.register_forward_hook(capture, prepend=True))
        try:
            with self.precision.forward(x.device), monitor or contextlib.nullcontext():
                losses = mean_over_views(self.loss_fn, model, x, y, self.views)
        finally:
            for h in handles:
                h.remove()
        return losses, list(monitor.outside) if monitor is not None else []

    @staticmethod
    def _records(
        model: nn.Module,
        params: Params,
        views: int,
        gram_only: bool,
        tuner: MethodTuner | None,
        state: _ModelState | None = None,
    ) -> list[_Record]:
        """A fresh record for each layer holding a parameter of ``params``; the walk over the
        modules is kept in ``state`` while the parameter set and names stay the same."""
        key = (state.support_key, tuple(params)) if state is not None else None
        if state is None or state.layers_key != key:
            layers = []
            for name, module in model.named_modules():
                local = {pname: (f"{name}.{pname}" if name else pname) in params for pname, _ in module.named_parameters(recurse=False)}
                if any(local.values()):
                    layers.append((module, name, local))
            if state is None:
                return [_Record(m, n, dict(t), views=views, gram_only=gram_only, tuner=tuner) for m, n, t in layers]
            state.layers, state.layers_key = layers, key
        return [_Record(m, n, dict(t), views=views, gram_only=gram_only, tuner=tuner) for m, n, t in state.layers]

    @staticmethod
    def _capture(record: _Record, copy: bool, monitor: _OutsideUseMonitor | None) -> Callable:
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
            if monitor is not None:
                monitor.active.pop()
            record.calls += 1
            record.inputs = inputs[0].detach().clone() if copy else inputs[0].detach()
            record.output = output
            record.versions = (output._version, record.inputs._version)
            # The rest of the model sees a copy, so in-place changes there leave the record intact.
            return output.clone() if copy else None

        return hook

"""The ghost engines' layer rules: each supported layer type's per-example norms and clipped sums (``RULES``).

A rule reads one layer's ``Record`` (``dpscale.privacy.clipping.ghost.record``): its ``norms`` give the
per-example squared norms (B,) of the layer's trainable parameters, and its ``sums`` the clipped
sum of their per-example gradients for given clip factors. The convolution rules are in
``dpscale.privacy.clipping.ghost.conv``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dpscale.layers import (
    ClassTokenPositionEmbedding,
    LoRADownConv2d,
    LoRADownLinear,
    ScalarGain,
    ScaledStdConv2d,
    ScaledStdLinear,
)
from dpscale.privacy.clipping.bounds import blocked_sq_norms, gamma, release_slack
from dpscale.privacy.clipping.ghost.conv import (
    conv_norms,
    conv_sums,
    ws_conv_norms,
    ws_rows,
    ws_weight_norms,
)
from dpscale.privacy.clipping.ghost.record import (
    cached_norms,
    FLOAT64_GRAM_COST,
    Record,
    accurate_enough,
    cached_sums,
    gram_sq_norms,
    or_zeros,
    part,
    per_example,
    plus,
    small_part,
    row_factors,
    tuned,
    upper_bound,
    use_ghost,
)
from dpscale.privacy.noise.gaussian import Params


SQ_SUM_BLOCK_BYTES = 1 << 20  # float64 rows squared at once: 1 MB, not a copy of the whole input


def float64_row_sq_sums(v: torch.Tensor) -> torch.Tensor:
    """Each row's sum of squares of a (B, n) tensor, squared and summed in float64 (a float32
    square is exact there), a block of rows at a time in one reused buffer.

    A linear model on 160 px images has n = 76,800: the whole chunk's float64 copy and its
    square took 2 x 315 MB at B = 512 and set a streamed run's peak memory (issue 62). A fresh
    block per row instead left glibc's heap 300 MB larger in some processes (freed blocks not
    reused); one buffer of at most ``SQ_SUM_BLOCK_BYTES`` (or two rows) allocates once. On the CPU
    only (see the body).

    Args:
        v: (B, n) values of any floating type.

    Returns:
        (B,) float64 sums of squares.
    """
    rows = max(2, SQ_SUM_BLOCK_BYTES // max(1, 8 * v.shape[1]))
    # off the CPU the whole copy: one kernel chain, not three launches a block (each costs host time
    # on a GPU, where the DP step is host-bound), and device memory is not the streamed run's RSS
    if len(v) <= rows or v.device.type != "cpu":
        v64 = v.double()  # its products are exact: a float32 square fits float64's mantissa
        return torch.linalg.vecdot(v64, v64)
    sums = v.new_empty(len(v), dtype=torch.float64)
    block = v.new_empty((rows, v.shape[1]), dtype=torch.float64)
    # every block full (the last one overlaps its predecessor): torch sums a row in the same
    # order in any block of 2 rows or more (one row alone is reduced in another order)
    for start in [*range(0, len(v) - rows, rows), len(v) - rows]:
        torch.sum(block.copy_(v[start : start + rows]).square_(), 1, out=sums[start : start + rows])
    return sums


def _linear_weight_gram(r: Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Weight norms from Gram matrices, a (B, T, d_in) and g (B, T, d_out); the release sums T products."""
    gram, weight = gram_sq_norms(a, g)
    r.slack = release_slack(a.shape[1], weight, a.dtype)
    return gram


def _linear_weight_bmm(r: Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    """Weight norms from each example's instantiated gradient (B, out, in), kept for the release."""
    r.cache["weight"] = torch.bmm(g.transpose(1, 2), a)
    return cached_norms(r)


LINEAR_WEIGHT_METHODS = {"gram": _linear_weight_gram, "bmm": _linear_weight_bmm}


def _linear_weight_method(r: Record, a: torch.Tensor, g: torch.Tensor, rows: tuple) -> str:
    """The rule's choice for a sequence Linear (ghost: Gram only), or the tuner's among the exact
    methods; ``rows`` = the record's (inputs, output grads) as the release takes them."""
    t, d_in, d_out = a.shape[1], a.shape[2], g.shape[2]
    rule = "gram" if r.gram_only or use_ghost(t, d_in, d_out) else "bmm"
    costs: dict[str, tuple[float, float]] = {
        "gram": (FLOAT64_GRAM_COST * t * t * (d_in + d_out), 2 * 8.0 * t * t * len(a))
    }
    if not r.gram_only:
        costs["bmm"] = (t * d_in * d_out, 0.0)
        costs = accurate_enough(costs, rule, t)
    signature = f"Linear|t={t}|in={d_in}|out={d_out}|views={r.views}|{a.dtype}"
    return tuned(
        r, signature, rule, costs, LINEAR_WEIGHT_METHODS, (a, g), rows, _linear_sums, len(a)
    )


def _linear_norms(r: Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    # an example's K views are consecutive rows: fold them into its sequence
    b = a.shape[0] // r.views
    # one row per example (the 2-d input of a classifier head): the rows themselves, no reshape
    one_row = a.dim() == 2 and r.views == 1
    a3, g3 = (a, g) if one_row else (a.reshape(b, -1, a.shape[-1]), g.reshape(b, -1, g.shape[-1]))
    sq = None
    if r.trainable.get("weight"):
        # ||g a^T|| = ||g|| ||a||; the release is one product per entry
        if one_row or a3.shape[1] == 1:
            # each factor summed and multiplied in float64: a factor rounded to float32 alone read 0
            # below float32's range (||a||^2 = 1e-48) although the gradient ||g|| ||a|| was ordinary,
            # and automatic clipping released 1287 C (issue 62's review). A factor whose square
            # overflows the records' type (3e38 in float32) still makes the example non-finite (zeroed).
            sq_a, sq_g = (float64_row_sq_sums(v if one_row else v[:, 0]) for v in (a3, g3))
            product = torch.where(
                torch.maximum(sq_a, sq_g) > torch.finfo(a.dtype).max, torch.inf, sq_a * sq_g
            )
            sq = plus(sq, part(r, "weight", product.to(a.dtype)))
            r.slack = release_slack(1, product.sqrt(), a.dtype)
        else:
            method = _linear_weight_method(r, a3, g3, (a, g))
            sq = plus(sq, part(r, "weight", LINEAR_WEIGHT_METHODS[method](r, a3, g3)))
    if r.trainable.get("bias"):
        r.cache["bias"] = g if one_row else g3.sum(1)
        sq = plus(sq, small_part(r, "bias"))
    return or_zeros(r, sq, a, b)


def _linear_sums(
    r: Record, a: torch.Tensor | None, g: torch.Tensor | None, c: torch.Tensor
) -> Params:
    out: Params = {}
    if r.trainable.get("weight"):
        if "weight" in r.cache:
            out["weight"] = torch.tensordot(c, r.cache["weight"], dims=1)
        else:
            assert a is not None and g is not None, (
                "a record's tensors are dropped only once its weight gradients are cached"
            )
            rows = row_factors(r, c)
            if a.dim() == 2:  # one row per example: no reshapes (each an operator)
                out["weight"] = (g * rows.unsqueeze(1)).t() @ a
            else:
                gc = (g * rows.view(-1, *([1] * (g.dim() - 1)))).reshape(-1, g.shape[-1])
                out["weight"] = gc.t() @ a.reshape(-1, a.shape[-1])
    if r.trainable.get("bias"):
        out["bias"] = c @ r.cache["bias"]
    return out


def _ws_linear_norms(r: Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    """A ScaledStdLinear's norms: each example's gradient with respect to W' (its output
    gradients times its inputs, summed over a sequence and an example's views), mapped through
    the standardisation by ``ws_weight_norms``; one input row per example takes the closed form
    (``_ws_outer_norms``) and never forms the (B, out, in) gradients."""
    b = a.shape[0] // r.views
    a3, g3 = a.reshape(b, -1, a.shape[-1]), g.reshape(b, -1, g.shape[-1])
    sq: torch.Tensor | None = None
    if a3.shape[1] == 1:
        sq = _ws_outer_norms(r, a3[:, 0], g3[:, 0])
    elif r.trainable.get("weight") or r.trainable.get("gain"):
        sq = ws_weight_norms(r, torch.bmm(g3.transpose(1, 2), a3), sq)
    if r.trainable.get("bias"):
        r.cache["bias"] = g3.sum(1)
        sq = plus(sq, small_part(r, "bias"))
    return or_zeros(r, sq, a, b)


def _ws_outer_norms(r: Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    """Weight and gain norms of a ScaledStdLinear whose examples have one input row a (B, n) and
    output gradient g (B, out), in float64 without the (B, out, n) gradients.

    Row r of an example's weight gradient is k_r g_r (a_c - u_r t_r), with a_c = a - mean(a),
    t_r = <u_r, a_c>, k_r = gain_r / s_r; its squared norm is k_r^2 g_r^2 (|a_c|^2 - (2 - |u_r|^2)
    t_r^2), and the gain's gradient is g_r t_r. The release (``_ws_linear_sums``) uses the same
    a_c and t in float64, so the norm is that of what is released, up to the rounding bounded
    here (added to the squared norm) and the release's (``Record.slack``)."""
    u, k = ws_rows(r.module, torch.float64)
    a64 = a.double()
    a_c = a64 - a64.mean(1, keepdim=True)
    g64, t = g.double(), a_c @ u.t()  # (B, out) each
    # per-example rows only in the cache: the engine zeroes a non-finite example's rows there
    r.cache["ws_a"], r.cache["ws_g"], r.cache["ws_t"] = a_c, g64, t
    sq = None
    if r.trainable.get("gain"):
        sq = plus(sq, part(r, "gain", (g64 * t).square().sum(1).to(a.dtype)))
    if r.trainable.get("weight"):
        kg2, sq_a, kappa = (k * g64).square(), a_c.square().sum(1, keepdim=True), u.square().sum(1)
        exact = (kg2 * (sq_a - (2 - kappa) * t.square())).sum(1)
        # float64 rounding of t (n terms) and of the expression: far below float32's, yet bounded
        rounding = gamma(a.shape[1] + g.shape[1] + 8, torch.float64) * (
            kg2 * (sq_a + 4 * t.square() + 2 * t.abs() * (kappa * sq_a).sqrt())
        ).sum(1)
        sq = plus(sq, part(r, "weight", (exact + rounding).to(a.dtype)))
        along = (kg2 * t.square() * kappa).sum(1).sqrt()
        r.slack = release_slack(
            4, (k * g64).norm(dim=1) * sq_a.squeeze(1).sqrt() + along, torch.float64
        )
    return or_zeros(r, sq, a, a.shape[0])


def _ws_linear_sums(
    r: Record, a: torch.Tensor | None, g: torch.Tensor | None, c: torch.Tensor
) -> Params:
    """The clipped sums of a ScaledStdLinear: from the cached per-example gradients, or, after
    ``_ws_outer_norms``, as k (cg^T a_c - diag(sum_i cg_i t_i) u) in float64, cg = c g."""
    if "ws_t" not in r.cache:
        return cached_sums(r, a, g, c)
    m, cache = r.module, r.cache
    assert isinstance(m, ScaledStdLinear), f"{type(m).__name__} is not a ScaledStdLinear"
    cg = cache["ws_g"] * c.double().unsqueeze(1)  # (B, out)
    along = (cg * cache["ws_t"]).sum(0)  # (out,)
    out: Params = {}
    if r.trainable.get("weight"):
        u, k = ws_rows(m, torch.float64)
        weight = k.unsqueeze(1) * (cg.t() @ cache["ws_a"] - along.unsqueeze(1) * u)
        out["weight"] = weight.to(m.weight.dtype)
    if r.trainable.get("gain"):
        out["gain"] = along.reshape(m.gain.shape).to(m.gain.dtype)
    if r.trainable.get("bias"):
        out["bias"] = c @ cache["bias"]
    return out


def _scalar_gain_norms(r: Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    """y = scale * gain * x: the per-example gradient of the gain is scale * <x_i, g_i>."""
    m = r.module
    assert isinstance(m, ScalarGain), f"{type(m).__name__} is not a ScalarGain"
    if not r.trainable.get("gain"):
        return a.new_zeros(a.shape[0] // r.views)
    per_row = (a * g).reshape(a.shape[0], -1).sum(1) * m.scale
    r.cache["gain"] = per_example(r, per_row)
    return part(r, "gain", r.cache["gain"].square())


def _norm_layer(r: Record) -> nn.GroupNorm | nn.LayerNorm:
    """The record's norm layer (the rule table gives these rules GroupNorm and LayerNorm only)."""
    m = r.module
    assert isinstance(m, (nn.GroupNorm, nn.LayerNorm)), (
        f"{type(m).__name__} is not a GroupNorm or LayerNorm"
    )
    return m


def _normalized(r: Record, a: torch.Tensor) -> torch.Tensor:
    m = _norm_layer(r)
    if isinstance(m, nn.GroupNorm):
        return F.group_norm(a, m.num_groups, None, None, m.eps)
    return F.layer_norm(a, m.normalized_shape, None, None, m.eps)


def _affine_parts(r: Record, a: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-example gradients of a norm layer's affine weight and bias, shaped (B, *param)."""
    m, b = _norm_layer(r), a.shape[0]
    parts = {}
    if isinstance(m, nn.GroupNorm):  # params per channel (dim 1)
        reduce = lambda t: t.sum(tuple(range(2, t.dim()))) if t.dim() > 2 else t  # noqa: E731
    else:  # LayerNorm: params over the trailing normalized_shape
        n = len(m.normalized_shape)
        reduce = lambda t: t.reshape(b, -1, *t.shape[t.dim() - n :]).sum(1)  # noqa: E731
    # the product and its sum in one operator
    if r.trainable.get("weight") and isinstance(m, nn.GroupNorm):
        parts["weight"] = torch.einsum("bc...,bc...->bc", g, _normalized(r, a))
    elif r.trainable.get("weight"):
        parts["weight"] = reduce(g * _normalized(r, a))
    if r.trainable.get("bias"):
        parts["bias"] = reduce(g)
    return parts


def _norm_layer_norms(r: Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    parts = {name: per_example(r, t) for name, t in _affine_parts(r, a, g).items()}
    r.cache.update(parts)
    sq = None
    for name in parts:
        sq = plus(sq, small_part(r, name))
    return or_zeros(r, sq, a, a.shape[0] // r.views)


def _norm_layer_sums(
    r: Record, a: torch.Tensor | None, g: torch.Tensor | None, c: torch.Tensor
) -> Params:
    return {
        name: torch.tensordot(c, r.cache[name], dims=1)
        for name in ("weight", "bias")
        if name in r.cache and r.trainable.get(name)
    }


def _embedding_norms(r: Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    m = r.module
    assert isinstance(m, nn.Embedding), f"{type(m).__name__} is not an Embedding"
    b = a.shape[0] // r.views  # views folded into the sequence, as for Linear
    idx = a.reshape(b, -1)
    g = g.reshape(b, idx.shape[1], -1)
    if m.padding_idx is not None:  # torch gives the padding row no gradient
        g = g * (idx != m.padding_idx).unsqueeze(-1)
    r.cache["idx"], r.cache["g"] = idx, g
    # rows hit by both positions; in float64 with a rounding bound, as gram_sq_norms and for its reason
    same = (idx.unsqueeze(2) == idx.unsqueeze(1)).to(torch.float64)
    g64 = g.double()
    gram = (same * torch.bmm(g64, g64.transpose(1, 2))).sum((1, 2))
    # a one-hot row of unit norm stands for a_t: W = sum_t ||g_t||, inner dimension d (the one-hot products are exact)
    weight = torch.linalg.vector_norm(g64, dim=-1).sum(1)
    # the release index_adds c g_t of an example's positions into the rows they hit
    r.slack = release_slack(idx.shape[1], weight, g.dtype)
    return part(r, "weight", upper_bound(gram, g.shape[-1], idx.shape[1], weight).to(g.dtype))


def _embedding_sums(
    r: Record, a: torch.Tensor | None, g: torch.Tensor | None, c: torch.Tensor
) -> Params:
    m = r.module
    assert isinstance(m, nn.Embedding), f"{type(m).__name__} is not an Embedding"
    idx, gg = r.cache["idx"], r.cache["g"]
    weight = torch.zeros_like(m.weight)
    weight.index_add_(0, idx.reshape(-1), (gg * c.view(-1, 1, 1)).reshape(-1, gg.shape[-1]))
    return {"weight": weight}


def _tokens_norms(r: Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    # out = [cls; tokens] + pos: d out / d pos = g (per example), d out / d cls = g[:, 0].
    g = r.cache["g"] = per_example(r, g)
    sq = None
    if r.trainable.get("pos_embed"):
        sq = plus(sq, part(r, "pos_embed", blocked_sq_norms(g)))
    if r.trainable.get("cls_token"):
        sq = plus(sq, part(r, "cls_token", blocked_sq_norms(g[:, 0])))
    return or_zeros(r, sq, a, g.shape[0])


def _tokens_sums(
    r: Record, a: torch.Tensor | None, g: torch.Tensor | None, c: torch.Tensor
) -> Params:
    g, out = r.cache["g"], {}
    if r.trainable.get("pos_embed"):
        out["pos_embed"] = torch.tensordot(c, g, dims=1).unsqueeze(0)
    if r.trainable.get("cls_token"):
        out["cls_token"] = (c @ g[:, 0]).view(1, 1, -1)
    return out


@dataclass(frozen=True)
class Rule:
    """How the ghost engines differentiate one layer type.

    Attributes:
        norms: (record, input a, output gradient g) -> per-example squared norms (B,), keeping on the
            record what ``sums`` needs; None when every term was left to the engine's batched pass
            (``ghost_record.small_part``, only on a record whose ``defer`` the engine set).
        sums: (record, a, g, clip factors (B,)) -> clipped sums by local parameter name; a and g are
            None once the engine has dropped them (the sums then come from the record's cache).
        params: the only parameter names the rule knows how to differentiate.
    """

    norms: Callable[[Record, torch.Tensor, torch.Tensor], torch.Tensor | None]
    sums: Callable[[Record, torch.Tensor | None, torch.Tensor | None, torch.Tensor], Params]
    params: frozenset[str]


_WEIGHT_BIAS = frozenset({"weight", "bias"})
# The rule of each supported layer type, looked up by exact type (a subclass needs its own entry).
RULES: dict[type, Rule] = {
    nn.Linear: Rule(_linear_norms, _linear_sums, _WEIGHT_BIAS),
    LoRADownLinear: Rule(
        _linear_norms, _linear_sums, frozenset({"weight"})
    ),  # its output: A x alone
    nn.Conv1d: Rule(conv_norms, conv_sums, _WEIGHT_BIAS),
    nn.Conv2d: Rule(conv_norms, conv_sums, _WEIGHT_BIAS),
    LoRADownConv2d: Rule(conv_norms, conv_sums, frozenset({"weight"})),
    nn.GroupNorm: Rule(_norm_layer_norms, _norm_layer_sums, _WEIGHT_BIAS),
    nn.LayerNorm: Rule(_norm_layer_norms, _norm_layer_sums, _WEIGHT_BIAS),
    nn.Embedding: Rule(_embedding_norms, _embedding_sums, frozenset({"weight"})),
    ClassTokenPositionEmbedding: Rule(
        _tokens_norms, _tokens_sums, frozenset({"pos_embed", "cls_token"})
    ),
    ScaledStdConv2d: Rule(ws_conv_norms, cached_sums, frozenset({"weight", "gain", "bias"})),
    ScaledStdLinear: Rule(_ws_linear_norms, _ws_linear_sums, frozenset({"weight", "gain", "bias"})),
    ScalarGain: Rule(_scalar_gain_norms, cached_sums, frozenset({"gain"})),
}

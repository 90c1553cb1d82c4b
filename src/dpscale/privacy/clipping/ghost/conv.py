"""The ghost engines' convolution rules: per-example weight norms (Gram, pixel Gram, bmm, grouped) and clipped sums.

Conv1d and Conv2d (stride, padding, dilation, groups; zero padding given as numbers) and the
scaled weight-standardised Conv2d of NF-ResNets; the rule table is ``dpscale.privacy.clipping.ghost.rules``.
"""

from __future__ import annotations

import math

from typing import TypeGuard, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.grad import conv2d_weight

from dpscale.layers import ScaledStdConv2d, ScaledStdLinear, standardized
from dpscale.privacy.clipping.bounds import blocked_sq_norms, release_slack
from dpscale.privacy.clipping.ghost.record import (
    cached_norms,
    FLOAT64_GRAM_COST,
    Record,
    accurate_enough,
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

# Convolutions need im2col patches for Gram matrices; on CPU materialising them costs about as
# much as this many multiply-adds per patch element (measured on the paper CNNs).
IM2COL_COST = 32
# Explicit conv per-example gradients take im2col + bmm (not grouped convolution) for layers
# with at most SHORT_OUTPUT output positions and at least LARGE_LAYER weights per group.
SHORT_OUTPUT = 64
LARGE_LAYER = 32768

Pair = tuple[int, int]


def _conv(r: Record) -> nn.Conv1d | nn.Conv2d:
    """The record's convolution (the rule table gives these rules convolutions only)."""
    m = r.module
    assert isinstance(m, (nn.Conv1d, nn.Conv2d)), f"{type(m).__name__} is not a convolution"
    return m


def _conv_geometry(m: nn.Conv1d | nn.Conv2d) -> tuple[Pair, Pair, Pair, Pair]:
    """(kernel, stride, padding, dilation) as 2-D pairs; Conv1d is a 1 x k Conv2d."""
    padding = m.padding
    assert not isinstance(padding, str), (
        "padding given as a string (unsupported_modules refuses it)"
    )
    if isinstance(m, nn.Conv1d):
        (k,), (s,), (p,), (d,) = m.kernel_size, m.stride, padding, m.dilation
        return (1, k), (1, s), (0, p), (1, d)
    # a Conv2d's are pairs (torch types them as tuples of any length)
    return cast(tuple[Pair, Pair, Pair, Pair], (m.kernel_size, m.stride, padding, m.dilation))


def _conv_unfold(r: Record, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs as (B, groups, C_in/groups * k, L) patches and output grads as (B, groups, C_out/groups, L)."""
    m = _conv(r)
    kernel, stride, padding, dilation = _conv_geometry(m)
    if isinstance(m, nn.Conv1d):
        a = a.unsqueeze(2)
    b, groups = a.shape[0], m.groups
    patches = unfold_patches(a, kernel, dilation=dilation, padding=padding, stride=stride)
    patches = patches.reshape(b, groups, -1, patches.shape[-1])
    g = g.reshape(b, groups, m.out_channels // groups, -1)
    return patches, g


def _output_size(size: Pair, kernel: Pair, dilation: Pair, stride: Pair) -> Pair:
    """A convolution's output (height, width) on an already padded (height, width) input."""
    return cast(
        Pair,
        tuple((n - d * (k - 1) - 1) // s + 1 for n, k, d, s in zip(size, kernel, dilation, stride)),
    )


def unfold_patches(
    a: torch.Tensor, kernel: Pair, *, dilation: Pair, padding: Pair, stride: Pair
) -> torch.Tensor:
    """``F.unfold(a, ...)``'s (B, C * kh * kw, L) patches, bit for bit, gathered by one copy of a
    strided view of the padded input: 1.5-4.4x faster than ``F.unfold`` on the paper CNNs' layers
    (2-core AMD EPYC, one thread)."""
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = kernel, dilation, padding, stride
    if ph or pw:
        a = F.pad(a, (pw, pw, ph, ph))
    b, c, h, w = a.shape
    out_h, out_w = _output_size((h, w), kernel, dilation, stride)
    sb, sc, sy, sx = a.stride()
    view = a.as_strided(
        (b, c, kh, kw, out_h, out_w),
        (sb, sc, sy * dh, sx * dw, sy * sh, sx * sw),
        a.storage_offset(),
    )
    return view.reshape(b, c * kh * kw, out_h * out_w)


def channels_last_patches(
    a: torch.Tensor, kernel: Pair, *, dilation: Pair, padding: Pair, stride: Pair
) -> torch.Tensor:
    """The patches of ``unfold_patches`` as (B, L, kh * kw * C), positions first and the columns
    in (kh, kw, C) order, gathered from a channels-last copy of the padded input: with dilation 1
    an output position's kw * C values of a kernel row are one contiguous run of that copy
    (C * kw floats instead of unfold's runs of one output row), so the gather is cheaper wherever C > 1
    (measured, 2-core AMD EPYC, one thread: papernot-cnn's second layer 2.1 against 3.0 ms,
    tramer-cifar-cnn's 8 x 8 layer 5.3 against 9.0 ms, its 16 x 16 layer 10.5 against 6.8 ms: the tuner
    decides). With C = 1 the same values in the same order as ``F.unfold``'s, transposed."""
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = kernel, dilation, padding, stride
    x = a.permute(0, 2, 3, 1)  # (B, H, W, C)
    x = (F.pad(x, (0, 0, pw, pw, ph, ph)) if ph or pw else x).contiguous()
    b, h, w, c = x.shape
    out_h, out_w = _output_size((h, w), kernel, dilation, stride)
    sb, sy, sx, sc = x.stride()
    view = x.as_strided(
        (b, out_h, out_w, kh, kw, c),
        (sb, sy * sh, sx * sw, sy * dh, sx * dw, sc),
        x.storage_offset(),
    )
    return view.reshape(b, out_h * out_w, kh * kw * c)


def _conv_per_example_grouped(r: Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-example weight gradients as one grouped-convolution weight gradient with the examples
    folded into the groups (uses the fast convolution kernels instead of im2col + bmm). An
    example's K views go in the batch dimension, over which the weight gradient already sums."""
    m = _conv(r)
    kernel, stride, padding, dilation = _conv_geometry(m)
    if isinstance(m, nn.Conv1d):
        a, g = a.unsqueeze(2), g.unsqueeze(2)
    views, groups = r.views, m.groups
    b = a.shape[0] // views

    def views_first(t: torch.Tensor) -> torch.Tensor:  # (B*K, C, H, W) -> (K, B*C, H, W)
        if views == 1:  # one reshape (three operators otherwise)
            return t.reshape(1, -1, *t.shape[2:])
        return t.reshape(b, views, *t.shape[1:]).transpose(0, 1).reshape(views, -1, *t.shape[2:])

    size = (b * m.out_channels, m.in_channels // groups, *kernel)
    weight = torch.ops.aten.convolution_backward(
        views_first(g),
        views_first(a),
        _shape_only(size, g),
        None,
        stride,
        padding,
        dilation,
        False,
        [0, 0],
        b * groups,
        (False, True, False),
    )[1]
    # the weight's layout: its clipped sum needs no reshape
    return weight.reshape(b, *m.weight.shape)


# zero-stride stand-ins for a weight the convolution backward reads only the shape of, by (shape,
# dtype, device): conv2d_weight makes one on every call (two operators a layer, issue 63)
_SHAPES: dict[tuple, torch.Tensor] = {}


def _shape_only(size: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A tensor of shape ``size`` (one value, expanded, never written) for ``aten.convolution_backward``'s
    weight argument, kept per shape, type and device."""
    key = (size, like.dtype, like.device)
    if key not in _SHAPES:
        if len(_SHAPES) > 256:  # shapes of many chunk sizes: start again rather than grow
            _SHAPES.clear()
        _SHAPES[key] = like.new_empty(1).expand(size)
    return _SHAPES[key]


def _fold_views(r: Record, t: torch.Tensor) -> torch.Tensor:
    """(B*K, G, d, L) -> (B, G, d, K*L): an example's views side by side along the positions."""
    if r.views == 1:
        return t
    rows, groups, d, length = t.shape
    return (
        t.reshape(rows // r.views, r.views, groups, d, length)
        .permute(0, 2, 3, 1, 4)
        .reshape(rows // r.views, groups, d, r.views * length)
    )


def _bmm_is_faster(d_in: int, d_out: int, length: int) -> bool:
    """The shape rule between the two ways to per-example conv gradients. Measured (2-core AMD
    EPYC, torch 2.13): im2col + bmm wins for thin inputs (d_in < 32) and for short outputs of large
    layers; grouped convolution wins elsewhere, by up to 10x. (The tuner times both where it pays.)"""
    return d_in < 32 or (length <= SHORT_OUTPUT and d_in * d_out >= LARGE_LAYER)


def _conv_per_example_bmm(r: Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Each example's weight gradient by im2col + bmm, (B, G, out/G, in/G * k) (ungrouped: (B, *weight.shape)), summed over its views."""
    patches, gg = _conv_unfold(r, a, g)
    patches, gg = _fold_views(r, patches), _fold_views(r, gg)  # sums over views in the bmm
    # plain bmm takes the transposed operand without a copy; in the weight's layout
    if _conv(r).groups == 1:
        return torch.bmm(gg[:, 0], patches[:, 0].transpose(1, 2)).view(
            len(gg), *_conv(r).weight.shape
        )
    return torch.matmul(gg, patches.transpose(2, 3))


def _conv_per_example_bmm_positions(r: Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Each example's weight gradient of an ungrouped convolution, summed over its views, as
    (B, 1, out, kh * kw * in): its columns in the kernel-major order of ``channels_last_patches``
    (``r.kernel_major`` set; the clipped sum is reordered once, the per-example gradients never).
    im2col with the positions first + one bmm without a transposed operand (faster than ``bmm`` on
    thin inputs on the AMD EPYC: papernot-cnn's first layer 3.8-4.2 against 5.2 ms)."""
    m = _conv(r)
    kernel, stride, padding, dilation = _conv_geometry(m)
    if isinstance(m, nn.Conv1d):
        a = a.unsqueeze(2)
    b = a.shape[0] // r.views
    patches = channels_last_patches(a, kernel, dilation=dilation, padding=padding, stride=stride)
    # an example's views one after another: (B, K*L, d)
    patches = patches.reshape(b, -1, patches.shape[-1])
    # (B, out, K*L)
    gg = g.reshape(b, r.views, m.out_channels, -1).transpose(1, 2).reshape(b, m.out_channels, -1)
    assert gg.shape[-1] == patches.shape[1], "output positions and patches disagree"
    r.kernel_major = True
    return torch.bmm(gg, patches).unsqueeze(1)


def _conv_per_example(r: Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Each example's weight gradient, (B, ...) of the weight's numel per example, summed over its K views (by the shape rule)."""
    m = _conv(r)
    length = math.prod(g.shape[2:]) * r.views
    d_in, d_out = (
        m.in_channels // m.groups * math.prod(m.weight.shape[2:]),
        m.out_channels // m.groups,
    )
    if _bmm_is_faster(d_in, d_out, length):
        return _conv_per_example_bmm(r, a, g)
    return _conv_per_example_grouped(r, a, g)


# The pixel Gram's k x k strided slices of a (B, L', L') float64 tensor cost about this many
# multiply-adds per element summed (memory-bound; measured on a 16 x 16 layer of tramer-cifar-cnn,
# 2-core AMD EPYC): added to its estimate when the tuner decides what to time.
PIXEL_SLICE_COST = 16


def _pixel_gram_eligible(m: nn.Module) -> TypeGuard[nn.Conv2d]:
    """Whether ``_pixel_gram_sq_norms`` applies: a plain 2-D convolution (one group, zero padding
    given as numbers; any stride and dilation)."""
    return (
        type(m) is nn.Conv2d
        and m.groups == 1
        and isinstance(m.padding, tuple)
        and m.padding_mode == "zeros"
    )


def _pixel_gram_cost(m: nn.Conv2d, a: torch.Tensor, length: int, views: int) -> float:
    """Multiply-adds per example of ``_pixel_gram_sq_norms``: the padded pixels' Gram, the k x k
    shifted block sums and the output gradients' Gram (float64: ``FLOAT64_GRAM_COST``)."""
    (kh, kw), _, (ph, pw), _ = _conv_geometry(m)
    pixels = views * (a.shape[-2] + 2 * ph) * (a.shape[-1] + 2 * pw)
    return (
        FLOAT64_GRAM_COST * (pixels * pixels * m.in_channels + length * length * m.out_channels)
        + kh * kw * length * length
    )


def _pixel_gram_sq_norms(
    r: Record, a: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gram_sq_norms`` of a convolution without im2col: the patch Gram <a_t, a_s> is the sum
    over the k x k kernel offsets o of <x_{st+do}, x_{ss+do}> (stride s, dilation d), entries of
    the Gram of the zero-padded input's pixels (C_in deep instead of C_in k^2), and ||a_t||^2 the
    same sum over the pixels' squared norms. The same float64 products, reordered: each
    patch-Gram entry is off by at most gamma_{C_in + k^2 + 1} ||a_t|| ||a_s|| (Cauchy-Schwarz over
    the offsets), which the bound covers with inner = max(d_in, C_in + k^2 + 1) + d_out. An
    example's K views are one sequence of positions, as for the unfolded Gram.

    Returns:
        (upper bound of each example's squared norm (B,), W = sum_t ||a_t|| ||g_t|| (B,)), float64 W.
    """
    m, views = _conv(r), r.views
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = _conv_geometry(m)
    x = F.pad(a.double(), (pw, pw, ph, ph))  # (B*K, C, Hp, Wp)
    rows, channels, hp, wp = x.shape
    b, ho, wo = rows // views, g.shape[-2], g.shape[-1]
    # einsum: one operator where transposes, reshapes and a bmm were five (issue 63); the same sums.
    # Viewed as (B, K, Hp, Wp, K, Hp, Wp) below; one view (no AugMult) needs no reshape to K = 1.
    if views == 1:
        full = torch.einsum("bchw,bcxy->bhwxy", x, x)
        f = full.stride()
        s: tuple[int, ...] = (f[0], 0, f[1], f[2], 0, f[3], f[4])  # the K dimensions of size 1
    else:
        pixels = x.reshape(b, views, channels, hp, wp)
        full = torch.einsum("bvchw,bucxy->bvhwuxy", pixels, pixels)
        s = full.stride()
    # the pixels under kernel tap (i, j) at every output position (a tap moves both pixels of a Gram
    # entry), summed over the columns' taps and then the rows', each a strided view's trailing
    # dimension: 4 operators where a slice and an add per tap were 2 k^2 (issue 63), and on the
    # CPU as fast as those (both taps in one view reduced 7-19x slower)
    columns = full.as_strided(
        (b, views, hp, wo, views, hp, wo, kw),
        (s[0], s[1], s[2], s[3] * sw, s[4], s[5], s[6] * sw, (s[3] + s[6]) * dw),
        full.storage_offset(),
    ).sum(-1)
    t = columns.stride()
    # (B, K, Ho, Wo, K, Ho, Wo)
    patch = columns.as_strided(
        (b, views, ho, wo, views, ho, wo, kh),
        (t[0], t[1], t[2] * sh, t[3], t[4], t[5] * sh, t[6], (t[2] + t[5]) * dh),
        columns.storage_offset(),
    ).sum(-1)
    if views == 1:
        g64 = g.double()  # (B, C_out, Ho, Wo)
        gram = torch.einsum("bvhwuxy,bhwxy->b", patch, torch.einsum("bchw,bcxy->bhwxy", g64, g64))
    else:
        g64 = g.double().reshape(b, views, m.out_channels, ho, wo)
        gram = torch.einsum(
            "bvhwuxy,bvhwuxy->b", patch, torch.einsum("bvchw,bucxy->bvhwuxy", g64, g64)
        )
    # ||a_t||^2 (B, K, Ho, Wo): each output position's k x k pixels' squared norms (the pixel Gram's
    # diagonal), summed; a float64 sum of squares, never negative
    row_sums = full.as_strided(
        (b, views, hp, wo, kw),
        (s[0], s[1] + s[4], s[2] + s[5], (s[3] + s[6]) * sw, (s[3] + s[6]) * dw),
        full.storage_offset(),
    ).sum(-1)
    q = row_sums.stride()
    box = row_sums.as_strided(
        (b, views, ho, wo, kh), (q[0], q[1], q[2] * sh, q[3], q[2] * dh), row_sums.storage_offset()
    ).sum(-1)
    # ||g_t|| (B, Ho, Wo), or (B, K, Ho, Wo) with views
    g_norms = torch.linalg.vector_norm(g64, dim=-3)
    weight = torch.einsum("bvhw,bhw->b" if views == 1 else "bvhw,bvhw->b", box.sqrt(), g_norms)
    inner = max(channels * kh * kw, channels + kh * kw + 1) + m.out_channels
    return upper_bound(gram, inner, views * ho * wo, weight).to(a.dtype), weight


def _conv_weight_pixel_gram(r: Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    gram, weight = _pixel_gram_sq_norms(r, a, g)
    # the release sums every position
    r.slack = release_slack(math.prod(g.shape[2:]) * r.views, weight, a.dtype)
    return gram


def _conv_weight_gram(r: Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    patches, gg = _conv_unfold(r, a, g)
    patches, gg = _fold_views(r, patches), _fold_views(r, gg)
    # per group (B, G, L, d)
    gram, weight = gram_sq_norms(patches.transpose(2, 3), gg.transpose(2, 3))
    # the release (a convolution weight gradient) sums an example's positions and views
    r.slack = release_slack(math.prod(g.shape[2:]) * r.views, weight, a.dtype)
    return gram


def _conv_weight_bmm(r: Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    r.cache["weight"] = _conv_per_example_bmm(r, a, g)
    return cached_norms(r)


def _conv_weight_bmm_positions(r: Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    r.cache["weight"] = _conv_per_example_bmm_positions(r, a, g)
    return cached_norms(r)


def _conv_weight_grouped(r: Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    r.cache["weight"] = _conv_per_example_grouped(r, a, g)
    return cached_norms(r)


# A conv weight's exact per-example-norm methods: Gram forms (an upper bound with the release's
# slack) and instantiated gradients (kept for the release). Names appear in logs and checkpoints.
CONV_WEIGHT_METHODS = {
    "pixel-gram": _conv_weight_pixel_gram,
    "gram": _conv_weight_gram,
    "bmm": _conv_weight_bmm,
    "bmm-positions": _conv_weight_bmm_positions,
    "grouped": _conv_weight_grouped,
}


def _conv_weight_method(r: Record, a: torch.Tensor, g: torch.Tensor) -> str:
    """The shape rule's method for a conv weight (ghost: Gram forms only), or the tuner's among
    the exact candidates."""
    m, b = _conv(r), a.shape[0] // r.views
    length = math.prod(g.shape[2:]) * r.views  # an example's positions, over all its views
    d_in, d_out = (
        m.in_channels // m.groups * math.prod(m.weight.shape[2:]),
        m.out_channels // m.groups,
    )
    explicit = length * d_in * d_out
    gram_cost = FLOAT64_GRAM_COST * length * length * (d_in + d_out) + IM2COL_COST * length * d_in
    costs: dict[str, tuple[float, float]] = {
        "gram": (gram_cost, 16.0 * b * m.groups * length * length)
    }
    if _pixel_gram_eligible(m):
        (kh, kw), _, (ph, pw), _ = _conv_geometry(m)
        pixels = r.views * (a.shape[-2] + 2 * ph) * (a.shape[-1] + 2 * pw)
        taps = kh * kw  # + the k^2 strided L x L slices the tuner has seen cost
        pixel_cost = _pixel_gram_cost(m, a, length, r.views)
        costs["pixel-gram"] = (
            pixel_cost + PIXEL_SLICE_COST * taps * length * length,
            8.0 * b * (pixels * pixels + 2 * length * length),
        )
    # the rule: without the slices' cost
    if "pixel-gram" in costs and pixel_cost < min(explicit, gram_cost):
        rule = "pixel-gram"
    elif r.gram_only or use_ghost(length, d_in, d_out, overhead=IM2COL_COST * length * d_in):
        rule = "gram"
    else:
        rule = "bmm" if _bmm_is_faster(d_in, d_out, length) else "grouped"
    if not r.gram_only:
        costs.update(bmm=(explicit + IM2COL_COST * length * d_in, 0.0), grouped=(explicit, 0.0))
        if m.groups == 1:  # a tuner's candidate only, never the shape rule's
            costs["bmm-positions"] = costs["bmm"]
        costs = accurate_enough(costs, rule, length)
    signature = (
        f"{type(m).__name__}|in={tuple(a.shape[1:])}|out={tuple(g.shape[1:])}|{_conv_geometry(m)}"
        f"|groups={m.groups}|views={r.views}|{a.dtype}"
    )
    return tuned(r, signature, rule, costs, CONV_WEIGHT_METHODS, (a, g), (a, g), conv_sums, b)


def conv_norms(r: Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    """A convolution's per-example squared norms (B,), from its input ``a`` (B*K, C_in, ...) and
    output gradient ``g`` (B*K, C_out, ...): the weight's by the rule's or the tuner's method."""
    sq = None
    if r.trainable.get("weight"):
        method = _conv_weight_method(r, a, g)
        sq = plus(sq, part(r, "weight", CONV_WEIGHT_METHODS[method](r, a, g)))
    if r.trainable.get("bias"):
        r.cache["bias"] = per_example(r, g.sum(tuple(range(2, g.dim()))))
        sq = plus(sq, small_part(r, "bias"))
    return or_zeros(r, sq, a, a.shape[0] // r.views)


def _weight_gradient(m: nn.Conv1d | nn.Conv2d, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The layer's ordinary weight gradient for input ``a`` and output gradient ``g``, in its
    weight's shape: torch's convolution backward, given the weight itself for its shape (read for
    its size only) where ``conv2d_weight`` would make one (two more operators a layer, issue 63)."""
    kernel, stride, padding, dilation = _conv_geometry(m)
    if isinstance(m, nn.Conv2d) and m.weight.dtype == g.dtype:
        return torch.ops.aten.convolution_backward(
            g,
            a,
            m.weight,
            None,
            stride,
            padding,
            dilation,
            False,
            [0, 0],
            m.groups,
            (False, True, False),
        )[1]
    if isinstance(m, nn.Conv1d):
        a, g = a.unsqueeze(2), g.unsqueeze(2)
    weight = conv2d_weight(
        a,
        (m.out_channels, m.in_channels // m.groups, *kernel),
        g,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=m.groups,
    )
    return weight.reshape(m.weight.shape)


def conv_sums(r: Record, a: torch.Tensor | None, g: torch.Tensor | None, c: torch.Tensor) -> Params:
    """A convolution's clipped sums by local name for the clip factors ``c`` (B,): the cached
    per-example weight gradients scaled, or one weight gradient of ``a`` with ``g`` scaled."""
    m, out = _conv(r), {}
    if r.trainable.get("weight"):
        if "weight" in r.cache:
            summed = torch.tensordot(c, r.cache["weight"], dims=1)
            if r.kernel_major:  # (out, kh, kw, in) -> the weight's (out, in, kh, kw)
                summed = summed.reshape(m.out_channels, *_conv_geometry(m)[0], -1).movedim(-1, 1)
            out["weight"] = (
                summed if summed.shape == m.weight.shape else summed.reshape(m.weight.shape)
            )
        else:
            assert a is not None and g is not None, (
                "a record's tensors are dropped only once its weight gradients are cached"
            )
            # sum_i c_i g_i^T a_i is the ordinary weight gradient with g scaled per example:
            # the library's convolution kernel, no im2col.
            scaled = g * row_factors(r, c).view(-1, *([1] * (g.dim() - 1)))
            out["weight"] = _weight_gradient(m, a, scaled)
    if r.trainable.get("bias"):
        out["bias"] = c @ r.cache["bias"]
    return out


def ws_rows(m: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight-standardised layer's standardised rows u (out, n) and k = gain / s (out,), s =
    sqrt(n var + eps), computed in ``dtype`` (float64 for the closed forms)."""
    assert isinstance(m, (ScaledStdConv2d, ScaledStdLinear)), (
        f"{type(m).__name__} is not weight-standardised"
    )
    with torch.no_grad():
        w = m.weight.reshape(m.weight.shape[0], -1).to(dtype)
        k = m.gain.to(dtype).reshape(-1) * torch.rsqrt(
            w.var(1, unbiased=False) * w.shape[1] + m.eps
        )
        return standardized(w, m.eps), k


def ws_weight_norms(
    r: Record, grad_w: torch.Tensor, sq: torch.Tensor | None
) -> torch.Tensor | None:
    """Scaled weight standardisation, W' = gain * u with u = (W - mean) / s per output row,
    s = sqrt(n var + eps): from each example's gradient G (B, out, n) with respect to W',
    d/d gain = <u, G> and d/d W = gain / s * (G - mean(G) - u <u, G>) (the Jacobian of u is
    (P - u u^T) / s, P the centring projection). Caches both for the release; returns ``sq``
    plus their squared norms (B,)."""
    m, b = r.module, grad_w.shape[0]
    assert isinstance(m, (ScaledStdConv2d, ScaledStdLinear)), (
        f"{type(m).__name__} is not weight-standardised"
    )
    u, k = ws_rows(m, grad_w.dtype)
    along_u = (grad_w * u).sum(-1, keepdim=True)  # (B, out, 1)
    if r.trainable.get("gain"):
        r.cache["gain"] = along_u.reshape(b, *m.gain.shape)
        sq = plus(sq, part(r, "gain", blocked_sq_norms(r.cache["gain"])))
    if r.trainable.get("weight"):
        r.cache["weight"] = (grad_w - grad_w.mean(-1, keepdim=True) - u * along_u) * k.unsqueeze(1)
        sq = plus(sq, part(r, "weight", blocked_sq_norms(r.cache["weight"])))
    return sq


def ws_conv_norms(r: Record, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    """A ScaledStdConv2d's norms: the ordinary conv per-example gradient mapped by
    ``ws_weight_norms``. Needs the explicit per-example gradient in both modes."""
    m, b = r.module, a.shape[0] // r.views
    assert isinstance(m, ScaledStdConv2d), f"{type(m).__name__} is not a ScaledStdConv2d"
    sq = None
    if r.trainable.get("weight") or r.trainable.get("gain"):
        sq = ws_weight_norms(r, _conv_per_example(r, a, g).reshape(b, m.out_channels, -1), sq)
    if r.trainable.get("bias"):
        r.cache["bias"] = per_example(r, g.sum(tuple(range(2, g.dim()))))
        sq = plus(sq, small_part(r, "bias"))
    return or_zeros(r, sq, a, b)

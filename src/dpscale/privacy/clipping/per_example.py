"""Per-example clipped gradient sums: the expensive heart of DP-SGD.

An engine turns one physical chunk of examples into the *sum* of their clipped
gradients (and the per-example norms before clipping). Noise is not an engine's
business: it is added once per logical step, after all chunks are summed.

Engines are selected by name (``make_engine``); ``vmap`` is the generic reference
built on ``torch.func`` and works for any model without batch-mixing layers.
"""

from __future__ import annotations

import weakref

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from dpscale.privacy.clipping.bounds import (
    blocked_sq_norms,
    clip_factors,
    group_clip_factors,
    resolve_clip_groups,
)
from dpscale.clip_norms import MaxGradNorm, is_per_layer
from dpscale.privacy.noise.gaussian import Params
from dpscale.privacy.clipping.precision import (
    FP32,
    Precision,
    at_least_fp32,
    exact_float32,
    float32_normalization,
    needs_zeroing,
    zero_rows,
)

Batch = tuple[torch.Tensor, torch.Tensor]
# A chunk whose privacy unit is a user (issue 43): (x, y, offsets), unit j = rows offsets[j]:offsets[j + 1].
UnitChunk = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class PaddedChunk(tuple):
    """A chunk (x, y) of a fixed number of rows whose rows from ``rows`` on are padding (zeros):
    every engine gives them exactly zero loss weight, gradient, norm and count, and returns the
    norms and losses of the first ``rows`` rows only (``pad_chunk``)."""

    rows: int

    def __new__(cls, x: torch.Tensor, y: torch.Tensor, rows: int) -> "PaddedChunk":
        chunk = super().__new__(cls, (x, y))
        chunk.rows = rows
        return chunk


def pad_chunk(batch: Batch, size: int) -> Batch:
    """``batch`` with zero rows appended up to ``size`` rows (a ``PaddedChunk``), so that every
    chunk of a step has one shape (a compiled step, CUDA graphs); a chunk of ``size`` rows or more
    as it is.

    Args:
        batch: (x, y), rows first (y may hold a target per row of a unit, (B, k)).
        size: the rows every chunk is padded to.
    """
    x, y = batch
    missing = size - x.shape[0]
    if missing <= 0:
        return batch
    return PaddedChunk(
        torch.cat([x, x.new_zeros(missing, *x.shape[1:])]),
        torch.cat([y, y.new_zeros(missing, *y.shape[1:])]),
        x.shape[0],
    )


def real_rows(batch: Batch) -> int | None:
    """The rows of ``batch`` that hold examples when it is a ``PaddedChunk`` (None: every row)."""
    return batch.rows if isinstance(batch, PaddedChunk) else None


# Per-example loss: (logits (B, ...), targets (B, ...)) -> losses (B,).
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


PADDING_LABEL = -100  # cross-entropy's ignore_index: a padding row's loss is exactly 0


def padded_units(batch: UnitChunk, rows: int) -> Batch:
    """A chunk of users as (m, k, ...) inputs and (m, k) targets: user j's examples in its first
    rows, the rest copies of its first example labelled ``PADDING_LABEL`` (its own data: a zero
    input could make a layer divide by zero). With ``views=k`` and ``user_sum_loss`` every engine
    then clips the sum of a user's examples' gradients as one vector (the rows of an AugMult example
    are a user's examples here; a padding row's loss, hence its gradient, is exactly 0).

    Args:
        batch: (x, y, offsets): user j holds rows ``offsets[j]:offsets[j + 1]`` (int64, (m + 1,),
            from 0 to the number of rows), 1 to ``rows`` examples each.
        rows: k, the rows per user.

    Returns:
        (x (m, k, ...), y (m, k)).

    Raises:
        ValueError: offsets that do not cover the rows, or a user of 0 or more than k examples.
    """
    x, y, offsets = batch
    sizes = torch.diff(offsets)
    if offsets.numel() < 2 or int(offsets[0]) != 0 or int(offsets[-1]) != x.shape[0]:
        raise ValueError(
            f"unit offsets must rise from 0 to the chunk's {x.shape[0]} rows, got {offsets.tolist()}"
        )
    if bool((sizes > rows).any()) or bool((sizes < 1).any()):
        raise ValueError(
            f"every user needs 1 to {rows} examples here, got {int(sizes.min())} to {int(sizes.max())}"
        )
    if rows == 1:  # users of one example: the chunk as it is (views=1 takes (B, ...) inputs)
        return x, y
    slot = torch.arange(x.shape[0], device=x.device) - torch.repeat_interleave(
        offsets[:-1], sizes
    ).to(x.device)
    user = torch.repeat_interleave(torch.arange(len(sizes)), sizes).to(x.device)
    xs = x[offsets[:-1].to(x.device)].unsqueeze(1).repeat(1, rows, *([1] * (x.dim() - 1)))
    ys = torch.full((len(sizes), rows), PADDING_LABEL, dtype=y.dtype, device=y.device)
    xs[user, slot], ys[user, slot] = x, y
    return xs, ys


def user_sum_loss(rows: int, base: LossFn | None = None) -> LossFn:
    """A row's loss times k (``base``'s, default cross-entropy; 0 on a padding row): ``mean_over_views``
    over a user's k (x K AugMult views) rows then gives the user the sum of its examples' losses
    (each example's the mean over its views)."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if base is None:
            return (
                F.cross_entropy(logits, targets, reduction="none", ignore_index=PADDING_LABEL)
                * rows
            )
        # base never sees the marker; where() passes no gradient there
        padding = targets == PADDING_LABEL
        out = base(logits, torch.where(padding, torch.zeros_like(targets), targets))
        return torch.where(padding, torch.zeros_like(out), out) * rows

    loss.per_row_targets = True  # type: ignore[attr-defined]  # (m, k) targets, one per row (mean_over_views)
    return loss


def user_rows(batch: UnitChunk, rows: int, views: int = 1) -> Batch:
    """A chunk of users as the engines take it at the user unit (with ``user_engine_options``):
    ``padded_units`` rows, each example's K AugMult views (x of (n, K, ...)) kept together in
    its rows. Users of at most one example (k = 1) are the chunk as it is.

    Args:
        batch: (x, y, offsets), x (n, ...) or with AugMult (n, K, ...), y (n,).
        rows: k, the examples per user at most; views: K.

    Returns:
        (x, y): (m, k * K, ...) and (m, k * K), or the (x, y) of the chunk when k = 1.
    """
    if rows == 1:
        return padded_units(batch, 1)
    xs, ys = padded_units(batch, rows)  # (m, k, [K,] ...), (m, k)
    if views == 1:
        return xs, ys
    return xs.reshape(xs.shape[0], rows * views, *xs.shape[3:]), ys.repeat_interleave(views, dim=1)


def user_engine_options(rows: int, views: int, loss_fn: LossFn | None) -> tuple[int, LossFn]:
    """The engine's views and loss at the user unit, for chunks from ``user_rows``.

    Args:
        rows: k; views: K; loss_fn: the per-example loss (None: cross-entropy).

    Returns:
        (views, loss): (k * K, ``user_sum_loss(k, loss_fn)``), or (K, loss_fn) when k = 1.
    """
    if rows == 1:
        return views, loss_fn or per_example_cross_entropy
    return rows * views, user_sum_loss(rows, loss_fn)


def ghost_per_user_notice(engine: str, rows: int) -> str | None:
    """A notice when engine ghost clips users of k > 1 images: its norm of a user's gradient is
    the Gram of the user's k x T positions, so its time and memory grow as k^2 (docs/privacy-units.md)."""
    if engine != "ghost" or rows <= 1:
        return None
    return (
        f"engine ghost at the user unit (k={rows}) computes each user's {rows}T x {rows}T Gram per layer: its time and "
        "memory grow as k^2 (2.8x and 5.5x its per-image step at k = 4 and 8 on papernot-cnn, out of memory on "
        "tramer-cifar-cnn at B=128); engine auto (bk) adds nothing measurable at the user unit"
    )


def refuse_units(batch: Batch | UnitChunk, engine: str) -> None:
    """Refuse an unpadded chunk of users (x, y, offsets), in one line: engines take users only as
    ``padded_units`` rows, which their AugMult path sums per user."""
    if len(batch) != 2:
        raise ValueError(
            f"engine {engine} takes a chunk of users as padded_units(chunk, k) with views=k and loss_fn=user_sum_loss(k)"
        )


def per_example_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets, reduction="none")


def mean_over_views(
    loss_fn: LossFn, model: Callable, x: torch.Tensor, y: torch.Tensor, views: int
) -> torch.Tensor:
    """Per-example losses (B,); with augmentation multiplicity K > 1, ``x`` is (B, K, ...) and an
    example's loss is the mean over its K views (TAN eq. 5: average *before* clipping), computed
    in one forward pass over the B*K views."""
    if views == 1:
        return loss_fn(model(x), y)
    if x.shape[1] != views:
        raise ValueError(f"expected {views} views per example, got input of shape {tuple(x.shape)}")
    logits = model(x.reshape(-1, *x.shape[2:]))
    # a loss over users' rows (user_sum_loss) takes a target per row, (B, K); AugMult repeats one per example
    rows = (
        y.reshape(-1) if getattr(loss_fn, "per_row_targets", False) else y.repeat_interleave(views)
    )
    return loss_fn(logits, rows).reshape(-1, views).mean(1)


def clip_units(
    unit_sq_norms: dict[str, torch.Tensor],
    max_grad_norm: MaxGradNorm,
    group_of: dict[str, int] | None = None,
    *,
    zeros: torch.Tensor,
    unit_slack: dict[str, torch.Tensor] | None = None,
    gamma: float | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-example clip factors of each unit (a parameter, or a layer) and the total norms.

    Each unit's release is bounded by its measured norm plus its slack (``release_slack``: the
    rounding of a release that accumulates positions); the factors clip that bound, computed in
    float64, with the margin of the release's type (``dpscale.privacy.clipping.bounds``), so that the
    released contribution is <= C (or C_g per group) under worst-case rounding.

    Args:
        unit_sq_norms: unit -> per-example squared norms (B,) of its gradient; together the whole gradient.
        max_grad_norm: C (one factor min(1, C (1 - m) / bound_i) for every unit), a per-layer
            mapping (a unit's factor is its group's, from the group's bound) or None.
        group_of: unit -> group index, for a per-layer ``max_grad_norm`` (``resolve_clip_groups``).
        zeros: (B,) zeros in the type the release is computed in: the norms when no unit has a
            gradient (no trainable layer ran), and the factors' type.
        unit_slack: unit -> (B,) slack of its release (units absent: 0).
        gamma: automatic clipping (factor C (1 - m) / (bound + gamma), every example scaled);
            None: clip to C.

    Returns:
        (unit -> factors (B,), norms (B,) of the whole unclipped gradients as measured). An example
        whose norm is not finite gets factor 0 everywhere: it contributes exactly zero.
    """
    if not unit_sq_norms:  # no trainable layer ran: every gradient is zero
        return {}, zeros
    slack = unit_slack or {}
    # the units with a slack first, so that their slacks add to one slice: a few operators for all
    # units, however many (one per unit per operation before issue 63)
    units = sorted(unit_sq_norms, key=lambda unit: unit not in slack)
    sq = torch.stack([unit_sq_norms[unit] for unit in units])  # (U, B)
    norms = sq.sum(0).sqrt()
    # what each unit's release can reach, in float64: Minkowski adds the slack to the unit's norm
    reach = sq.double().clamp(min=0).sqrt()
    slacked = [slack[unit] for unit in units if unit in slack]
    if slacked:
        reach[: len(slacked)] += torch.stack(slacked)
    release_dtype = zeros.dtype
    if not is_per_layer(max_grad_norm):
        # float64: its rounding far inside clip_margin's float64 term
        bound = torch.linalg.vector_norm(reach, dim=0)
        flat_bound: float = max_grad_norm  # type: ignore[assignment]  # a number: not per layer
        factors = clip_factors(bound, flat_bound, release_dtype=release_dtype, gamma=gamma)
        factors = factors.to(release_dtype)
        # norms + bound is finite exactly when both are (neither is negative)
        factors = torch.where(torch.isfinite(norms + bound), factors, 0.0)
        return dict.fromkeys(unit_sq_norms, factors), norms
    if group_of is None:
        raise ValueError("per-layer clipping needs each unit's group (resolve_clip_groups)")
    bounds = list(max_grad_norm.values())
    index = torch.tensor([group_of[unit] for unit in units], device=reach.device)
    group_bound = (
        reach.new_zeros(len(bounds), norms.shape[0]).index_add_(0, index, reach.square()).sqrt()
    )
    finite = torch.isfinite(norms) & torch.isfinite(group_bound).all(0)
    group_factors = group_clip_factors(
        bounds, group_bound, release_dtype=release_dtype, gamma=gamma
    ).to(release_dtype)
    rows = torch.where(finite, group_factors, 0.0).unbind(0)
    return {unit: rows[group_of[unit]] for unit in unit_sq_norms}, norms


# Exact engines are compared with independent references (the start-up self-check, the ghost
# engine's route check) to a relative tolerance by dtype: reordered sums of many products differ
# by ~1e-6 in float32, a missed route by percents.
_TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-3}
_LOW_PRECISION_TOLERANCE = 3e-2
# Errors are relative to the value itself, floored at this share of the largest one, so that an
# exactly-zero gradient (a bias before a normalisation) is not judged by its float noise.
RELATIVE_ERROR_FLOOR = 1e-3


def tolerance_for(dtype: torch.dtype) -> float:
    """Relative tolerance for comparing an exact engine with a reference, for values of ``dtype``."""
    return _TOLERANCE.get(dtype, _LOW_PRECISION_TOLERANCE)


# Each model's detached trainable tensors, kept while its parameters stay the same objects with the
# same storage, flags, types and shapes: detaching every tensor launched one operator per parameter
# per step (62 of resnet18-gn's, issue 63). A detached tensor shares its parameter's storage and
# version counter, so in-place updates (the optimizer's) show through it.
_TRAINABLE: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Params]] = weakref.WeakKeyDictionary()


def trainable_params(model: nn.Module) -> Params:
    """The parameters DP-SGD updates (requires_grad=True), detached, by name (a new dict each call)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    key = tuple(
        (name, id(p), p.data_ptr(), p.dtype, p.device, p.shape, p.stride()) for name, p in named
    )
    kept = _TRAINABLE.get(model)
    if kept is None or kept[0] != key:
        kept = (key, {name: p.detach() for name, p in named})
        _TRAINABLE[model] = kept
    return dict(kept[1])


class PerExampleEngine(Protocol):
    """Computes the clipped-gradient sum of one physical chunk. Its attributes are read-only (the
    engines are frozen dataclasses or wrappers that forward them). The step reads the tensors an
    engine returns and never writes them (``train.step``), so an engine may keep or reuse them; a
    ``PaddedChunk``'s padding rows must weigh nothing, and only its real rows' norms and losses
    come back."""

    @property
    def name(self) -> str:
        """The engine's name ("vmap", "bk", "ghost")."""
        ...

    @property
    def max_grad_norm(self) -> MaxGradNorm:
        """C, per-layer bounds pattern -> C_g, or None (no clipping)."""
        ...

    @property
    def precision(self) -> Precision:
        """The forward/backward precision (its matmul flags hold for the whole step)."""
        ...

    @property
    def clip_gamma(self) -> float | None:
        """Automatic clipping's gamma (None: clip to C)."""
        ...

    def per_example_clipped_sum(
        self, model: nn.Module, params: Params, batch: Batch
    ) -> tuple[Params, torch.Tensor]:
        """Returns (sum over examples of clipped gradients, per-example gradient norms before clipping)."""
        ...

    def clipped_sum_and_losses(
        self, model: nn.Module, params: Params, batch: Batch
    ) -> tuple[Params, torch.Tensor, torch.Tensor]:
        """As ``per_example_clipped_sum`` plus the per-example losses (for logging)."""
        ...


class ClippedSumMixin:
    """What every engine shares: the interface method on top of ``clipped_sum_and_losses``,
    and the result for an empty chunk (a Poisson draw may select nobody)."""

    def per_example_clipped_sum(
        self, model: nn.Module, params: Params, batch: Batch
    ) -> tuple[Params, torch.Tensor]:
        grad_sum, norms, _ = self.clipped_sum_and_losses(model, params, batch)  # type: ignore[attr-defined]
        return grad_sum, norms

    @staticmethod
    def empty_result(params: Params, x: torch.Tensor) -> tuple[Params, torch.Tensor, torch.Tensor]:
        empty = x.new_zeros(0)
        return {k: torch.zeros_like(v) for k, v in params.items()}, empty, empty


@dataclass(frozen=True)
class VmapEngine(ClippedSumMixin):
    """Per-example gradients by ``vmap(grad(loss))`` over a batch of one.

    Args:
        max_grad_norm: clipping norm C (L2 over all trainable parameters), a per-layer mapping
            pattern -> C_g (``dpscale.privacy.clipping.bounds``); None = no clipping.
        loss_fn: per-example loss (logits, labels) -> (B,).
        views: augmentation multiplicity K (chunks hold x of shape (B, K, ...); see mean_over_views).
        precision: how the model computes (``dpscale.privacy.clipping.precision``); per-example gradients
            are taken to float32 before their norms.
        clip_gamma: automatic clipping (each gradient scaled by C / (||g|| + gamma)); None: clip to C.

    An example whose gradient is not finite contributes exactly zero, in every precision.
    """

    max_grad_norm: MaxGradNorm
    loss_fn: LossFn = per_example_cross_entropy
    name: str = "vmap"
    views: int = 1
    precision: Precision = FP32
    clip_gamma: float | None = None

    def clipped_sum_and_losses(
        self, model: nn.Module, params: Params, batch: Batch
    ) -> tuple[Params, torch.Tensor, torch.Tensor]:
        refuse_units(batch, self.name)
        rows = real_rows(batch)
        # vmap: each row apart, padding dropped
        x, y = batch if rows is None else (batch[0][:rows], batch[1][:rows])
        if x.shape[0] == 0 or not params:  # nobody sampled, or nothing to train
            return self.empty_result(params, x)
        slots, constants = _functional_slots(model, params)
        precision, scale = self.precision, self.precision.loss_scale

        def loss_one(p: Params, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            values = {**constants, **{slot: p[name] for slot, name in slots.items()}}
            forward = lambda inputs: functional_call(model, values, (inputs,), tie_weights=False)  # noqa: E731
            # 16 bits: norm layers on a float32 copy of their input (vmap cannot differentiate the mix)
            with precision.forward(xi.device), float32_normalization(precision.low):
                loss = mean_over_views(
                    self.loss_fn, forward, xi.unsqueeze(0), yi.unsqueeze(0), self.views
                )[0]
            return at_least_fp32(loss) * scale  # fp16: the fixed loss scale S

        try:
            grads, losses = vmap(grad_and_value(loss_one), in_dims=(None, 0, 0))(params, x, y)
        except RuntimeError as err:
            if "randomness" not in str(err):
                raise
            raise ValueError(
                f"{type(model).__name__} draws random numbers in its forward pass (e.g. Dropout); the vmap "
                "engine does not support that (and the draws would not be checkpointed). Remove it or use eval mode."
            ) from err
        if precision.low:  # float32 gradients of the loss itself
            grads = {k: at_least_fp32(g) / scale for k, g in grads.items()}
            losses = losses / scale
        grad_sum, norms = self._clipped_sum(grads, x.shape[0])
        return grad_sum, norms, losses.detach()

    def _clipped_sum(self, grads: Params, examples: int) -> tuple[Params, torch.Tensor]:
        """The sum of the clipped per-example gradients ``grads`` (each of ``examples`` rows) and their
        norms before clipping (``examples``,)."""
        with exact_float32():  # the clip bound's arithmetic never in TF32
            # blocked: a float32 sum of millions of squares may underestimate (clip_margin covers blocks)
            sq_norms = {k: blocked_sq_norms(g) for k, g in grads.items()}
            # per layer: each unit's group (is_per_layer, spelled out so that the type narrows)
            bounds = self.max_grad_norm
            group_of = (
                resolve_clip_groups(bounds, list(grads)).group_of
                if isinstance(bounds, Mapping)
                else None
            )
            zeros = next(iter(sq_norms.values())).new_zeros(examples)
            factors, norms = clip_units(
                sq_norms, self.max_grad_norm, group_of, zeros=zeros, gamma=self.clip_gamma
            )
            # Every precision: a non-finite example (an overflow, a NaN from its own data) contributes
            # exactly zero, a function of that example alone; its rows are set to zero, since
            # 0 * inf = NaN would spread to the whole update and show that it was in the batch.
            finite = torch.isfinite(norms)
            if needs_zeroing(finite):
                grads = {k: zero_rows(g, finite) for k, g in grads.items()}
            grad_sum = {k: torch.tensordot(factors[k], g, dims=1) for k, g in grads.items()}
        return grad_sum, norms


def _functional_slots(
    model: nn.Module, params: Params
) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Where ``functional_call`` must put each tensor: one name per (layer, attribute), each layer
    once. A parameter tied between layers gets the same (batched) value in every layer that holds
    it; a layer registered under two names is swapped once (torch's own tying would swap it twice
    and restore the model with a detached copy in place of the parameter).

    Returns:
        (slot name -> name in ``params`` for trainable tensors, slot name -> constant tensor for
        frozen parameters and buffers).
    """
    canonical = {id(p): n for n, p in model.named_parameters()}  # the name trainable_params uses
    slots, constants = {}, {}
    for prefix, module in model.named_modules():  # each layer once
        for local, t in [
            *module.named_parameters(recurse=False),
            *module.named_buffers(recurse=False),
        ]:
            slot = f"{prefix}.{local}" if prefix else local
            name = canonical.get(id(t))
            if name in params:
                slots[slot] = name
            else:
                constants[slot] = t
    return slots, constants

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

This module holds the engine; the layer rules are in ``ghost_rules`` (the rule table, Linear,
norm layers, embeddings, tokens) and ``ghost_conv`` (convolutions) over the record and shared
numerics of ``ghost_record``, and the per-model bookkeeping (support, routes, clip units, released
sums) in ``ghost_model``.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import nn

from dpscale.privacy.clipping.autotune import MethodTuner
from dpscale.privacy.clipping.bounds import clip_dtype
from dpscale.clip_norms import MaxGradNorm, is_per_layer
from dpscale.privacy.clipping.ghost.model import (
    ModelState,
    OutsideUseMonitor,
    add_deferred_norms,
    released_all,
    units_of_pass,
    unseen_routes,
    unsupported_modules,
)
from dpscale.privacy.clipping.ghost.record import Record, cached_sums
from dpscale.privacy.clipping.ghost.rules import RULES
from dpscale.privacy.clipping.per_example import (
    Batch,
    ClippedSumMixin,
    LossFn,
    clip_units,
    mean_over_views,
    per_example_cross_entropy,
    real_rows,
    refuse_units,
)
from dpscale.privacy.noise.gaussian import Params
from dpscale.privacy.clipping.precision import (
    FP32,
    Precision,
    at_least_fp32,
    exact_float32,
    needs_zeroing,
    zero_rows,
)

# unsupported_modules: imported from here (dpscale.privacy, engines)
__all__ = ["GhostEngine", "unsupported_modules"]


def _true_gradients(model: nn.Module, params: Params) -> dict[str, torch.Tensor]:
    """The model's own trainable tensors named in ``params`` (which may hold detached copies)."""
    return {name: p for name, p in model.named_parameters() if name in params and p.requires_grad}


def _unscaled(t: torch.Tensor, scale: float) -> torch.Tensor:
    """A gradient of the loss times ``scale`` (fp16 loss scaling), as float32 of the loss itself."""
    return at_least_fp32(t) / scale if scale != 1.0 else at_least_fp32(t)


def _taken(r: Record) -> tuple[torch.Tensor, torch.Tensor]:
    """The (input, output) recorded for a layer that ran (its forward hook sets both)."""
    assert r.inputs is not None and r.output is not None, f"layer {r.name!r} has no records"
    return r.inputs, r.output


def _zero_examples(records: list[Record], finite: torch.Tensor, views: int) -> None:
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
        precision: how the model computes (``dpscale.privacy.clipping.precision``): in 16 bits the forward
            pass runs under autocast and every record is taken to float32 before its norms.
        tuner: times each layer shape's exact weight-norm methods on the device once and keeps
            the fastest (``dpscale.privacy.clipping.autotune``); None: the shape rule.

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

    def clipped_sum_and_losses(
        self, model: nn.Module, params: Params, batch: Batch
    ) -> tuple[Params, torch.Tensor, torch.Tensor]:
        refuse_units(batch, self.mode)
        x, _ = batch
        if x.shape[0] == 0:
            return self.empty_result(params, x)
        grad_sum, norms, losses, _ = self.clip_with_layer_norms(model, params, batch)
        rows = real_rows(batch)  # padding rows: zero loss weight, so zero gradient, norm and sum
        return (
            (grad_sum, norms, losses) if rows is None else (grad_sum, norms[:rows], losses[:rows])
        )

    def clip_with_layer_norms(
        self, model: nn.Module, params: Params, batch: Batch
    ) -> tuple[Params, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """As ``clipped_sum_and_losses`` plus each layer's per-example squared norms (B,) by
        layer name (for the start-up self-check, which names the layers that disagree)."""
        refuse_units(batch, self.mode)
        state = self._models.setdefault(model, ModelState())
        problems = state.static_problems(model)
        if problems:
            raise ValueError(
                f"{self.mode} engine cannot handle: {'; '.join(problems)}; use engine=vmap"
            )
        key = state.route_key(model)
        check = key not in state.checked  # first pass in this mode with this parameter set
        if check and self.precision.name != "fp32":
            self._check_routes_in_float32(model, params, batch)
            check = False  # this pass's 16-bit (or TF32) rounding is no evidence about routes
        records, losses = self._recorded_forward(model, params, batch, watch=check)
        losses, scale = at_least_fp32(losses), self.precision.loss_scale
        # Gradients w.r.t. the layer outputs only (and, on a checked pass, w.r.t. the parameters);
        # the list of outputs is not kept, so that each output can be freed once its layer is done.
        checked_params = _true_gradients(model, params) if check and losses.requires_grad else {}
        targets = [_taken(r)[1] for r in records] + list(checked_params.values())
        rows = real_rows(batch)
        # padding rows weigh exactly 0
        loss = (losses if rows is None else losses[:rows]).sum() * scale
        grads: list[torch.Tensor | None] = (
            list(torch.autograd.grad(loss, targets, allow_unused=True)) if targets else []
        )
        out_grads = grads[: len(records)]
        true = {
            n: None if t is None else _unscaled(t, scale)
            for n, t in zip(checked_params, grads[len(records) :])
        }
        del targets, grads
        # the clip bound's arithmetic never in TF32; nothing after the backward pass is differentiated
        with exact_float32(), torch.no_grad():
            layer_sq = self._layer_norms(records, out_grads, state)
            units = units_of_pass(records, layer_sq, self.max_grad_norm, params)
            # the type the release is computed in (never the tokens' int type)
            zeros = batch[0].new_zeros(batch[0].shape[0], dtype=clip_dtype(params.values()))
            factors, norms = clip_units(
                units.sq,
                self.max_grad_norm,
                units.group_of,
                zeros=zeros,
                unit_slack=units.slack,
                gamma=self.clip_gamma,
            )
            finite = torch.isfinite(norms)
            # a non-finite example makes the autograd reference non-finite: this pass cannot tell
            # (a one-off pass: its host read is no cost)
            if (
                check
                and bool(finite.all())
                and self._check_routes(records, true, torch.ones_like(norms))
            ):
                state.checked.add(key)
            # Every precision: a non-finite example (an overflow, a NaN from its own data) contributes
            # exactly zero, a function of that example alone; otherwise 0 * inf = NaN would spread
            # to the whole update and show that the example was in the batch.
            if needs_zeroing(finite):
                _zero_examples(records, finite, self.views)
            sums = released_all(records, factors, units)
            # a zero tensor only for a parameter whose layer did not run (one per parameter was an
            # operator each, issue 63)
            grad_sum = {
                name: sums[name] if name in sums else torch.zeros_like(p)
                for name, p in params.items()
            }
        return grad_sum, norms.detach(), losses.detach(), layer_sq

    def _layer_norms(
        self, records: list[Record], out_grads: list[torch.Tensor | None], state: ModelState
    ) -> dict[str, torch.Tensor]:
        """Per-example squared norms (B,) by layer, each layer's output freed once used. In 16-bit
        precision each record is first taken to float32 (its gradient unscaled). With one bound for
        the whole gradient, the small cached gradients' norms are taken for all layers at once
        (``add_deferred_norms``); per-layer bounds keep every tensor's own (``Record.parts``)."""
        scale, low = self.precision.loss_scale, self.precision.low
        layer_sq: dict[str, torch.Tensor | None] = {}
        batched = not is_per_layer(self.max_grad_norm)
        for i, r in enumerate(records):
            r.defer = batched
            g, out_grads[i] = out_grads[i], None
            assert r.inputs is not None and r.output is not None, f"layer {r.name!r} has no records"
            r.out_grad = torch.zeros_like(r.output) if g is None else g
            del g
            r.output = None  # only needed as a gradient target; free it now
            if low:
                r.out_grad = _unscaled(r.out_grad, scale)
                r.inputs = at_least_fp32(r.inputs) if r.inputs.is_floating_point() else r.inputs
            layer_sq[r.name] = RULES[type(r.module)].norms(r, r.inputs, r.out_grad)
            if "weight" in r.cache or RULES[type(r.module)].sums is cached_sums:
                # the clipped sum comes from the cache: drop the activations early
                r.inputs = r.out_grad = None
        return add_deferred_norms(records, layer_sq, state)

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

    def _check_routes(
        self, records: list[Record], true: dict[str, torch.Tensor | None], ones: torch.Tensor
    ) -> bool:
        """Refuse a route the records miss; False when this pass cannot tell (an autograd
        gradient is not finite), so that the next pass checks again."""
        if any(t is not None and not bool(torch.isfinite(t).all()) for t in true.values()):
            return False
        unseen = unseen_routes(records, true, ones)
        if unseen:
            raise ValueError(
                f"{self.mode} engine: the gradient of {', '.join(unseen)} reaches the loss by a route the layer "
                "records do not see (a view or copy of the parameter used elsewhere, a replaced forward, a "
                "global hook changing an output?); use engine=vmap"
            )
        return True

    def _recorded_forward(
        self, model: nn.Module, params: Params, batch: Batch, watch: bool
    ) -> tuple[list[Record], torch.Tensor]:
        """One forward pass with every trainable layer's (input, output) recorded, checked for
        routes the records would miss (under the outside-use monitor when ``watch``). A layer
        whose recorded tensor is changed in place later is recorded from a copy, from then on
        (the pass is redone once when first found)."""
        state = self._models[model]
        for _ in range(2):
            records = self._records(
                model, params, self.views, self.mode == "ghost", self.tuner, state
            )
            losses, outside = self._forward(model, records, batch, state, watch)
            if outside:
                raise ValueError(
                    f"{self.mode} engine: parameter(s) {', '.join(outside)} reach the loss outside their own "
                    "layer's call (e.g. a tied head or a parameter used by the parent module); use engine=vmap"
                )
            for r in records:
                if r.calls > 1:
                    raise ValueError(
                        f"layer {r.name!r} ran {r.calls} times in one forward pass (weight sharing?); use engine=vmap"
                    )
            records = [r for r in records if r.calls]  # a layer that did not run has zero gradient
            taken = [(r, _taken(r)) for r in records]
            detached = [r.name for r, (_, output) in taken if not output.requires_grad]
            if detached:  # run under no_grad, e.g. by reentrant activation checkpointing
                raise ValueError(
                    f"{self.mode} engine: the outputs of layer(s) {', '.join(detached)} carry no gradient when "
                    "recorded (torch.no_grad or checkpoint(..., use_reentrant=True)?); use use_reentrant=False"
                )
            # the forward pass sees an example's K views as rows
            rows = batch[0].shape[0] * self.views
            shared = [
                r.name
                for r, (inputs, output) in taken
                if inputs.shape[0] != rows or output.shape[0] != rows
            ]
            if shared:  # e.g. a layer applied to one constant row broadcast to every example
                raise ValueError(
                    f"{self.mode} engine: layer(s) {', '.join(shared)} do not process the {rows} examples row by row "
                    "(their per-example gradients cannot be told apart); use engine=vmap"
                )
            changed = {
                r.name
                for r, (inputs, output) in taken
                if (output._version, inputs._version) != r.versions
            }
            if not changed:
                return records, losses
            if changed <= state.copied:
                break
            state.copied |= changed
        raise ValueError(
            f"{self.mode} engine: the tensors of layer(s) {', '.join(sorted(changed))} change in place"
        )

    def _forward(
        self, model: nn.Module, records: list[Record], batch: Batch, state: ModelState, watch: bool
    ) -> tuple[torch.Tensor, list[str]]:
        """The hooked forward pass: (per-example losses, parameters used outside their layer,
        when ``watch`` runs it under the outside-use monitor)."""
        x, y = batch
        monitor = OutsideUseMonitor(records) if watch else None
        handles = []
        for r in records:
            if monitor is not None:
                handles.append(
                    r.module.register_forward_pre_hook(lambda m, i: monitor.active.append(m))
                )
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
        state: ModelState | None = None,
    ) -> list[Record]:
        """A fresh record for each layer holding a parameter of ``params``; the walk over the
        modules is kept in ``state`` while the parameter set and names stay the same."""
        key = (state.support_key, tuple(params)) if state is not None else None
        if state is None or state.layers_key != key:
            layers = []
            for name, module in model.named_modules():
                local = {
                    pname: (f"{name}.{pname}" if name else pname) in params
                    for pname, _ in module.named_parameters(recurse=False)
                }
                if any(local.values()):
                    layers.append((module, name, local))
            if state is None:
                return [
                    Record(m, n, dict(t), views=views, gram_only=gram_only, tuner=tuner)
                    for m, n, t in layers
                ]
            state.layers, state.layers_key = layers, key
        return [
            Record(m, n, dict(t), views=views, gram_only=gram_only, tuner=tuner)
            for m, n, t in state.layers
        ]

    @staticmethod
    def _capture(record: Record, copy: bool, monitor: OutsideUseMonitor | None) -> Callable:
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
            if monitor is not None:
                monitor.active.pop()
            record.calls += 1
            # not detached (an operator a layer): every use is under no_grad (clip_with_layer_norms)
            record.inputs = inputs[0].detach().clone() if copy else inputs[0]
            record.output = output
            record.versions = (output._version, record.inputs._version)
            # The rest of the model sees a copy, so in-place changes there leave the record intact.
            return output.clone() if copy else None

        return hook

"""Start-up self-check: the chosen clipping engine against a per-example loop on real examples.

The ghost/bk engines are exact only for the routes their per-layer records see; support checks
catch the known ways a model can leave that set (see ``dpscale.privacy.clipping.ghost.engine``), and this check
catches the rest on the run's own model. Before the first step, on a few real training examples,
the engine's per-example norms, each layer's per-example norms (ghost/bk) and the clipped sum of
every parameter are compared with a plain loop of batch-of-one backward passes (no hooks, no
vmap). Beyond the tolerance the run refuses, naming the layers and parameters that differ, or,
for ``engine: auto``, falls back to vmap (which is checked the same way).

Tolerance (relative): 1e-8 in float64; 1e-3 in float32, where reordered sums of many products
differ by ~1e-6 and a missed route differs by percents; 3e-2 in 16-bit types.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace

import torch
from torch import nn

from dpscale.privacy.clipping.bounds import clip_dtype
from dpscale.clip_norms import MaxGradNorm
from dpscale.privacy.clipping.autotune import MethodTuner
from dpscale.privacy.clipping.engines import make_engine
from dpscale.privacy.clipping.independence import IndependenceResult, check_batch_independence
from dpscale.privacy.clipping.per_example import (
    RELATIVE_ERROR_FLOOR,
    Batch,
    LossFn,
    PerExampleEngine,
    VmapEngine,
    per_example_cross_entropy,
    tolerance_for,
    trainable_params,
)
from dpscale.privacy.noise.gaussian import Params
from dpscale.privacy.clipping.precision import FP32, Precision
from dpscale.privacy.clipping.reference import (
    PerExampleReference,
    float64_copy,
    per_example_reference,
)

SELF_CHECK_EXAMPLES = 8  # examples the check runs on (fewer if the training set is smaller)


@dataclass(frozen=True)
class SelfCheckResult:
    """Attributes:
    engine: the engine checked.
    examples: examples compared.
    tolerance: relative tolerance applied.
    norm_error: largest relative error of a per-example norm.
    sum_error: largest relative error of a parameter's clipped sum.
    mismatched: layers (per-example norms) and parameters (clipped sums) beyond the tolerance.
    refusal: the engine's own refusal (e.g. a parameter used outside its layer), if it refused.
    seconds: wall time of the check.
    independence: the batch-independence check run with it (``checked_engine``), if any.
    """

    engine: str
    examples: int
    tolerance: float
    norm_error: float
    sum_error: float
    mismatched: tuple[str, ...]
    refusal: str | None
    seconds: float
    independence: IndependenceResult | None = None

    @property
    def ok(self) -> bool:
        return self.refusal is None and not self.mismatched

    def as_json(self) -> dict:
        """The verdict for summary.json (no timing, so that reruns compare equal)."""
        return {
            "engine": self.engine,
            "passed": self.ok,
            "examples": self.examples,
            "tolerance": self.tolerance,
            "norm_error": self.norm_error,
            "sum_error": self.sum_error,
            "mismatched": list(self.mismatched),
            "batch_independence": None
            if self.independence is None
            else {
                "passed": self.independence.ok,
                "examples": self.independence.examples,
                "loss_error": self.independence.loss_error,
                "norm_error": self.independence.norm_error,
            },
        }

    def describe(self) -> str:
        if self.refusal is not None:
            return f"self-check: {self.engine} refused: {self.refusal}"
        verdict = "matches" if self.ok else "DIFFERS from"
        text = (
            f"self-check: {self.engine} {verdict} a per-example loop on {self.examples} examples "
            f"(largest relative error: norms {self.norm_error:.2g}, clipped sums {self.sum_error:.2g}; "
            f"tolerance {self.tolerance:g}; {self.seconds:.2f} s)"
        )
        return text if self.ok else f"{text} in: {', '.join(self.mismatched)}"


def _relative(error: torch.Tensor, value: torch.Tensor, scale: float) -> float:
    if not error.numel():
        return 0.0
    return float((error / value.clamp(min=RELATIVE_ERROR_FLOOR * scale + 1e-300)).max().detach())


def self_check(engine: PerExampleEngine, model: nn.Module, batch: Batch) -> SelfCheckResult:
    """Compare ``engine`` on ``batch`` with the per-example loop (``per_example_reference``, its
    forward pass in the engine's precision), in eval mode, so that both see the same
    deterministic function (the training mode is restored).

    Args:
        engine: the engine to check (holds C, the loss and the views).
        model: the model it will train.
        batch: a few real training examples (x, y), x of shape (B, K, ...) with K views.

    Returns:
        the verdict, with the largest errors and the layers/parameters that differ.
    """
    started = time.perf_counter()
    params = trainable_params(model)
    precision = getattr(engine, "precision", FP32)
    dtype = (
        precision.compare_dtype
        if precision.name != "fp32"
        else next(iter(params.values()), torch.zeros(())).dtype
    )
    tol = tolerance_for(dtype) if params else 0.0
    was_training = model.training
    model.eval()
    try:
        try:
            grad_sum, norms, layer_sq = _engine_side(engine, model, params, batch)
            finite = torch.isfinite(norms.detach()).cpu()
            # it overflows on its own (zeroed, tested elsewhere); a float64 reference would not
            if not finite.all():
                batch = (batch[0][finite.to(batch[0].device)], batch[1][finite.to(batch[1].device)])
                grad_sum, norms, layer_sq = _engine_side(engine, model, params, batch)
        except ValueError as err:
            return SelfCheckResult(
                engine.name,
                len(batch[1]),
                tol,
                0.0,
                0.0,
                (),
                str(err),
                time.perf_counter() - started,
            )
        got = (grad_sum, norms, layer_sq)
        # the reference clips with the engine's margin (that of the type it clips in), in any dtype
        release = clip_dtype(params.values())
        result = _compare(
            engine.name,
            tol,
            got,
            _reference(engine, model, params, batch, precision, release),
            started,
        )
        # judged again against the exact values (below)
        if not result.ok and dtype == torch.float32:
            copy = _float64_reference(model, params, batch)
            exact = _compare(
                engine.name, tol, got, _reference(engine, *copy, release_dtype=release), started
            )
            if not exact.ok and copy[0] is not model:  # the engine's own rules, run in float64 too
                exact = _judged_in_float64(engine, copy, tol, started) or exact
            result = exact if exact.ok else result
    finally:
        model.train(was_training)
    return result


def _judged_in_float64(
    engine: PerExampleEngine, copy: tuple, tol: float, started: float
) -> SelfCheckResult | None:
    """The engine run on the float64 copy against the float64 loop; None when it refuses there (a
    route its records miss, say), which leaves the float32 verdict standing."""
    try:
        got = _engine_side(engine, *copy)
    except ValueError:
        return None
    return _compare(engine.name, tol, got, _reference(engine, *copy), started)


def _reference(
    engine: PerExampleEngine,
    model: nn.Module,
    params: Params,
    batch: Batch,
    precision: Precision = FP32,
    release_dtype: torch.dtype = torch.float32,
) -> PerExampleReference:
    """The per-example loop for ``engine``'s C, loss and views, through ``model`` as it is, with
    the clip margin of ``release_dtype`` (the type the engine clips in)."""
    loss_fn = getattr(engine, "loss_fn", per_example_cross_entropy)
    views = getattr(engine, "views", 1)
    return per_example_reference(
        model,
        batch,
        engine.max_grad_norm,
        loss_fn=loss_fn,
        views=views,
        names=list(params),
        precision=precision,
        release_dtype=release_dtype,
        clip_gamma=getattr(engine, "clip_gamma", None),
    )


def _engine_side(engine: PerExampleEngine, model: nn.Module, params: Params, batch: Batch) -> tuple:
    """The engine's clipped sum, per-example norms and (ghost/bk) per-layer squared norms."""
    if hasattr(engine, "clip_with_layer_norms"):
        grad_sum, norms, _, layer_sq = engine.clip_with_layer_norms(model, params, batch)
        return grad_sum, norms, layer_sq
    grad_sum, norms, _ = engine.clipped_sum_and_losses(model, params, batch)
    return grad_sum, norms, {}


def _float64_reference(
    model: nn.Module, params: Params, batch: Batch
) -> tuple[nn.Module, Params, Batch]:
    """A float64 copy of a float32 model and batch. The engine must match the reference loop in
    its own precision or, failing that, in float64 (its float32 result against the float64 loop,
    else the engine itself run in float64): a float32 batch of one takes other kernels than a batch
    (oneDNN, cuDNN), float32 itself can be 1e-3 off on the cancelling sums of a deep model with many
    views, and where two max-pooled values lie within float32's rounding of each other the kernels
    route the gradient to different inputs (5e-3 on tramer-cifar-cnn, docs/benchmarks.md); a missed
    route or a wrong rule fails in every precision. (The model itself, if it cannot be copied.)"""
    try:
        copy, copied_batch = float64_copy(model, batch)
    except Exception:  # an uncopyable model keeps the float32 reference
        return model, params, batch
    return copy, trainable_params(copy), copied_batch


def _compare(
    name: str, tol: float, got: tuple, want: PerExampleReference, started: float
) -> SelfCheckResult:
    grad_sum, norms, layer_sq = got
    ref_sum, ref_norms, ref_layer_sq, scales = (
        want.clipped_sum,
        want.norms,
        want.layer_sq_norms,
        want.clipped_norm_sums,
    )
    scale = float(ref_norms.max()) if ref_norms.numel() else 0.0
    norm_error = _relative((norms.double().cpu() - ref_norms.cpu()).abs(), ref_norms.cpu(), scale)
    mismatched = []
    for layer, sq in layer_sq.items():
        want_layer = ref_layer_sq.get(layer, torch.zeros_like(ref_norms)).cpu().sqrt()
        error = (sq.detach().double().cpu().clamp(min=0).sqrt() - want_layer).abs()
        if _relative(error, want_layer, scale) > tol:
            mismatched.append(f"layer {layer or '<root>'} (per-example norms)")
    if not layer_sq and norm_error > tol:
        mismatched.append("per-example norms")
    # a clipped sum's error is judged against the sum of its examples' clipped norms (its size
    # without cancellation: float32 rounding scales with it, a missed route is percents of it)
    size = {
        p: max(scales.get(p, 0.0), float(torch.linalg.vector_norm(r.double())))
        for p, r in ref_sum.items()
    }
    total = float(torch.sqrt(torch.tensor(sum(v * v for v in size.values()), dtype=torch.float64)))
    sum_error = 0.0
    for param, ref in ref_sum.items():
        error = torch.linalg.vector_norm((grad_sum[param] - ref).double()).reshape(1)
        relative = _relative(error.cpu(), torch.tensor([size[param]], dtype=torch.float64), total)
        sum_error = max(sum_error, relative)
        if relative > tol:
            mismatched.append(f"parameter {param} (clipped sum)")
    examples = int(ref_norms.numel())
    return SelfCheckResult(
        name,
        examples,
        tol,
        norm_error,
        sum_error,
        tuple(mismatched),
        None,
        time.perf_counter() - started,
    )


def checked_engine(
    name: str,
    max_grad_norm: MaxGradNorm,
    model: nn.Module,
    batch: Batch,
    *,
    views: int = 1,
    loss_fn: LossFn = per_example_cross_entropy,
    check: bool = True,
    precision: Precision = FP32,
    tuner: MethodTuner | None = None,
    clip_gamma: float | None = None,
) -> tuple[PerExampleEngine, list[str], SelfCheckResult | None]:
    """The engine a run trains with: ``make_engine``'s choice, verified on ``batch``.

    With ``check``, first the batch-independence check (train mode: the model, the loss and the
    engine's norms treat each example on its own, ``check_batch_independence``), then the
    comparison with a per-example loop (``self_check``); without it, a ghost/bk engine still runs
    once on ``batch`` so that a parameter used outside its layer is found before training.
    ``auto`` falls back to vmap (checked in turn) with a notice when only the engine failed; an
    explicitly named engine that fails, or a model or loss that mixes examples, raises. ``tuner``:
    bk/ghost's per-layer method tuner (None: a fresh ``default_tuner()``). ``clip_gamma``:
    automatic clipping's gamma (``make_engine``), for the engine and its reference loop alike.

    Returns:
        (engine, notices to print, the self-check of the returned engine or None if not checked).

    Raises:
        ValueError: the model or loss mixes examples, or the named engine (or vmap, after auto's
            fallback) failed, naming what differs.
    """
    make = functools.partial(
        make_engine,
        model=model,
        loss_fn=loss_fn,
        views=views,
        precision=precision,
        clip_gamma=clip_gamma,
    )
    engine, notice = make(name, max_grad_norm, tuner=tuner)
    notices = [notice] if notice else []
    failure, engine_only, result, independence = _verdict(engine, model, batch, check)
    if (
        failure is not None
        and engine_only
        and name == "auto"
        and not isinstance(engine, VmapEngine)
    ):
        notices.append(f"engine auto -> vmap: {failure}")
        engine, _ = make("vmap", max_grad_norm)
        failure, _, result, independence = _verdict(engine, model, batch, check)
    if failure is not None:
        raise ValueError(f"{failure}; refusing to train with engine={engine.name}")
    if result is not None:
        result = replace(result, independence=independence)
    return engine, notices, result


def _verdict(
    engine: PerExampleEngine, model: nn.Module, batch: Batch, check: bool
) -> tuple[str | None, bool, SelfCheckResult | None, IndependenceResult | None]:
    """Why ``engine`` cannot train ``model`` (independence check, then self-check) or None, whether
    only the engine is at fault (False: the model or loss itself mixes examples), the self-check
    (None unless ``check``) and the independence check (None unless ``check`` and >= 2 examples)."""
    independence = check_batch_independence(engine, model, batch) if check else None
    if independence is not None and not independence.ok:
        return independence.describe(), independence.engine_only, None, independence
    # the per-example loop: a few suffice
    head = (batch[0][:SELF_CHECK_EXAMPLES], batch[1][:SELF_CHECK_EXAMPLES])
    result = _verify(engine, model, head, check)
    if result is not None and not result.ok:
        return result.describe(), True, result, independence
    return None, True, result if check else None, independence


def _verify(
    engine: PerExampleEngine, model: nn.Module, batch: Batch, check: bool
) -> SelfCheckResult | None:
    if check:
        return self_check(engine, model, batch)
    if isinstance(engine, VmapEngine):
        return None
    try:  # the route probe only: a refusal, not a comparison
        engine.clipped_sum_and_losses(model, trainable_params(model), batch)
    except ValueError as err:
        return SelfCheckResult(engine.name, len(batch[1]), 0.0, 0.0, 0.0, (), str(err), 0.0)
    return None

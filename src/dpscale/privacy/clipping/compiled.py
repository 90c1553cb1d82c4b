"""The compiled step (issue 63): the vmap engine's clipped sum captured whole by ``torch.compile``.

One chunk's forward pass, backward pass (``vmap(grad)`` over batches of one), per-example norms,
clip factors and clipped (weighted) sum run as one compiled graph; the noise and the accounting
stay outside, in the step and the mechanism, unchanged. The clip bound is the eager engines':
the same ``blocked_sq_norms`` and ``clip_units`` (float64 bounds, ``clip_margin``) run inside the
graph, and the margin covers any order of summation and one rounding per operation, which is all
that compiled kernels change (the bound holds by construction, not by equality with eager).

Shapes are fixed: each new chunk shape (or model, training mode, set of trainable parameters)
compiles again (``dynamic=False``; seconds to minutes on a CPU), so a run should give every chunk
one size (``fixed_shapes``' padded chunks, their padding masked with a row mask). Past torch's recompile limit (8 per
process by default) torch runs the same function eagerly: the same arithmetic, no speed-up. On
CUDA the graph is replayed as a CUDA graph (``mode="reduce-overhead"``); on a CPU, inductor's
default mode.

Each new shape's first chunk is also run through the eager vmap engine and the two compared
(``compiled_check``): a capture that computes something else is refused, not trained.
What it does not take (``check_compilable``) is refused in one line: engines bk and ghost (their
hooks are not captured), precisions other than fp32, tied trainable parameters, and the layers the
vmap engine refuses.
"""

from __future__ import annotations

import itertools
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from dpscale.privacy.clipping.bounds import blocked_sq_norms, resolve_clip_groups
from dpscale.clip_norms import MaxGradNorm
from dpscale.privacy.clipping.compiled_check import capture_mismatch
from dpscale.privacy.clipping.per_example import (
    Batch,
    ClippedSumMixin,
    LossFn,
    PerExampleEngine,
    VmapEngine,
    clip_units,
    mean_over_views,
    per_example_cross_entropy,
    real_rows,
    refuse_units,
)
from dpscale.privacy.noise.gaussian import Params
from dpscale.privacy.clipping.layer_refusals import check_per_example_compatible
from dpscale.privacy.clipping.precision import FP32, Precision, exact_float32, zero_rows

# the engine's name in logs, summaries and the bench's resolved column
COMPILED_ENGINE = "vmap-compiled"
COMPILED_NOTE = (
    "compile: each chunk's clipped sum runs as one torch.compile graph of the vmap engine (checked above); each new "
    "chunk shape compiles once (seconds to minutes) and is compared once with the eager engine; train.fixed_shapes (on "
    "with compile where the batches have a largest size) pads every chunk to one shape"
)

# (engine, model, chunk) -> the engine the first-chunk check lets train (``make_private``'s, the Trainer's)
FirstChunkCheck = Callable[[PerExampleEngine, nn.Module, Batch], PerExampleEngine]
# (params, x, y, row mask or None, C as a float64 0-d tensor or None) -> (clipped sum, norms, losses)
ClippedSums = Callable[..., tuple[Params, torch.Tensor, torch.Tensor]]


def check_compilable(engine: str, precision: Precision, model: nn.Module | None = None) -> None:
    """Refuse, in one line, what the compiled step does not take.

    Args:
        engine: the engine asked for ("auto" and "vmap" compile the vmap engine).
        precision: the run's precision (fp32 only).
        model: the model, whose layers and tied parameters are checked (None: not yet known).

    Raises:
        ValueError: engine bk or ghost, a precision other than fp32, a trainable parameter held by
            two layers, or a layer the vmap engine refuses; each with the way out.
    """
    if engine in ("bk", "ghost"):
        raise ValueError(
            f"compile captures the vmap engine's per-example gradients (engine {engine}'s hooks are not captured "
            f"by torch.compile): use engine=auto or vmap with compile, or engine={engine} without it"
        )
    if precision.name != "fp32":
        raise ValueError(
            f"compile runs in fp32 only (precision {precision.name}'s autocast, float32 norm-layer copies and TF32 "
            f"flags are not captured): use precision=fp32 with compile, or {precision.name} without it"
        )
    if model is None:
        return
    _refuse_tied(model)
    try:
        check_per_example_compatible(model, "vmap")
    except ValueError as err:
        raise ValueError(f"{err} (compile runs the vmap engine)") from err


def _refuse_tied(model: nn.Module) -> None:
    """Refuse a trainable tensor held by two layers: the compiled step swaps each parameter in
    under its first name only, so the second layer would use it as a constant."""
    holder: dict[int, str] = {}
    for prefix, module in model.named_modules():  # each layer once
        for local, p in module.named_parameters(recurse=False):
            name = f"{prefix}.{local}" if prefix else local
            if p.requires_grad and holder.setdefault(id(p), name) != name:
                raise ValueError(
                    f"compile: parameter {holder[id(p)]} is also {name} (tied weights), which the compiled step would "
                    "read as a constant there; untie them, or train without compile"
                )


def compiled_engine_name(engine: str, precision: Precision, model: nn.Module | None = None) -> str:
    """The eager engine a compiled run builds and checks first: vmap, for ``engine`` auto or vmap
    (``check_compilable``'s refusals otherwise)."""
    check_compilable(engine, precision, model)
    return "vmap"


# numbers the code objects of the captured functions (``_own_code``)
_CAPTURES = itertools.count()


@dataclass
class _ModelCaptures:
    """One model's compiled functions by setting, and the chunk shapes already compared with the eager engine."""

    functions: dict[tuple, ClippedSums] = field(default_factory=dict)
    checked: set[tuple] = field(default_factory=set)


@dataclass
class _Captures:
    """What every copy of one engine shares (``dataclasses.replace`` keeps it: adaptive clipping
    makes a copy each step with its new C): each model's ``_ModelCaptures``."""

    models: weakref.WeakKeyDictionary[nn.Module, _ModelCaptures] = field(
        default_factory=weakref.WeakKeyDictionary
    )


@dataclass(frozen=True)
class CompiledEngine(ClippedSumMixin):
    """The vmap engine's clipped sum, compiled (see the module docstring).

    Args:
        max_grad_norm: C (passed to the graph as a tensor: adaptive clipping's moving C compiles
            once), per-layer bounds pattern -> C_g (part of the graph), or None (no clipping).
        loss_fn: per-example loss (logits, labels) -> (B,).
        views: augmentation multiplicity K (x of (B, K, ...), as ``VmapEngine``).
        precision: fp32 only (``check_compilable``).
        clip_gamma: automatic clipping's gamma (None: clip to C).

    An example whose gradient is not finite contributes exactly zero, as in the eager engines.
    """

    max_grad_norm: MaxGradNorm
    loss_fn: LossFn = per_example_cross_entropy
    name: str = COMPILED_ENGINE
    views: int = 1
    precision: Precision = FP32
    clip_gamma: float | None = None
    captures: _Captures = field(default_factory=_Captures, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_compilable("vmap", self.precision)

    @classmethod
    def of(cls, engine: PerExampleEngine) -> CompiledEngine:
        """The compiled twin of a vmap engine (its C, loss, views, precision and gamma).

        Raises:
            ValueError: ``engine`` is not a vmap engine.
        """
        if not isinstance(engine, VmapEngine):
            check_compilable(engine.name, engine.precision)  # bk and ghost: their own line
            raise ValueError(f"compile takes the vmap engine, got engine {engine.name}")
        return cls(
            engine.max_grad_norm,
            engine.loss_fn,
            views=engine.views,
            precision=engine.precision,
            clip_gamma=engine.clip_gamma,
        )

    @property
    def eager(self) -> VmapEngine:
        """The eager vmap engine of the same settings: what the set-up checks run and each new shape is compared with."""
        return VmapEngine(
            self.max_grad_norm,
            self.loss_fn,
            views=self.views,
            precision=self.precision,
            clip_gamma=self.clip_gamma,
        )

    def clipped_sum_and_losses(
        self, model: nn.Module, params: Params, batch: Batch, row_mask: torch.Tensor | None = None
    ) -> tuple[Params, torch.Tensor, torch.Tensor]:
        """One chunk's clipped sum, per-example norms and losses.

        Args:
            model, params, batch: as every engine's (x (B, ...) or (B, K, ...), y (B,)).
            row_mask: (B,) bool, False on padding rows: each contributes exactly zero (its loss
                and norm read 0, nothing of it is summed); count the examples as ``row_mask.sum()``.

        Returns:
            (clipped sum by parameter, norms (B,), losses (B,)).
        """
        refuse_units(batch, self.name)
        x, y = batch
        rows = real_rows(batch)
        # a fixed-shape chunk (pad_chunk): its padding masked, its examples' norms and losses returned
        if rows is not None:
            padding = torch.arange(x.shape[0], device=x.device) < rows
            grad_sum, norms, losses = self.clipped_sum_and_losses(
                model, params, (x, y), padding if row_mask is None else row_mask & padding
            )
            return grad_sum, norms[:rows], losses[:rows]
        _check_mask(row_mask, x.shape[0])
        if x.shape[0] == 0 or not params:  # nobody sampled, or nothing to train
            return self.empty_result(params, x)
        captures = self.captures.models.setdefault(model, _ModelCaptures())
        function = self._function(captures, model, params, x.device)
        clip = None
        # a fill, no host copy
        if self.max_grad_norm is not None and not isinstance(self.max_grad_norm, Mapping):
            clip = torch.full((), float(self.max_grad_norm), dtype=torch.float64, device=x.device)
        key = (
            tuple(x.shape),
            x.dtype,
            x.device,
            tuple(y.shape),
            row_mask is None,
            model.training,
            tuple(params),
        )
        with exact_float32():  # never TF32 (the clip bound's arithmetic, and fp32's forward)
            if key in captures.checked:
                return _owned(_run(function, params, x, y, row_mask, clip))
            result = self._first_run(function, model, params, batch, row_mask, clip)
        captures.checked.add(key)
        return result

    def _function(
        self, captures: _ModelCaptures, model: nn.Module, params: Params, device: torch.device
    ) -> ClippedSums:
        """The compiled function for this model, these settings and parameters, and the device's mode."""
        bounds = self.max_grad_norm if isinstance(self.max_grad_norm, Mapping) else None
        settings = (
            self.loss_fn,
            self.views,
            self.clip_gamma,
            None if bounds is None else tuple(bounds.items()),
            tuple(params),
            device.type,
        )
        if settings not in captures.functions:
            check_compilable("vmap", self.precision, model)
            group_of = (
                resolve_clip_groups(bounds, list(params)).group_of if bounds is not None else None
            )
            sums = _own_code(
                clipped_sums(model, self.loss_fn, self.views, self.clip_gamma, bounds, group_of)
            )
            mode = "reduce-overhead" if device.type == "cuda" else None  # CUDA graphs on a GPU
            captures.functions[settings] = torch.compile(
                sums, dynamic=False, fullgraph=True, mode=mode
            )
        return captures.functions[settings]

    def _first_run(
        self,
        function: ClippedSums,
        model: nn.Module,
        params: Params,
        batch: Batch,
        row_mask: torch.Tensor | None,
        clip: torch.Tensor | None,
    ) -> tuple[Params, torch.Tensor, torch.Tensor]:
        """A new shape: the eager vmap engine on the kept rows first (its refusals, e.g. a model
        that draws random numbers, come from it), then the capture, compared with it."""
        x, y = batch
        kept = (x, y) if row_mask is None else (x[row_mask], y[row_mask])
        want = self.eager.clipped_sum_and_losses(model, params, kept)
        try:
            got = _owned(_run(function, params, x, y, row_mask, clip))
        except Exception as err:  # any failure to capture is refused in one line
            first = (str(err).strip().splitlines() or [""])[0][:200]
            raise ValueError(
                f"compile: torch.compile could not capture {type(model).__name__}'s clipped step ({type(err).__name__}: "
                f"{first}); train without compile"
            ) from err
        rows = got[1] if row_mask is None else got[1][row_mask]
        losses = got[2] if row_mask is None else got[2][row_mask]
        differs = capture_mismatch(
            (got[0], rows, losses),
            want,
            model=model,
            params=params,
            kept=kept,
            max_grad_norm=self.max_grad_norm,
            loss_fn=self.loss_fn,
            views=self.views,
            clip_gamma=self.clip_gamma,
        )
        if differs:
            raise ValueError(
                f"compile: the compiled step differs from the eager vmap engine (and from the float64 loop) on a chunk of "
                f"{tuple(x.shape)} ({differs}); train without compile"
            )
        return got


def compiled_choice(
    engine: PerExampleEngine, check: FirstChunkCheck | None
) -> tuple[CompiledEngine, FirstChunkCheck | None]:
    """A run's eager engine, built and checked as every run's (``compiled_engine_name``'s vmap),
    compiled; its first-chunk check, if any, run on the eager twin (a check's passes over halved
    chunks would each compile a shape the run never takes).

    Raises:
        ValueError: an engine other than the vmap engine (bk and ghost are refused first).
    """
    compiled = CompiledEngine.of(engine)
    if check is None:
        return compiled, None

    def eager_check(engine: PerExampleEngine, model: nn.Module, chunk: Batch) -> PerExampleEngine:
        if not isinstance(engine, CompiledEngine):
            return check(engine, model, chunk)
        eager = engine.eager
        verdict = check(eager, model, chunk)
        return engine if verdict == eager else CompiledEngine.of(verdict)

    return compiled, eager_check


def _own_code(function: ClippedSums) -> ClippedSums:
    """``function`` with a code object of its own. torch.compile keeps its graphs, and its limit
    on recompiling (8 by default), per code object: shared by every model, the ninth model or shape
    in a process (a test suite, a sweep) would run eagerly without a word."""
    number = next(_CAPTURES)
    code = function.__code__
    own = code.replace(
        co_name=f"{code.co_name}_{number}", co_qualname=f"{code.co_qualname}_{number}"
    )
    return types.FunctionType(
        own, function.__globals__, own.co_name, function.__defaults__, function.__closure__
    )


def _check_mask(row_mask: torch.Tensor | None, rows: int) -> None:
    """Refuse a row mask that is not one bool per row (read from its type and shape: no host sync)."""
    if row_mask is not None and (row_mask.dtype != torch.bool or tuple(row_mask.shape) != (rows,)):
        raise ValueError(
            f"row_mask must be a bool tensor of shape ({rows},), one per row, got {row_mask.dtype} {tuple(row_mask.shape)}"
        )


def _run(
    function: ClippedSums,
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    row_mask: torch.Tensor | None,
    clip: torch.Tensor | None,
) -> tuple[Params, torch.Tensor, torch.Tensor]:
    # a new replay of the CUDA graph: the previous outputs may be overwritten
    if x.device.type == "cuda":
        torch.compiler.cudagraph_mark_step_begin()
    return function(params, x, y, row_mask, clip)


def _owned(
    result: tuple[Params, torch.Tensor, torch.Tensor],
) -> tuple[Params, torch.Tensor, torch.Tensor]:
    """The outputs, copied out of a CUDA graph's buffers (its next replay overwrites them); as they are elsewhere."""
    grad_sum, norms, losses = result
    if norms.device.type != "cuda":
        return result
    return {k: g.clone() for k, g in grad_sum.items()}, norms.clone(), losses.clone()


def clipped_sums(
    model: nn.Module,
    loss_fn: LossFn,
    views: int,
    gamma: float | None,
    bounds: Mapping[str, float] | None,
    group_of: dict[str, int] | None,
) -> ClippedSums:
    """The function ``torch.compile`` captures: the vmap engine's arithmetic for one chunk.

    Args:
        model: the model (its frozen parameters and buffers are read from it).
        loss_fn, views, gamma: the engine's loss, views K and automatic clipping's gamma.
        bounds, group_of: per-layer bounds and each parameter's group (None: one C, or none).

    Returns:
        f(params, x, y, rows, clip) -> (clipped sum, norms (B,), losses (B,)): ``rows`` a (B,) bool
        mask or None (every row), ``clip`` C as a float64 0-d tensor (None with ``bounds`` or
        without clipping). Rows masked out, and examples whose norm is not finite, contribute
        exactly zero (``zero_rows``: set, not multiplied); masked rows' norms and losses read 0.
    """

    def loss_one(p: Params, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        forward = lambda inputs: functional_call(model, p, (inputs,), tie_weights=False)  # noqa: E731
        return mean_over_views(loss_fn, forward, xi.unsqueeze(0), yi.unsqueeze(0), views)[0]

    def sums(
        params: Params,
        x: torch.Tensor,
        y: torch.Tensor,
        rows: torch.Tensor | None,
        clip: torch.Tensor | None,
    ) -> tuple[Params, torch.Tensor, torch.Tensor]:
        grads, losses = vmap(grad_and_value(loss_one), in_dims=(None, 0, 0))(params, x, y)
        # blocked: a float32 sum of millions of squares may underestimate (clip_margin covers blocks)
        sq_norms = {k: blocked_sq_norms(g) for k, g in grads.items()}
        zeros = next(iter(sq_norms.values())).new_zeros(x.shape[0])
        # C as a tensor: clip_factors' arithmetic is the same
        limit: Any = bounds if bounds is not None else clip
        factors, norms = clip_units(sq_norms, limit, group_of, zeros=zeros, gamma=gamma)
        keep = torch.isfinite(norms) if rows is None else rows & torch.isfinite(norms)
        grad_sum = {
            k: torch.tensordot(factors[k], zero_rows(g, keep), dims=1) for k, g in grads.items()
        }
        if rows is None:
            return grad_sum, norms, losses.detach()
        return grad_sum, torch.where(rows, norms, 0.0), torch.where(rows, losses.detach(), 0.0)

    return sums

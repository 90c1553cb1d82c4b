"""Batch-independence check: does an example's loss and clipped gradient depend on the others?

DP-SGD's sensitivity bound (one example moves the clipped sum by at most C) holds only if each
example's loss, and the engine's per-example gradient norm, are functions of that example alone.
A BatchNorm (in any form), a layer of the user's that centres over the batch in training mode, a
loss that mixes examples (in-batch contrastive, logits centred over the batch) or a layer that
takes a dimension other than 0 as the batch (``batch_first=False``, time-major) break that, and
the eval-mode self-check cannot see the first three. So this check runs in the mode training runs
in (train mode), on real examples: each example's loss (a plain batched forward pass through the
model and the loss) and its per-example norm (the engine's) computed within the whole chunk must
equal those computed within the chunk rolled by one place and within its first half (chunks of
2-3: within the chunk whose other examples are copies of the first, so that no float32 pass
runs on one example, whose kernels differ on some CPUs and would read as mixing).

It also refuses a forward pass that writes a buffer in training mode (running statistics of the
private batch, released without noise in ``state_dict()``). Dropout layers are switched off
during the check (their masks follow batch positions, not examples, and they do not mix
examples); every buffer and the global RNGs are restored, so the run is unchanged by the check.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from dpscale.privacy.per_example import (
    RELATIVE_ERROR_FLOOR,
    Batch,
    PerExampleEngine,
    mean_over_views,
    per_example_cross_entropy,
    tolerance_for,
    trainable_params,
)
from dpscale.privacy.precision import FP32

MIN_EXAMPLES = 2  # fewer: nothing to compare (and nothing for one example to mix with)
DROPOUT_LAYERS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
# What a one-line refusal advises, by what mixed the examples (one place for each text).
MODEL_MIXING_FIX = (
    "use per-example layers (GroupNorm/LayerNorm instead of BatchNorm; dim 0 as the batch, batch_first=True)"
)
LOSS_MIXING_FIX = "DP-SGD needs each example's loss to depend on that example alone (no in-batch contrastive/centred logits)"
BUFFER_WRITE = "updates its buffer"
ENGINE_MIXING_FIX = (
    "a layer that takes a dimension other than 0 as the batch (batch_first=False, time-major) is a likely cause; "
    "use batch_first=True, or engine=vmap"
)


@dataclass(frozen=True)
class IndependenceResult:
    """Attributes:
    examples: examples in the chunk checked.
    tolerance: relative tolerance applied.
    loss_error: largest relative change of an example's loss (permuted or halved chunk).
    norm_error: largest relative change of an example's per-example gradient norm.
    culprit: what mixes examples ("layer 'x' (Type)", "the loss function", "engine bk's
        per-example norms", "layer 'x' (Type) writes buffer 'b'"), or None.
    fix: the way out, for the refusal.
    seconds: wall time of the check (s).
    """

    examples: int
    tolerance: float
    loss_error: float
    norm_error: float
    culprit: str | None
    fix: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.culprit is None

    @property
    def engine_only(self) -> bool:
        """The model and loss are batch-independent, only the engine's norms are not (another
        engine may be exact)."""
        return self.culprit is not None and self.culprit.startswith("engine ")

    def describe(self) -> str:
        if self.ok:
            return (
                f"batch independence: per-example losses and norms unchanged when the chunk of {self.examples} "
                f"is permuted or halved (train mode; largest relative change {max(self.loss_error, self.norm_error):.2g}, "
                f"tolerance {self.tolerance:g}; {self.seconds:.2f} s)"
            )
        if BUFFER_WRITE in self.culprit:
            return f"{self.culprit} from the private batch in training mode, without noise (it is in state_dict()); {self.fix}"
        if self.engine_only and self.norm_error == float("inf"):  # the engine refused, in train mode
            return f"in training mode, {self.fix}"
        what = "per-example gradient norm" if self.engine_only else "loss"
        return (
            f"{self.culprit} mixes examples in training mode: an example's {what} changes when the other examples "
            f"in its batch change (by up to {max(self.loss_error, self.norm_error):.3g} relative), so one example "
            f"can move the clipped sum by more than C; {self.fix}"
        )


def check_batch_independence(engine: PerExampleEngine, model: nn.Module, batch: Batch) -> IndependenceResult | None:
    """Compare each example's loss and norm within ``batch``, within ``batch`` rolled by one and
    within its first half, in train mode.

    Args:
        engine: the clipping engine (holds the loss, the views and the precision).
        model: the model it trains.
        batch: real examples (x, y); x of shape (B, K, ...) with K views.

    Returns:
        the verdict, or None when the batch has fewer than ``MIN_EXAMPLES`` examples.
    """
    x, y = batch
    n = int(y.shape[0])
    if n < MIN_EXAMPLES:
        return None
    started = time.perf_counter()
    precision = getattr(engine, "precision", FP32)
    params = trainable_params(model)
    dtype = precision.compare_dtype if precision.name != "fp32" else next(iter(params.values()), x).dtype
    tol = tolerance_for(dtype if dtype.is_floating_point else torch.float32)
    order = torch.roll(torch.arange(n, device=y.device), 1)
    half, part = _part_without_the_others(batch)
    parts = [(x, y), (x[order], y[order]), part]
    with _training_as_run(model) as buffers_before:
        losses = [_plain_losses(engine, model, part) for part in parts]
        culprit, fix = _buffer_writer(model, buffers_before), MODEL_MIXING_FIX
        loss_error = _change(losses, order, half)
        norm_error = 0.0
        if culprit is None and loss_error > tol:
            culprit, fix = _mixing_layer(engine, model, (batch, part), half, tol)
        if culprit is None:
            norm_error, refusal = _engine_norm_change(engine, model, params, parts, order, half)
            if norm_error > tol:
                culprit, fix = f"engine {engine.name}", refusal or ENGINE_MIXING_FIX
    return IndependenceResult(n, tol, loss_error, norm_error, culprit, fix, time.perf_counter() - started)


@contextlib.contextmanager
def _training_as_run(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Train mode with dropout off, every buffer and the global RNGs restored afterwards; yields
    the buffers as they were before."""
    was_training = model.training
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.train()
    dropouts = [m for m in model.modules() if isinstance(m, DROPOUT_LAYERS)]
    for m in dropouts:
        m.eval()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield saved
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in saved:
                    b.copy_(saved[name])
        model.train(was_training)


def _engine_norm_change(
    engine: PerExampleEngine, model: nn.Module, params: dict, parts: list[Batch], order: torch.Tensor, half: int
) -> tuple[float, str | None]:
    """The engine's per-example norms: largest relative change, and its refusal if it refused
    one of the chunks (a layout it handles at one batch size only: inf)."""
    try:
        norms = [engine.clipped_sum_and_losses(model, params, part)[1].detach() for part in parts]
    except ValueError as err:
        return float("inf"), str(err)
    return _change(norms, order, half), None


def _plain_losses(engine: PerExampleEngine, model: nn.Module, batch: Batch) -> torch.Tensor:
    """Per-example losses of one batched forward pass (what the ghost/bk engines differentiate)."""
    precision = getattr(engine, "precision", FP32)
    loss_fn = getattr(engine, "loss_fn", per_example_cross_entropy)
    x, y = batch
    with torch.no_grad(), precision.forward(x.device):
        return mean_over_views(loss_fn, model, x, y, getattr(engine, "views", 1)).detach().double()


def _part_without_the_others(batch: Batch) -> tuple[int, Batch]:
    """(h, a chunk whose first h examples are the batch's first h, without the batch's others):
    the first half for 4 examples or more, else the batch with its others replaced by copies of
    its first example (the same size: no float32 pass on one example)."""
    x, y = batch
    n = int(y.shape[0])
    if n >= 4:
        return n // 2, (x[: n // 2], y[: n // 2])
    keep = torch.zeros(n, dtype=torch.long, device=y.device)
    return 1, (x[keep], y[keep])


def _change(values: list[torch.Tensor], order: torch.Tensor, half: int) -> float:
    """Largest relative change of a per-example value between the whole chunk and the rolled
    chunk / its first half (relative to the value, floored at a share of the largest)."""
    full, rolled, halved = (v.double() for v in values)
    finite = full[torch.isfinite(full)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    floor = RELATIVE_ERROR_FLOOR * scale + 1e-300
    worst = 0.0
    for got, want in ((rolled, full[order]), (halved[:half], full[:half])):
        finite = torch.isfinite(want)
        # an example that overflows on its own (it will contribute zero) is left out, not read as mixing
        if got.shape != want.shape or not torch.equal(finite, torch.isfinite(got)):
            return float("inf")
        if finite.any():
            error = (got - want)[finite].abs() / want[finite].abs().clamp(min=floor)
            worst = max(worst, float(error.max()))
    return worst


def _buffer_writer(model: nn.Module, before: dict[str, torch.Tensor]) -> str | None:
    """The first layer whose buffer a training-mode forward pass changed: statistics of the
    private batch, kept without noise (and released in ``state_dict()``)."""
    for name, buffer in model.named_buffers():
        old = before.get(name)
        if old is not None and (old.shape != buffer.shape or not torch.equal(old, buffer)):
            layer, _, local = name.rpartition(".")
            module = model.get_submodule(layer)
            return f"layer {layer or '<root>'!r} ({type(module).__name__}) {BUFFER_WRITE} {local!r}"
    return None


def _mixing_layer(
    engine: PerExampleEngine, model: nn.Module, batches: tuple[Batch, Batch], half: int, tol: float
) -> tuple[str, str]:  # fmt: skip
    """Name what mixes examples: the first layer (in execution order) whose output for the first
    ``half`` examples changes between ``batches`` (the chunk, and one without the others), or
    whose output does not follow the batch along dim 0 (a time-major layout); the loss function
    if no layer does."""
    views = getattr(engine, "views", 1)  # rows of the forward pass: examples x views
    sizes = [int(chunk[1].shape[0]) * views for chunk in batches]
    outputs: dict[str, list[torch.Tensor]] = {}

    def record(name: str):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            first = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(first, torch.Tensor):
                outputs.setdefault(name, []).append(first.detach().double())
        return hook

    handles = [m.register_forward_hook(record(name)) for name, m in model.named_modules() if name]
    try:
        for chunk in batches:
            _plain_losses(engine, model, chunk)
    finally:
        for handle in handles:
            handle.remove()
    rows = half * views
    for name, seen in outputs.items():  # dicts keep insertion order: the order layers ran
        if len(seen) != 2:
            continue
        follows = [out.dim() > 0 and out.shape[0] == size for out, size in zip(seen, sizes)]
        if follows[0] != follows[1] or (all(follows) and _differs(seen[0][:rows], seen[1][:rows], tol)):
            module = model.get_submodule(name)
            return f"layer {name!r} ({type(module).__name__})", MODEL_MIXING_FIX
    return "the loss function", LOSS_MIXING_FIX


def _differs(full: torch.Tensor, part: torch.Tensor, tol: float) -> bool:
    """Whether a layer's output rows differ beyond ``tol`` (relative, floored), non-finite
    entries compared by where they are."""
    finite = torch.isfinite(full)
    if full.shape != part.shape or not torch.equal(finite, torch.isfinite(part)):
        return True
    if not finite.any():
        return False
    full, part = full[finite], part[finite]
    scale = float(full.abs().max())
    error = (full - part).abs() / full.abs().clamp(min=RELATIVE_ERROR_FLOOR * scale + 1e-300)
    return bool((error > tol).any())

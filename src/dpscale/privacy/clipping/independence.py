"""Batch-independence check: does an example's loss and clipped gradient depend on the others?

DP-SGD's sensitivity bound (one example moves the clipped sum by at most C) holds only if each
example's loss, and the engine's per-example gradient norm, are functions of that example alone.
A BatchNorm (in any form), a layer of the user's that centres over the batch in training mode, a
loss that mixes examples (in-batch contrastive, logits centred over the batch) or a layer that
takes a dimension other than 0 as the batch (``batch_first=False``, time-major) break that, and
the eval-mode self-check cannot see the first three. So this check runs in the mode training runs
in (train mode), on real examples: each example's loss (a plain batched forward pass through the
model and the loss) and its per-example norm (the engine's) computed within the whole chunk must
equal those computed within the chunk rolled by one place and within each half of it (chunks of
2-3: within the chunk whose rows are all copies of its first, then its last, example, so that no
float32 pass runs on one example, whose kernels differ on some CPUs and would read as mixing).

It also refuses a forward pass that writes a buffer or a parameter in training mode (running
statistics, a data-dependent initialisation: values of the private batch kept without noise),
and a model that draws random numbers other than nn.Dropout's (its draws follow batch
positions, so passes cannot be compared). Dropout layers are switched off during the check
(their masks follow batch positions, not examples, and they do not mix examples); every
parameter, buffer and the global RNGs are restored, so the run is unchanged by the check.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from dpscale.privacy.clipping.per_example import (
    RELATIVE_ERROR_FLOOR,
    Batch,
    PerExampleEngine,
    mean_over_views,
    per_example_cross_entropy,
    tolerance_for,
    trainable_params,
)
from dpscale.privacy.clipping.precision import FP32

MIN_EXAMPLES = 2  # fewer: nothing to compare (and nothing for one example to mix with)
DROPOUT_LAYERS = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)
# What a one-line refusal advises, by what mixed the examples (one place for each text).
MODEL_MIXING_FIX = "use per-example layers (GroupNorm/LayerNorm instead of BatchNorm; dim 0 as the batch, batch_first=True)"
LOSS_MIXING_FIX = "DP-SGD needs each example's loss to depend on that example alone (no in-batch contrastive/centred logits)"
STATE_WRITE = "writes its"
STATE_WRITE_FIX = "compute such values from public data before make_private/the run (or keep them out of the model's state)"
RANDOM_DRAWS_FIX = (
    "its examples cannot be checked for independence: use nn.Dropout modules (switched off during the check) "
    "instead of functional dropout or added noise, or turn the checks off (train.self_check=false, "
    "make_private(check=False))"
)
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
        if self.culprit is None:  # self.ok, spelled out so that the type narrows
            return (
                f"batch independence: per-example losses and norms unchanged when the chunk of {self.examples} "
                f"is permuted or halved (train mode; largest relative change {max(self.loss_error, self.norm_error):.2g}, "
                f"tolerance {self.tolerance:g}; {self.seconds:.2f} s)"
            )
        if STATE_WRITE in self.culprit:
            return f"{self.culprit} from the private batch in training mode, without noise (it is in state_dict()); {self.fix}"
        if self.culprit == "the model":
            return f"the model draws random numbers in its training-mode forward pass; {self.fix}"
        # the engine refused, in train mode
        if self.engine_only and self.norm_error == float("inf"):
            return f"in training mode, {self.fix}"
        what = "per-example gradient norm" if self.engine_only else "loss"
        return (
            f"{self.culprit} mixes examples in training mode: an example's {what} changes when the other examples "
            f"in its batch change (by up to {max(self.loss_error, self.norm_error):.3g} relative), so one example "
            f"can move the clipped sum by more than C; {self.fix}"
        )


def check_batch_independence(
    engine: PerExampleEngine, model: nn.Module, batch: Batch
) -> IndependenceResult | None:
    """Compare each example's loss and norm within ``batch`` with those within ``batch`` rolled
    by one and within each of its halves, in train mode.

    Args:
        engine: the clipping engine (holds the loss, the views and the precision).
        model: the model it trains.
        batch: real examples (x, y); x of shape (B, K, ...) with K views.

    Returns:
        the verdict, or None when the batch has fewer than ``MIN_EXAMPLES`` examples.
    """
    n = int(batch[1].shape[0])
    if n < MIN_EXAMPLES:
        return None
    started = time.perf_counter()
    precision = getattr(engine, "precision", FP32)
    params = trainable_params(model)
    dtype = (
        precision.compare_dtype
        if precision.name != "fp32"
        else next(iter(params.values()), batch[0]).dtype
    )
    tol = tolerance_for(dtype if dtype.is_floating_point else torch.float32)
    comparisons = _comparisons(batch)
    with _training_as_run(model) as state_before:
        full = _plain_losses(engine, model, batch)
        culprit, fix = _random_draws(engine, model, batch, full, tol)
        losses = [_plain_losses(engine, model, part) for part, _ in comparisons]
        written = _state_writer(model, state_before)
        if culprit is None and written is not None:
            culprit, fix = written, STATE_WRITE_FIX
        errors = [_change(full[rows], got) for (_, rows), got in zip(comparisons, losses)]
        loss_error, norm_error = max(errors), 0.0
        if culprit is None and loss_error > tol:
            worst = comparisons[errors.index(loss_error)]
            culprit, fix = _mixing_layer(engine, model, batch, worst, tol)
        if culprit is None:
            norm_error, refusal = _engine_norm_change(engine, model, params, batch, comparisons)
            if norm_error > tol:
                culprit, fix = f"engine {engine.name}", refusal or ENGINE_MIXING_FIX
    return IndependenceResult(
        n, tol, loss_error, norm_error, culprit, fix, time.perf_counter() - started
    )


# A sub-batch to compare with the whole: (chunk, the whole batch's indices of its examples).
Comparison = tuple[Batch, torch.Tensor]


def _comparisons(batch: Batch) -> list[Comparison]:
    """The batch rolled by one place, and each example within a chunk without some of the others:
    both halves for 4 examples or more (each example is in one), else the batch with every row
    replaced by its first (then its last) example: the same size, so that no float32 pass runs
    on a single example (other kernels on some CPUs, which would read as mixing)."""
    x, y = batch
    n = int(y.shape[0])
    index = torch.arange(n, device=y.device)
    rolled = torch.roll(index, 1)
    parts = [((x[rolled], y[rolled]), rolled)]
    if n >= 4:
        return parts + [((x[rows], y[rows]), rows) for rows in (index[: n // 2], index[n // 2 :])]
    for keep in (0, n - 1):
        rows = torch.full((n,), keep, dtype=torch.long, device=y.device)
        # row 0 is example ``keep``; the copies are its company
        parts.append(((x[rows], y[rows]), rows[:1]))
    return parts


def _random_draws(
    engine: PerExampleEngine, model: nn.Module, batch: Batch, full: torch.Tensor, tol: float
) -> tuple[str | None, str]:
    """Whether the training-mode forward pass draws random numbers other than nn.Dropout's (a
    functional dropout, added noise): the same chunk under another seed gives other losses. Such
    a model cannot be checked by comparing passes (its draws follow batch positions)."""
    torch.manual_seed(1)
    again = _plain_losses(engine, model, batch)
    torch.manual_seed(0)  # every other pass: the same draws
    if _change(full, again) > tol:
        return "the model", RANDOM_DRAWS_FIX
    return None, MODEL_MIXING_FIX


@contextlib.contextmanager
def _training_as_run(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Train mode with dropout off and the global RNGs seeded (each pass draws alike), every
    parameter, buffer and RNG restored afterwards; yields the parameters and buffers as they were."""
    was_training = model.training
    saved = {
        name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]
    }
    model.train()
    dropouts = [m for m in model.modules() if isinstance(m, DROPOUT_LAYERS)]
    for m in dropouts:
        m.eval()
    devices = (
        [torch.cuda.current_device()]
        if torch.cuda.is_available() and torch.cuda.is_initialized()
        else []
    )
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)
            yield saved
    finally:
        with torch.no_grad():
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                if name in saved and saved[name].shape == t.shape:
                    t.copy_(saved[name])
        model.train(was_training)


def _engine_norm_change(
    engine: PerExampleEngine,
    model: nn.Module,
    params: dict,
    batch: Batch,
    comparisons: list[Comparison],
) -> tuple[float, str | None]:
    """The engine's per-example norms: largest relative change between ``batch`` and the
    comparisons, and the engine's refusal if it refused one of them (a layout it handles at one
    batch size only: inf)."""
    try:
        full = engine.clipped_sum_and_losses(model, params, batch)[1].detach()
        norms = [
            engine.clipped_sum_and_losses(model, params, part)[1].detach()
            for part, _ in comparisons
        ]
    except ValueError as err:
        return float("inf"), str(err)
    return max(_change(full[rows], got) for (_, rows), got in zip(comparisons, norms)), None


def _plain_losses(engine: PerExampleEngine, model: nn.Module, batch: Batch) -> torch.Tensor:
    """Per-example losses of one batched forward pass (what the ghost/bk engines differentiate)."""
    precision = getattr(engine, "precision", FP32)
    loss_fn = getattr(engine, "loss_fn", per_example_cross_entropy)
    x, y = batch
    with torch.no_grad(), precision.forward(x.device):
        return mean_over_views(loss_fn, model, x, y, getattr(engine, "views", 1)).detach().double()


def _change(want: torch.Tensor, got: torch.Tensor) -> float:
    """Largest relative change of a per-example value: ``got``'s first rows against ``want``
    (relative to the value, floored at a share of the largest). An example that overflows on its
    own (it will contribute zero) is left out, not read as mixing."""
    want, got = want.double(), got[: want.shape[0]].double()
    finite = torch.isfinite(want)
    if got.shape != want.shape or not torch.equal(finite, torch.isfinite(got)):
        return float("inf")
    if not finite.any():
        return 0.0
    scale = float(want[finite].abs().max())
    error = (got - want)[finite].abs() / want[finite].abs().clamp(
        min=RELATIVE_ERROR_FLOOR * scale + 1e-300
    )
    return float(error.max())


def _state_writer(model: nn.Module, before: dict[str, torch.Tensor]) -> str | None:
    """The first layer whose buffer or parameter a training-mode forward pass wrote (running
    statistics, a data-dependent initialisation): values of the private batch, kept in the model
    without noise (and released with it)."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        old = before.get(name)
        if old is not None and (old.shape != tensor.shape or not torch.equal(old, tensor)):
            layer, _, local = name.rpartition(".")
            module = model.get_submodule(layer)
            return f"layer {layer or '<root>'!r} ({type(module).__name__}) {STATE_WRITE} {local!r}"
    return None


def _mixing_layer(
    engine: PerExampleEngine, model: nn.Module, batch: Batch, comparison: Comparison, tol: float
) -> tuple[str, str]:
    """Name what mixes examples: the first layer (in execution order) whose output for some
    examples changes between ``batch`` and ``comparison``'s chunk, or whose output does not
    follow the batch along dim 0 (a time-major layout); the loss function if no layer does."""
    part, rows = comparison
    views = getattr(engine, "views", 1)  # rows of the forward pass: examples x views
    sizes = [int(chunk[1].shape[0]) * views for chunk in (batch, part)]
    view_rows = (rows.unsqueeze(1) * views + torch.arange(views, device=rows.device)).reshape(-1)
    outputs: dict[str, list[torch.Tensor]] = {}

    def record(name: str):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            first = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(first, torch.Tensor):
                outputs.setdefault(name, []).append(first.detach().double())

        return hook

    handles = [m.register_forward_hook(record(name)) for name, m in model.named_modules() if name]
    try:
        for chunk in (batch, part):
            _plain_losses(engine, model, chunk)
    finally:
        for handle in handles:
            handle.remove()
    for name, seen in outputs.items():  # dicts keep insertion order: the order layers ran
        if len(seen) != 2:
            continue
        follows = [out.dim() > 0 and out.shape[0] == size for out, size in zip(seen, sizes)]
        if follows[0] != follows[1] or (
            all(follows) and _differs(seen[0][view_rows], seen[1][: len(view_rows)], tol)
        ):
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

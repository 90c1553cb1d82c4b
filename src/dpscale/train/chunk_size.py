"""``train.max_physical_batch_size: auto``: the largest physical chunk whose step fits the memory given.

A chunk's peak memory is about a fixed part (workspaces, the clipped sum) plus a part per example
(activations, per-example gradients or Grams). ``choose_units`` (``chunk_search``) measures the engine's clipped sum at
two small sizes (``PROBE_UNITS``), takes the largest size (up to the largest logical batch; a
multiple of 8 below it) the line through them fits in the budget, and runs it once to check it
(``_next_size``: a size that does not fit, or runs out of CUDA memory, is searched for below it; one
with room to spare grown). The peak is ``dpscale.privacy.clipping.autotune.peak_bytes``'s: the CUDA
allocator's, or the CPU tensor memory the torch profiler records, above what was allocated before.

The budget (``memory_budget``): ``train.memory_budget_mb`` when set; else ``CUDA_FREE_FRACTION`` of
the GPU's free memory, or ``CPU_BUDGET_FRACTION`` of the RAM the kernel reports available.

The probe reads no training example (inputs drawn from a fixed seed in their shape and dtype), runs
inside ``torch.random.fork_rng``, and has the clip-method tuner off but in the checking runs (which
time at the size the run will use); a compiled engine is probed eagerly and checked compiled. The
choice is cached in ``cache_path("chunk_size.json")``, keyed by what changes it (``cache_key``); a
cached peak over today's budget is measured anew. Delete the file to measure again.

The chunk size changes how a step's clipped sum is added up (and so its last bits): a run records the
number chosen in its config.yaml (``build_run``), so a resumed run uses that number and continues
bit for bit, on any machine.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from dpscale._io import cache_path
from dpscale.cpu_memory import trim_kept_memory
from dpscale.errors import ConfigError
from dpscale.privacy.clipping.peak_memory import peak_bytes
from dpscale.privacy.clipping.per_example import Batch, PerExampleEngine, trainable_params
from dpscale.privacy.plan.dp_plan import DPPlan
from dpscale.train.chunk_cache import CACHE_NAME, cache_key, cached_choice, store_choice
from dpscale.train.chunk_search import Measure, choose_units, gigabytes
from dpscale.train.units import rows_per_user

AUTO = "auto"
# of the GPU's free memory: the rest for cuBLAS/cuDNN workspaces and fragmentation
CUDA_FREE_FRACTION = 0.9
# of /proc/meminfo's MemAvailable: the rest for the data, the loader and the OS
CPU_BUDGET_FRACTION = 0.5
# Parameter-sized float32 tensors a step holds beside the clipped sum: the running sum, the noise,
# the noisy sum, the gradient, and an optimizer's state (Adam's two moments).
STEP_PARAMETER_COPIES = 6
# A Poisson batch above B + 4 sqrt(B) examples is rarer than 1 step in 30,000: such a step takes a second chunk.
POISSON_SPREAD = 4.0


@dataclass(frozen=True)
class ChunkChoice:
    """The chunk ``train.max_physical_batch_size: auto`` chose.

    Attributes:
        units: examples per chunk (users at the user unit); rows: ``units`` x the rows each unit
            takes (AugMult views, a user's k examples): the number ``max_physical_batch_size`` counts.
        peak_bytes: the measured peak of a chunk of ``units`` (plus the step's parameter copies).
        budget_bytes: the memory it had to fit; budget_source: where that budget came from.
        source: "measured in S s" or "cached"; capped: ``units`` is the largest logical batch (not the budget's).
    """

    units: int
    rows: int
    peak_bytes: float
    budget_bytes: float
    budget_source: str
    source: str
    capped: bool

    def describe(self) -> str:
        """One line for a run's log."""
        per = self.rows // self.units
        what = (
            f"{self.rows} example{'s' * (self.rows > 1)}"
            if per == 1
            else f"{self.rows} rows ({self.units} units of {per})"
        )
        bound = ", the largest logical batch" if self.capped else ""
        return (
            f"chunk size auto: {what}{bound} (peak {gigabytes(self.peak_bytes)} of a {gigabytes(self.budget_bytes)} budget, "
            f"{self.budget_source}; {self.source})"
        )


def available_cpu_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (None where there is none: not Linux, no /proc)."""
    try:
        found = re.search(
            r"^MemAvailable:\s+(\d+) kB",
            Path("/proc/meminfo").read_text(encoding="ascii"),
            re.MULTILINE,
        )
    except (OSError, ValueError):
        return None
    return int(found.group(1)) * 1024 if found else None


def memory_budget(device: torch.device, budget_mb: float | None, setting: str) -> tuple[float, str]:
    """The bytes a chunk's step may use, and where that figure came from.

    Args:
        device: where the step runs.
        budget_mb: the budget given (``train.memory_budget_mb``), MB; None: the device's.
        setting: how the user sets it, for the error.

    Raises:
        ConfigError: no budget given and none known for ``device`` (a CPU without /proc/meminfo, mps).
    """
    if budget_mb is not None:
        return budget_mb * 1e6, f"{setting}={budget_mb:g}"
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the allocator's cached blocks count as free for the run
        free, _ = torch.cuda.mem_get_info(device)
        return CUDA_FREE_FRACTION * free, f"{CUDA_FREE_FRACTION:.0%} of the GPU's free memory"
    available = available_cpu_bytes() if device.type == "cpu" else None
    if available is None:
        raise ConfigError(
            f"max_physical_batch_size=auto does not know how much memory {device.type} has here: set {setting}"
        )
    return CPU_BUDGET_FRACTION * available, f"{CPU_BUDGET_FRACTION:.0%} of the available RAM"


def largest_batch_units(plan: DPPlan) -> int:
    """The most examples (users) a logical batch of ``plan`` holds, but for rare Poisson draws:
    the cap (``dp.max_batch_size``), B for fixed-size batches, B + 4 sqrt(B) for Poisson ones."""
    if plan.max_batch_size is not None:
        return int(plan.max_batch_size)
    spread = POISSON_SPREAD * math.sqrt(plan.batch_size) if plan.sampling == "poisson" else 0.0
    return max(1, min(plan.dataset_size, math.ceil(plan.batch_size + spread)))


def synthetic_unit(
    input_shape: tuple[int, ...],
    rows: int,
    per_row_targets: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> Batch:
    """One unit as the engine takes it, drawn from a fixed seed (no training example is read):
    x (1, [rows,] *input_shape), y (1,) or, at the user unit, (1, rows), every label 0.

    Args:
        input_shape: one example's; rows: the rows a unit takes (AugMult views x a user's k);
        per_row_targets: a label per row (the user unit with k > 1); dtype, device: the inputs'.
    """
    shape = (1, *((rows,) if rows > 1 else ()), *input_shape)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(
        device=device, dtype=dtype
    )
    y = torch.zeros((1, rows) if per_row_targets else (1,), dtype=torch.long, device=device)
    return x, y


def engine_peak(
    engine: PerExampleEngine, model: nn.Module, unit: Batch, device: torch.device
) -> Measure:
    """``Measure`` of the engine's clipped sum over ``unit`` repeated n times: one warm-up call (first
    calls allocate workspaces; the tuner, when on, times there), then the peak of a second."""
    params = trainable_params(model)

    def measure(units: int) -> float | None:
        def run() -> None:
            pick = torch.arange(units, device=unit[1].device) % unit[1].shape[0]
            engine.clipped_sum_and_losses(model, params, (unit[0][pick], unit[1][pick]))

        try:
            run()
            return peak_bytes(run, device)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return None

    return measure


@contextlib.contextmanager
def _tuner(engine: PerExampleEngine, enabled: bool) -> Iterator[None]:
    """The engine's clip-method tuner (if it has one) on or off for the block, as it was after it."""
    tuner: Any = getattr(engine, "tuner", None)
    before = getattr(tuner, "enabled", None)
    if before is not None:
        tuner.enabled = before and enabled
    try:
        yield
    finally:
        if before is not None:
            tuner.enabled = before


def auto_chunk(
    engine: PerExampleEngine,
    model: nn.Module,
    unit: Batch,
    *,
    rows_per_unit: int,
    max_units: int,
    device: torch.device,
    budget_mb: float | None,
    setting: str,
    cache_file: Path | None = None,
) -> ChunkChoice:
    """The largest chunk of ``unit``s whose step fits the memory budget: cached, else measured
    (``choose_units``) and cached.

    Args:
        engine, model: what the steps run (the model on ``device``).
        unit: one unit (an example with its views, or a user's rows) as the engine takes it.
        rows_per_unit: the rows it holds (what ``max_physical_batch_size`` counts).
        max_units: the largest logical batch, in units (``largest_batch_units``).
        budget_mb, setting: the budget given (MB; None: the device's) and how it is set (errors).
        cache_file: default ``cache_path("chunk_size.json")``.

    Raises:
        ConfigError: no budget known, one example over it (with what it needs), or nothing checked fit.
    """
    budget, where = memory_budget(device, budget_mb, setting)
    key, path = cache_key(engine, model, unit, device, budget), cache_file or cache_path(CACHE_NAME)
    hit = cached_choice(path, key, budget, max_units)
    if hit is not None:
        units, peak, capped = hit
        return ChunkChoice(units, units * rows_per_unit, peak, budget, where, "cached", capped)
    extra = STEP_PARAMETER_COPIES * sum(
        p.numel() * p.element_size() for p in trainable_params(model).values()
    )
    # a compiled engine is probed by its eager twin (a compile for each probe size would cost minutes) and checked
    # compiled: its step's peak is its own (1.3x the eager one on resnet18-gn, lower on papernot-cnn), the checks decide
    measure = engine_peak(engine, model, unit, device)
    eager = engine_peak(getattr(engine, "eager", engine), model, unit, device)

    # the shape rule's methods: nothing timed at a size the run never takes
    def probe(units: int) -> float | None:
        with _tuner(engine, False):
            return eager(units)

    forked, started = [device] if device.type == "cuda" else [], time.perf_counter()
    # the run's streams untouched
    with torch.random.fork_rng(devices=forked), engine.precision.matmul_flags():
        try:
            units, peak = choose_units(probe, measure, budget, max_units, extra)
        except ConfigError as err:
            raise ConfigError(f"{err} ({where})") from err
    if device.type == "cpu":
        trim_kept_memory()  # the probes' larger blocks back to the system
    measured = f"measured in {time.perf_counter() - started:.1f} s"
    choice = ChunkChoice(
        units, units * rows_per_unit, peak, budget, where, measured, units >= max_units
    )
    store_choice(path, key, asdict(choice))
    return choice


def run_chunk(
    engine: PerExampleEngine,
    model: nn.Module,
    plan: DPPlan,
    data: Any,
    views: int,
    device: torch.device,
    budget_mb: float | None,
) -> ChunkChoice:
    """``auto_chunk`` for a ``dpscale train`` run: a unit shaped like its training examples (``data.info``,
    in ``views`` AugMult views; at the user unit k x K rows, a label each)."""
    k = rows_per_user(plan) if plan.user_level else 1
    x_train = getattr(data, "x_train", None)  # a stream's examples reach the model as float32
    dtype = (
        x_train.dtype
        if isinstance(x_train, torch.Tensor) and x_train.is_floating_point()
        else torch.float32
    )
    unit = synthetic_unit(tuple(data.info.input_shape), k * views, k > 1, dtype, device)
    return auto_chunk(
        engine,
        model,
        unit,
        rows_per_unit=k * views,
        max_units=largest_batch_units(plan),
        device=device,
        budget_mb=budget_mb,
        setting="train.memory_budget_mb",
    )


def batch_chunk(
    size: str,
    engine: PerExampleEngine,
    model: nn.Module,
    plan: DPPlan,
    batch: Batch | None,
    views: int,
) -> int:
    """``make_private(max_physical_batch_size="auto")``: the rows of the chunk ``auto_chunk`` chose for
    examples shaped like ``batch``'s first (its ``views`` AugMult views), on the model's device.

    Raises:
        ValueError: a ``size`` other than "auto"; no ``batch`` (``check_batch``) to take the examples'
            shape from; see ``auto_chunk``.
    """
    if size != AUTO:
        raise ValueError(
            f'max_physical_batch_size must be an integer >= 1, "auto" or None, got {size!r}'
        )
    if batch is None:
        raise ValueError(
            'max_physical_batch_size="auto" needs check_batch=(x, y), the examples\' shape it measures with '
            "(so not with user_ids); or give a number"
        )
    device = next(iter(trainable_params(model).values())).device
    unit = (batch[0][:1].to(device), batch[1][:1].to(device))
    return auto_chunk(
        engine,
        model,
        unit,
        rows_per_unit=views,
        max_units=largest_batch_units(plan),
        device=device,
        budget_mb=None,
        setting="a number for max_physical_batch_size",
    ).rows

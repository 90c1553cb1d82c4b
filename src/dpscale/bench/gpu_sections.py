"""The device suite's issue-63 sections (``dpscale.bench.gpu_suite`` runs them, after its own six).

7. **chunk size auto vs fixed**: the ``dpscale-fmnist-cnn`` preset in the ``Trainer`` with
   ``train.max_physical_batch_size`` at the preset's number, at ``auto`` (the device's budget) and
   at ``auto`` under ``train.memory_budget_mb`` = half the auto row's measured step peak: the chunk
   chosen and how (``ChunkChoice.describe``), one step's measured peak (``autotune.peak_bytes``), the
   budget, and steps/s over the steps after warm-up (``Trainer.train_step`` alone: no evaluation or
   checkpoint). A row checks that the step's peak stays within its budget;
8. **eager vs compiled**: ``dpscale bench step-time`` rows (non-private, dpscale-auto,
   dpscale-auto-compiled, and opacus-ew where Opacus is installed) at B = 4 and at the device's
   batch sizes, each compiled row's time as a ratio to the eager row's; a compiled row that does
   not run is a FAIL row with its reason.

The step-time sections (4 and 8) also say where the tuner's per-layer methods came from (timed
now, the disk cache with its date and load: ``autotune.describe_methods``). On a CPU with
``--quick`` nothing is compiled (``compiles``): one cold inductor compile of papernot-cnn's step took
~50 s on the 2-core VM (13 s for the linear model), more than the whole quick suite.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

import torch

QUICK_CPU_COMPILE_NOTE = (
    "compiled rows left out: --quick on a CPU, where one cold inductor compile of papernot-cnn's step takes "
    "~50 s (2-core VM); they run without --quick, and on CUDA"
)
STEP_TIME_MODELS = ("papernot-cnn", "tramer-cifar-cnn", "wrn16-4", "resnet18-gn")
COMPILED_HEADER = [
    "| model | batch | engine | engine run | median ms | x non-private | x eager | peak MB | |",
    "|---|---|---|---|---|---|---|---|---|",
]
CHUNK_HEADER = [
    "| data | train.max_physical_batch_size | chunk (examples) | how chosen | one step's peak MB | budget MB "
    "| steps/s | |",
    "|---|---|---|---|---|---|---|---|",
]
PRESET = "preset:dpscale-fmnist-cnn"
# section 7's run with --data-root: enough steps to time after warm-up, not the whole preset
CHUNK_STEPS = 40
WARM_STEPS = 3  # the first steps tune the clip methods, pick kernels, compile


def compiles(dev: torch.device, quick: bool) -> bool:
    """Whether the suite times compiled steps: everywhere but a CPU with ``--quick`` (module docstring)."""
    return dev.type == "cuda" or not quick


def opacus_rows() -> list[str]:
    """opacus-ew where Opacus is installed (its best mode on the zoo), else none."""
    import importlib.util

    return ["opacus-ew"] if importlib.util.find_spec("opacus") is not None else []


def step_time_models(models: list[str]) -> list[str]:
    """The step-time sections' models: the four the issue times, of those asked for (else the first)."""
    return [m for m in models if m in STEP_TIME_MODELS] or models[:1]


def tuner_notes(log_lines: list[str]) -> list[str]:
    """The step-time bench's lines saying where each row's per-layer methods came from, as a list."""
    found = [line for line in log_lines if " clip methods" in line]
    return ["", *(f"- tuner: {line}" for line in found)] if found else []


# Section 5's physical chunk sizes: the preset's (sized for a CPU's caches) and one chunk per
# logical step (B = 2048 at most ~2,200 under Poisson sampling), since on a GPU each chunk costs
# the host its Python per layer whatever its size; quick: the same two at B = 64.
CHUNKS, QUICK_CHUNKS = (512, 4096), (16, 64)


def training_data(data_root: str | None, quick: bool) -> tuple[list[str], str, tuple[int, int]]:
    """(config overrides, a label, ``CHUNKS`` or ``QUICK_CHUNKS``) for the Trainer sections (5, 7): the
    whole preset on Fashion-MNIST under ``data_root``, else (and with ``quick``) 6 steps on the embedded MNIST sample."""
    if data_root is not None and not quick:
        return [f"data.root={data_root}"], "fashion-mnist", CHUNKS
    return (
        ["data.name=mnist-5k", "dp.batch_size=64", "train.steps=6"],
        "mnist-5k (embedded), 6 steps",
        QUICK_CHUNKS,
    )


def compiled_step_rows(dev: torch.device, models: list[str], quick: bool) -> list[str]:
    """Section 8: eager against compiled steps at B = 4 and at the device's batch sizes (quick: 8)."""
    from dpscale.bench.step_time import run_step_time

    compiled = compiles(dev, quick)
    engines = [
        "nonprivate",
        "dpscale-auto",
        *(["dpscale-auto-compiled"] if compiled else []),
        *opacus_rows(),
    ]
    rows, notes = [], []
    for batch in (4, 8 if quick else None):
        logged: list[str] = []
        timed = run_step_time(
            step_time_models(models),
            engines,
            repeats=2 if quick else 10,
            warmup=1 if quick else 3,
            device=str(dev),
            batch_size=batch,
            log=logged.append,
        )
        rows += _compiled_table(timed, logged, compiled)
        notes += logged
    return [*rows, *tuner_notes(notes), *([] if compiled else ["", f"- {QUICK_CPU_COMPILE_NOTE}"])]


def _compiled_table(rows: list[Any], logged: list[str], compiled: bool) -> list[str]:
    """Section 8's rows for one batch size (``step_time.Row``s), a compiled row as a ratio to the
    eager one; where a compiled row was asked for and is missing, a FAIL row with the bench's reason."""
    by_key = {(r.model, r.engine): r for r in rows}
    lines = []
    for r in rows:
        eager = by_key.get((r.model, "dpscale-auto"))
        ratio = (
            f"{r.median_ms / eager.median_ms:.2f}"
            if r.engine.endswith("-compiled") and eager
            else ""
        )
        lines.append(
            f"| {r.model} | {r.batch_size} | {r.engine} | {r.resolved or 'torch'} | {r.median_ms:.1f} | "
            f"{r.ratio_to_nonprivate:.2f} | {ratio} | {r.peak_mem_mb:.1f} | |"
        )
    for model, batch in dict.fromkeys((r.model, r.batch_size) for r in rows):
        if compiled and (model, "dpscale-auto-compiled") not in by_key:
            reason = next(
                (
                    line
                    for line in logged
                    if "dpscale-auto-compiled" in line and line.startswith("skip ")
                ),
                "not run",
            )
            lines.append(
                f"| {model} | {batch} | dpscale-auto-compiled | {reason[:200]} | | | | | FAIL |"
            )
    return lines


def chunk_rows(device: torch.device, data_root: str | None, quick: bool) -> list[str]:
    """Section 7: the preset's chunk size, auto under the device's budget, and auto under half the
    auto row's measured step peak (a budget that binds wherever the whole batch fits in one chunk)."""
    data, name, chunks = training_data(data_root, quick)
    if chunks == CHUNKS:  # the whole dataset, but not the whole preset
        name, data = f"{name}, {CHUNK_STEPS} steps", [*data, f"train.steps={CHUNK_STEPS}"]
    fixed, _ = _chunk_row(
        device,
        name,
        [*data, f"train.max_physical_batch_size={chunks[0]}"],
        f"{chunks[0]} (the preset's)",
    )
    auto = [*data, "train.max_physical_batch_size=auto"]
    device_budget, peak_mb = _chunk_row(device, name, auto, "auto")
    tight = round(peak_mb / 2, 1)
    bound, _ = _chunk_row(
        device,
        name,
        [*auto, f"train.memory_budget_mb={tight}"],
        f"auto, memory_budget_mb={tight}",
        tight,
    )
    return [fixed, device_budget, bound]


def _chunk_row(
    device: torch.device,
    name: str,
    overrides: list[str],
    setting: str,
    budget_mb: float | None = None,
) -> tuple[str, float]:
    """One section-7 row and its step's measured peak in MB: the preset with ``overrides`` built by
    the Trainer, ``WARM_STEPS`` steps, one step under ``peak_bytes``, the rest timed; an auto row
    fails if that step's peak exceeds the budget it chose for (``budget_mb``, else the device's)."""
    from dpscale.config import load_config
    from dpscale.privacy.clipping.peak_memory import peak_bytes
    from dpscale.train.chunk_size import memory_budget

    auto = setting.startswith("auto")
    budget = memory_budget(device, budget_mb, "train.memory_budget_mb")[0] / 1e6 if auto else None
    with tempfile.TemporaryDirectory() as out:
        config = load_config(
            PRESET,
            [f"run.device={device.type}", f"run.out_dir={out}/run", "run.seed=0", *overrides],
        )
        trainer, lines = _logged_trainer(config)
        try:
            for _ in range(min(WARM_STEPS, trainer.total_steps - 2)):
                trainer.train_step()
            # MB as train.memory_budget_mb counts them
            peak = peak_bytes(trainer.train_step, device) / 1e6
            steps, started = trainer.total_steps - trainer.step, time.perf_counter()
            for _ in range(steps):
                trainer.train_step()
            _sync(device)
            rate = steps / (time.perf_counter() - started)
        finally:
            trainer.close()
    how = next(
        (
            line.removeprefix("chunk size auto: ")
            for line in lines
            if line.startswith("chunk size auto:")
        ),
        "given",
    )
    verdict = "ok" if budget is None or peak <= budget else "FAIL"
    return (
        f"| {name} | {setting} | {trainer.config.train.max_physical_batch_size} | {how} | {peak:.1f} | "
        f"{'' if budget is None else f'{budget:.1f}'} | {rate:.1f} | {verdict} |",
        peak,
    )


def _logged_trainer(config: Any) -> tuple[Any, list[str]]:
    """``Trainer.create(config)`` with its report kept in a list (the chunk size line) instead of printed."""
    from dpscale.train.loop import Trainer

    lines: list[str] = []

    class Logged(Trainer):
        def log(self, message: str) -> None:
            lines.append(message)

    return Logged.create(config, progress=False, report=False), lines


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

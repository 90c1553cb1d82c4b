"""The device acceptance suite (issue 44): one markdown report of what must hold on a machine.

``dpscale bench gpu-suite --device cuda --out report.md`` (``make gpu-check``) runs, offline:

1. **engines**: every engine on every model (TF32 off) against the float64 per-example loop on
   the CPU (same weights, same examples): the clipped sum's relative error (< 1e-3) and the norms';
   and the clip bound on the device: each example's own released contribution, inputs scaled so
   that every gradient is clipped, has a float64 norm <= C with no tolerance;
2. **16-bit**: the same clip bound with bf16 and fp16 forward/backward (fp16 with its loss scale);
3. **mechanism**: ``make_private`` steps on the device equal the same seed's steps on the CPU
   (DP-SGD, BandMF's correlated noise, a LoRA model): the noise is drawn on the host, so the
   released gradients differ only by the device's float32 arithmetic (relative 1e-3);
4. **step time**: ``dpscale bench step-time`` rows (non-private, bk, auto, and opacus-ew where
   Opacus is installed) at the device's batch sizes, wall clock, and where the tuner's per-layer
   methods came from (timed now, or the disk cache with its date and load);
5. **training loop**: the ``dpscale-fmnist-cnn`` preset trained by ``dpscale train`` itself
   (``Trainer``) on the device, in the preset's physical chunks, in one chunk per step, and in the
   preset's chunks with ``train.compile=true`` (not on a CPU with ``--quick``):
   steps/s, and on a GPU the idle fraction (1 - kernel time / wall time over a profiled window
   of steps) and the host syncs per step (``torch.cuda`` sync debug mode); with ``--data-root``
   (Fashion-MNIST) the whole preset to its test accuracy and epsilon, else (and with
   ``--quick``) a few steps on the embedded MNIST sample;
6. **operators per step**: ``dpscale bench ops`` rows (non-private, auto, auto-compiled where the
   suite compiles, opacus-ew where installed) at B = 4: the ATen operators one step launches from the
   host (CPU-activity profile, the per-layer methods this machine's tuner picks, as section 4's steps ran);
7. **chunk size auto vs fixed** and 8. **eager vs compiled** step: ``dpscale.bench.gpu_sections``.

Each check row ends in ok or FAIL; the command exits 1 on any FAIL. ``--device cpu --quick``
runs the same checks at tiny sizes (the default test suite does).
"""

from __future__ import annotations

import time
import traceback
import warnings
from pathlib import Path
from typing import Callable

import torch

import dpscale.bench.gpu_sections as gpu_sections
from dpscale.errors import ConfigError
from dpscale.models import build_model, default_input_shape, list_models
from dpscale.models.peft import apply_peft
from dpscale.privacy import make_engine
from dpscale.privacy.clipping.engines import supported_engines
from dpscale.privacy.clipping.per_example import trainable_params
from dpscale.privacy.clipping.precision import make_precision
from dpscale.privacy.clipping.reference import float64_reference

SMALL_INPUT = {
    "resnet18-gn": (3, 32, 32),
    "resnet50-gn": (3, 32, 32),
    "nf-resnet50": (3, 32, 32),
    "vit-tiny": (3, 32, 32),
    "vit-small": (3, 32, 32),
}
QUICK_MODELS = ("papernot-cnn",)
CLIP, SUM_TOLERANCE, MECHANISM_TOLERANCE = 1.0, 1e-3, 1e-3
ENGINE_HEADER = [
    "| model | engine | clipped sum rel. error | max norm rel. error | max one-example released norm | ms | |",
    "|---|---|---|---|---|---|---|",
]


def _relative(got: dict, ref: dict) -> float:
    """||got - ref|| / ||ref|| over all parameters, in float64 on the CPU."""
    num = sum(float((got[k].double().cpu() - ref[k].double().cpu()).square().sum()) for k in ref)
    den = sum(float(ref[k].double().cpu().square().sum()) for k in ref)
    return (num / max(den, 1e-300)) ** 0.5


def worst_single_example_norm(engine, model, params, x: torch.Tensor, y: torch.Tensor) -> float:
    """The largest float64 norm of one example's released (clipped) gradient, over the examples."""
    worst = 0.0
    for i in range(len(x)):
        clipped, _ = engine.per_example_clipped_sum(model, params, (x[i : i + 1], y[i : i + 1]))
        worst = max(worst, sum(float(g.double().square().sum()) for g in clipped.values()) ** 0.5)
    return worst


def _model_and_batch(name: str, batch: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    shape = SMALL_INPUT.get(name, default_input_shape(name))
    return build_model(name, 10, shape), torch.randn(batch, *shape), torch.randint(0, 10, (batch,))


def engine_rows(name: str, device: torch.device, batch: int) -> list[str]:
    """Section 1 for one model: one row per engine."""
    cpu_model, x, y = _model_and_batch(name, batch)
    ref = float64_reference(cpu_model, (x, y), CLIP)
    model = cpu_model.to(device)
    params, xd, yd = trainable_params(model), x.to(device), y.to(device)
    rows = []
    for engine_name in supported_engines(model):
        engine, _ = make_engine(engine_name, CLIP, model)
        start = time.perf_counter()
        clipped, norms = engine.per_example_clipped_sum(model, params, (xd, yd))
        _sync(device)
        ms = 1e3 * (time.perf_counter() - start)
        sum_err = _relative(clipped, ref.clipped_sum)
        norm_err = float(((norms.double().cpu() - ref.norms) / ref.norms).abs().max())
        worst = worst_single_example_norm(engine, model, params, 50.0 * xd, yd)
        verdict = "ok" if worst <= CLIP and sum_err < SUM_TOLERANCE else "FAIL"
        rows.append(
            f"| {name} | {engine_name} | {sum_err:.2e} | {norm_err:.2e} | {worst:.9f} | {ms:.1f} | {verdict} |"
        )
    return rows


def sixteen_bit_rows(name: str, device: torch.device, batch: int) -> list[str]:
    """Section 2 for one model: the clip bound under bf16 and fp16 on every engine."""
    model, x, y = _model_and_batch(name, batch)
    model = model.to(device)
    params, xd, yd = trainable_params(model), 50.0 * x.to(device), y.to(device)
    rows = []
    for precision in ("bf16", "fp16"):
        for engine_name in supported_engines(model):
            engine, _ = make_engine(engine_name, CLIP, model, precision=make_precision(precision))
            worst = worst_single_example_norm(engine, model, params, xd, yd)
            rows.append(
                f"| {name} | {precision} | {engine_name} | {worst:.9f} | {'ok' if worst <= CLIP else 'FAIL'} |"
            )
    return rows


def _released_first_step(device: torch.device, **options) -> dict[str, torch.Tensor]:
    """The first step's released gradient of a seeded make_private run of papernot-cnn."""
    from dpscale.privacy.options import Flat, NoiseMultiplier, Poisson
    from dpscale.train.private import make_private

    model, x, y = _model_and_batch("papernot-cnn", 32)
    apply_peft(model, options.pop("peft", "none"), rank=2)
    model = model.to(device)
    optimizer = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9
    )
    mechanism = make_private(
        model,
        optimizer,
        dataset_size=32,
        sampling=Poisson(batch_size=16),
        clipping=Flat(max_grad_norm=CLIP),
        budget=NoiseMultiplier(sigma=1.0, delta=1e-5),
        steps=8,
        seed=0,
        **options,
    )
    released: dict[str, torch.Tensor] = {}
    mechanism.observer = lambda gradient: released.update(
        {k: v.detach().double().cpu() for k, v in gradient.items()}
    )
    indices = mechanism.sample()
    mechanism.step(x[indices].to(device), y[indices].to(device))
    return released


def mechanism_rows(device: torch.device) -> list[str]:
    """Section 3: seeded steps on the device against the same steps on the CPU."""
    from dpscale.privacy.options import BandMF

    cases: dict[str, dict] = {
        "dp-sgd": {},
        "bandmf (b=2)": {"noise": BandMF(bands=2)},
        "lora (r=2)": {"peft": "lora"},
    }
    rows = []
    for label, options in cases.items():
        on_device = _released_first_step(device, **dict(options))
        on_cpu = _released_first_step(torch.device("cpu"), **dict(options))
        err = _relative(on_device, on_cpu)
        rows.append(f"| {label} | {err:.2e} | {'ok' if err < MECHANISM_TOLERANCE else 'FAIL'} |")
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _section(title: str, header: list[str], make_rows: Callable[[], list[str]]) -> list[str]:
    """A report section; an error becomes a FAIL row instead of hiding the other sections."""
    started = time.perf_counter()
    try:
        rows = make_rows()
    except Exception as err:  # one failing check must not hide the others
        empty_cells = header[0].count("|") - 3 if header else 0
        rows = [
            f"| error: {type(err).__name__}: {str(err).splitlines()[0][:160]} |"
            + " |" * empty_cells
            + " FAIL |"
        ]
    return ["", f"## {title}", "", *header, *rows, "", f"({time.perf_counter() - started:.0f} s)"]


def suite_device(device: str) -> torch.device:
    """``device`` as a torch device the suite can run on.

    Raises:
        ConfigError: one line for a name torch does not know, or a CUDA device that this torch
            build lacks (a CPU-only wheel: ``make gpu-check`` printed CUDA's traceback) or cannot see.
    """
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device must be cuda, cuda:<index> or cpu, got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        if torch.version.cuda is None:
            raise ConfigError(
                f"--device {device}: no CUDA in this torch build ({torch.__version__}): install a "
                "CUDA torch, or use --device cpu"
            )
        raise ConfigError(
            f"--device {device}: this torch build has CUDA {torch.version.cuda} but sees no CUDA "
            "device (no GPU, or its driver is missing): use --device cpu"
        )
    return dev


def run_suite(
    device: str = "cuda",
    models: list[str] | None = None,
    batch: int = 8,
    quick: bool = False,
    log: Callable[[str], None] = print,
    data_root: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[str, bool]:
    """Run every section; returns (the markdown report, whether every check passed).

    Each section is logged as soon as it ends and ``progress`` receives the report so far, so a
    run stopped by a time limit (a lent device's) still leaves the sections it finished.
    """
    dev = suite_device(device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # full float32
    models = models or (list(QUICK_MODELS) if quick else list_models())
    where = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    lines = [
        f"# Device suite on {where}",
        "",
        f"torch {torch.__version__}, TF32 off, C = {CLIP}, {batch} examples "
        f"per model, models: {', '.join(models)}; {time.strftime('%Y-%m-%d %H:%M')}",
    ]
    sections: list[Callable[[], list[str]]] = [
        lambda: _section(
            "1. Engines against the float64 per-example loop (float32 on the device)",
            ENGINE_HEADER,
            lambda: [row for name in models for row in engine_rows(name, dev, batch)],
        ),
        lambda: _section(
            "2. The clip bound in 16-bit",
            [
                "| model | precision | engine | max one-example released norm | |",
                "|---|---|---|---|---|",
            ],
            lambda: [r for name in models[:2] for r in sixteen_bit_rows(name, dev, batch)],
        ),
        lambda: _section(
            "3. make_private on the device = the same seed on the CPU",
            ["| case | released gradient rel. difference | |", "|---|---|---|"],
            lambda: mechanism_rows(dev),
        ),
        lambda: _section(
            "4. Step time (wall clock)", [], lambda: _step_time_rows(dev, models, quick)
        ),
        lambda: _section(
            "5. The training loop on the device (dpscale train, preset dpscale-fmnist-cnn)",
            TRAINING_HEADER,
            lambda: training_rows(dev, data_root, quick),
        ),
        lambda: _section(
            "6. Operators per step (host launches, B = 4)",
            [],
            lambda: _ops_rows(dev, models, quick),
        ),
        lambda: _section(
            "7. Chunk size auto vs fixed (dpscale train, preset dpscale-fmnist-cnn)",
            gpu_sections.CHUNK_HEADER,
            lambda: gpu_sections.chunk_rows(dev, data_root, quick),
        ),
        lambda: _section(
            "8. Eager vs compiled step (wall clock)",
            gpu_sections.COMPILED_HEADER,
            lambda: gpu_sections.compiled_step_rows(dev, models, quick),
        ),
    ]
    for line in lines:
        log(line)
    for make_section in sections:
        section = make_section()
        for line in section:
            log(line)
        lines += section
        if progress is not None:
            progress("\n".join(lines) + "\n")
    report = "\n".join(lines) + "\n"
    return report, "FAIL" not in report


def _step_time_rows(dev: torch.device, models: list[str], quick: bool) -> list[str]:
    """Section 4: the step-time table (its own header) at the device's batch sizes (tiny with ``quick``)."""
    from dpscale.bench.step_time import markdown_table, run_step_time

    logged: list[str] = []
    engines = ["nonprivate", "dpscale-bk", "dpscale-auto", *gpu_sections.opacus_rows()]
    rows = run_step_time(
        gpu_sections.step_time_models(models),
        engines,
        repeats=2 if quick else 10,
        warmup=1 if quick else 3,
        device=str(dev),
        batch_size=8 if quick else None,
        log=logged.append,
    )
    table = markdown_table(rows, "dpscale bench gpu-suite (section 4)", str(dev)).splitlines()
    return table[2:] + gpu_sections.tuner_notes(logged)


def _ops_rows(dev: torch.device, models: list[str], quick: bool) -> list[str]:
    """Section 6: the ``dpscale bench ops`` table (its own header) for section 4's models."""
    from dpscale.bench.ops import OPS_MODELS, markdown_table, run_ops

    counted = [m for m in models if m in OPS_MODELS] or models[:1]
    compiled = ["dpscale-auto-compiled"] if gpu_sections.compiles(dev, quick) else []
    engines = ["nonprivate", "dpscale-auto", *compiled, *gpu_sections.opacus_rows()]
    rows = run_ops(counted, engines, device=str(dev), methods="tuned", log=lambda _: None)
    return markdown_table(
        rows, "dpscale bench gpu-suite (section 6)", str(dev), "tuned"
    ).splitlines()[2:]


TRAINING_HEADER = [
    "| data | steps | steps/s | GPU idle fraction | host syncs per step | syncs' source lines (per step) "
    "| test accuracy | epsilon | |",
    "|---|---|---|---|---|---|---|---|---|",
]
PROFILED_STEPS = 20  # the window over which the idle fraction and the syncs are measured


def training_rows(device: torch.device, data_root: str | None, quick: bool) -> list[str]:
    """Section 5: the preset trained by the Trainer on ``device``, once per physical chunk size
    (``gpu_sections.CHUNKS``), then compiled in the preset's chunks (``gpu_sections.compiles``: not on
    a CPU with ``quick``); a row fails if its run does not finish or its accuracy is not above chance."""
    data, name, chunks = gpu_sections.training_data(data_root, quick)
    rows = [
        _training_row(
            device, name, [*data, f"train.max_physical_batch_size={chunk}"], f"chunks of {chunk}"
        )
        for chunk in chunks
    ]
    if not gpu_sections.compiles(device, quick):
        return [*rows, "", f"- {gpu_sections.QUICK_CPU_COMPILE_NOTE}"]
    compiled = [*data, f"train.max_physical_batch_size={chunks[0]}", "train.compile=true"]
    return [*rows, _training_row(device, name, compiled, f"chunks of {chunks[0]}, compiled")]


def _training_row(device: torch.device, name: str, overrides: list[str], chunks: str) -> str:
    """One section-5 row: the preset with ``overrides`` trained to its end on ``device``."""
    import tempfile

    from dpscale.config import load_config
    from dpscale.train.loop import Trainer

    with tempfile.TemporaryDirectory() as out:
        config = load_config(
            "preset:dpscale-fmnist-cnn",
            [f"run.device={device.type}", f"run.out_dir={out}/run", "run.seed=0", *overrides],
        )
        trainer = Trainer.create(config, progress=False, report=False)
        warm = min(3, trainer.total_steps - 1)
        trainer.run(max_steps=warm)  # compiles kernels, tunes the clip methods
        window = min(PROFILED_STEPS, trainer.total_steps - warm - 1) if device.type == "cuda" else 0
        idle, syncs, sites = (
            _profiled_window(trainer, warm + window, device)
            if window > 0
            else (None, None, "n/a (CPU)")
        )
        started, done = time.perf_counter(), trainer.step
        summary = trainer.run()
        # evaluations and checkpoints included
        rate = (trainer.step - done) / (time.perf_counter() - started)
    assert summary is not None  # run() without max_steps trains to the end, then gives the summary
    accuracy, epsilon = summary["test_accuracy"], summary["epsilon"]
    ok = summary["steps"] == trainer.total_steps and accuracy > 0.1
    fmt = lambda v, spec: "n/a (CPU)" if v is None else format(v, spec)  # noqa: E731
    return (
        f"| {name}, {chunks} | {summary['steps']} | {rate:.1f} | {fmt(idle, '.2f')} | {fmt(syncs, '.1f')} | {sites} | "
        f"{100 * accuracy:.2f}% | {epsilon:.2f} | {'ok' if ok else 'FAIL'} |"
    )


def _profiled_window(trainer, stop: int, device: torch.device) -> tuple[float, float, str]:
    """(GPU idle fraction, host syncs per step, where they come from) over the trainer's steps up
    to ``stop``: the kernels' summed device time against the window's wall time, and the
    synchronising calls the CUDA sync debug mode reports (``sync_sites``)."""
    from torch.profiler import ProfilerActivity, profile

    steps = stop - trainer.step
    torch.cuda.synchronize(device)
    sites: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        stack = traceback.extract_stack()[:-1]
        # the window ends in a checkpoint (run() saves when it stops early): a save's syncs are
        # once per ten minutes in a real run, not per step
        if "synchroniz" in str(message) and not any(
            f.name == "save" and f.filename.endswith("loop.py") for f in stack
        ):
            sites.append(sync_site(filename, lineno, stack))

    with warnings.catch_warnings(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        # called at the sync itself, so the Python stack is the caller's
        warnings.showwarning = record
        try:
            started = time.perf_counter()
            trainer.run(max_steps=stop)
            torch.cuda.synchronize(device)
            wall_us = (time.perf_counter() - started) * 1e6
        finally:
            torch.cuda.set_sync_debug_mode("default")
    busy_us = sum(event.self_device_time_total for event in prof.key_averages())
    return max(0.0, 1.0 - busy_us / wall_us), len(sites) / max(1, steps), sync_sites(sites, steps)


def sync_site(filename: str, lineno: int, stack: list[traceback.FrameSummary]) -> str:
    """Where one synchronisation came from: ``step.py:185``, or, when the line that synchronised
    is outside dpscale (torch's optimizer, say), that line and the innermost dpscale line that
    called it: ``sgd.py:40 via step.py:185``."""
    site = f"{Path(filename).name}:{lineno}"
    if "dpscale" in Path(filename).parts:
        return site
    ours = [
        f
        for f in stack
        if "dpscale" in Path(f.filename).parts and "bench" not in Path(f.filename).parts
    ]
    return f"{site} via {Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else site


def sync_sites(sites: list[str], steps: int, top: int = 6) -> str:
    """The sites (``sync_site``) that synchronised the host most often, per step: e.g.
    ``step.py:185 x2.0, sgd.py:40 via step.py:201 x1.0`` ("none" when there were none)."""
    from collections import Counter

    counts = Counter(sites)
    return (
        ", ".join(f"{site} x{count / max(1, steps):.1f}" for site, count in counts.most_common(top))
        or "none"
    )


def main(args) -> int:
    def write(report: str) -> None:  # after each section, so a partial report survives a kill
        Path(args.out).write_text(report)

    _, passed = run_suite(
        args.device,
        [m for m in (args.models or "").split(",") if m] or None,
        args.batch,
        args.quick,
        data_root=args.data_root,
        progress=write if args.out else None,
    )
    return 0 if passed else 1

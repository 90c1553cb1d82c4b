"""Step-time benchmark: one DP-SGD optimizer step per engine, against a non-private step.

Every row is measured in this one process, interleaved (each repeat runs every engine once,
in turn), after warm-up, and reported as the median; ratios are to the non-private step of the
same model and batch measured alongside. Opacus rows need the optional ``opacus`` package
(``pip install -c constraints.txt .[bench]``) and are skipped with a note without it.

Peak memory is measured against the memory held by the model, optimizer state and data alone:
before the measured step, whatever the previous step left behind (``.grad``, Opacus'
``grad_sample``) is released. On CPU it is the largest amount of tensor memory live during one
step beyond that: the running sum of every allocation and free the torch profiler records
(``autotune.cpu_allocation_peak``; before session 19 innermost ops only, another figure); on
CUDA ``torch.cuda.max_memory_allocated`` over the same baseline.

``--precision bf16|fp16|tf32`` runs every row's forward/backward in that precision (the
non-private and Opacus rows under the same autocast; fp16 with the same fixed loss scale).

``--compile`` adds a "-compiled" twin after each dpscale row: ``make_private(compile=True)``, the
vmap engine's clipped step as one ``torch.compile`` graph (``dpscale.privacy.clipping.compiled``), compiled
in the step's first run (before the warm-up, never timed); the engines it refuses are skipped.

The command (its flags, threads and table file) is ``bench/step_time_command.py``; the rows' name
suffixes are read in ``bench/engine_names.py``.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, cast

import torch
import torch.nn.functional as F
from torch import nn

from dpscale.bench.engine_names import compiled_of, peft_of, user_rows_of
from dpscale.cpu_memory import keep_freed_memory
from dpscale.models import build_model, default_input_shape
from dpscale.models.peft import apply_peft
from dpscale.privacy.clipping.precision import FP32, Precision, make_precision
from dpscale.train.step import physical_chunks

if TYPE_CHECKING:
    from dpscale.train.mechanism import DPMechanism

DEFAULT_BATCH = {"papernot-cnn": 256, "tramer-cifar-cnn": 128, "wrn16-4": 64, "resnet18-gn": 32}
# On a GPU: the batch sizes of the H100 table (224x224 for the ImageNet models).
GPU_BATCH = {
    "papernot-cnn": 2048,
    "tramer-cifar-cnn": 512,
    "wrn16-4": 256,
    "resnet18-gn": 128,
    "resnet50-gn": 64,
    "vit-small": 128,
    "nf-resnet50": 64,
}
# ImageNet-size models run at 224x224 on a GPU; on a CPU at 32x32 (CIFAR stem), labelled "@32".
CPU_INPUT = {"resnet18-gn": (3, 32, 32), "resnet50-gn": (3, 32, 32)}
DPSCALE_ENGINES = ("vmap", "ghost", "bk", "auto")
OPACUS_MODES = ("hooks", "functorch", "ew", "ghost")
ALL_ENGINES = (
    "nonprivate",
    *(f"dpscale-{e}" for e in DPSCALE_ENGINES),
    *(f"opacus-{m}" for m in OPACUS_MODES),
)
SIGMA, CLIP, LR = 1.0, 1.0, 0.1
# the plan's length for BandMF rows (its strategy is optimised for it, once)
BANDMF_BENCH_STEPS = 2000

Step = Callable[[], None]


@dataclass(frozen=True)
class TimedStep:
    """One engine's optimizer step, and how to drop what a step leaves behind (gradients,
    per-sample gradients) so that memory is measured from the model + optimizer + data alone."""

    run: Step
    release: Step
    engine: Callable[[], str] = lambda: ""  # the engine a dpscale row ended up with (auto's choice)
    # its per-layer methods and where they came from (timed now, the disk cache, pinned): autotune.describe_methods
    methods: Callable[[], str | None] = lambda: None


@dataclass(frozen=True)
class Row:
    model: str
    batch_size: int
    engine: str
    median_ms: float
    ratio_to_nonprivate: float
    peak_mem_mb: float
    repeats: int
    resolved: str = ""  # the engine class a dpscale row ran (auto: its choice), for the noise check


def _input_shape(name: str, device: torch.device) -> tuple[int, int, int]:
    return (
        CPU_INPUT.get(name, default_input_shape(name))
        if device.type == "cpu"
        else default_input_shape(name)
    )


def _fresh_model(name: str, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return build_model(name, 10, _input_shape(name, device)).to(device)


def _views(x: torch.Tensor, views: int, generator: torch.Generator) -> torch.Tensor:
    """AugMult input: K crop-flip views per example (B, K, C, H, W), drawn inside the timed step."""
    from dpscale.data.augment import augment_views

    return augment_views(x, "crop-flip", views, generator)


def _nonprivate_step(
    name: str, x: torch.Tensor, y: torch.Tensor, views: int = 1, precision: Precision = FP32
) -> TimedStep:
    model = _fresh_model(name, x.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    augment = torch.Generator().manual_seed(1)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        inputs, targets = x, y
        if views > 1:  # the same work without privacy: mean loss over the B*K views
            inputs, targets = _views(x, views, augment).flatten(0, 1), y.repeat_interleave(views)
        with precision.forward(x.device):
            loss = F.cross_entropy(model(inputs), targets)
        (loss.float() * precision.loss_scale).backward()  # fp16: the same fixed loss scale
        optimizer.step()

    return TimedStep(step, lambda: optimizer.zero_grad(set_to_none=True))


def _dpscale_step(
    name: str,
    engine_name: str,
    x: torch.Tensor,
    y: torch.Tensor,
    views: int = 1,
    precision: Precision = FP32,
    bands: int = 1,
    peft: str = "none",
    lora_rank: int = 8,
    user_rows: int = 0,
    compile: bool = False,
) -> TimedStep:
    """A step through ``make_private``'s mechanism, as users' loops and the trainer take it (the
    noise from the 128-bit host generator and the accounting included), on the whole batch;
    with ``bands`` > 1, BandMF's correlated noise (its recursion over the last b-1 noise vectors);
    with ``peft``, only that method's parameters train (``dpscale.models.peft``); with
    ``user_rows`` = k > 0, the same B images as B / k users of k images each, clipped per user
    (privacy unit user: the chunk cut and padded by ``user_rows`` inside the timed step); with
    ``compile``, the compiled step (``make_private(compile=True)``)."""
    from dpscale.privacy.clipping.per_example import user_rows as padded_user_rows

    model = _fresh_model(name, x.device)
    apply_peft(model, peft, rank=lora_rank)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    batch = x.shape[0]
    if user_rows and batch % user_rows:
        raise ValueError(
            f"-user{user_rows} rows need a batch size divisible by {user_rows}, got {batch}"
        )
    mechanism = _mechanism(
        model, optimizer, engine_name, batch, views, precision, bands, user_rows, compile
    )
    augment = torch.Generator().manual_seed(1)
    indices = torch.arange(batch, device=x.device)
    offsets = torch.arange(0, batch + 1, max(1, user_rows))

    def step() -> None:
        inputs = _views(x, views, augment) if views > 1 else x
        if user_rows:
            mechanism.step_drawn_chunks([padded_user_rows((inputs, y, offsets), user_rows, views)])
        else:
            mechanism.step_drawn_chunks(physical_chunks(inputs, y, indices, batch))

    # apply_gradient already drops the gradients
    from dpscale.privacy.clipping.autotune import describe_methods

    return TimedStep(
        step,
        lambda: None,
        lambda: type(mechanism.engine).__name__,
        lambda: describe_methods(mechanism.engine),
    )


def _mechanism(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    engine_name: str,
    batch: int,
    views: int,
    precision: Precision,
    bands: int,
    user_rows: int,
    compile: bool,
) -> DPMechanism:
    """``make_private``'s mechanism for a ``_dpscale_step`` row (its arguments' meanings are that function's)."""
    from dpscale.privacy.options import (
        BandMF,
        EngineName,
        Flat,
        Independent,
        NoiseMultiplier,
        PerExample,
        PerformanceFlags,
        PerUser,
        Poisson,
        PrecisionName,
    )
    from dpscale.train.private import make_private

    return make_private(
        model,
        optimizer,
        dataset_size=100 * batch,
        sampling=Poisson(batch_size=batch // max(1, user_rows)),
        clipping=Flat(max_grad_norm=CLIP),
        budget=NoiseMultiplier(sigma=SIGMA, delta=1e-5),
        steps=BANDMF_BENCH_STEPS if bands > 1 else 10**5,
        accountant="rdp",
        augment_multiplicity=views,
        seed=0,
        noise=BandMF(bands=bands) if bands > 1 else Independent(),
        unit=PerUser(
            user_ids=torch.arange(100 * batch) // user_rows, max_examples_per_user=user_rows
        )
        if user_rows
        else PerExample(),
        performance=PerformanceFlags(
            engine=cast(EngineName, engine_name),
            precision=cast(PrecisionName, precision.name),
            compile=compile,
        ),
    )


def _parse_engine(engine: str) -> tuple[str, str, int, int]:
    """ "dpscale-auto-k4-bandmf8" -> ("dpscale", "auto", 4, 8): a "-kK" suffix asks for K augmented
    views, a "-bandmfB" suffix for BandMF's correlated noise with B bands (1: DP-SGD); a PEFT
    suffix (``peft_of``), a "-userK" suffix (``user_rows_of``) and "-compiled" (``compiled_of``) are read apart."""
    views, bands = 1, 1
    engine = peft_of(user_rows_of(compiled_of(engine)[0])[0])[0]
    head, _, last = engine.rpartition("-")
    if head and last.startswith("bandmf") and last[6:].isdigit():
        engine, bands = head, int(last[6:])
        head, _, last = engine.rpartition("-")
    if head and last.startswith("k") and last[1:].isdigit():
        engine, views = head, int(last[1:])
    kind, _, mode = engine.partition("-")
    return kind, mode, views, bands


def _opacus_step(
    name: str, mode: str, x: torch.Tensor, y: torch.Tensor, precision: Precision = FP32
) -> TimedStep:
    import warnings

    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    model = _fresh_model(name, x.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(TensorDataset(x, y), batch_size=x.shape[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = PrivacyEngine(accountant="rdp").make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=SIGMA,
            max_grad_norm=CLIP,
            poisson_sampling=False,
            grad_sample_mode=mode,
            criterion=nn.CrossEntropyLoss(),
        )
    if mode == "ghost":
        private_model, private_optimizer, criterion, _ = made
    else:
        private_model, private_optimizer, _ = made
        criterion = nn.CrossEntropyLoss()

    def step() -> None:
        private_optimizer.zero_grad(set_to_none=True)
        with precision.forward(x.device):
            loss = criterion(private_model(x), y)
        # (Opacus' ghost mode returns its own loss type, without .float())
        if precision.loss_scale != 1.0:
            loss = loss.float() * precision.loss_scale
        loss.backward()
        private_optimizer.step()

    # zero_grad(set_to_none) also drops Opacus' grad_sample / summed_grad
    return TimedStep(step, lambda: private_optimizer.zero_grad(set_to_none=True))


def _peak_memory_mb(timed: TimedStep, device: torch.device) -> float:
    """Extra tensor memory at the peak of one step over model + optimizer + data (see module docstring)."""
    from dpscale.privacy.clipping.peak_memory import peak_bytes

    timed.release()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return peak_bytes(timed.run, device) / 2**20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_step_time(
    models: list[str],
    engines: list[str],
    repeats: int = 10,
    warmup: int = 3,
    device: str = "cpu",
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
    precision: str = "fp32",
    batch_size: int | None = None,
    lora_rank: int = 8,
    clock: str = "wall",
) -> list[Row]:
    """Measure every (model, engine); returns rows (engines that cannot run are skipped with a log line).

    Args:
        lora_rank: r of "-lora" rows.
        precision: fp32, tf32, bf16 or fp16 for every row (see the module docstring).
        batch_size: for every model (default: DEFAULT_BATCH on CPU, GPU_BATCH on CUDA, else 64).
    """
    import warnings

    # Opacus' hooks warn on every step that the input needs no gradient; not news here.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    dev = torch.device(device)
    # before any step is built: every row, non-private included, allocates alike
    if dev.type == "cpu":
        keep_freed_memory()
    prec = make_precision(precision)
    defaults = GPU_BATCH if dev.type == "cuda" else DEFAULT_BATCH
    rows: list[Row] = []
    for name in models:
        batch = batch_size or defaults.get(name, 64)
        g = torch.Generator().manual_seed(0)
        shape = _input_shape(name, dev)
        label = name if shape == default_input_shape(name) else f"{name}@{shape[-1]}"
        x = torch.randn(batch, *shape, generator=g).to(dev)
        y = torch.randint(0, 10, (batch,), generator=g).to(dev)
        steps = _timed_steps(name, engines, x, y, prec, lora_rank, log)
        with prec.matmul_flags():
            rows += _measure(label, batch, steps, repeats, warmup, dev, log, clock)
    return rows


def _timed_steps(
    name: str,
    engines: list[str],
    x: torch.Tensor,
    y: torch.Tensor,
    prec: Precision,
    lora_rank: int,
    log: Callable[[str], None],
) -> dict[str, TimedStep]:
    """Every engine's step for model ``name`` on (x, y), each run once (those that cannot run are skipped with a log line)."""
    steps: dict[str, TimedStep] = {"nonprivate": _nonprivate_step(name, x, y, precision=prec)}
    for engine in engines:
        if engine == "nonprivate":
            continue
        kind, mode, views, bands = _parse_engine(engine)
        try:
            if kind == "nonprivate" and bands == 1:
                steps[engine] = _nonprivate_step(name, x, y, views, prec)
            elif kind == "dpscale":
                base, compiled = compiled_of(engine)
                steps[engine] = _dpscale_step(
                    name,
                    mode,
                    x,
                    y,
                    views,
                    prec,
                    bands,
                    peft_of(user_rows_of(base)[0])[1],
                    lora_rank,
                    user_rows_of(base)[1],
                    compiled,
                )
            elif kind == "opacus" and views == 1 and bands == 1:
                steps[engine] = _opacus_step(name, mode, x, y, prec)
            else:
                raise ValueError(f"unknown engine {engine!r}; choose from {', '.join(ALL_ENGINES)}")
            steps[engine].run()  # fail here, not mid-measurement
        except ImportError:
            log(
                f"skip {engine}: opacus is not installed (pip install -c constraints.txt '.[bench]')"
            )
            steps.pop(engine, None)
        except (RuntimeError, ValueError, NotImplementedError) as err:
            log(f"skip {name} {engine}: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
            steps.pop(engine, None)
    return steps


# bk and auto running the same engine must agree within this, else the table is noisy
NOISE_TOLERANCE = 0.05


def _measure(
    label: str,
    batch: int,
    steps: dict[str, TimedStep],
    repeats: int,
    warmup: int,
    dev: torch.device,
    log: Callable[[str], None],
    clock: str = "wall",
) -> list[Row]:
    """Warm up, time the steps interleaved, then measure each one's peak memory.

    ``clock`` "thread" takes ``time.thread_time`` (CPU seconds of this thread, with one torch
    thread: what other processes on a shared machine do not inflate, unlike the wall clock)."""
    rows = []
    for timed in steps.values():
        for _ in range(warmup):
            timed.run()
    now = time.thread_time if clock == "thread" else time.perf_counter
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):  # interleaved: machine noise hits every engine alike
        for engine, timed in steps.items():
            _sync(dev)
            start = now()
            timed.run()
            _sync(dev)
            times[engine].append(now() - start)
    base = statistics.median(times["nonprivate"])
    for engine, timed in steps.items():
        median = statistics.median(times[engine])
        rows.append(
            Row(
                label,
                batch,
                engine,
                1000 * median,
                median / base,
                _peak_memory_mb(timed, dev),
                repeats,
                timed.engine(),
            )
        )
        log(f"{label} B={batch} {engine}: {1000 * median:.1f} ms ({median / base:.2f}x)")
        methods = timed.methods()
        if methods:  # which choices the tuner's cache gave (a busy machine's cache once made every step slow)
            log(f"{label} B={batch} {engine} {methods}")
    return rows


def noisy_rows(rows: list[Row], tolerance: float = NOISE_TOLERANCE) -> list[str]:
    """Where the table cannot be trusted: dpscale-bk and dpscale-auto rows of one model (and the
    same suffixes) that ran the same engine but whose medians differ by more than ``tolerance``."""
    found = []
    by_key = {(r.model, r.batch_size, r.engine): r for r in rows}
    for r in rows:
        if not r.engine.startswith("dpscale-bk"):
            continue
        auto = by_key.get((r.model, r.batch_size, "dpscale-auto" + r.engine[len("dpscale-bk") :]))
        if auto is None or auto.resolved != r.resolved or not r.resolved:
            continue
        gap = abs(auto.median_ms - r.median_ms) / min(auto.median_ms, r.median_ms)
        if gap > tolerance:
            found.append(
                f"{r.model} B={r.batch_size}: {r.engine} and {auto.engine} both ran {r.resolved} but differ "
                f"by {100 * gap:.0f}% (> {100 * tolerance:.0f}%)"
            )
    return found


def _cpu_name() -> str:
    # looked up at the call: a test's patch of it takes
    from dpscale.privacy.clipping import autotune_cache

    cpu = autotune_cache.cpu_model() or platform.machine() + " CPU"
    return f"{cpu} ({autotune_cache.cpu_isa()} kernels), {os.cpu_count()} logical cores"


def markdown_table(
    rows: list[Row],
    command: str,
    device: str,
    precision: str = "fp32",
    clock: str = "wall",
    load: tuple[float, float] | None = None,
) -> str:
    threads = torch.get_num_threads()
    machine = torch.cuda.get_device_name() if device.startswith("cuda") else _cpu_name()
    clock_words = "thread-CPU time of the timing thread" if clock == "thread" else "wall clock"
    load_words = f"; load average {load[0]:.2f} before, {load[1]:.2f} after" if load else ""
    noisy = noisy_rows(rows)
    lines = [
        "# Step-time benchmark",
        "",
        f"- command: `{command}`",
        f"- machine: {machine}, {threads} torch threads, torch {torch.__version__}, Python {platform.python_version()}",
        f"- date: {time.strftime('%Y-%m-%d')}; precision: {precision}; clock: {clock_words}{load_words}",
        *([f"- cpu memory: {keep_freed_memory()}"] if not device.startswith("cuda") else []),
        *(
            f"- **NOISY**: {line}: rerun {'with more --repeats' if clock == 'thread' else 'on an idle machine, or with --clock thread'}"
            for line in noisy
        ),
        "- median ms per optimizer step over interleaved repeats after warm-up; ratio to the non-private",
        "  step of the same model and batch measured in the same process; peak = extra tensor memory",
        "  during one step (see `src/dpscale/bench/step_time.py`).",
        "",
        "| model | batch | engine | median ms | x non-private | peak MB | x non-private mem |",
        "|---|---|---|---|---|---|---|",
    ]
    base_mem = {(r.model, r.batch_size): r.peak_mem_mb for r in rows if r.engine == "nonprivate"}
    for r in rows:
        mem_ratio = (
            r.peak_mem_mb / base_mem[(r.model, r.batch_size)]
            if base_mem.get((r.model, r.batch_size))
            else float("nan")
        )
        lines.append(
            f"| {r.model} | {r.batch_size} | {r.engine} | {r.median_ms:.1f} | {r.ratio_to_nonprivate:.2f} | "
            f"{r.peak_mem_mb:.1f} | {mem_ratio:.2f} |"
        )
    return "\n".join(lines) + "\n"

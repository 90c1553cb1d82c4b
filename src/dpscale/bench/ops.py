"""Operators per optimizer step (``dpscale bench ops``): the ATen operators one step launches, per engine.

On a GPU the DP step is host-bound (issue 63): what it costs is the number of operators the host
launches, and that number can be counted on any machine. Each step is built exactly as
``dpscale bench step-time`` builds it (its builders), run ``warmup`` times (the tuner's timings, state
built on first use, a ``torch.compile``), then run once under the torch profiler, CPU activity only
(on CUDA too: the count is of host launches). What counts (``is_launch``):

- every ``aten::`` event with no ``aten::`` ancestor (``cpu_parent``): the operators Python code and
  the autograd engine call, backward kernels included, but not those a composite operator runs
  inside itself (``aten::linear`` is one, not linear + t + addmm);
- inside a compiled region, each kernel its graph launches, once: the events under inductor's
  ``## Call CompiledFxGraph`` that are neither Python frames nor ATen calls (cpp or triton kernels);
  the region's wrappers (``Torch-Compiled Region``, ``CompiledFunction``, the graph call) are not
  counted. Inductor's cpp kernels show in the profile only when compiled with
  ``cpp.enable_kernel_profile``, which ``step_operators`` sets for the warm-up that compiles; a region
  compiled before that (outside the bench) shows its extern (``aten::``) kernels only.

The count is deterministic once the per-layer methods are fixed: by default the shape rule
(``$DPSCALE_AUTOTUNE=0``, as the tests run); ``methods="tuned"`` counts what this machine's tuner
picks (its cache, or timings), which can differ between machines and runs.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from torch.autograd.profiler_util import FunctionEvent

from dpscale.bench.step_time import (
    TimedStep,
    _cpu_name,
    _dpscale_step,
    _input_shape,
    _nonprivate_step,
    _opacus_step,
    _parse_engine,
)
from dpscale.bench.engine_names import compiled_of, peft_of, user_rows_of
from dpscale.choices import BENCH_METHODS
from dpscale.cpu_memory import keep_freed_memory
from dpscale.models import default_input_shape
from dpscale.privacy.clipping.autotune import TUNE_OFF_ENV
from dpscale.privacy.clipping.autotune_cache import autotune_cache_path
from dpscale.privacy.clipping.peak_memory import profiler_markers_dropped

OPS_MODELS = ("papernot-cnn", "tramer-cifar-cnn", "wrn16-4", "resnet18-gn")
OPS_ENGINES = ("nonprivate", "dpscale-auto", "opacus-ew")
OPS_BATCH, OPS_WARMUP = 4, 2
GRAPH_CALL = "## Call CompiledFxGraph"  # inductor's event around one compiled graph's launches
BACKWARD = "autograd::engine::evaluate_function:"  # the autograd engine running one backward node
# by_function's name for ops no dpscale frame launched
OUTSIDE = "(autograd engine, outside dpscale)"


@dataclass(frozen=True)
class OpsRow:
    model: str
    batch_size: int
    engine: str
    ops: int
    ratio_to_nonprivate: float
    # every launched operator (or compiled kernel) name: its count, most first
    operators: dict[str, int]
    # the dpscale function that launched them
    by_function: dict[str, int] = field(default_factory=dict)


def _ancestors(event: FunctionEvent) -> Iterator[FunctionEvent]:
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def is_launch(event: FunctionEvent) -> bool:
    """Whether ``event`` is one operator launch: a top-level ``aten::`` call, or a compiled kernel."""
    if event.name.startswith("aten::"):
        return not any(a.name.startswith("aten::") for a in _ancestors(event))
    if event.is_python_function or event.is_user_annotation or event.name.startswith("##"):
        return False
    above = [a.name for a in _ancestors(event) if not a.is_python_function]
    # a kernel: directly under a graph call (Python frames of the generated wrapper aside)
    return bool(above) and above[0].startswith(GRAPH_CALL)


def launched_ops(events: Iterable[FunctionEvent]) -> list[FunctionEvent]:
    """The events of a profile that are operator launches (``is_launch``), in order."""
    return [event for event in events if is_launch(event)]


def profiled_launches(fn: Callable[[], object], with_stack: bool = False) -> list[FunctionEvent]:
    """Run ``fn`` once under the torch profiler (CPU activity) and return its operator launches.

    Args:
        with_stack: also record Python frames (``launched_by`` names the dpscale function of each).
    """
    from torch.profiler import ProfilerActivity, profile

    with (
        profiler_markers_dropped(),
        profile(activities=[ProfilerActivity.CPU], with_stack=with_stack) as prof,
    ):
        fn()
    return launched_ops(prof.events())


def launched_by(event: FunctionEvent) -> str:
    """The innermost dpscale function above a launch (``privacy/clipping/bounds.py(130): blocked_sq_norms``),
    or ``OUTSIDE`` when the autograd engine (or code outside dpscale) comes first. Needs a profile
    taken ``with_stack``."""
    for above in _ancestors(event):
        if above.name.startswith(BACKWARD):
            return OUTSIDE
        if above.is_python_function and "dpscale/" in above.name:
            return above.name.split("dpscale/")[-1]
    return OUTSIDE


@contextmanager
def per_layer_methods(methods: str) -> Iterator[None]:
    """``shape-rule``: engines built inside pick each layer's method by the shape rule (the
    tuner off, as ``$DPSCALE_AUTOTUNE=0`` asks), so the count does not depend on timings;
    ``tuned``: as the environment says (this machine's tuner and its cache)."""
    if methods not in BENCH_METHODS:
        raise ValueError(f"methods must be one of {', '.join(BENCH_METHODS)}, got {methods!r}")
    before = os.environ.get(TUNE_OFF_ENV)
    if methods == "shape-rule":
        os.environ[TUNE_OFF_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TUNE_OFF_ENV, None)
        else:
            os.environ[TUNE_OFF_ENV] = before


def step_operators(
    timed: TimedStep, warmup: int = OPS_WARMUP, with_stack: bool = False
) -> list[FunctionEvent]:
    """One step's operator launches after ``warmup`` steps (inductor's cpp kernels recorded)."""
    import torch._inductor.config as inductor_config  # (already loaded by torch.optim)

    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        for _ in range(warmup):
            timed.run()
        return profiled_launches(timed.run, with_stack)


def build_step(name: str, engine: str, x: torch.Tensor, y: torch.Tensor) -> TimedStep:
    """``engine``'s step on ``model``, built by the step-time bench's own builders (same names:
    nonprivate, dpscale-ENGINE, opacus-MODE, and their -kK, -bandmfB, PEFT, -userK and -compiled
    suffixes; a compiled step compiles in ``step_operators``' warm-up).

    Raises:
        ImportError: an opacus row without Opacus installed.
        ValueError: an engine name the step-time bench does not know.
    """
    kind, mode, views, bands = _parse_engine(engine)
    if kind == "nonprivate" and bands == 1:
        return _nonprivate_step(name, x, y, views)
    if kind == "dpscale":
        base, compiled = compiled_of(engine)
        peft, user_rows = peft_of(user_rows_of(base)[0])[1], user_rows_of(base)[1]
        return _dpscale_step(
            name, mode, x, y, views, bands=bands, peft=peft, user_rows=user_rows, compile=compiled
        )
    if kind == "opacus" and views == 1 and bands == 1:
        return _opacus_step(name, mode, x, y)
    raise ValueError(f"unknown engine {engine!r}; e.g. {', '.join(OPS_ENGINES)}")


def _model_rows(
    name: str,
    engines: list[str],
    batch: int,
    dev: torch.device,
    warmup: int,
    with_stack: bool,
    log: Callable[[str], None],
) -> list[OpsRow]:
    """Every engine's row for one model (the non-private step first: the ratios' base)."""
    g = torch.Generator().manual_seed(0)
    shape = _input_shape(name, dev)
    label = name if shape == default_input_shape(name) else f"{name}@{shape[-1]}"
    x = torch.randn(batch, *shape, generator=g).to(dev)
    y = torch.randint(0, 10, (batch,), generator=g).to(dev)
    rows: list[OpsRow] = []
    for engine in ["nonprivate", *(e for e in engines if e != "nonprivate")]:
        try:
            launches = step_operators(build_step(name, engine, x, y), warmup, with_stack)
        except ImportError:
            log(
                f"skip {engine}: opacus is not installed (pip install -c constraints.txt '.[bench]')"
            )
            continue
        except (RuntimeError, ValueError, NotImplementedError) as err:
            log(f"skip {name} {engine}: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
            continue
        operators = dict(Counter(e.name for e in launches).most_common())
        functions = (
            dict(Counter(launched_by(e) for e in launches).most_common()) if with_stack else {}
        )
        base = rows[0].ops if rows else len(launches)
        rows.append(
            OpsRow(label, batch, engine, len(launches), len(launches) / base, operators, functions)
        )
        log(f"{label} B={batch} {engine}: {len(launches)} ops ({len(launches) / base:.2f}x)")
    return rows


def run_ops(
    models: Iterable[str] = OPS_MODELS,
    engines: Iterable[str] = OPS_ENGINES,
    batch_size: int = OPS_BATCH,
    device: str = "cpu",
    warmup: int = OPS_WARMUP,
    methods: str = "shape-rule",
    by_function: bool = False,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
) -> list[OpsRow]:
    """Count one step's operator launches for every (model, engine); engines that cannot run
    (Opacus not installed, an engine the model refuses) are skipped with a log line.

    Args:
        batch_size: examples per step, every model.
        methods: per-layer methods by the ``shape-rule`` (deterministic) or ``tuned`` (see the
            module docstring).
        by_function: also attribute each launch to the dpscale function that made it (profiles
            with Python stacks; ``OpsRow.by_function``).

    Returns:
        one row per (model, engine), the non-private step first for each model.
    """
    dev = torch.device(device)
    if dev.type == "cpu":  # as the step-time bench: the tuner's cache keys say how malloc runs
        keep_freed_memory()
    with per_layer_methods(methods):
        return [
            row
            for name in models
            for row in _model_rows(name, list(engines), batch_size, dev, warmup, by_function, log)
        ]


def _breakdown(counts: dict[str, int], top: int) -> str:
    """``add 356, slice 324, ...``: the ``top`` most launched (``aten::`` left out of the names)."""
    return ", ".join(f"{name.removeprefix('aten::')} {n}" for name, n in list(counts.items())[:top])


def markdown_table(
    rows: list[OpsRow],
    command: str,
    device: str,
    methods: str = "shape-rule",
    top: int = 0,
    by_function: int = 0,
) -> str:
    """The rows as markdown, with the machine, torch and method lines of the step-time table's header;
    ``top`` > 0 adds each row's most launched operators, ``by_function`` > 0 its top sources."""
    machine = torch.cuda.get_device_name() if device.startswith("cuda") else _cpu_name()
    if methods == "shape-rule" or os.environ.get(TUNE_OFF_ENV) == "0":
        chosen = "the shape rule" + ("" if methods == "shape-rule" else f" (${TUNE_OFF_ENV}=0)")
    else:
        chosen = f"this machine's tuner (cache {autotune_cache_path()})"
    lines = [
        "# Operators per step",
        "",
        f"- command: `{command}`",
        f"- machine: {machine}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, Python {platform.python_version()}",
        f"- date: {time.strftime('%Y-%m-%d')}; per-layer methods: {chosen}",
        "- ops: the ATen operators one optimizer step launches, after warm-up (torch profiler, CPU activity): every",
        "  `aten::` call with no `aten::` caller, backward kernels included, and each compiled kernel once",
        "  (see `src/dpscale/bench/ops.py`); ratio to the non-private step of the same model and batch.",
        "",
        "| model | batch | engine | ops | x non-private |",
        "|---|---|---|---|---|",
        *(
            f"| {r.model} | {r.batch_size} | {r.engine} | {r.ops} | {r.ratio_to_nonprivate:.2f} |"
            for r in rows
        ),
    ]
    if top > 0:
        lines += ["", "| model | engine | most launched |", "|---|---|---|"]
        lines += [f"| {r.model} | {r.engine} | {_breakdown(r.operators, top)} |" for r in rows]
    if by_function > 0:
        lines += ["", "| model | engine | launched by | ops |", "|---|---|---|---|"]
        lines += [
            f"| {r.model} | {r.engine} | `{f}` | {n} |"
            for r in rows
            for f, n in list(r.by_function.items())[:by_function]
        ]
    return "\n".join(lines) + "\n"


def main(args) -> int:
    if args.device == "cpu":
        # one torch thread, as the counts (intra-op threads launch nothing more)
        torch.set_num_threads(1)
    rows = run_ops(
        [m for m in args.models.split(",") if m] if args.models else OPS_MODELS,
        [e for e in args.engines.split(",") if e] if args.engines else OPS_ENGINES,
        batch_size=args.batch_size,
        device=args.device,
        warmup=args.warmup,
        methods=args.methods,
        by_function=args.by_function > 0,
    )
    table = markdown_table(
        rows,
        ("dpscale bench ops " + " ".join(args.argv)).strip(),
        args.device,
        args.methods,
        args.top,
        args.by_function,
    )
    print(json.dumps([asdict(r) for r in rows]) if args.json else table)
    if args.write:
        Path(args.write).parent.mkdir(parents=True, exist_ok=True)
        Path(args.write).write_text(table)
    return 0

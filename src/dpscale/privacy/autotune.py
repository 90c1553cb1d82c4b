"""Per-layer method choice by timing on the machine that runs (issue 44).

A layer's per-example weight-gradient norms (and its clipped sum) have several exact methods:
Gram matrices with or without im2col, instantiated per-example gradients by im2col + bmm or by a
grouped convolution. Which is fastest depends on the shapes *and* on the hardware (an AMD EPYC,
an AVX-512 Xeon and a GPU rank them differently), so a shape rule tuned on one machine is wrong on
another. ``MethodTuner`` times the candidates a cost estimate leaves in contention, once per layer
signature (per-example shapes, geometry, dtype) and device, and keeps the fastest:

* in the process, for every later chunk of any batch size (the signature leaves out the batch);
* on disk (``autotune_cache_path``), so the next run on this machine does not time again;
* in the run's checkpoint (``as_json`` / ``pin``), so a resumed run does exactly the same
  arithmetic as an uninterrupted one, whatever the timings on the resuming machine say.

Every candidate is exact and keeps its rounding bound (the Gram forms add a rigorous float64
bound, the instantiated ones take the norm of the gradient itself), so the choice changes the
speed and the last bits of the norms, never what the guarantee covers.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from dpscale.cpu_memory import memory_mode
from dpscale._io import atomic_write_text, cache_path

# Candidates whose estimated multiply-adds exceed the cheapest estimate by more than this factor are
# not timed (a wider spread mostly times hopeless Gram candidates: the 16x16 pixel Grams estimated at 2.4x
# measured 38x on the AMD EPYC).
TUNE_SPREAD = 3.0
# A chunk whose cheapest candidate needs fewer multiply-adds than this is too small to time
# reliably (and too cheap to matter): the shape rule decides, and nothing is recorded.
TUNE_MIN_MACS = 2e7
# Gram candidates whose float64 Gram matrices would exceed this many bytes are not timed.
TUNE_MAX_GRAM_BYTES = 1 << 30
TUNE_REPEATS = 3  # timed runs per candidate after one warm-up, interleaved; the median is kept
# Fast candidates get more rounds, up to this many, so that each is timed for ~TUNE_WINDOW_MS in all
# (a 5 ms layer's medians over 3 rounds differed by 10% between runs on a shared VM).
TUNE_MAX_REPEATS, TUNE_WINDOW_MS = 11, 60.0
TUNE_DROP = 2.0  # a candidate this many times slower than the fastest in the first timed round is not timed again
# Candidates whose medians are within this fraction of the fastest are as fast as timing on a shared VM can
# tell: of those (on a CPU), the one whose measured peak tensor memory (``peak_bytes``) is lowest is kept, so that
# neither the choice nor the step's peak follows the timing noise. papernot-cnn's second layer on the 2-core
# AVX2 VM, two tuning passes a second apart: bmm 8.5 / grouped 9.7 ms, then grouped 10.8 / bmm 12.6 ms
# (a neighbour on the host slows the thread clock too, and not every method alike); peaks bmm 14.2 MB,
# grouped 24.0 MB (its kernel's buffers). A pass that kept grouped raised the step's peak 37.1 -> 46.8 MB
# (session 18's measure, which missed some outputs: ``cpu_allocation_peak``).
TUNE_TIE = 0.20
# Peaks within this fraction of the lowest count as equal, and the faster of them is kept: bmm and
# bmm-positions hold the same patches and per-example gradients (papernot-cnn's second layer: 14.2 MB
# each), and a few bytes of bookkeeping must not decide between them.
PEAK_TIE = 0.05
TUNE_OFF_ENV = "DPSCALE_AUTOTUNE"  # "0": never time, use the shape rule (and any pinned choice)
# What torch's profiler (kineto) writes to fd 2, at any KINETO_LOG_LEVEL, each time it starts and
# stops: "USDT:2026-11-29 03:46:12 10456:10456 SyncActivityProfilerHandler.cpp:52] profiler_start".
# peak_bytes drops these lines (they filled every first run's stderr, issue 62) and nothing else.
PROFILER_MARKER = re.compile(rb"^USDT:[^\n]*\] profiler_(?:start|stop)\r?(?:\n|\Z)", re.MULTILINE)


def autotune_cache_path() -> Path:
    """``cache_path("autotune.json")``: ``$DPSCALE_CACHE_DIR/autotune.json`` if set, else
    ``$XDG_CACHE_HOME/dpscale/autotune.json`` (``~/.cache`` if unset)."""
    return cache_path("autotune.json")


def device_descriptor(device: torch.device) -> str:
    """What the timings depend on besides the shapes: the processor (or GPU) model, on a CPU the
    vector instruction set torch's kernels run with, the torch threads and version, and on a CPU
    whether freed memory is kept (``dpscale.cpu_memory``: page faults made the instantiating
    methods several times slower). E.g. ``cpu:AMD EPYC:isa=AVX2:threads=1:torch=2.13.0:memory=kept``.

    The instruction set is there because virtual machines name very different processors alike:
    two "AMD EPYC" VMs, one with AVX-512 and one with AVX2 only, ranked papernot-cnn's two layers'
    methods in opposite orders, and a cache in a home directory shared by both would carry one's
    choices to the other."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}:threads={torch.get_num_threads()}:torch={torch.__version__}"
    name = cpu_model() or platform.processor() or platform.machine()
    return f"cpu:{name}:isa={cpu_isa()}:threads={torch.get_num_threads()}:torch={torch.__version__}:memory={memory_mode()}"


def cpu_isa() -> str:
    """The vector instruction set torch's CPU kernels run with in this process ("AVX512", "AVX2",
    "DEFAULT"; lower than the processor's where ``ATEN_CPU_CAPABILITY`` caps it)."""
    return torch.backends.cpu.get_cpu_capability()


def cpu_model() -> str | None:
    """The processor's model name from /proc/cpuinfo (None where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


@dataclass
class Candidate:
    """One exact method for a layer: its name, estimated multiply-adds per example, the bytes of
    the Gram matrices it would build for the chunk (0 if none), and a call that runs it (norms and
    clipped sum) on the chunk without touching the record."""

    name: str
    macs: float
    gram_bytes: float
    run: Callable[[], Any]


@dataclass
class LayerChoice:
    """The method one layer uses: how it was chosen ("timed"; "timed, least memory (...)" when
    candidates within ``TUNE_TIE`` of the fastest were told apart by their measured peaks, given
    in MB; "estimate", "cache", "pinned" from a checkpoint) and, when timed, each candidate's
    median milliseconds on this chunk."""

    method: str
    source: str
    ms: dict[str, float] = field(default_factory=dict)


@dataclass
class MethodTuner:
    """Chooses each layer signature's method, by timing on this device, once.

    Args:
        enabled: time candidates (False: the shape rule, or a pinned choice, always).
        cache_file: the on-disk cache shared by runs on this machine (None: in memory only).
    """

    enabled: bool = True
    cache_file: Path | None = None
    choices: dict[str, LayerChoice] = field(default_factory=dict)  # signature -> choice
    layers: dict[str, str] = field(default_factory=dict)  # layer name -> signature (for the log)
    tuning_s: float = 0.0
    _device: str | None = None
    _reported: int = 0  # layers already described by ``unreported``

    def choose(self, layer: str, signature: str, device: torch.device, rule: str, candidates: list[Candidate],
               rows: int) -> str:  # fmt: skip
        """The method for ``layer`` (signature without the batch size): the remembered choice,
        else the cached one, else the fastest of the contending candidates timed now on this
        chunk of ``rows`` examples (of those within ``TUNE_TIE`` of it, the one with the lowest
        measured peak memory); the shape rule's ``rule`` when tuning is off or the chunk is too
        small to time (then nothing is remembered)."""
        known = self.remembered(layer, signature)
        if known is not None:
            return known
        names = {c.name for c in candidates}
        cached = self._cached(device).get(signature) if self.enabled else None
        if cached in names:
            return self._remember(layer, signature, LayerChoice(cached, "cache"))
        contending = _contending(candidates, rule, rows)
        if not self.enabled or len(contending) < 2:
            if self.enabled and len(contending) == 1 and min(c.macs for c in candidates) * rows >= TUNE_MIN_MACS:
                return self._remember(layer, signature, LayerChoice(rule, "estimate"))
            return rule
        started = time.perf_counter()
        ms = _time_candidates(contending, device)
        best, source = _leanest_near_fastest(ms, contending, device)
        self.tuning_s += time.perf_counter() - started
        self._store(device, signature, best)
        return self._remember(layer, signature, LayerChoice(best, source, ms))

    def remembered(self, layer: str, signature: str) -> str | None:
        """The method already chosen for ``signature`` (now also ``layer``'s), else None: every step
        after the first asks only this, before any candidate is built."""
        known = self.choices.get(signature)
        if known is None:
            return None
        self.layers[layer] = signature
        return known.method

    def pin(self, saved: dict[str, Any]) -> None:
        """Take a checkpoint's choices (``as_json``) as fixed: the resumed run computes exactly as
        the run that saved them, whatever this machine's timings."""
        for signature, method in saved.get("methods", {}).items():
            self.choices[signature] = LayerChoice(method, "pinned")

    def as_json(self) -> dict[str, Any]:
        """The choices so far: {"device", "methods": signature -> method, "layers": name -> [method,
        source, {candidate: ms}], "tuning_s"} (for the checkpoint, the summary and the log)."""
        layers = {name: [self.choices[s].method, self.choices[s].source, self.choices[s].ms]
                  for name, s in self.layers.items()}  # fmt: skip
        return {
            "device": self._device,
            "methods": {s: c.method for s, c in self.choices.items()},
            "layers": layers,
            "tuning_s": round(self.tuning_s, 3),
        }

    def describe(self) -> str:
        """One line for the run log: each layer's method and how it was chosen."""
        if not self.layers:
            return "clip methods: shape rule (no layer large enough to time)"
        parts = []
        for name, (method, source, ms) in self.as_json()["layers"].items():
            timing = "/".join(f"{k} {v:.1f}" for k, v in sorted(ms.items(), key=lambda kv: kv[1]))
            parts.append(f"{name or '<root>'} {method} ({source}{': ' + timing + ' ms' if timing else ''})")
        where = f" on {self._device}" if self._device else ""
        return f"clip methods{where}, tuned in {self.tuning_s:.1f} s: " + "; ".join(parts)

    def unreported(self) -> str | None:
        """``describe()`` if layers were chosen since the last call, else None (for a run's log)."""
        if len(self.layers) == self._reported:
            return None
        self._reported = len(self.layers)
        return self.describe()

    def _remember(self, layer: str, signature: str, choice: LayerChoice) -> str:
        self.choices[signature] = choice
        self.layers[layer] = signature
        return choice.method

    def _cached(self, device: torch.device) -> dict[str, str]:
        self._device = self._device or device_descriptor(device)
        if self.cache_file is None or not self.cache_file.exists():
            return {}
        try:
            table = json.loads(self.cache_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # an unreadable cache is re-timed and rewritten, never fatal
            return {}
        entry = table.get(self._device) if isinstance(table, dict) else None
        return entry if isinstance(entry, dict) else {}

    def _store(self, device: torch.device, signature: str, method: str) -> None:
        if self.cache_file is None:
            return
        table: dict[str, Any] = {}
        if self.cache_file.exists():
            try:
                table = json.loads(self.cache_file.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                table = {}
        table.setdefault(device_descriptor(device), {})[signature] = method
        try:
            atomic_write_text(self.cache_file, json.dumps(table, indent=1, sort_keys=True) + "\n")
        except OSError:  # a read-only home: the choice still holds for this run (and its checkpoint)
            pass


def default_tuner() -> MethodTuner:
    """The tuner engines get: on (unless ``$DPSCALE_AUTOTUNE=0``), cached at ``autotune_cache_path``."""
    return MethodTuner(enabled=os.environ.get(TUNE_OFF_ENV, "1") != "0", cache_file=autotune_cache_path())


def _contending(candidates: list[Candidate], rule: str, rows: int) -> list[Candidate]:
    """The candidates worth timing: within ``TUNE_SPREAD`` of the cheapest estimate and within the
    Gram memory cap (the rule's own choice always), none if the chunk is too small to time."""
    cheapest = min(c.macs for c in candidates)
    if cheapest * rows < TUNE_MIN_MACS:
        return []
    return [
        c for c in candidates
        if c.name == rule or (c.macs <= TUNE_SPREAD * cheapest and c.gram_bytes <= TUNE_MAX_GRAM_BYTES)
    ]  # fmt: skip


def _leanest_near_fastest(ms: dict[str, float], candidates: list[Candidate], device: torch.device) -> tuple[str, str]:
    """(method, how it was chosen): the fastest median in ``ms``, unless others are within
    ``TUNE_TIE`` of it; then, of those, the fastest whose ``peak_bytes`` is within ``PEAK_TIE``
    of the lowest. On a CPU only, and not under a user's own torch profiler: the measurement is a
    profiler there, and a nested one ends the user's session with no events; on CUDA it would reset
    the user's peak-memory statistics (and the noise it settles is a shared CPU VM's)."""
    fastest = min(ms, key=ms.__getitem__)
    near = [c for c in candidates if c.name in ms and ms[c.name] <= (1.0 + TUNE_TIE) * ms[fastest]]
    if len(near) < 2 or device.type != "cpu" or torch._C._autograd._profiler_enabled():
        return fastest, "timed"
    with torch.no_grad():
        peaks = {c.name: peak_bytes(c.run, device) for c in near}
    lowest = min(peaks.values())
    best = min((name for name, peak in peaks.items() if peak <= (1.0 + PEAK_TIE) * lowest), key=ms.__getitem__)
    if best == fastest:
        return fastest, "timed"
    return best, "timed, least memory (peak MB: " + ", ".join(f"{n} {b / 2**20:.1f}" for n, b in peaks.items()) + ")"


def peak_bytes(run: Callable[[], Any], device: torch.device) -> float:
    """Tensor memory at the peak of one call of ``run`` above what was allocated before it, in
    bytes: on CUDA the allocator's peak; on a CPU the running sum of the allocations and frees the
    torch profiler records (``cpu_allocation_peak``). This is how ``dpscale bench step-time``
    reports a step's peak too."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity, profile

    with profiler_markers_dropped(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    return cpu_allocation_peak(prof)


@contextlib.contextmanager
def profiler_markers_dropped() -> Iterator[None]:
    """Run the block with file descriptor 2 (the C++ profiler's stderr) sent to a temporary file,
    then write back to it everything but the profiler's start/stop lines (``PROFILER_MARKER``):
    a warning or an error printed meanwhile, by C++ or by Python, still reaches stderr (after the
    block). Where fd 2 cannot be duplicated, the block runs as it is."""
    sys.stderr.flush()  # what Python printed before goes out first, in order
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = memoryview(PROFILER_MARKER.sub(b"", capture.read()))
            while kept:
                kept = kept[os.write(2, kept) :]


def cpu_allocation_peak(prof: Any) -> float:
    """The peak, in bytes, of the CPU tensor memory a finished ``torch.profiler.profile(...,
    profile_memory=True)`` saw allocated above its start: every allocation and free in the order
    they happened, those inside an op included (a convolution kernel's buffers). From the
    profiler's event tree (the API ``torch.profiler._memory_profiler`` reads); where a torch lacks
    it, from the ops' own net allocations (``self_cpu_memory_usage``, counted at each op's start:
    an op's output once, by the op that allocated it; a buffer an op frees before returning is
    not seen).

    Until session 19 the CPU figure summed the innermost ops' memory only, and so missed every
    tensor an op with child ops allocates itself (``x * 2`` and ``torch.bmm``'s outputs: their
    scalar conversion and ``resolve_conj`` are children) and every free such an op makes; on whole
    steps it read high (papernot-cnn's DP step at f97f17a: 46.8 MB, 29.5 by this sum), on single
    layers low. The peaks in docs/benchmarks.md before then are that other measure."""
    try:
        from torch._C._profiler import _EventType

        roots = prof.profiler.kineto_results.experimental_event_tree()
        changes = [(n.start_time_ns, n.extra_fields.alloc_size) for n in _walk(roots) if n.tag == _EventType.Allocation]
    except (ImportError, AttributeError):
        changes = [(e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage]
    live = peak = 0
    for _, size in sorted(changes, key=lambda change: change[0]):
        live += size
        peak = max(peak, live)
    return float(peak)


def _walk(nodes: Any) -> Iterator[Any]:
    for node in nodes:
        yield node
        yield from _walk(node.children)


def _time_candidates(candidates: list[Candidate], device: torch.device) -> dict[str, float]:
    """Median milliseconds of each candidate: one untimed warm-up round (first calls allocate),
    then ``TUNE_REPEATS`` or more interleaved timed rounds (up to ``TUNE_MAX_REPEATS`` for fast
    candidates; a load that comes and goes hits every candidate alike), a candidate whose better
    time in the first two timed rounds is over ``TUNE_DROP`` times the fastest's dropped from the
    rest (its two times kept: one sample, preempted on a loaded machine, once dropped the
    fastest). The thread-CPU clock with one torch thread on a CPU (other processes' load does not
    count), else the wall clock, synchronised on a GPU."""
    clock = time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter

    def timed(c: Candidate) -> float:
        _sync(device)
        start = clock()
        c.run()
        _sync(device)
        return (clock() - start) * 1e3

    with torch.no_grad():
        for c in candidates:
            c.run()
        samples: dict[str, list[float]] = {c.name: [] for c in candidates}
        for _ in range(2):  # two looks before dropping: one preempted sample must not drop the fastest
            for c in candidates:
                samples[c.name].append(timed(c))
        best = {name: min(v) for name, v in samples.items()}
        fastest = min(best.values())
        kept = [c for c in candidates if best[c.name] <= TUNE_DROP * fastest]
        rounds = int(min(TUNE_MAX_REPEATS, max(TUNE_REPEATS, TUNE_WINDOW_MS / max(fastest, 1e-3))))
        for _ in range(rounds - 2):
            for c in kept:
                samples[c.name].append(timed(c))
    return {name: round(statistics.median(v), 3) for name, v in samples.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def methods_state(engine: Any) -> dict[str, Any] | None:
    """An engine's per-layer method choices for a checkpoint (None: it has no tuner)."""
    tuner = getattr(engine, "tuner", None)
    return tuner.as_json() if isinstance(tuner, MethodTuner) else None


def layer_methods(engine: Any) -> dict[str, str] | None:
    """Each layer's method (name -> method) for a run's summary: the same for an uninterrupted run
    and its resumed twin (how each was chosen, and the timings, are in the log and checkpoint)."""
    tuner = getattr(engine, "tuner", None)
    return {name: tuner.choices[s].method for name, s in tuner.layers.items()} if isinstance(tuner, MethodTuner) else None


def pin_methods(engine: Any, saved: dict[str, Any] | None) -> None:
    """Pin a checkpoint's choices (``methods_state``) on ``engine``'s tuner, if both exist."""
    tuner = getattr(engine, "tuner", None)
    if saved and isinstance(tuner, MethodTuner):
        tuner.pin(saved)

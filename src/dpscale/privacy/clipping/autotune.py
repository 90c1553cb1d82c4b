"""Per-layer method choice by timing on the machine that runs (issue 44).

A layer's per-example weight-gradient norms (and its clipped sum) have several exact methods:
Gram matrices with or without im2col, instantiated per-example gradients by im2col + bmm or by a
grouped convolution. Which is fastest depends on the shapes *and* on the hardware (an AMD EPYC,
an AVX-512 Xeon and a GPU rank them differently), so a shape rule tuned on one machine is wrong on
another. ``MethodTuner`` times the candidates a cost estimate leaves in contention, once per layer
signature (per-example shapes, geometry, dtype) and device, and keeps the fastest:

* in the process, for every later chunk of any batch size (the signature leaves out the batch);
* on disk (``autotune_cache_path``), so the next run on this machine does not time again, keyed
  by the device, the signature and the chunk's rows in powers of two (``cache_key``), and only
  when the timing shows no load (``autotune_timing.load_verdict``); a cached choice is timed once more before
  it is used and timed anew if it runs well off its prediction, and one that later runs off it
  (on a CPU, sampled chunks) leaves the cache for the next run to time (issue 63);
* in the run's checkpoint (``as_json`` / ``pin``), so a resumed run does exactly the same
  arithmetic as an uninterrupted one, whatever the timings on the resuming machine say.

Every candidate is exact and keeps its rounding bound (the Gram forms add a rigorous float64
bound, the instantiated ones take the norm of the gradient itself), so the choice changes the
speed and the last bits of the norms, never what the guarantee covers.

The clock is ``autotune_timing``'s, the file ``autotune_cache``'s, the peaks ``peak_memory``'s.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dpscale.privacy.clipping import autotune_timing
from dpscale.privacy.clipping.autotune_cache import (
    autotune_cache_path,
    cache_key,
    device_descriptor,
    read_table,
    rows_bucket,
    store_entry,
)
from dpscale.privacy.clipping.autotune_timing import (
    IDLE,
    JUDGE_MIN_MS,
    TUNE_DROP,
    Candidate,
    fastest_runs,
)
from dpscale.privacy.clipping.peak_memory import peak_bytes

# Candidates whose estimated multiply-adds exceed the cheapest estimate by more than this factor are
# not timed (a wider spread mostly times hopeless Gram candidates: the 16x16 pixel Grams estimated at 2.4x
# measured 38x on the AMD EPYC).
TUNE_SPREAD = 3.0
# A chunk whose cheapest candidate needs fewer multiply-adds than this is too small to time
# reliably (and too cheap to matter): the shape rule decides, and nothing is recorded.
TUNE_MIN_MACS = 2e7
# Gram candidates whose float64 Gram matrices would exceed this many bytes are not timed.
TUNE_MAX_GRAM_BYTES = 1 << 30
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
TUNE_RETIME = "retime"  # $DPSCALE_AUTOTUNE=retime: the cache is not read; every layer is timed, its entry replaced
# On its first chunk a cached choice runs CHECK_RUNS times, timed, interleaved with the runner-up of its
# timing (if that was within TUNE_DROP of it); its fastest run more than CHECK_OFF times off its cached
# prediction (scaled to the chunk's rows), either way, or over 1 + TUNE_TIE times the runner-up's, means
# the conditions it was timed in do not hold here: the layer is timed again now, before the choice computes
# anything. The fastest run, with no warm-up: the first call of a method in a process allocates. On the
# 2-core AMD EPYC at load average 4 the checks of a cached run cost 0.1 s (papernot-cnn, B = 256) and 1.1 s
# (tramer-cifar-cnn, B = 128) of wall time, against 2.5 s and 14 s for timing their layers.
CHECK_RUNS, CHECK_OFF = 2, 1.5
# Later (a CPU only: on a GPU the extra run would add launches and a synchronisation to the step), a
# signature's chunks 2, 4, 8, ..., CHECK_EVERY and every CHECK_EVERY-th after run the chosen method once
# more, timed: CHECK_STRIKES checks in a row off by CHECK_OFF drop its cache entry (the next run times it).
# The run keeps its choice: one changed mid-run would no longer compute as its twin resumed from a
# checkpoint taken before the change (which pins the old one).
CHECK_EVERY, CHECK_STRIKES = 128, 3


@dataclass
class LayerChoice:
    """The method one layer uses and where it came from.

    Attributes:
        method: the method's name.
        source: how it was chosen: "timed"; "timed, least memory (...)" when candidates within
            ``TUNE_TIE`` of the fastest were told apart by their measured peaks, given in MB;
            "estimate"; "cache"; "pinned" from a checkpoint.
        ms: when timed (now or for the cache), each candidate's median milliseconds on a chunk of
            ``rows`` examples: the chosen one's is its prediction.
        rows: the examples of the chunk it was timed on (0: not timed).
        timed_on: the date it was timed (YYYY-MM-DD), "" if not timed.
        load: ``IDLE`` or "under load (...)": what the timing's load check said.
        note: what a check against the prediction found ("" if nothing).
        checked: whether later chunks check it against its prediction (``CHECK_EVERY``).
    """

    method: str
    source: str
    ms: dict[str, float] = field(default_factory=dict)
    rows: int = 0
    timed_on: str = ""
    load: str = ""
    note: str = ""
    checked: bool = False

    def provenance(self) -> str:
        """Where the choice came from, for the run's line: "timed now", "cached 2026-11-28, timed
        idle", "pinned from the checkpoint", "estimate", with the timings and any check's note."""
        if self.source == "pinned":
            return "pinned from the checkpoint"
        if self.source == "estimate":
            return "estimate"
        if self.source == "cache":
            where = f"cached {self.timed_on or 'undated'}, timed {self.load}"
        else:
            where = (
                "timed now"
                + ("" if self.load in (IDLE, "") else f", {self.load}: not cached")
                + self.source[len("timed") :]
            )
        timing = "/".join(f"{k} {v:.1f}" for k, v in sorted(self.ms.items(), key=lambda kv: kv[1]))
        return (
            where + (f": {timing} ms" if timing else "") + (f"; {self.note}" if self.note else "")
        )


@dataclass
class MethodTuner:
    """Chooses each layer signature's method, by timing on this device, once.

    Args:
        enabled: time candidates (False: the shape rule, or a pinned choice, always).
        cache_file: the on-disk cache shared by runs on this machine (None: in memory only).
        read_cache: take choices from ``cache_file`` (False: time every layer, replacing its entry).
    """

    enabled: bool = True
    cache_file: Path | None = None
    read_cache: bool = True
    choices: dict[str, LayerChoice] = field(default_factory=dict)  # signature -> choice
    layers: dict[str, str] = field(default_factory=dict)  # layer name -> signature (for the log)
    tuning_s: float = 0.0
    _device: str | None = None
    _reported: tuple[int, int] = (0, 0)  # (layers, notes) already described by ``unreported``
    _notes: int = 0  # choices re-described since they were made (a check's finding)
    _chunks: dict[str, int] = field(default_factory=dict)  # signature -> chunks seen since chosen
    # signature -> checks in a row off its prediction
    _strikes: dict[str, int] = field(default_factory=dict)
    # signatures whose next ``choose`` checks the prediction
    _due: set[str] = field(default_factory=set)
    # this device's cache table as read once (or last written) by this tuner: a chunk too small to
    # time asks for its layers on every step, and reading the file each time cost 0.6 ms a step
    # (papernot-cnn at B = 4, a twelfth of its DP step)
    _table: dict[str, Any] | None = None

    def choose(
        self,
        layer: str,
        signature: str,
        device: torch.device,
        rule: str,
        candidates: list[Candidate],
        rows: int,
    ) -> str:
        """The method for ``layer`` (signature without the batch size): the remembered choice,
        else the cached one (for a chunk of ``rows`` examples, if it runs as predicted here), else
        the fastest of the contending candidates timed now on this chunk (of those within
        ``TUNE_TIE`` of it, the one with the lowest measured peak memory); the shape rule's
        ``rule`` when tuning is off or the chunk is too small to time (then nothing is remembered).
        A remembered choice whose check is due (``remembered`` said None) is run once, timed."""
        known = self.choices.get(signature)
        if known is not None:
            self.layers[layer] = signature
            if signature in self._due:
                self._due.discard(signature)
                self._check(signature, known, candidates, device, rows)
            return known.method
        cached, note = (
            self._from_cache(device, signature, candidates, rows) if self.enabled else (None, "")
        )
        if cached is not None:
            return self._remember(layer, signature, cached)
        contending = _contending(candidates, rule, rows)
        if not self.enabled or len(contending) < 2:
            # a cached choice that failed its check, and nothing to time now: not read again
            if note:
                self._store(device, cache_key(signature, rows), None)
            if (
                self.enabled
                and len(contending) == 1
                and min(c.macs for c in candidates) * rows >= TUNE_MIN_MACS
            ):
                return self._remember(layer, signature, LayerChoice(rule, "estimate"))
            return rule
        return self._remember(
            layer, signature, self._timed(device, signature, contending, rows, note)
        )

    def remembered(self, layer: str, signature: str) -> str | None:
        """The method already chosen for ``signature`` (now also ``layer``'s), else None: every step
        after the first asks only this, before any candidate is built. Also None when this chunk
        is one that checks the choice against its prediction (``CHECK_EVERY``): the caller then
        builds the candidates and ``choose`` runs the chosen one once more, timed."""
        known = self.choices.get(signature)
        if known is None:
            return None
        self.layers[layer] = signature
        if self.enabled and known.checked and self._check_due(signature):
            return None
        return known.method

    def pin(self, saved: dict[str, Any]) -> None:
        """Take a checkpoint's choices (``as_json``) as fixed: the resumed run computes exactly as
        the run that saved them, whatever this machine's timings."""
        for signature, method in saved.get("methods", {}).items():
            self.choices[signature] = LayerChoice(method, "pinned")

    def as_json(self) -> dict[str, Any]:
        """The choices so far: {"device", "methods": signature -> method, "layers": name -> [method,
        source, {candidate: ms}], "tuning_s"} (for the checkpoint, the summary and the log)."""
        layers = {
            name: [self.choices[s].method, self.choices[s].source, self.choices[s].ms]
            for name, s in self.layers.items()
        }
        return {
            "device": self._device,
            "methods": {s: c.method for s, c in self.choices.items()},
            "layers": layers,
            "tuning_s": round(self.tuning_s, 3),
        }

    def describe(self) -> str:
        """One line for the run log: each layer's method and where it came from (timed now, the
        cache with the date and load it was timed under, a checkpoint), with the timings."""
        if not self.layers:
            return "clip methods: shape rule (no layer large enough to time)"
        parts = [
            f"{name or '<root>'} {self.choices[s].method} ({self.choices[s].provenance()})"
            for name, s in self.layers.items()
        ]
        where = f" on {self._device}" if self._device else ""
        return f"clip methods{where}, tuned in {self.tuning_s:.1f} s: " + "; ".join(parts)

    def unreported(self) -> str | None:
        """``describe()`` if layers were chosen, or a choice's check found something, since the
        last call, else None (for a run's log)."""
        state = (len(self.layers), self._notes)
        if state == self._reported:
            return None
        self._reported = state
        return self.describe()

    def _remember(self, layer: str, signature: str, choice: LayerChoice) -> str:
        self.choices[signature] = choice
        self.layers[layer] = signature
        self._chunks[signature], self._strikes[signature] = 1, 0
        return choice.method

    def _timed(
        self,
        device: torch.device,
        signature: str,
        contending: list[Candidate],
        rows: int,
        note: str,
    ) -> LayerChoice:
        """The choice timing ``contending`` on this chunk gives, written to the cache if the timing
        showed no load (else any entry for its key removed: the next run times it again)."""
        started = time.perf_counter()
        # looked up on its module: tests replace it
        timing = autotune_timing.time_candidates(contending, device)
        best, source = _leanest_near_fastest(timing.ms, contending, device)
        self.tuning_s += time.perf_counter() - started
        choice = LayerChoice(
            best, source, timing.ms, rows, time.strftime("%Y-%m-%d"), timing.load, note
        )
        choice.checked = timing.load == IDLE and self._checkable(choice, device)
        self._store(
            device, cache_key(signature, rows), _entry(choice) if timing.load == IDLE else None
        )
        return choice

    def _from_cache(
        self, device: torch.device, signature: str, candidates: list[Candidate], rows: int
    ) -> tuple[LayerChoice | None, str]:
        """(the cached choice for this chunk if it runs here as it was timed (``_cache_check``),
        else None; why a cached choice was not taken, "" if there was none)."""
        table = self._cached(device)
        if not self.read_cache:
            return None, ""
        choice = _choice_of(table.get(cache_key(signature, rows)), {c.name for c in candidates})
        if choice is None:
            return None, ""
        started = time.perf_counter()
        why = self._cache_check(choice, candidates, device, rows)
        self.tuning_s += time.perf_counter() - started
        if why:
            return None, f"re-timed: {why} (cached {choice.timed_on})"
        choice.checked = self._checkable(choice, device)
        return choice, ""

    def _cache_check(
        self, choice: LayerChoice, candidates: list[Candidate], device: torch.device, rows: int
    ) -> str:
        """Why the cached ``choice`` does not run here as it was timed ("" if it does): its method
        and the runner-up of its timing (if within ``TUNE_DROP`` of it), ``CHECK_RUNS`` timed runs
        each, interleaved; the method's fastest run over ``CHECK_OFF`` off its prediction (scaled
        to ``rows``), or over ``1 + TUNE_TIE`` times the runner-up's (a ranking a load made)."""
        predicted = self._prediction(choice, rows)
        if predicted is None:
            return ""
        near = TUNE_DROP * choice.ms[choice.method]
        others = [
            c
            for c in candidates
            if c.name != choice.method and choice.ms.get(c.name, float("inf")) <= near
        ]
        runner_up = min(others, key=lambda c: choice.ms[c.name], default=None)
        measured = fastest_runs(
            [c for c in candidates if c.name == choice.method] + ([runner_up] if runner_up else []),
            device,
            CHECK_RUNS,
        )
        off = measured[choice.method] / predicted
        if not 1 / CHECK_OFF <= off <= CHECK_OFF:
            return (
                f"the cached {choice.method} ran {off:.2f}x its {choice.ms[choice.method]:.1f} ms"
            )
        if (
            runner_up is not None
            and measured[choice.method] > (1.0 + TUNE_TIE) * measured[runner_up.name]
        ):
            ratio = measured[choice.method] / measured[runner_up.name]
            return f"the cached {choice.method} ran {ratio:.2f}x {runner_up.name}'s time"
        return ""

    def _prediction(self, choice: LayerChoice, rows: int) -> float | None:
        """``choice``'s predicted ms for a chunk of ``rows``, scaled from the rows it was timed on;
        None where there is none to compare with (not timed, under ``JUDGE_MIN_MS``, another rows
        bucket)."""
        predicted = choice.ms.get(choice.method, 0.0)
        if (
            predicted < JUDGE_MIN_MS
            or choice.rows < 1
            or rows_bucket(rows) != rows_bucket(choice.rows)
        ):
            return None
        return predicted * rows / choice.rows

    def _checkable(self, choice: LayerChoice, device: torch.device) -> bool:
        """Whether later chunks check ``choice`` against its prediction: a CPU's, in the cache, and
        long enough to time in one run."""
        return (
            device.type == "cpu"
            and self.cache_file is not None
            and choice.ms.get(choice.method, 0.0) >= JUDGE_MIN_MS
        )

    def _check_due(self, signature: str) -> bool:
        """Count a chunk of ``signature``; True (and the check marked due) on chunks 2, 4, 8, ...,
        ``CHECK_EVERY`` and every ``CHECK_EVERY``-th after."""
        seen = self._chunks[signature] = self._chunks.get(signature, 1) + 1
        if seen % CHECK_EVERY == 0 or (seen < CHECK_EVERY and seen & (seen - 1) == 0):
            self._due.add(signature)
            return True
        return False

    def _check(
        self,
        signature: str,
        known: LayerChoice,
        candidates: list[Candidate],
        device: torch.device,
        rows: int,
    ) -> None:
        """A later chunk's check: ``known``'s method run once, timed (the step has just warmed it);
        ``CHECK_STRIKES`` in a row off its prediction by ``CHECK_OFF`` drop its cache entry and say
        so in the run's line."""
        predicted = self._prediction(known, rows)
        chosen = [c for c in candidates if c.name == known.method]
        if predicted is None or not chosen:
            return
        off = fastest_runs(chosen, device, 1)[known.method] / predicted
        if 1 / CHECK_OFF <= off <= CHECK_OFF:
            self._strikes[signature] = 0
            return
        self._strikes[signature] = self._strikes.get(signature, 0) + 1
        if self._strikes[signature] < CHECK_STRIKES:
            return
        self._store(device, cache_key(signature, known.rows), None)
        known.checked = False
        known.note = f"ran {off:.2f}x its prediction in {CHECK_STRIKES} checks in a row: dropped from the cache, timed again next run"
        self._notes += 1

    def _cached(self, device: torch.device) -> dict[str, Any]:
        self._device = self._device or device_descriptor(device)
        if self._table is None:
            self._table = read_table(self.cache_file, self._device)
        return self._table

    def _store(self, device: torch.device, key: str, entry: dict[str, Any] | None) -> None:
        """Write ``entry`` at ``key`` in this device's table (None: remove it; ``store_entry``)."""
        if store_entry(self.cache_file, device, key, entry):
            self._table = None  # read again (with what other runs wrote meanwhile) when next needed


def _entry(choice: LayerChoice) -> dict[str, Any]:
    """A timed choice as the cache keeps it."""
    return {
        "method": choice.method,
        "ms": choice.ms,
        "rows": choice.rows,
        "timed": choice.timed_on,
        "load": choice.load,
    }


def _choice_of(entry: Any, names: set[str]) -> LayerChoice | None:
    """The cached choice ``entry`` holds, None unless it is one of ``names`` with its prediction,
    rows and an idle timing."""
    if not isinstance(entry, dict) or entry.get("load") != IDLE or entry.get("method") not in names:
        return None
    ms, rows = entry.get("ms"), entry.get("rows")
    if (
        not isinstance(ms, dict)
        or not isinstance(rows, int)
        or rows < 1
        or not isinstance(ms.get(entry["method"]), (int, float))
    ):
        return None
    timings = {str(k): float(v) for k, v in ms.items() if isinstance(v, (int, float))}
    return LayerChoice(entry["method"], "cache", timings, rows, str(entry.get("timed", "")), IDLE)


def default_tuner() -> MethodTuner:
    """The tuner engines get: on (unless ``$DPSCALE_AUTOTUNE=0``), cached at ``autotune_cache_path``
    (not read with ``$DPSCALE_AUTOTUNE=retime``: every layer timed again, its entry replaced)."""
    setting = os.environ.get(TUNE_OFF_ENV, "1")
    return MethodTuner(
        enabled=setting != "0", cache_file=autotune_cache_path(), read_cache=setting != TUNE_RETIME
    )


def describe_methods(engine: Any) -> str | None:
    """The line a run logs for ``engine``'s per-layer methods (``MethodTuner.describe``: each layer's
    method, whether it was timed now, taken from the disk cache (the date and load it was timed
    under) or pinned from a checkpoint, and the timings); None for an engine without a tuner."""
    tuner = getattr(engine, "tuner", None)
    return tuner.describe() if isinstance(tuner, MethodTuner) else None


def _contending(candidates: list[Candidate], rule: str, rows: int) -> list[Candidate]:
    """The candidates worth timing: within ``TUNE_SPREAD`` of the cheapest estimate and within the
    Gram memory cap (the rule's own choice always), none if the chunk is too small to time."""
    cheapest = min(c.macs for c in candidates)
    if cheapest * rows < TUNE_MIN_MACS:
        return []
    return [
        c
        for c in candidates
        if c.name == rule
        or (c.macs <= TUNE_SPREAD * cheapest and c.gram_bytes <= TUNE_MAX_GRAM_BYTES)
    ]


def _leanest_near_fastest(
    ms: dict[str, float], candidates: list[Candidate], device: torch.device
) -> tuple[str, str]:
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
    best = min(
        (name for name, peak in peaks.items() if peak <= (1.0 + PEAK_TIE) * lowest),
        key=ms.__getitem__,
    )
    if best == fastest:
        return fastest, "timed"
    return best, "timed, least memory (peak MB: " + ", ".join(
        f"{n} {b / 2**20:.1f}" for n, b in peaks.items()
    ) + ")"


def methods_state(engine: Any) -> dict[str, Any] | None:
    """An engine's per-layer method choices for a checkpoint (None: it has no tuner)."""
    tuner = getattr(engine, "tuner", None)
    return tuner.as_json() if isinstance(tuner, MethodTuner) else None


def layer_methods(engine: Any) -> dict[str, str] | None:
    """Each layer's method (name -> method) for a run's summary: the same for an uninterrupted run
    and its resumed twin (how each was chosen, and the timings, are in the log and checkpoint)."""
    tuner = getattr(engine, "tuner", None)
    return (
        {name: tuner.choices[s].method for name, s in tuner.layers.items()}
        if isinstance(tuner, MethodTuner)
        else None
    )


def pin_methods(engine: Any, saved: dict[str, Any] | None) -> None:
    """Pin a checkpoint's choices (``methods_state``) on ``engine``'s tuner, if both exist."""
    tuner = getattr(engine, "tuner", None)
    if saved and isinstance(tuner, MethodTuner):
        tuner.pin(saved)

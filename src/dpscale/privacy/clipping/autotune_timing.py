"""Timing the clip-method candidates: one measured call, interleaved repeats, the load verdict.

The tuner's clock (``dpscale.privacy.clipping.autotune``): each candidate runs once untimed, then in
interleaved timed rounds, on the thread-CPU clock with one torch thread on a CPU (other processes'
load does not count), else on the wall clock (synchronised on a GPU); a timing whose thread waited
for a core, or whose runs spread too far, is judged under load (``load_verdict``) and not cached.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

TUNE_REPEATS = 3  # timed runs per candidate after one warm-up, interleaved; the median is kept
# Fast candidates get more rounds, up to this many, so that each is timed for ~TUNE_WINDOW_MS in all
# (a 5 ms layer's medians over 3 rounds differed by 10% between runs on a shared VM).
TUNE_MAX_REPEATS, TUNE_WINDOW_MS = 11, 60.0
TUNE_DROP = 2.0  # a candidate this many times slower than the fastest in the first timed round is not timed again
# A timing is "under load", and not written to the cache, when (one torch thread on a CPU) its runs took
# more than LOAD_WALL_RATIO times their thread-CPU time on the wall clock (the thread waited for a core),
# or a candidate's timed runs spread over LOAD_SPREAD of their median. The issue 63 cache: written on a
# loaded 2-core VM, it held pixel-gram for tramer-cifar-cnn's 3x3 convolutions where an idle timing
# picks grouped, and every later run stepped at 2.67x non-private instead of 1.29x. At load average 4-5 on
# the 2-core AMD EPYC, two timings of its layers read wall 1.7-2.7x thread CPU, and both picked pixel-gram
# for its 128-channel 8 x 8 layer (bmm-positions at load 2).
LOAD_WALL_RATIO, LOAD_SPREAD = 1.3, 0.5
# Runs shorter than this (ms) are neither judged for load nor checked against a prediction: the clock
# calls and a single preemption weigh too much in them (and such a layer costs little whichever method).
JUDGE_MIN_MS = 0.5
IDLE = "idle"  # the load verdict of a timing that showed none


@dataclass
class Candidate:
    """One exact method for a layer: its name, estimated multiply-adds per example, the bytes of
    the Gram matrices it would build for the chunk (0 if none), and a call that runs it (norms and
    clipped sum) on the chunk without touching the record."""

    name: str
    macs: float
    gram_bytes: float
    run: Callable[[], Any]


@dataclass(frozen=True)
class Timing:
    """A timing pass: each candidate's median milliseconds and the load check's verdict."""

    ms: dict[str, float]
    load: str


def time_candidates(candidates: list[Candidate], device: torch.device) -> Timing:
    """Median milliseconds of each candidate and the load check's verdict (``load_verdict``): one
    untimed warm-up round (first calls allocate), then ``TUNE_REPEATS`` or more interleaved timed
    rounds (up to ``TUNE_MAX_REPEATS`` for fast candidates; a load that comes and goes hits every
    candidate alike), a candidate whose better time in the first two timed rounds is over
    ``TUNE_DROP`` times the fastest's dropped from the rest (its two times kept: one sample,
    preempted on a loaded machine, once dropped the fastest). The thread-CPU clock with one torch
    thread on a CPU (other processes' load does not count), else the wall clock, synchronised on a
    GPU (``measure_once``)."""
    with torch.no_grad():
        for c in candidates:
            c.run()
        samples: dict[str, list[tuple[float, float]]] = {c.name: [] for c in candidates}
        # two looks before dropping: one preempted sample must not drop the fastest
        for _ in range(2):
            for c in candidates:
                samples[c.name].append(measure_once(c, device))
        best = {name: min(_on_clock(s, device) for s in v) for name, v in samples.items()}
        fastest = min(best.values())
        kept = [c for c in candidates if best[c.name] <= TUNE_DROP * fastest]
        rounds = int(min(TUNE_MAX_REPEATS, max(TUNE_REPEATS, TUNE_WINDOW_MS / max(fastest, 1e-3))))
        for _ in range(rounds - 2):
            for c in kept:
                samples[c.name].append(measure_once(c, device))
    ms = {
        name: round(statistics.median(_on_clock(s, device) for s in v), 3)
        for name, v in samples.items()
    }
    return Timing(ms, load_verdict(samples, thread_clock(device)))


def fastest_runs(candidates: list[Candidate], device: torch.device, runs: int) -> dict[str, float]:
    """Each candidate's fastest of ``runs`` interleaved timed runs, in ms, on the clock that ranks
    on ``device``."""
    fastest = {c.name: float("inf") for c in candidates}
    with torch.no_grad():
        for _ in range(runs):
            for c in candidates:
                fastest[c.name] = min(fastest[c.name], _on_clock(measure_once(c, device), device))
    return fastest


def measure_once(candidate: Candidate, device: torch.device) -> tuple[float, float]:
    """One call of ``candidate.run`` (synchronised on a GPU): (thread-CPU ms, wall ms). The tuner's
    only clock: tests replace it to give a candidate any timing."""
    _sync(device)
    wall, cpu = time.perf_counter(), time.thread_time()
    candidate.run()
    _sync(device)
    return (time.thread_time() - cpu) * 1e3, (time.perf_counter() - wall) * 1e3


def thread_clock(device: torch.device) -> bool:
    """Whether timings on ``device`` take the thread-CPU clock: a CPU with one torch thread (with
    more, the work of the others is not in this thread's time; on a GPU, the host's)."""
    return device.type == "cpu" and torch.get_num_threads() == 1


def _on_clock(sample: tuple[float, float], device: torch.device) -> float:
    """The milliseconds of a (thread-CPU, wall) sample on the clock that ranks on ``device``."""
    return sample[0] if thread_clock(device) else sample[1]


def load_verdict(samples: dict[str, list[tuple[float, float]]], thread: bool) -> str:
    """``IDLE``, or "under load (...)" with what showed it, for a timing's (thread-CPU ms, wall ms)
    samples per candidate: on the thread clock (``thread``), their wall time over their thread-CPU
    time above ``LOAD_WALL_RATIO`` (the thread waited for a core); on either clock, a candidate's
    (three or more) timed runs spread, (max - min) / median without the slowest run, over ``LOAD_SPREAD``. Candidates whose
    median is under ``JUDGE_MIN_MS`` are not judged."""
    judged = {}
    for name, runs in samples.items():
        times = [cpu if thread else wall for cpu, wall in runs]
        if times and statistics.median(times) >= JUDGE_MIN_MS:
            judged[name] = times
    if thread:
        cpu = sum(c for name in judged for c, _ in samples[name])
        wall = sum(w for name in judged for _, w in samples[name])
        if cpu > 0 and wall > LOAD_WALL_RATIO * cpu:
            return f"under load (wall clock {wall / cpu:.2f}x thread CPU)"
    for name, times in judged.items():
        # without the slowest run: one page-fault burst or preemption is not load (on the idle VM one
        # such run read 64-137% spreads and kept good timings out of the cache, session 22)
        kept = sorted(times)[:-1]
        spread = (max(kept) - min(kept)) / statistics.median(times) if kept else 0.0
        if len(times) >= TUNE_REPEATS and spread > LOAD_SPREAD:
            return f"under load ({name}'s runs spread {spread:.0%})"
    return IDLE


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

"""Tensor memory at the peak of one call (CUDA's allocator, or the torch profiler on a CPU), with
the profiler's start/stop lines kept off stderr.

The tuner keeps, of candidates within the timing noise, the one with the lowest peak
(``dpscale.privacy.clipping.autotune``); ``dpscale bench step-time`` and the chunk-size search
measure a step's peak with it too.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from typing import Any, Callable, Iterator

import torch

# What torch's profiler (kineto) writes to fd 2, at any KINETO_LOG_LEVEL, each time it starts and
# stops: "USDT:2026-11-29 03:46:12 10456:10456 SyncActivityProfilerHandler.cpp:52] profiler_start".
# peak_bytes drops these lines (they filled every first run's stderr, issue 62) and nothing else.
PROFILER_MARKER = re.compile(rb"^USDT:[^\n]*\] profiler_(?:start|stop)\r?(?:\n|\Z)", re.MULTILINE)


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

    with (
        profiler_markers_dropped(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
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
        changes = [
            (n.start_time_ns, n.extra_fields.alloc_size)
            for n in _walk(roots)
            if n.tag == _EventType.Allocation
        ]
    except (ImportError, AttributeError):
        changes = [
            (e.time_range.start, e.self_cpu_memory_usage)
            for e in prof.events()
            if e.self_cpu_memory_usage
        ]
    live = peak = 0
    for _, size in sorted(changes, key=lambda change: change[0]):
        live += size
        peak = max(peak, live)
    return float(peak)


def _walk(nodes: Any) -> Iterator[Any]:
    for node in nodes:
        yield node
        yield from _walk(node.children)

"""Freed CPU memory kept in the process, so that a step's fresh tensors cost no page faults.

A DP step on the CPU allocates large short-lived tensors every step (per-example gradients,
Grams, a grouped convolution's workspace: 8-75 MB on the paper CNNs). glibc's malloc serves
blocks above its mmap threshold (128 kB, rising to at most 32 MB as blocks are freed) with a
fresh ``mmap`` and gives them back with ``munmap`` on ``free``, and trims the heap's top above
its trim threshold, so each step touches new pages: the kernel zero-fills every 4 kB page on its
first write. On the 2-core AMD EPYC VM that was 5,700 page faults per papernot-cnn step pair
(non-private + DP at B = 256) and 12 ms of system time in the grouped convolution alone (16 ms
where 3.5 ms is arithmetic; docs/benchmarks.md, session 15). Raising both thresholds to
``THRESHOLD_BYTES`` makes glibc keep freed blocks for reuse, like a caching allocator: after
the first steps the same pages serve every step.

The cost: the process keeps its peak heap instead of returning it to the system between steps
(its resident size stays at the step's high-water mark; tensor memory is unchanged). Set
``DPSCALE_CPU_MEMORY=release`` to leave malloc as it is. Only glibc has ``mallopt``; elsewhere
(musl, macOS, Windows) nothing changes and the status says so.

Bounded: a kept heap fragments when the blocks it is asked for change size (Poisson batches
split into chunks of varying length, an evaluation's batches between steps), and its resident
size then creeps above one step's high-water mark. ``bound_kept_memory`` (after every
``DPMechanism`` step) returns the heap's free pages to the system with ``malloc_trim(0)`` once
the resident set is more than ``KEPT_GROWTH_BYTES`` (256 MiB) above its level after the first
step since the last trim, and the trainer trims before and after each evaluation
(``trim_kept_memory``). A step that follows a trim faults its pages in once, as with
``release``. What stays bounded is the creep: a step's own high-water mark, which buys the
speed, stays resident. Measured on the 2-core AMD EPYC VM (docs/engines.md, max RSS):
tramer-cifar-cnn on 6,000 JPEGs at 64 px in memory (B = 256, 20 steps, two evaluations) peaked
at 3,655-4,357 MB kept without the bound, 2,738-2,740 MB bounded, 3,154-3,193 MB with
``release``; the default ``dpscale train`` at 705-708 / 635 / 695-706 MB.

Not for a streamed run unless asked for (``DPSCALE_CPU_MEMORY=keep``): its chunks are fresh
tensors of varying size (157 MB for 512 images at 160 px), and in a kept heap a small block
placed in a freed chunk's hole leaves it too short for the next one, so the heap grew by a chunk
every step or two: a linear model's streamed epoch of 30,000 images peaked at 2,135 MB kept
against 929 MB with malloc as it is (docs/data.md). Streaming promises memory bounded by the
chunks in flight; its default leaves malloc as it is, so the setting adds nothing to its peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from pathlib import Path

MEMORY_ENV = "DPSCALE_CPU_MEMORY"
MEMORY_CHOICES = ("keep", "release")
STREAMED = f"malloc left as it is for a streamed run (its chunks would fragment a kept heap; {MEMORY_ENV}=keep keeps freed memory)"
# blocks up to 1 GiB come from (and return to) the heap; larger ones are mmap'ed
THRESHOLD_BYTES = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)

# resident bytes a kept heap may gain over its post-trim level before a trim
KEPT_GROWTH_BYTES = 256 << 20

KEPT = "freed CPU memory kept for reuse"
_status: str | None = None  # what this process's first call did (mallopt's effect is process-wide)
# set once the thresholds are raised: its malloc_trim bounds the kept heap
_libc: ctypes.CDLL | None = None
# resident bytes after the first step since the last trim (None: not measured yet)
_floor: int | None = None


def keep_freed_memory(streamed: bool = False) -> str:
    """Make glibc's malloc keep freed blocks up to ``THRESHOLD_BYTES`` in the process (once per
    process; later calls return the first call's status).

    Args:
        streamed: the caller trains on streamed chunks (``data.loader=stream``): malloc is left
            as it is unless ``$DPSCALE_CPU_MEMORY`` says ``keep``.

    Returns:
        one line for a run's header: what was set, or why malloc was left as it is.

    Raises:
        ValueError: ``$DPSCALE_CPU_MEMORY`` is neither ``keep`` nor ``release``.
    """
    global _status
    choice = os.environ.get(MEMORY_ENV)
    if choice is not None and choice not in MEMORY_CHOICES:
        raise ValueError(f"{MEMORY_ENV}={choice!r}: expected one of {', '.join(MEMORY_CHOICES)}")
    if _status is None:
        if choice == "release":
            _status = f"malloc left as it is ({MEMORY_ENV}=release)"
        else:
            _status = STREAMED if streamed and choice is None else _set_thresholds()
    return _status


def _set_thresholds() -> str:
    """glibc's mmap and trim thresholds raised to ``THRESHOLD_BYTES``, or why not."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"malloc left as it is (not glibc: {platform.system()} {platform.libc_ver()[0] or ''})".rstrip()
    global _libc
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mmap_ok = libc.mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES) == 1
    trim_ok = libc.mallopt(_M_TRIM_THRESHOLD, THRESHOLD_BYTES) == 1
    if not (mmap_ok and trim_ok):
        return "malloc left as it is (glibc refused the thresholds)"
    _libc = libc
    gib = THRESHOLD_BYTES / 2**30
    return (
        f"{KEPT}: glibc's mmap and trim thresholds at {gib:g} GiB, so a step's fresh "
        f"tensors cost no page faults ({MEMORY_ENV}=release to leave malloc as it is)"
    )


def memory_mode() -> str:
    """``kept`` once this process keeps freed memory (``keep_freed_memory`` succeeded), else
    ``system``: what CPU timings (the clip-method tuner's) depend on."""
    return "kept" if _status is not None and _status.startswith(KEPT) else "system"


def trim_kept_memory() -> None:
    """Return a kept heap's free pages to the system (glibc's ``malloc_trim(0)``; nothing when
    freed memory is not kept), and measure the level ``bound_kept_memory`` allows anew."""
    global _floor
    if _libc is not None:
        _libc.malloc_trim(0)
        _floor = None


def bound_kept_memory() -> bool:
    """After a step: trim the kept heap once the process's resident set has grown more than
    ``KEPT_GROWTH_BYTES`` above its level after the first step since the last trim (a heap that
    fragments creeps; one whose blocks are reused stays level and is never trimmed).

    Returns:
        whether it trimmed.
    """
    global _floor
    if _libc is None:
        return False
    try:
        # bytes
        resident = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    # glibc without /proc mounted (a chroot, a sandbox): no bound to read
    except (OSError, ValueError, IndexError):
        return False
    if _floor is None:
        _floor = resident
        return False
    if resident <= _floor + KEPT_GROWTH_BYTES:
        return False
    trim_kept_memory()
    return True

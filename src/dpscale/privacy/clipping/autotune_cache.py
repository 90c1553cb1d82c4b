"""The clip-method tuner's disk cache: where it lives, the device and chunk keys its entries are
filed under, reading a device's table and writing one entry.

``dpscale.privacy.clipping.autotune`` decides what goes in (a timed choice, only when its timing
showed no load) and what it trusts coming out; this module keeps the file: one table per device
(``device_descriptor``), an entry per layer signature and bucket of chunk rows (``cache_key``).
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import torch

from dpscale.cpu_memory import memory_mode
from dpscale._io import atomic_write_text, cache_path


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


def cache_key(signature: str, rows: int) -> str:
    """A cache entry's key: ``signature`` and the chunk's rows bucketed by powers of two, e.g.
    ``...|rows=65-128`` (a chunk's size changes which method is fastest: fixed costs weigh less in
    a larger one). Entries written before the rows were in the key (their value a bare method
    name) are not read, whatever they say (taken as absent: they hold no prediction to check and
    nothing of the load they were timed under), and are dropped when the file is next written."""
    top = rows_bucket(rows)
    return f"{signature}|rows={top // 2 + 1}-{top}"


def rows_bucket(rows: int) -> int:
    """The power of two at or above ``rows`` (1 for 0 or 1)."""
    return 1 << max(0, rows - 1).bit_length()


def read_table(cache_file: Path | None, descriptor: str | None) -> dict[str, Any]:
    """The table of one device in the cache file.

    Args:
        cache_file: the cache file (None: there is none).
        descriptor: the device's ``device_descriptor``.

    Returns:
        Its entries, key -> entry ({} without a file, or an unreadable one).
    """
    if cache_file is None or not cache_file.exists():
        return {}
    try:
        table = json.loads(cache_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # an unreadable cache is re-timed and rewritten, never fatal
        return {}
    entry = table.get(descriptor) if isinstance(table, dict) else None
    return entry if isinstance(entry, dict) else {}


def store_entry(
    cache_file: Path | None, device: torch.device, key: str, entry: dict[str, Any] | None
) -> bool:
    """Write ``entry`` at ``key`` in ``device``'s table (None: remove it), dropping the table's
    entries in an older format (a bare method name: ``cache_key``); a missing file is not created
    to remove. A file that cannot be written (a read-only home) is left as it is.

    Args:
        cache_file: the cache file (None: nothing is written).
        device: the device whose table (``device_descriptor``) holds the entry.
        key: the entry's ``cache_key``.
        entry: what the cache keeps of a timed choice, or None to remove the key.

    Returns:
        Whether the file was rewritten (or its rewrite tried): a table read before is stale.
    """
    if cache_file is None or (entry is None and not cache_file.exists()):
        return False
    table: dict[str, Any] = {}
    if cache_file.exists():
        try:
            table = json.loads(cache_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            table = {}
    if not isinstance(table, dict):
        table = {}
    ours = table.get(device_descriptor(device))
    mine = {k: v for k, v in ours.items() if isinstance(v, dict)} if isinstance(ours, dict) else {}
    if entry is None:
        mine.pop(key, None)
    else:
        mine[key] = entry
    table[device_descriptor(device)] = mine
    try:
        atomic_write_text(cache_file, json.dumps(table, indent=1, sort_keys=True) + "\n")
    except OSError:  # a read-only home: the choice still holds for this run (and its checkpoint)
        pass
    return True

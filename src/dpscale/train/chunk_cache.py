"""The cache of ``train.max_physical_batch_size: auto``'s choices (``cache_path("chunk_size.json")``):
keyed by what changes the choice (``cache_key``); a cached peak over today's budget, or one capped by
a smaller largest batch, is not used."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpscale._io import atomic_write_text
from dpscale._version import __version__
from dpscale.privacy.clipping.autotune_cache import device_descriptor
from dpscale.privacy.clipping.per_example import Batch, PerExampleEngine

CACHE_NAME = "chunk_size.json"
BUCKETS_PER_OCTAVE = 4  # budgets within a quarter octave (19%) share a cache entry


def cache_key(
    engine: PerExampleEngine, model: nn.Module, unit: Batch, device: torch.device, budget: float
) -> str:
    """What the chosen chunk depends on: the device (``device_descriptor``), the model (class,
    parameters, trainable shapes), one unit's input shape and dtype, the engine and its
    precision, the clipping's form, the dpscale version and the budget to a quarter octave."""
    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters() if p.requires_grad]
    digest = hashlib.sha256(repr(shapes).encode()).hexdigest()[:12]
    total = sum(p.numel() for p in model.parameters())
    bound = engine.max_grad_norm
    clip = (
        f"groups={len(bound)}"
        if isinstance(bound, dict)
        else "one"
        if bound is not None
        else "none"
    )
    bucket = 2 ** (
        math.floor(math.log2(max(budget, 1.0) / 1e6) * BUCKETS_PER_OCTAVE) / BUCKETS_PER_OCTAVE
    )
    return (
        f"{device_descriptor(device)}|model={type(model).__name__}:{total}:{digest}|unit={tuple(unit[0].shape[1:])}:"
        f"{unit[0].dtype}:{tuple(unit[1].shape[1:])}|engine={engine.name}:{engine.precision.name}:clip={clip}:"
        f"gamma={engine.clip_gamma is not None}|dpscale={__version__}|budget~{bucket:.0f}MB"
    )


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    # missing or unreadable: measured again and rewritten, never fatal
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def cached_choice(
    path: Path, key: str, budget: float, max_units: int
) -> tuple[int, float, bool] | None:
    """(units, peak, capped) of a cached choice that still holds: its peak within ``budget``, and
    not capped by a smaller largest batch than ``max_units`` (then a larger chunk may fit).

    Args:
        path: the cache file; key: the choice's ``cache_key``.
        budget: today's budget (bytes); max_units: the largest logical batch, in units.

    Returns:
        The choice's units (at most ``max_units``), peak and whether it is capped; None: none holds.
    """
    entry = _read_cache(path).get(key)
    try:
        units, peak, capped = int(entry["units"]), float(entry["peak_bytes"]), bool(entry["capped"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        return None
    if peak > budget or units < 1 or (capped and units < max_units):
        return None
    return min(units, max_units), peak, capped or units >= max_units


def store_choice(path: Path, key: str, choice: dict[str, Any]) -> None:
    """A choice recorded under ``key`` in the cache file ``path`` (``choice``: ``ChunkChoice``'s
    fields); a cache that cannot be written is left as it is."""
    table = _read_cache(path)
    table[key] = {
        k: v
        for k, v in choice.items()
        if k in ("units", "rows", "peak_bytes", "budget_bytes", "capped")
    }
    # a read-only home: the choice still holds for this run (in its config)
    with contextlib.suppress(OSError):
        atomic_write_text(path, json.dumps(table, indent=1, sort_keys=True) + "\n")

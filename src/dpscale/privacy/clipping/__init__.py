"""Clipping: what the bound C means (flat, per layer, adaptive, automatic), the engines that compute
the clipped per-example sum (vmap, the ghost and book-keeping engines, the compiled step), their method
tuner, mixed precision, the float64 reference they are checked against and the start-up self-check.
Names are imported on first use."""

from __future__ import annotations

from dpscale._lazy import lazy_dir, lazy_getattr

_MODULE_OF = {
    "GhostEngine": "ghost.engine",
    "PerExampleEngine": "per_example",
    "VmapEngine": "per_example",
    "clip_bounds": "bounds",
    "clip_factors": "per_example",
    "make_engine": "engines",
    "unsupported_modules": "ghost.model",
}
__all__ = sorted(_MODULE_OF)
__getattr__ = lazy_getattr(__name__, _MODULE_OF)
__dir__ = lazy_dir(_MODULE_OF, ("ghost",))

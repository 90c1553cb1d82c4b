"""The ghost and book-keeping engines: per-example norms without per-example gradients (the layer
rules, the convolution methods, each layer's record and the model's bookkeeping)."""

from __future__ import annotations

from dpscale._lazy import lazy_dir, lazy_getattr

_MODULE_OF = {"GhostEngine": "engine", "unsupported_modules": "model"}
__all__ = sorted(_MODULE_OF)
__getattr__ = lazy_getattr(__name__, _MODULE_OF)
__dir__ = lazy_dir(_MODULE_OF)

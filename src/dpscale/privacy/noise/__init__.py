"""Noise: independent Gaussian noise on the clipped sum, and BandMF's correlated noise (the strategy,
its linear algebra and the online draw). Names are imported on first use."""

from __future__ import annotations

from dpscale._lazy import lazy_dir, lazy_getattr

_MODULE_OF = {"add_gaussian_noise": "gaussian", "draw_noise": "gaussian"}
__all__ = sorted(_MODULE_OF)
__getattr__ = lazy_getattr(__name__, _MODULE_OF)
__dir__ = lazy_dir(_MODULE_OF)

"""Sampling: the batch samplers (Poisson, capped Poisson, fixed size, shuffling, cyclic for BandMF)
and the samplers of people (user-level DP). Names are imported on first use."""

from __future__ import annotations

from dpscale._lazy import lazy_dir, lazy_getattr

_MODULE_OF = {
    "FixedSizeSampler": "samplers",
    "PoissonSampler": "samplers",
    "SAMPLING_MODES": "modes",
    "SHUFFLE_CAVEAT": "modes",
    "ShuffleSampler": "samplers",
    "UserPoissonSampler": "units",
    "make_sampler": "samplers",
}
__all__ = sorted(_MODULE_OF)
__getattr__ = lazy_getattr(__name__, _MODULE_OF)
__dir__ = lazy_dir(_MODULE_OF)

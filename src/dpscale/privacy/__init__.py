"""Privacy: per-example clipping engines, noise, accounting and calibration."""

# Imported on first use (PEP 562): ``dpscale account``/``--help`` then never pay for torch.
from __future__ import annotations

from dpscale._lazy import lazy_getattr

_MODULE_OF = {
    "ACCOUNTANT_KINDS": "accountant",
    "AccountingSegment": "accountant",
    "GhostEngine": "ghost",
    "PerExampleEngine": "per_example",
    "PrivacyAccountant": "accountant",
    "VmapEngine": "per_example",
    "add_gaussian_noise": "noise",
    "calibrate_noise_multiplier": "calibrate",
    "calibrate_steps": "calibrate",
    "clip_bounds": "clipping",
    "clip_factors": "per_example",
    "compute_epsilon": "accountant",
    "eps_tan": "tan",
    "gaussian_release": "accountant",
    "make_engine": "engines",
    "tan_eta": "tan",
    "total_amount_of_noise": "tan",
    "unsupported_modules": "ghost",
}

__all__ = sorted(_MODULE_OF)


__getattr__ = lazy_getattr(__name__, _MODULE_OF)

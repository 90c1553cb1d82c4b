"""Accounting (torch-free): the privacy loss of what ran, as epsilon for a delta (PLD and RDP through
dp_accounting), calibration of sigma or steps to a target, truncated Poisson, group privacy, the
attacker's odds, TAN and the cost of tuning. Names are imported on first use."""

from __future__ import annotations

from dpscale._lazy import lazy_dir, lazy_getattr

_MODULE_OF = {
    "ACCOUNTANT_KINDS": "accountant",
    "AccountingSegment": "segments",
    "PrivacyAccountant": "accountant",
    "calibrate_noise_multiplier": "calibrate",
    "calibrate_steps": "calibrate",
    "compute_epsilon": "accountant",
    "eps_tan": "tan",
    "gaussian_release": "segments",
    "tan_eta": "tan",
    "total_amount_of_noise": "tan",
}
__all__ = sorted(_MODULE_OF)
__getattr__ = lazy_getattr(__name__, _MODULE_OF)
__dir__ = lazy_dir(_MODULE_OF)

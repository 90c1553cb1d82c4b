"""Privacy: per-example clipping engines, noise, accounting and calibration."""

from dpscale.privacy.accountant import (
    ACCOUNTANT_KINDS,
    AccountingSegment,
    PrivacyAccountant,
    compute_epsilon,
    gaussian_release,
)
from dpscale.privacy.calibrate import calibrate_noise_multiplier, calibrate_steps
from dpscale.privacy.noise import add_gaussian_noise
from dpscale.privacy.ghost import GhostEngine, unsupported_modules
from dpscale.privacy.engines import make_engine
from dpscale.privacy.per_example import PerExampleEngine, VmapEngine, clip_factors
from dpscale.privacy.tan import eps_tan, tan_eta, total_amount_of_noise

__all__ = [
    "ACCOUNTANT_KINDS",
    "AccountingSegment",
    "GhostEngine",
    "PerExampleEngine",
    "PrivacyAccountant",
    "VmapEngine",
    "add_gaussian_noise",
    "calibrate_noise_multiplier",
    "calibrate_steps",
    "clip_factors",
    "compute_epsilon",
    "gaussian_release",
    "eps_tan",
    "make_engine",
    "tan_eta",
    "total_amount_of_noise",
    "unsupported_modules",
]

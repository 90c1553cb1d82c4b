"""The DP plan (torch-free): one frozen plan from a run's privacy numbers, from which the sampler, the
clipping, the noise std and the accounting all derive; the checks that run before it. Names are
imported on first use."""

from __future__ import annotations

from dpscale._lazy import lazy_dir, lazy_getattr

_MODULE_OF = {
    "DPPlan": "dp_plan",
    "PrivacyNumbers": "numbers",
    "check_compatible": "make_plan",
    "make_dp_plan": "make_plan",
}
__all__ = sorted(_MODULE_OF)
__getattr__ = lazy_getattr(__name__, _MODULE_OF)
__dir__ = lazy_dir(_MODULE_OF)

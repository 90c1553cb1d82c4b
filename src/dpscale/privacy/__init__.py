"""Privacy, in five rooms along the imports: ``accounting`` (torch-free), ``sampling``, ``noise``,
``clipping`` (with ``clipping.ghost``) and ``plan`` (torch-free), over the typed options
(``options``) and the doors' wording (``spelling``). Each room imports only the rooms before it in
that order. The names below are imported on first use (PEP 562): ``dpscale account`` and ``--help``
never pay for torch."""

from __future__ import annotations

from dpscale._lazy import lazy_dir, lazy_getattr

# lowest first: a room imports only earlier ones
ROOMS = ("accounting", "sampling", "noise", "clipping", "plan")

_MODULE_OF = {
    "ACCOUNTANT_KINDS": "accounting.accountant",
    "AccountingSegment": "accounting.segments",
    "GhostEngine": "clipping.ghost.engine",
    "PerExampleEngine": "clipping.per_example",
    "PrivacyAccountant": "accounting.accountant",
    "VmapEngine": "clipping.per_example",
    "add_gaussian_noise": "noise.gaussian",
    "calibrate_noise_multiplier": "accounting.calibrate",
    "calibrate_steps": "accounting.calibrate",
    "clip_bounds": "clipping.bounds",
    "clip_factors": "clipping.per_example",
    "compute_epsilon": "accounting.accountant",
    "eps_tan": "accounting.tan",
    "gaussian_release": "accounting.segments",
    "make_engine": "clipping.engines",
    "tan_eta": "accounting.tan",
    "total_amount_of_noise": "accounting.tan",
    "unsupported_modules": "clipping.ghost.model",
}

__all__ = sorted(_MODULE_OF)
__getattr__ = lazy_getattr(__name__, _MODULE_OF)
__dir__ = lazy_dir(_MODULE_OF, (*ROOMS, "options", "spelling"))

"""The privacy numbers of a run, in one vocabulary: ``PrivacyNumbers`` is what ``make_private``, a
config's ``dp`` section and a saved plan's check hand to ``make_dp_plan``.

Following jax_privacy, the numbers that decide the guarantee are kept apart from the performance
flags that never change it (the clipping engine, precision, physical batch size, workers): those
stay with the engine and the loop. The facts of the run rather than of the user's choice (N, the
steps S, the releases of source runs, BandMF's request, the privacy unit) are ``make_dp_plan``'s
own keywords.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpscale.clip_norms import MaxGradNorm
from dpscale.privacy.clipping.adaptive import AdaptiveClipping
from dpscale.privacy.options import check_accountant


@dataclass(frozen=True, kw_only=True)
class PrivacyNumbers:
    """The privacy numbers asked for (keyword-only, frozen).

    Attributes:
        batch_size: expected logical batch size B (q = B / N; at the user unit, users per step).
        max_grad_norm: C, per-layer bounds pattern -> C_g, or per-tensor bounds name -> C_i (the
            noise std is then sigma * sqrt(sum C^2)); None: no clipping (non-private runs only).
        delta: the guarantee's delta.
        target_epsilon: calibrate sigma so the planned steps spend this (the config's dp.epsilon).
        noise_multiplier: sigma, given instead (checked against target_epsilon when both are set;
            0: not private).
        sampling: "poisson", "fixed" or "shuffle" (``dpscale.privacy.accounting.batch_sampling``).
        max_batch_size: cap Poisson batches at this many examples, "auto", or None (uncapped).
        accountant: "pld" or "rdp" (replaced by the one that composes the sampling).
        adaptive: adaptive clipping's settings (C_0 = max_grad_norm), or None for fixed C.
        clip_gamma: automatic clipping's gamma, or None (clip to C).
        simulated_batch_size: a TAN simulation of this run at that batch size, or None.
    """

    batch_size: float
    max_grad_norm: MaxGradNorm
    delta: float
    target_epsilon: float | None = None
    noise_multiplier: float | None = None
    sampling: str = "poisson"
    max_batch_size: int | str | None = None
    accountant: str = "pld"
    adaptive: AdaptiveClipping | None = None
    clip_gamma: float | None = None
    simulated_batch_size: float | None = None

    def __post_init__(self) -> None:
        # every door's plan: an unknown name never plans with another
        check_accountant(self.accountant)

"""One frozen DP plan from which sampling, clipping, noise and accounting are all derived.

Sampler, clipping norm, noise std and accounting event are read from the same
``DPPlan``, so they cannot disagree (the jax_privacy idea).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dpscale.config import ConfigError, DPConfig
from dpscale.data.sampling import SHUFFLE_CAVEAT, make_sampler
from dpscale.privacy.accountant import AccountingSegment, compute_epsilon
from dpscale.privacy.calibrate import calibrate_noise_multiplier
from dpscale.privacy.tan import PRIVACY_WALL_SIGMA, eps_tan

NOT_PRIVATE = "NOT PRIVATE: noise_multiplier=0 (non-private baseline), no DP guarantee"
GUARANTEE_SCOPE = (
    "epsilon covers the trained model (and anything computed from it alone). Not covered: the "
    "train_loss/gradient-norm statistics in metrics.jsonl and the progress bar (computed on private "
    "examples without noise), the RNG states in checkpoint.pt, a fixed run.seed, and hyper-parameter "
    "tuning on the same data. Keep the run directory private; release the model."
)


@dataclass(frozen=True)
class DPPlan:
    """Attributes:
    dataset_size: N.
    batch_size: expected logical batch size B; the noisy sum is divided by B.
    sample_rate: q = B / N.
    steps: total logical steps S.
    noise_multiplier: sigma (0 for a non-private run).
    max_grad_norm: clipping norm C (None: no clipping).
    delta: delta.
    target_epsilon: the budget (None if not set).
    epsilon: epsilon after all S steps as planned (inf when not private).
    sampling: "poisson" | "shuffle".
    accountant: "pld" | "rdp".
    calibrated: whether sigma was calibrated to target_epsilon.
    releases: one-off Gaussian mechanisms on the training data made before training (e.g.
        private Data Normalization), composed with the DP-SGD steps in ``epsilon`` and in the
        calibration of sigma.
    """

    dataset_size: int
    batch_size: int
    sample_rate: float
    steps: int
    noise_multiplier: float
    max_grad_norm: float | None
    delta: float
    target_epsilon: float | None
    epsilon: float
    sampling: str
    accountant: str
    calibrated: bool
    releases: tuple[AccountingSegment, ...] = ()

    def __post_init__(self) -> None:
        # A plan read back from a checkpoint holds its releases as dicts (dataclasses.asdict).
        releases = tuple(r if isinstance(r, AccountingSegment) else AccountingSegment(**r) for r in self.releases)
        object.__setattr__(self, "releases", releases)

    def release_noise(self, label: str) -> float:
        """Noise multiplier of the release named ``label`` (KeyError if the plan has none)."""
        for release in self.releases:
            if release.label == label:
                return release.noise_multiplier
        raise KeyError(f"the DP plan has no {label!r} release")

    @property
    def is_private(self) -> bool:
        return self.noise_multiplier > 0

    @property
    def noise_std(self) -> float:
        """Std of the Gaussian added to the clipped-gradient sum: sigma * C."""
        return self.noise_multiplier * self.max_grad_norm if self.is_private else 0.0

    @property
    def eps_tan(self) -> float:
        return eps_tan(self.sample_rate, self.noise_multiplier, self.steps, self.delta) if self.is_private else math.inf

    def caveats(self) -> list[str]:
        """Everything the reported guarantee does not cover; printed with every epsilon."""
        notes = []
        if not self.is_private:
            notes.append(NOT_PRIVATE)
            return notes
        if self.sampling == "shuffle":
            notes.append(SHUFFLE_CAVEAT)
        if self.delta >= 1.0 / self.dataset_size:
            notes.append(
                f"delta={self.delta:g} >= 1/N={1.0 / self.dataset_size:.3g}: a weak guarantee "
                "(releasing one random example outright meets it); use delta < 1/N"
            )
        return notes

    def make_sampler(self, generator: torch.Generator):
        return make_sampler(self.sampling, self.dataset_size, self.batch_size, generator)

    def describe(self) -> str:
        if not self.is_private:
            return f"{NOT_PRIVATE}; B={self.batch_size}, S={self.steps}"
        tan_note = "" if self.noise_multiplier >= PRIVACY_WALL_SIGMA else " (sigma<2: eps_TAN under-estimates)"
        if self.releases:  # eps_TAN describes the DP-SGD steps alone
            tan_note += "; composed with " + ", ".join(
                f"{r.label} ({r.steps} Gaussian sum{'s' if r.steps > 1 else ''}, sigma={r.noise_multiplier:g})"
                for r in self.releases
            )
        return (
            f"DP-SGD: N={self.dataset_size}, B={self.batch_size}, q={self.sample_rate:.5g}, S={self.steps}, "
            f"sigma={self.noise_multiplier:.5g}, C={self.max_grad_norm:g}, "
            f"epsilon={self.epsilon:.4g} at delta={self.delta:g} ({self.accountant}, {self.sampling} sampling), "
            f"eps_TAN={self.eps_tan:.4g}{tan_note}"
        )


def steps_for(epochs: float | None, steps: int | None, dataset_size: int, batch_size: int) -> int:
    """Logical steps for a run: ``steps`` if given, else round(epochs * N / B), at least 1."""
    if steps is not None:
        return int(steps)
    return max(1, round(epochs * dataset_size / batch_size))


def check_plan_matches(
    plan: DPPlan, dp: DPConfig, dataset_size: int, steps: int, releases: tuple[AccountingSegment, ...] = ()
) -> None:
    """Raise ConfigError if a saved plan (from a checkpoint) does not describe this config and data."""
    expected = {
        "releases": tuple(releases) if plan.is_private else (),
        "dataset_size": dataset_size,
        "batch_size": dp.batch_size,
        "steps": steps,
        "max_grad_norm": dp.max_grad_norm,
        "delta": dp.delta,
        "target_epsilon": dp.epsilon,
        "sampling": dp.sampling,
        "accountant": dp.accountant,
    }
    if dp.noise_multiplier is not None:
        expected["noise_multiplier"] = float(dp.noise_multiplier)
    wrong = [f"{k}: checkpoint {getattr(plan, k)!r} vs now {v!r}" for k, v in expected.items() if getattr(plan, k) != v]
    if wrong:
        raise ConfigError("the checkpoint's DP plan does not match this config and data (" + "; ".join(wrong) + ")")


def make_dp_plan(
    dp: DPConfig, dataset_size: int, steps: int, releases: tuple[AccountingSegment, ...] = ()
) -> DPPlan:
    """Resolve the DP config against the dataset: calibrate sigma or check it meets the budget.

    Args:
        dp: the DP section of the config.
        dataset_size: N.
        steps: logical DP-SGD steps S.
        releases: one-off Gaussian mechanisms on the data before training (see
            ``dpscale.privacy.gaussian_release``); sigma is calibrated for the composition.

    Raises:
        ConfigError: batch larger than the dataset, releases that alone spend the budget, or a
            given sigma that overspends dp.epsilon.
    """
    if dp.batch_size > dataset_size:
        raise ConfigError(f"dp.batch_size={dp.batch_size} is larger than the training set (N={dataset_size})")
    q = dp.batch_size / dataset_size
    releases = tuple(releases)
    calibrated = False
    if dp.noise_multiplier is None:
        try:
            sigma = calibrate_noise_multiplier(dp.epsilon, dp.delta, q, steps, dp.accountant, releases=releases)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        calibrated = True
    else:
        sigma = float(dp.noise_multiplier)
    if sigma > 0:
        epsilon = compute_epsilon(q, sigma, steps, dp.delta, dp.accountant, releases=releases)
        if dp.epsilon is not None and epsilon > dp.epsilon:
            what = " with " + ", ".join(r.label for r in releases) if releases else ""
            raise ConfigError(
                f"dp.noise_multiplier={sigma} for {steps} steps at q={q:.5g}{what} spends epsilon={epsilon:.4g} "
                f"> dp.epsilon={dp.epsilon}; raise the noise, train fewer steps, or set dp.noise_multiplier=null "
                "to calibrate it"
            )
    else:
        epsilon = math.inf
    return DPPlan(
        dataset_size=dataset_size,
        batch_size=dp.batch_size,
        sample_rate=q,
        steps=steps,
        noise_multiplier=sigma,
        max_grad_norm=dp.max_grad_norm,
        delta=dp.delta,
        target_epsilon=dp.epsilon,
        epsilon=epsilon,
        sampling=dp.sampling,
        accountant=dp.accountant,
        calibrated=calibrated,
        releases=releases if sigma > 0 else (),
    )

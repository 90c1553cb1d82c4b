"""One frozen DP plan from which sampling, clipping, noise and accounting are all derived.

Sampler, clipping norm, noise std and accounting event are read from the same
``DPPlan``, so they cannot disagree (the jax_privacy idea).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from dpscale.clip_norms import MaxGradNorm, clip_sensitivity, describe_clip
from dpscale.privacy.sampling.modes import FIXED_CAVEAT, SHUFFLE_CAVEAT
from dpscale.privacy.accounting.accountant import compute_epsilon, history_accountant
from dpscale.privacy.accounting.segments import AccountingSegment
from dpscale.privacy.clipping.adaptive import AdaptiveClipping
from dpscale.privacy.accounting.batch_sampling import (
    POISSON,
    REPLACE_ONE,
    BatchSampling,
    batch_sampling_for,
)
from dpscale.privacy.noise.correlated import BandedNoisePlan, compositions
from dpscale.privacy.accounting.group_privacy import meaning, unit_text
from dpscale.privacy.plan.sampling_plan import cap_cost_text, truncation_rate
from dpscale.privacy.plan.source_runs import SourceRunPrivacy
from dpscale.privacy.accounting.tan import PRIVACY_WALL_SIGMA, eps_tan, privacy_wall_warning
from dpscale.privacy.accounting.tradeoff import attacker_odds, format_odds
from dpscale.privacy.plan.caveat_texts import (
    ENGINE_UNCHECKED_CAVEAT,
    NOT_PRIVATE,
    SEEDED_CAVEAT,
    SEEDED_SECURE_NOISE_CAVEAT,
)

if TYPE_CHECKING:  # the plan itself never needs torch (dpscale account loads without it)
    from dpscale.rng import DPRandom

# The own epsilon of a TAN simulation is a diagnostic, not a guarantee anyone relies on; RDP gives
# it in milliseconds where PLD takes tens of seconds at the tiny sigma of a simulation.
SIMULATION_OWN_ACCOUNTANT = "rdp"


@dataclass(frozen=True)
class TanSimulation:
    """The reference run that a TAN simulation (Sander et al. 2023, Section 3.4) stands for.

    Attributes:
        batch_size: the reference's expected batch size B_ref.
        noise_multiplier: sigma_ref (the simulation runs at sigma_ref * B / B_ref).
        sample_rate: q_ref = B_ref / N.
        epsilon: what the reference run spends after all S steps (plan's accountant and releases).
        compute_fraction: B / B_ref, the simulation's share of the reference's compute.
    """

    batch_size: float
    noise_multiplier: float
    sample_rate: float
    epsilon: float
    compute_fraction: float


@dataclass(frozen=True)
class DPPlan:
    """Attributes:
    dataset_size: N.
    batch_size: expected logical batch size B; the noisy sum is divided by B.
    sample_rate: q = B / N.
    steps: total logical steps S.
    noise_multiplier: sigma (0 for a non-private run).
    max_grad_norm: clipping norm C, or per-layer bounds pattern -> C_g (None: no clipping).
    delta: delta.
    target_epsilon: the budget (None if not set).
    epsilon: epsilon after all S steps as planned (inf when not private).
    sampling: "poisson" | "fixed" | "shuffle" (``dpscale.privacy.accounting.batch_sampling``).
    accountant: "pld" | "rdp" (the one that can compose ``sampling``: rdp for fixed, pld when capped).
    calibrated: whether sigma was calibrated to target_epsilon.
    releases: one-off Gaussian mechanisms on the training data made before training (e.g.
        private Data Normalization), composed with the DP-SGD steps in ``epsilon`` and in the
        calibration of sigma.
    simulation: set for a TAN simulation: the reference run it stands for. batch_size,
        sample_rate and noise_multiplier are then the simulation's own, and ``epsilon`` its own
        (RDP) epsilon, which is no useful guarantee.
    seeded: whether run.seed is fixed (a caveat). A label derived from the config, not a privacy
        parameter: plans read back from a checkpoint get it from the run's config.
    extractor: set for a ``checkpoint:`` feature extractor: how its run enters the guarantee (its
        releases, when composed, are in ``releases``). A label too, recomputed on resume.
    init_run: set for ``model.init``: how its source run enters the guarantee (as ``extractor``).
    engine_unchecked: train.self_check is off (a caveat; a label from the config, like seeded).
    secure_noise: the noise comes from the OS CSPRNG (dp.secure_noise), so a fixed seed replays
        the sampling only. A label from the config, like seeded.
    mechanism: "dpsgd" (independent noise each step) or "bandmf" (correlated noise, cyclic
        Poisson sampling; ``correlated`` holds its strategy).
    correlated: BandMF's strategy (bands, coefficients, why); None for DP-SGD.
    adaptive: adaptive clipping (``dpscale.privacy.clipping.adaptive``): C starts at max_grad_norm and
        follows a quantile of the norms; noise_multiplier is then the accounted sigma of the
        joint release (gradient and count), the gradient's own is ``gradient_noise_multiplier``.
    privacy_unit: "example" (N examples, B examples per step, one example clipped to C) or "user"
        (N users, B expected users per step, each user's summed gradient clipped to C: the
        guarantee protects a person, docs/privacy-units.md).
    max_examples_per_user: k, the examples a drawn user contributes per step (user unit only).
    max_batch_size: the cap of truncated Poisson batches (None: uncapped; poisson sampling only).
    clip_gamma: automatic clipping (Bu et al. 2023): each per-example gradient scaled by
        C / (||g|| + gamma), its norm below C (the sensitivity, as for clipping); None: clip to C.
    """

    dataset_size: int
    batch_size: float
    sample_rate: float
    steps: int
    noise_multiplier: float
    max_grad_norm: MaxGradNorm
    delta: float
    target_epsilon: float | None
    epsilon: float
    sampling: str
    accountant: str
    calibrated: bool
    releases: tuple[AccountingSegment, ...] = ()
    simulation: TanSimulation | None = None
    # Labels of how the run was made (set from its config), not privacy numbers: left out of
    # ``==``, so two plans are equal exactly when they describe the same mechanism.
    seeded: bool = field(default=False, compare=False)
    extractor: SourceRunPrivacy | None = field(default=None, compare=False)
    engine_unchecked: bool = field(default=False, compare=False)
    secure_noise: bool = field(default=False, compare=False)
    init_run: SourceRunPrivacy | None = field(default=None, compare=False)
    mechanism: str = "dpsgd"
    correlated: BandedNoisePlan | None = None
    adaptive: AdaptiveClipping | None = None
    privacy_unit: str = "example"
    max_examples_per_user: int | None = None
    max_batch_size: int | None = None
    clip_gamma: float | None = None

    def __post_init__(self) -> None:
        # A plan read back from a checkpoint holds its parts as dicts (dataclasses.asdict).
        if isinstance(self.correlated, dict):
            object.__setattr__(self, "correlated", BandedNoisePlan(**self.correlated))
        if isinstance(self.adaptive, dict):
            object.__setattr__(self, "adaptive", AdaptiveClipping(**self.adaptive))
        releases = tuple(
            r if isinstance(r, AccountingSegment) else AccountingSegment(**r) for r in self.releases
        )
        object.__setattr__(self, "releases", releases)
        if isinstance(self.simulation, dict):
            object.__setattr__(self, "simulation", TanSimulation(**self.simulation))
        for name in ("extractor", "init_run"):
            if isinstance(getattr(self, name), dict):
                object.__setattr__(self, name, SourceRunPrivacy(**getattr(self, name)))

    @property
    def sources(self) -> tuple[SourceRunPrivacy, ...]:
        """The runs this run starts from whose privacy it checked (extractor, then model.init)."""
        return tuple(s for s in (self.extractor, self.init_run) if s is not None)

    @property
    def batch_sampling(self) -> BatchSampling:
        """The sampler the accountant composes (a TAN simulation's own steps: Poisson)."""
        if self.simulation is not None:
            return POISSON
        return batch_sampling_for(self.sampling, self.dataset_size, self.max_batch_size)

    @property
    def adjacency(self) -> str:
        """ "add/remove" or "replace-one": which neighbouring datasets the guarantee is about."""
        return self.batch_sampling.adjacency

    @property
    def bands(self) -> int:
        """b: the strategy's bands and the number of sampling groups (1 for DP-SGD)."""
        return self.correlated.bands if self.correlated is not None else 1

    @property
    def participation_rate(self) -> float:
        """p: the probability that an example joins a step of its group, b*q (q for DP-SGD)."""
        # b*q above 1 by a rounding error is 1 (the sampler's p)
        return min(1.0, self.sample_rate * self.bands)

    def compositions(self, steps: int) -> int:
        """The accountant's compositions after ``steps`` steps: ceil(steps / b) (steps for DP-SGD)."""
        return compositions(steps, self.bands)

    @property
    def run_accountant(self) -> str:
        """The accountant that tracks this run's own steps (RDP for a TAN simulation)."""
        return SIMULATION_OWN_ACCOUNTANT if self.simulation else self.accountant

    def reference_epsilon(self, steps: int) -> float:
        """For a TAN simulation: the reference run's epsilon after ``steps`` steps (with the releases)."""
        if self.simulation is None:
            raise ValueError("not a TAN simulation")
        sim = self.simulation
        return compute_epsilon(
            sample_rate=sim.sample_rate,
            noise_multiplier=sim.noise_multiplier,
            steps=steps,
            delta=self.delta,
            kind=self.accountant,
            releases=self.releases,
        )

    def wall_warning(self) -> str | None:
        """The privacy-wall warning for the DP-SGD steps (of the reference run, for a simulation), or None
        (also for fixed-size or shuffled batches: their replace-one epsilon is no Poisson one to set
        against eps_TAN)."""
        if not self.is_private or self.adjacency == REPLACE_ONE:
            return None
        sim = self.simulation
        q, sigma = (
            (sim.sample_rate, sim.noise_multiplier)
            if sim
            else (self.participation_rate, self.noise_multiplier)
        )
        if sigma >= PRIVACY_WALL_SIGMA:
            return None  # cannot fire: skip the accountant call
        steps = self.compositions(self.steps)  # per participation for BandMF
        # eps_TAN estimates the uncapped Poisson steps
        capped = self.batch_sampling.mode == "truncated"
        if sim is None and not self.releases and not capped:
            epsilon = self.epsilon
        else:  # eps_TAN describes the DP-SGD steps alone, uncapped (a cap's cost is reported on its own)
            epsilon = compute_epsilon(
                sample_rate=q,
                noise_multiplier=sigma,
                steps=steps,
                delta=self.delta,
                kind=self.accountant,
                batches=POISSON if capped else self.batch_sampling,
            )
        warning = privacy_wall_warning(epsilon, sigma, eps_tan(q, sigma, steps, self.delta))
        if warning and capped:
            warning = f"of the uncapped Poisson steps: {warning}"
        return f"reference run: {warning}" if warning and sim else warning

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
    def sensitivity(self) -> float | None:
        """L2 bound on one example's clipped gradient: C, or sqrt(sum_g C_g^2) with per-layer clipping."""
        return clip_sensitivity(self.max_grad_norm)

    @property
    def gradient_noise_multiplier(self) -> float:
        """The noise multiplier on the gradient sum: sigma, or with adaptive clipping the larger
        sigma_grad = (sigma^-2 - (2 sigma_b)^-2)^(-1/2) (the count's release takes the rest)."""
        if self.adaptive is None:
            return self.noise_multiplier
        return self.adaptive.gradient_noise_multiplier(self.noise_multiplier)

    @property
    def noise_std(self) -> float:
        """Std of the Gaussian added to the clipped-gradient sum: sigma * C (sigma * sqrt(sum_g C_g^2)
        per layer); with adaptive clipping sigma_grad * C_0, the first step's (the mechanism
        scales it with C_t)."""
        if not self.is_private:
            return 0.0
        sensitivity = self.sensitivity
        # a TypeError, as sigma * None was: a private run needs a clipping norm
        if sensitivity is None:
            raise TypeError(
                "a private DP plan has no noise std without a clipping norm (max_grad_norm is None)"
            )
        return self.gradient_noise_multiplier * sensitivity

    @property
    def eps_tan(self) -> float:
        """TAN's estimate (Sander et al. 2023) of the steps' epsilon; for BandMF, per participation
        (p = b*q over ceil(S/b) compositions, what its accounting composes)."""
        if not self.is_private:
            return math.inf
        return eps_tan(
            self.participation_rate,
            self.noise_multiplier,
            self.compositions(self.steps),
            self.delta,
        )

    def caveats(self) -> list[str]:
        """Everything the reported guarantee does not cover; printed with every epsilon."""
        notes = []
        if not self.is_private:
            notes.append(NOT_PRIVATE)
            return notes
        if self.simulation is not None:
            notes.append(self._simulation_note(self.simulation))
        if self.sampling in ("fixed", "shuffle") and self.simulation is None:
            notes.append(SHUFFLE_CAVEAT if self.sampling == "shuffle" else FIXED_CAVEAT)
        if self.delta >= 1.0 / self.dataset_size:
            notes.append(
                f"delta={self.delta:g} >= 1/N={1.0 / self.dataset_size:.3g}: a weak guarantee "
                "(releasing one random example outright meets it); use delta < 1/N"
            )
        if self.seeded:
            notes.append(SEEDED_SECURE_NOISE_CAVEAT if self.secure_noise else SEEDED_CAVEAT)
        for source in self.sources:
            notes.extend(source.caveats())
        if self.engine_unchecked:
            notes.append(ENGINE_UNCHECKED_CAVEAT)
        return notes

    @property
    def sampling_text(self) -> str:
        """The sampling that ran: "poisson", "fixed", "shuffle", "truncated poisson" (capped at
        ``max_batch_size``), or "cyclic poisson" (BandMF, b > 1)."""
        if self.bands > 1:
            return "cyclic poisson"
        return "truncated poisson" if self.max_batch_size is not None else self.sampling

    def _epsilon_text(self) -> str:
        if self.simulation:
            return (
                f"own epsilon={self.epsilon:.4g} at delta={self.delta:g} ({self.run_accountant}, no useful guarantee; "
                f"{self.sampling} sampling)"
            )
        detail = f", {REPLACE_ONE} adjacency" if self.adjacency == REPLACE_ONE else ""
        detail += f" at most {self.max_batch_size}" if self.max_batch_size is not None else ""
        return (
            f"epsilon={self.epsilon:.4g} at delta={self.delta:g} ({self.accountant}, {self.sampling_text} "
            f"sampling{detail})"
        )

    def _simulation_note(self, sim: TanSimulation) -> str:
        return (
            f"TAN SIMULATION, NO PRIVACY GUARANTEE at epsilon={sim.epsilon:.4g}: this run trained at "
            f"B={self.batch_size:g}, sigma={self.noise_multiplier:.4g} (its own epsilon is {self.epsilon:.4g}, "
            f"RDP) to predict the reference run at B={sim.batch_size:g}, sigma={sim.noise_multiplier:.4g}, "
            f"S={self.steps}, which would spend epsilon={sim.epsilon:.4g} at delta={self.delta:g}. "
            "Use it to choose hyper-parameters; do not release it as a private model"
        )

    def meaning(self) -> str:
        """The guarantee in plain words: what epsilon and delta promise about one training example."""
        if not self.is_private:
            return "No privacy guarantee: the model may reveal its training examples."
        if self.simulation:
            return (
                "No privacy guarantee: a TAN simulation, for choosing hyper-parameters; the reference run it stands "
                f"for would have epsilon={self.simulation.epsilon:.3g} at delta={self.delta:g}."
            )
        return meaning(
            epsilon=self.epsilon,
            delta=self.delta,
            unit_words=unit_text(self.privacy_unit),
            replace_one=self.adjacency == REPLACE_ONE,
        )

    def planned_odds(self) -> str | None:
        """The planned run's guarantee after all its steps as an attacker's odds, one line for the
        run header (``dpscale.privacy.accounting.tradeoff``); None where the epsilon is no guarantee of the
        sampling that runs (no noise, a TAN simulation)."""
        if not self.is_private or self.simulation is not None:
            return None
        accountant = history_accountant(  # the history _planned_epsilon composed (cached)
            sample_rate=self.participation_rate,
            noise_multiplier=self.noise_multiplier,
            steps=self.compositions(self.steps),
            kind=self.accountant,
            releases=self.releases,
            batches=self.batch_sampling,
        )
        odds = attacker_odds(accountant, "person" if self.user_level else "image")
        return f"After all {self.steps} steps, {odds['odds']} ({format_odds(odds)})."

    @property
    def user_level(self) -> bool:
        """Whether the guarantee's unit is a user (all of one person's examples)."""
        return self.privacy_unit == "user"

    def _units_text(self) -> str:
        """N with its unit in the header: "N=60000" (examples, as always) or "N=15000 users (at most k
        examples each per step; the guarantee covers any one person's images)"."""
        if not self.user_level:
            return f"N={self.dataset_size}"
        return (
            f"N={self.dataset_size} users (B and q count users; at most {_count(self.max_examples_per_user, 'example')} of a "
            "drawn user per step, their summed gradient clipped as one: the guarantee covers any one person's images)"
        )

    def status(self, epsilon: float, reference_epsilon: float | None = None) -> str:
        """The privacy clause of every result line (train, eval, tan simulate, sweeps): what the
        run's epsilon means, after ``epsilon`` was spent (and, for a TAN simulation, the
        reference run's ``reference_epsilon``)."""
        if self.simulation:
            return (
                f"TAN SIMULATION (no guarantee): stands for epsilon={reference_epsilon:.3f} delta={self.delta:g} "
                f"({self.accountant}) at B={self.simulation.batch_size:g}; own epsilon={epsilon:.4g} ({self.run_accountant})"
            )
        if not self.is_private:
            return "epsilon=inf (NOT PRIVATE)"
        runs = [s.words.noun for s in self.sources if s.case == "composed"]
        composed = f" (composed with {' and '.join(runs)})" if runs else ""
        mechanism = (
            f" {self.correlated.short()} sigma={self.noise_multiplier:.4g}"
            if self.correlated
            else ""
        )
        unit = " per user" if self.user_level else ""
        return f"epsilon={epsilon:.3f} delta={self.delta:g}{unit} ({self.accountant}{self._sampling_note()}){composed}{mechanism}"

    def _sampling_note(self) -> str:
        """The result line's word on a sampler other than Poisson: ", fixed sampling, replace-one" or
        ", truncated poisson at most M" ("" for Poisson and BandMF's cyclic sampling, named elsewhere)."""
        if self.sampling == "poisson" and self.max_batch_size is None:
            return ""
        cap = f" at most {self.max_batch_size}" if self.max_batch_size is not None else ""
        adjacency = f", {REPLACE_ONE}" if self.adjacency == REPLACE_ONE else ""
        return f", {self.sampling_text} sampling{cap}{adjacency}"

    def make_sampler(
        self,
        generator: DPRandom,
        rank: int = 0,
        world_size: int = 1,
        *,
        partition_seed: int | None = None,
        start_step: int = 0,
        users: Any = None,
    ):
        """This rank's sampler (its shard of the dataset when world_size > 1), drawing from ``generator``:
        Poisson sampling, or for BandMF with b > 1 cyclic Poisson sampling over the b groups of the
        partition ``partition_seed`` draws, at step ``start_step`` of the run. At the user unit,
        ``users`` (a ``dpscale.data.user_ids.UserIndex`` of the plan's N users) is sampled instead."""
        # here: the plan itself never needs torch
        from dpscale.privacy.sampling.samplers import make_sampler

        if self.user_level:
            from dpscale.privacy.sampling.units import user_sampler

            return user_sampler(
                self,
                users,
                generator,
                world_size=world_size,
                partition_seed=partition_seed,
                start_step=start_step,
            )

        return make_sampler(
            self.sampling,
            self.dataset_size,
            self.batch_size,
            generator,
            rank,
            world_size,
            bands=self.bands,
            partition_seed=partition_seed,
            start_step=start_step,
            max_batch_size=self.max_batch_size,
        )

    def describe(self) -> str:
        """The one-line header printed when a run starts (and which case applies to each source run)."""
        extractor = "".join(f"; {source.describe()}" for source in self.sources)
        if not self.is_private:
            return f"{NOT_PRIVATE}; B={self.batch_size:g}, S={self.steps}{extractor}"
        tan_note = " (TAN's estimate, Sander et al. 2023)"  # the privacy-wall warning says when it is optimistic
        if self.adjacency == REPLACE_ONE:
            tan_note = (
                " (TAN's estimate for Poisson sampling, Sander et al. 2023; not of this sampling)"
            )
        if self.releases:  # eps_TAN describes the DP-SGD steps alone
            tan_note += "; composed with " + ", ".join(_release_text(r) for r in self.releases)
        tan_note += extractor
        if self.simulation:
            sim = self.simulation
            tan_note += (
                f"; TAN simulation of B={sim.batch_size:g}, sigma={sim.noise_multiplier:.5g} "
                f"(epsilon={sim.epsilon:.4g}) at {sim.compute_fraction:.3g}x its compute"
            )
        return (
            f"{self._mechanism_text()}: {self._units_text()}, B={self.batch_size:g}, q={self.sample_rate:.5g}, "
            f"S={self.steps}, sigma={self.noise_multiplier:.5g}, {describe_clip(self.max_grad_norm)}, "
            f"{self._epsilon_text()}, "
            f"eps_TAN={self.eps_tan:.4g}{tan_note}{self._cap_text()}{self._automatic_text()}"
            + (
                f"; {self.adaptive.describe(self.noise_multiplier)}"
                if self.adaptive is not None
                else ""
            )
        )

    def _automatic_text(self) -> str:
        """Automatic clipping in the header: its scale and why C is still the sensitivity."""
        if self.clip_gamma is None:
            return ""
        return (
            f"; automatic clipping (Bu et al. 2023): each per-example gradient scaled by C/(||g|| + "
            f"{self.clip_gamma:g}), norm < C, the sensitivity"
        )

    def _cap_text(self) -> str:
        """What a batch cap costs: the uncapped Poisson epsilon at the same sigma, beside the plan's."""
        if self.max_batch_size is None or self.simulation is not None:
            return ""
        uncapped = compute_epsilon(
            sample_rate=self.sample_rate,
            noise_multiplier=self.noise_multiplier,
            steps=self.steps,
            delta=self.delta,
            kind="pld",
            releases=self.releases,
        )
        units = "users" if self.user_level else "examples"  # the sampler caps the units it draws
        return (
            f"; batches capped at {self.max_batch_size} {units} (truncated Poisson, P(cut) per step "
            f"{truncation_rate(self.dataset_size, self.sample_rate, self.max_batch_size):.2g}): "
            f"{cap_cost_text(self.epsilon, uncapped, percent=False)} against uncapped Poisson's {uncapped:.4g}"
        )

    def _mechanism_text(self) -> str:
        """The mechanism's name in the header; for BandMF its bands, sampling and accounting."""
        if self.correlated is None:
            return "DP-SGD"
        return (
            f"{self.correlated.describe()}; cyclic Poisson sampling in b={self.bands} groups at p=b*q="
            f"{self.participation_rate:.5g}, accounted as {self.compositions(self.steps)} DP-SGD compositions "
            "(amplified BandMF, Choquette-Choo et al. 2023)"
        )


# The DPPlan fields that are labels, not privacy numbers (one list: the dataclass's own).
PLAN_LABELS = tuple(f.name for f in fields(DPPlan) if not f.compare)
# Labels whose caveat stays with the steps taken under it, whatever a continuation's config says.
LASTING_CAVEATS = ("seeded", "engine_unchecked")


def _release_text(release: AccountingSegment) -> str:
    """A release for the header: Gaussian sums on the whole dataset, or subsampled steps (q < 1,
    e.g. the DP-SGD steps of a checkpoint extractor's run)."""
    if release.sample_rate < 1.0:
        return f"{release.label} ({release.steps} steps at q={release.sample_rate:.5g}, sigma={release.noise_multiplier:.5g})"
    plural = "s" if release.steps > 1 else ""
    return f"{release.label} ({release.steps} Gaussian sum{plural}, sigma={release.noise_multiplier:g})"


def _count(number: int | None, noun: str) -> str:
    """ "1 example", "4 examples": the header's counts read as English."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"

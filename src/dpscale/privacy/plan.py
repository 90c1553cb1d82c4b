"""One frozen DP plan from which sampling, clipping, noise and accounting are all derived.

Sampler, clipping norm, noise std and accounting event are read from the same
``DPPlan``, so they cannot disagree (the jax_privacy idea).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from dpscale.errors import ConfigError
from dpscale.data.sampling_modes import FIXED_CAVEAT, SHUFFLE_CAVEAT
from dpscale.privacy.adaptive import AdaptiveClipping
from dpscale.clip_norms import MaxGradNorm, clip_sensitivity, describe_clip, is_per_layer
from dpscale.clip_norms import check_clip_gamma, check_max_grad_norm
from dpscale.privacy.accountant import AccountingSegment, compute_epsilon, history_accountant, releases_under
from dpscale.privacy.batch_sampling import POISSON, REPLACE_ONE, BatchSampling, batch_sampling_for
from dpscale.privacy.accountant import FREE_CAP_TOLERANCE
from dpscale.privacy.sampling_plan import (
    AUTO_CAP,
    accountant_for,
    check_sampling_settings,
    resolve_batch_cap,
    truncation_rate,
)
from dpscale.privacy.calibrate import calibrate_noise_multiplier
from dpscale.privacy.correlated import (
    BandedNoisePlan, BandsRequest, check_bandmf_settings, choose_bands, compositions,
)  # fmt: skip
from dpscale.privacy.tan import PRIVACY_WALL_SIGMA, eps_tan, privacy_wall_warning, simulated_noise_multiplier
from dpscale.privacy.group_privacy import check_privacy_unit, meaning, unit_text
from dpscale.privacy.tradeoff import attacker_odds, format_odds

if TYPE_CHECKING:  # the plan itself never needs torch (dpscale account loads without it)
    from dpscale.rng import DPRandom

NOT_PRIVATE = "NOT PRIVATE: noise_multiplier=0 (non-private baseline), no DP guarantee"
GUARANTEE_SCOPE = (
    "epsilon covers the trained model (and anything computed from it alone). Not covered: the "
    "train_loss/gradient-norm statistics in metrics.jsonl, the TensorBoard events and the progress bar "
    "(computed on private examples without noise), the RNG states in checkpoint.pt, and hyper-parameter tuning on the same "
    "data. Keep the run directory private; release the model (dpscale export)."
)
# A fixed run.seed is a caveat of its own (DPPlan.seeded), printed with every epsilon of such a run.
SEEDED_CAVEAT = (
    "run.seed is fixed: anyone who knows it (and the code) can replay the batch sampling and the noise, "
    "which the guarantee assumes secret; use a seed for research, not for a model you release"
)
SEEDED_SECURE_NOISE_CAVEAT = (
    "run.seed is fixed: anyone who knows it (and the code) can replay the batch sampling, which the guarantee "
    "assumes secret (the noise of DP-SGD and of Data Normalization comes from the OS CSPRNG, dp.secure_noise, "
    "and cannot be replayed)"
)
# train.self_check=false: the clipping engine was not compared with a per-example loop (DPPlan.engine_unchecked).
ENGINE_UNCHECKED_CAVEAT = (
    "checks off (train.self_check=false, make_private(check=False)): neither was the per-example clipping engine "
    "checked against a per-example loop on this model, nor the model and loss for batch independence, so a gradient "
    "route the engine misses, or a layer or loss that mixes examples, would go unnoticed (docs/privacy.md)"
)
# Label prefixes of the releases that stand for a source run's own history ("extractor-run:dp-sgd").
EXTRACTOR_RUN = "extractor-run"
INIT_RUN = "init-run"
# How a source run enters the guarantee; "assumed public" is a model.init source that is no dpscale
# run directory (a weights file, timm:<name>), whose data and cost cannot be read.
SOURCE_CASES = ("composed", "declared public", "other data", "assumed public")
EXTRACTOR_CASES = SOURCE_CASES[:3]


@dataclass(frozen=True)
class SourceRole:
    """What a source run is to this run: the words every text about it uses.

    Attributes:
        key: the config key that names it; public_key: the key that declares it public.
        prefix: label prefix of its releases in this run's plan.
        noun: how texts name it ("the extractor run"); gives: what this run takes from it.
        product: what of it would have no finite epsilon if it trained without noise.
        alternative: the way out besides declaring it public.
    """

    key: str
    public_key: str
    prefix: str
    noun: str
    gives: str
    product: str
    alternative: str


SOURCE_ROLES = {
    "extractor": SourceRole(
        "features.extractor", "features.extractor_public", EXTRACTOR_RUN, "the extractor run", "features from",
        "features from its model", "use another extractor",
    ),
    "init": SourceRole(
        "model.init", "model.init_public", INIT_RUN, "the init run", "initial weights from",
        "weights from it", "start from a run on public data",
    ),
}  # fmt: skip


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
class SourceRunPrivacy:
    """How a run this run starts from (a ``checkpoint:`` feature extractor, a ``model.init``
    source) enters this run's guarantee.

    Attributes:
        source: what the config names, e.g. "checkpoint:<run dir>" or the model.init run directory.
        case: "composed" (it trained on this run's training data: its whole accounting history
            is composed into the plan's releases), "declared public" (same data, but the role's
            public key says its cost is not to be counted), "other data" (its data fingerprint
            differs: nothing composed) or "assumed public" (model.init only: no dpscale run
            directory, nothing can be checked).
        source_caveats: what the source run's own guarantee did not cover (its fixed seed, an
            unchecked engine, ...): when its cost is composed, this run's guarantee inherits them.
        role: "extractor" or "init" (``SOURCE_ROLES``); checkpoints from before "init" lack it.
    """

    source: str
    case: str
    source_caveats: tuple[str, ...] = ()
    role: str = "extractor"

    def __post_init__(self) -> None:
        cases = EXTRACTOR_CASES if self.role == "extractor" else SOURCE_CASES
        if self.role not in SOURCE_ROLES or self.case not in cases:
            raise ValueError(f"source run privacy: role {self.role!r} with case {self.case!r} (cases: {cases})")
        object.__setattr__(self, "source_caveats", tuple(self.source_caveats))  # a list when read back

    @property
    def words(self) -> SourceRole:
        """The role's words (config keys, label prefix, how texts name it)."""
        return SOURCE_ROLES[self.role]

    def describe(self) -> str:
        """One clause for the plan's header: which case applies."""
        if self.case == "composed":
            return (
                f"{self.words.gives} {self.source}, trained on this run's training data (same data fingerprint): "
                f"its privacy cost is composed ({self.words.prefix}:* releases)"
            )
        return self.caveat()

    def caveats(self) -> list[str]:
        """Everything the guarantee does not cover because of the source: the case's own
        caveat, or (composed) the source run's caveats, each naming the source."""
        if self.case == "composed":
            return [f"{self.words.noun} {self.source} (its cost is composed): {note}" for note in self.source_caveats]
        return [self.caveat()]

    def caveat(self) -> str | None:
        """What the guarantee does not cover because of the source's case (None when composed)."""
        words = self.words
        if self.case == "declared public":
            return (
                f"{words.public_key}: {words.noun} {self.source} trained on this run's training "
                "data (same data fingerprint) and is declared public: its cost is not included in epsilon"
            )
        if self.case == "other data":
            return (
                f"{words.noun} {self.source} trained on other data (its data fingerprint differs): its cost "
                "is not included in epsilon, which assumes that data shares no example with this run's "
                "(an overlapping subset is not detected)"
            )
        if self.case == "assumed public":
            return (
                f"{words.key}: the guarantee assumes the training data of the initial weights ({self.source}) is "
                "public (not a dpscale run directory, so its data and privacy cost cannot be checked)"
            )
        return None


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
    sampling: "poisson" | "fixed" | "shuffle" (``dpscale.privacy.batch_sampling``).
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
    adaptive: adaptive clipping (``dpscale.privacy.adaptive``): C starts at max_grad_norm and
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
        releases = tuple(r if isinstance(r, AccountingSegment) else AccountingSegment(**r) for r in self.releases)
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
        return min(1.0, self.sample_rate * self.bands)  # b*q above 1 by a rounding error is 1 (the sampler's p)

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
            sample_rate=sim.sample_rate, noise_multiplier=sim.noise_multiplier, steps=steps, delta=self.delta,
            kind=self.accountant, releases=self.releases,
        )  # fmt: skip

    def wall_warning(self) -> str | None:
        """The privacy-wall warning for the DP-SGD steps (of the reference run, for a simulation), or None
        (also for fixed-size or shuffled batches: their replace-one epsilon is no Poisson one to set
        against eps_TAN)."""
        if not self.is_private or self.adjacency == REPLACE_ONE:
            return None
        sim = self.simulation
        q, sigma = (sim.sample_rate, sim.noise_multiplier) if sim else (self.participation_rate, self.noise_multiplier)
        if sigma >= PRIVACY_WALL_SIGMA:
            return None  # cannot fire: skip the accountant call
        steps = self.compositions(self.steps)  # per participation for BandMF
        if sim is None and not self.releases:
            epsilon = self.epsilon
        else:  # eps_TAN describes the DP-SGD steps alone
            epsilon = compute_epsilon(
                sample_rate=q, noise_multiplier=sigma, steps=steps, delta=self.delta, kind=self.accountant,
                batches=self.batch_sampling,
            )  # fmt: skip
        warning = privacy_wall_warning(epsilon, sigma, eps_tan(q, sigma, steps, self.delta))
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
        return self.gradient_noise_multiplier * self.sensitivity if self.is_private else 0.0

    @property
    def eps_tan(self) -> float:
        """TAN's estimate (Sander et al. 2023) of the steps' epsilon; for BandMF, per participation
        (p = b*q over ceil(S/b) compositions, what its accounting composes)."""
        if not self.is_private:
            return math.inf
        return eps_tan(self.participation_rate, self.noise_multiplier, self.compositions(self.steps), self.delta)

    def caveats(self) -> list[str]:
        """Everything the reported guarantee does not cover; printed with every epsilon."""
        notes = []
        if not self.is_private:
            notes.append(NOT_PRIVATE)
            return notes
        if self.simulation is not None:
            notes.append(self._simulation_note())
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
        return (f"epsilon={self.epsilon:.4g} at delta={self.delta:g} ({self.accountant}, {self.sampling_text} "
                f"sampling{detail})")  # fmt: skip

    def _simulation_note(self) -> str:
        sim = self.simulation
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
            return ("No privacy guarantee: a TAN simulation, for choosing hyper-parameters; the reference run it stands "
                    f"for would have epsilon={self.simulation.epsilon:.3g} at delta={self.delta:g}.")  # fmt: skip
        return meaning(epsilon=self.epsilon, delta=self.delta, unit_words=unit_text(self.privacy_unit),
                       replace_one=self.adjacency == REPLACE_ONE)  # fmt: skip

    def planned_odds(self) -> str | None:
        """The planned run's guarantee after all its steps as an attacker's odds, one line for the
        run header (``dpscale.privacy.tradeoff``); None where the epsilon is no guarantee of the
        sampling that runs (no noise, a TAN simulation)."""
        if not self.is_private or self.simulation is not None:
            return None
        accountant = history_accountant(  # the history _planned_epsilon composed (cached)
            sample_rate=self.participation_rate, noise_multiplier=self.noise_multiplier,
            steps=self.compositions(self.steps), kind=self.accountant, releases=self.releases,
            batches=self.batch_sampling,
        )  # fmt: skip
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
            f"N={self.dataset_size} users (B and q count users; at most {self.max_examples_per_user} examples of a "
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
        mechanism = f" {self.correlated.short()} sigma={self.noise_multiplier:.4g}" if self.correlated else ""
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
        self, generator: DPRandom, rank: int = 0, world_size: int = 1, *, partition_seed: int | None = None,
        start_step: int = 0, users: Any = None,
    ):  # fmt: skip
        """This rank's sampler (its shard of the dataset when world_size > 1), drawing from ``generator``:
        Poisson sampling, or for BandMF with b > 1 cyclic Poisson sampling over the b groups of the
        partition ``partition_seed`` draws, at step ``start_step`` of the run. At the user unit,
        ``users`` (a ``dpscale.data.units.UserIndex`` of the plan's N users) is sampled instead."""
        from dpscale.data.sampling import make_sampler  # here: the plan itself never needs torch

        if self.user_level:
            from dpscale.data.units import user_sampler

            return user_sampler(self, users, generator, world_size=world_size, partition_seed=partition_seed,
                                start_step=start_step)  # fmt: skip

        return make_sampler(
            self.sampling, self.dataset_size, self.batch_size, generator, rank, world_size, bands=self.bands,
            partition_seed=partition_seed, start_step=start_step, max_batch_size=self.max_batch_size,
        )  # fmt: skip

    def describe(self) -> str:
        """The one-line header printed when a run starts (and which case applies to each source run)."""
        extractor = "".join(f"; {source.describe()}" for source in self.sources)
        if not self.is_private:
            return f"{NOT_PRIVATE}; B={self.batch_size:g}, S={self.steps}{extractor}"
        tan_note = " (TAN's estimate, Sander et al. 2023)"  # the privacy-wall warning says when it is optimistic
        if self.adjacency == REPLACE_ONE:
            tan_note = " (TAN's estimate for Poisson sampling, Sander et al. 2023; not of this sampling)"
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
            + (f"; {self.adaptive.describe(self.noise_multiplier)}" if self.adaptive is not None else "")
        )

    def _automatic_text(self) -> str:
        """Automatic clipping in the header: its scale and why C is still the sensitivity."""
        if self.clip_gamma is None:
            return ""
        return (f"; automatic clipping (Bu et al. 2023): each per-example gradient scaled by C/(||g|| + "
                f"{self.clip_gamma:g}), norm < C, the sensitivity")  # fmt: skip

    def _cap_text(self) -> str:
        """What a batch cap costs: the uncapped Poisson epsilon at the same sigma, beside the plan's."""
        if self.max_batch_size is None or self.simulation is not None:
            return ""
        uncapped = compute_epsilon(sample_rate=self.sample_rate, noise_multiplier=self.noise_multiplier,
                                   steps=self.steps, delta=self.delta, kind="pld", releases=self.releases)  # fmt: skip
        return (f"; batches capped at {self.max_batch_size} examples (truncated Poisson, P(cut) per step "
                f"{truncation_rate(self.dataset_size, self.sample_rate, self.max_batch_size):.2g}): the cap costs "
                f"epsilon {self.epsilon - uncapped:+.3g} over uncapped Poisson's {uncapped:.4g}")  # fmt: skip

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


def steps_for(epochs: float | None, steps: int | None, dataset_size: int, batch_size: float) -> int:
    """Logical steps for a run: ``steps`` if given, else round(epochs * N / B), at least 1."""
    if steps is not None:
        return int(steps)
    return max(1, round(epochs * dataset_size / batch_size))


def check_plan_matches(
    plan: DPPlan,
    *,
    dataset_size: int,
    batch_size: float,
    steps: int,
    max_grad_norm: MaxGradNorm,
    delta: float,
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    simulated_batch_size: float | None = None,
    sampling: str = "poisson",
    accountant: str = "pld",
    releases: tuple[AccountingSegment, ...] = (),
    correlated: BandsRequest | None = None,
    adaptive: AdaptiveClipping | None = None,
    max_batch_size: int | str | None = None,
    clip_gamma: float | None = None,
) -> None:
    """Raise ConfigError if a saved plan (from a checkpoint) does not describe these numbers.

    The labels ``seeded``, ``extractor``, ``init_run``, ``engine_unchecked`` and ``secure_noise`` are not compared: they
    derive from the config (the caller sets them afresh); what a source run costs is in ``releases``, recomputed
    from that run.

    Args:
        plan: the plan saved in the checkpoint.
        dataset_size: N of the training set now; steps: the run's total logical steps.
        batch_size ... accountant: the privacy numbers asked for now (as for ``make_dp_plan``).
        releases: the releases recomputed now (a checkpoint extractor's run's history, a
            model.init run's, then the feature normalisation's).
        correlated: BandMF's request now (its mechanism and a fixed b must match; the saved
            strategy itself is kept, never re-optimised).
        adaptive: adaptive clipping's settings now (they must match; the current C is the
            mechanism state's).
        max_batch_size: the batch cap now (a number must match; "auto" keeps the cap it chose).
    """
    releases = releases_under(releases, plan.batch_sampling)  # as make_dp_plan labelled them
    _check_source_releases(plan, releases)
    simulated = is_simulation(batch_size, simulated_batch_size)
    expected = {
        "releases": tuple(releases) if plan.is_private else (),
        "dataset_size": dataset_size,
        "batch_size": simulated_batch_size if simulated else batch_size,
        "steps": steps,
        "max_grad_norm": max_grad_norm,
        "delta": delta,
        "target_epsilon": target_epsilon,
        "sampling": sampling,
        "accountant": accountant_for(sampling, max_batch_size, accountant),
        "adaptive": adaptive,
        "clip_gamma": clip_gamma,
    }
    if max_batch_size != "auto":
        expected["max_batch_size"] = max_batch_size
    expected["mechanism"] = "dpsgd" if correlated is None else "bandmf"
    if correlated is not None and correlated.bands != "auto":
        expected["bands"] = int(correlated.bands)
    actual: dict[str, Any] = {k: getattr(plan, k) for k in expected}
    actual["simulation_of_batch_size"] = plan.simulation.batch_size if plan.simulation else None
    expected["simulation_of_batch_size"] = batch_size if simulated else None
    if noise_multiplier is not None:
        expected["noise_multiplier"] = float(noise_multiplier)  # the reference's, for a simulation
        actual["noise_multiplier"] = plan.simulation.noise_multiplier if plan.simulation else plan.noise_multiplier
    wrong = [f"{k}: checkpoint {actual[k]!r} vs now {v!r}" for k, v in expected.items() if actual[k] != v]
    if wrong:
        raise ConfigError("the checkpoint's DP plan does not match this config and data (" + "; ".join(wrong) + ")")


def _check_source_releases(plan: DPPlan, releases: tuple[AccountingSegment, ...]) -> None:
    """Refuse to continue a run whose source run (checkpoint extractor, model.init run) is no
    longer the one its plan composed (it trained on, or was resumed, since): the saved epsilon
    would no longer cover it."""
    if not plan.is_private:
        return

    def shown(segments: list[AccountingSegment]) -> Any:
        return [(r.label, r.sample_rate, r.noise_multiplier, r.steps) for r in segments] or "nothing"

    for role in SOURCE_ROLES.values():
        saved = [r for r in plan.releases if r.label.startswith(f"{role.prefix}:")]
        now = [r for r in releases if r.label.startswith(f"{role.prefix}:")]
        if saved != now:
            raise ConfigError(
                f"the run behind {role.key} changed since this run started: this run's DP plan composed "
                f"{shown(saved)} from it, its checkpoint now gives {shown(now)} (it trained further, its data "
                "fingerprint changed, or this run predates that composition); refusing to continue: restore that "
                "run's checkpoint, or start a new run"
            )


def make_dp_plan(
    *,
    dataset_size: int,
    batch_size: float,
    steps: int,
    max_grad_norm: MaxGradNorm,
    delta: float,
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    simulated_batch_size: float | None = None,
    sampling: str = "poisson",
    accountant: str = "pld",
    releases: tuple[AccountingSegment, ...] = (),
    seeded: bool = False,
    extractor: SourceRunPrivacy | None = None,
    correlated: BandsRequest | None = None,
    adaptive: AdaptiveClipping | None = None,
    privacy_unit: str = "example",
    max_examples_per_user: int | None = None,
    max_batch_size: int | str | None = None,
    clip_gamma: float | None = None,
) -> DPPlan:
    """The frozen DP plan for these numbers: sigma calibrated to ``target_epsilon``, or the given
    ``noise_multiplier`` checked against it.

    Args:
        dataset_size: N; batch_size: expected B (q = B / N); steps: logical DP-SGD steps S.
        max_grad_norm: C, or per-layer bounds pattern -> C_g (the noise std is then sigma *
            sqrt(sum_g C_g^2)); None: no clipping, non-private runs only. delta: the guarantee's delta.
        target_epsilon: calibrate sigma to spend this; noise_multiplier: sigma, given (0: not private).
        simulated_batch_size: a TAN simulation of this run at that batch size (see below).
        sampling: "poisson", "fixed" (B distinct examples each step, replace-one adjacency, RDP) or
            "shuffle" (accounted without amplification); accountant: "pld" or "rdp" (replaced by the
            one that composes the sampling, ``accountant_for``).
        releases: one-off Gaussian mechanisms on the data before training (see
            ``dpscale.privacy.gaussian_release``), and the history of a checkpoint extractor's or model.init run
            on the same data; sigma is calibrated for the composition.
        seeded: the seed is fixed (a caveat of the plan).
        extractor: how a ``checkpoint:`` extractor's run enters the guarantee (None otherwise).
        correlated: BandMF (dp.mechanism=bandmf): its bands and workload; None for DP-SGD. The
            steps are then accounted as ceil(S/b) compositions at p = b*q, sigma calibrated for the b chosen.
        adaptive: adaptive clipping (C_0 = max_grad_norm); sigma is the joint release's, as calibrated.
        privacy_unit: "example", or "user": then dataset_size and batch_size count users (q = B / U),
            and ``max_examples_per_user`` (k >= 1) bounds a drawn user's examples per step.
        max_batch_size: cap Poisson batches at this many examples (truncated Poisson, PLD), "auto"
            for the smallest cap within 1% of the uncapped epsilon (``smallest_free_cap``), or None.
        clip_gamma: automatic clipping's gamma (> 0; needs one C or per-layer C_g, not adaptive
            clipping); None: clip to C.

    Returns:
        The plan (the TAN simulation's, with ``simulated_batch_size``).

    With ``simulated_batch_size`` set, the plan of the reference run (batch_size, its sigma
    calibrated or checked as usual) is resolved first and the TAN simulation derived from it:
    B = simulated_batch_size, sigma = sigma_ref * B / B_ref, same S.

    Raises:
        ConfigError: batch larger than the dataset, releases that alone spend the budget, or a
            given sigma that overspends target_epsilon.
    """
    check_max_grad_norm(max_grad_norm)
    _check_automatic(clip_gamma, max_grad_norm, adaptive)
    _check_adaptive(adaptive, max_grad_norm, correlated, is_simulation(batch_size, simulated_batch_size))
    check_privacy_unit(privacy_unit, max_examples_per_user, simulated=is_simulation(batch_size, simulated_batch_size),
                       sampling=sampling)  # fmt: skip
    if batch_size > dataset_size:
        units = "users" if privacy_unit == "user" else "the training set"
        raise ConfigError(f"dp.batch_size={batch_size} is larger than {units} (N={dataset_size})")
    releases = tuple(releases)
    check_sampling_settings(sampling, max_batch_size, batch_size=batch_size, adaptive=adaptive is not None,
                            simulated=is_simulation(batch_size, simulated_batch_size), bandmf=correlated is not None)  # fmt: skip
    q = batch_size / dataset_size
    accountant = accountant_for(sampling, max_batch_size, accountant)
    noise_plan = None
    cap = None
    if correlated is None:
        noise_for = functools.partial(_noise_for, noise_multiplier=noise_multiplier, delta=delta, q=q, steps=steps,
                                      accountant=accountant)  # fmt: skip
        if sampling == "poisson":
            sigma, calibrated, cap = _noise_and_cap(noise_for, target_epsilon, max_batch_size, dataset_size=dataset_size,
                                                    batch_size=batch_size, steps=steps, delta=delta, releases=releases)  # fmt: skip
        else:  # fixed-size or shuffled batches: the releases join their replace-one history
            batches = batch_sampling_for(sampling, dataset_size)
            releases = _releases_for(releases, batches)
            sigma, calibrated = noise_for(target_epsilon, releases=releases, batches=batches)
    else:
        check_bandmf_settings(
            sampling=sampling, simulated=is_simulation(batch_size, simulated_batch_size),
            noise_multiplier=noise_multiplier, bands=correlated.bands,
        )  # fmt: skip
        noise_plan, sigma, calibrated = choose_bands(
            correlated, steps=steps, sample_rate=q, sigma_for=lambda b: _noise_for(
                target_epsilon, noise_multiplier=noise_multiplier, delta=delta, q=min(1.0, b * q),
                steps=compositions(steps, b), accountant=accountant, releases=releases,
            ),
        )  # fmt: skip
    bands = noise_plan.bands if noise_plan is not None else 1
    epsilon = _planned_epsilon(q, sigma, bands, steps, delta, accountant, releases, target_epsilon,
                               batch_sampling_for(sampling, dataset_size, cap))  # fmt: skip
    plan = DPPlan(
        dataset_size=dataset_size, batch_size=batch_size, sample_rate=q, steps=steps, noise_multiplier=sigma,
        max_grad_norm=max_grad_norm, delta=delta, target_epsilon=target_epsilon, epsilon=epsilon, sampling=sampling,
        accountant=accountant, calibrated=calibrated, releases=releases if sigma > 0 else (), seeded=seeded,
        extractor=extractor, mechanism="dpsgd" if correlated is None else "bandmf", correlated=noise_plan,
        adaptive=adaptive, privacy_unit=privacy_unit, max_examples_per_user=max_examples_per_user,
        max_batch_size=cap, clip_gamma=clip_gamma,
    )  # fmt: skip
    if adaptive is not None:
        try:
            adaptive.gradient_noise_multiplier(sigma)
        except ValueError as err:
            raise ConfigError(str(err)) from err
    return simulate_plan(plan, simulated_batch_size) if is_simulation(batch_size, simulated_batch_size) else plan


def _noise_and_cap(
    noise_for: Callable[..., tuple[float, bool]], target_epsilon: float | None, max_batch_size: int | str | None, *,
    dataset_size: int, batch_size: float, steps: int, delta: float, releases: tuple[AccountingSegment, ...],
) -> tuple[float, bool, int | None]:  # fmt: skip
    """(sigma, calibrated, cap) of a DP-SGD plan with Poisson batches, capped or not.

    A given cap: sigma calibrated (or checked) for the truncated event. "auto": sigma calibrated for
    uncapped Poisson batches at target / 1.01, then the smallest cap within 1% of that epsilon at that
    sigma (``resolve_batch_cap``): the capped run spends at most the target without a second, ~10x dearer,
    calibration on the truncated event (it forgoes < 1% of the budget)."""
    if max_batch_size != AUTO_CAP:
        cap = resolve_batch_cap(max_batch_size, dataset_size=dataset_size, batch_size=batch_size, steps=steps,
                                delta=delta, releases=releases, noise_multiplier=None)  # fmt: skip
        batches = batch_sampling_for("poisson", dataset_size, cap)
        return (*noise_for(target_epsilon, releases=releases, batches=batches), cap)
    aim = None if target_epsilon is None else target_epsilon / (1 + FREE_CAP_TOLERANCE)
    sigma, calibrated = noise_for(aim, releases=releases, batches=POISSON)
    cap = resolve_batch_cap(AUTO_CAP, dataset_size=dataset_size, batch_size=batch_size, steps=steps, delta=delta,
                            releases=releases, noise_multiplier=sigma)  # fmt: skip
    return sigma, calibrated, cap


def _releases_for(releases: Sequence[AccountingSegment], batches: BatchSampling) -> tuple[AccountingSegment, ...]:
    """``releases_under`` as a ConfigError (a source run's Poisson steps in a replace-one run)."""
    try:
        return releases_under(releases, batches)
    except ValueError as err:
        raise ConfigError(f"dp.sampling={batches.mode}: {err}") from err


def _planned_epsilon(
    q: float, sigma: float, bands: int, steps: int, delta: float, accountant: str,
    releases: tuple[AccountingSegment, ...], target_epsilon: float | None, batches: BatchSampling = POISSON,
) -> float:  # fmt: skip
    """Epsilon after all ``steps`` (ceil(S/b) compositions at p = b*q; inf without noise).

    Raises:
        ConfigError: a given sigma that spends more than ``target_epsilon``.
    """
    if not sigma > 0:
        return math.inf
    epsilon = compute_epsilon(
        sample_rate=min(1.0, q * bands), noise_multiplier=sigma, steps=compositions(steps, bands), delta=delta,
        kind=accountant, releases=releases, batches=batches,
    )  # fmt: skip
    if target_epsilon is not None and epsilon > target_epsilon:
        what = " with " + ", ".join(r.label for r in releases) if releases else ""
        raise ConfigError(
            f"dp.noise_multiplier={sigma} for {steps} steps at q={q:.5g}{what} spends epsilon={epsilon:.4g} "
            f"> dp.epsilon={target_epsilon}; raise the noise, train fewer steps, or set dp.noise_multiplier=null "
            f"to calibrate it{_source_run_hint(releases)}"
        )
    return epsilon


def _check_automatic(clip_gamma: float | None, max_grad_norm: MaxGradNorm, adaptive: AdaptiveClipping | None) -> None:
    """Refuse automatic clipping without a C to scale to, beside adaptive clipping, or with a bad gamma."""
    if clip_gamma is None:
        return
    try:
        check_clip_gamma(clip_gamma)
    except ValueError as err:
        raise ConfigError(f"dp.clip_gamma: {err}") from err
    if max_grad_norm is None or adaptive is not None:
        raise ConfigError("automatic clipping (dp.clipping=automatic) scales each gradient to norm < C: it needs "
                          "dp.max_grad_norm and is not adaptive clipping")  # fmt: skip


def _check_adaptive(
    adaptive: AdaptiveClipping | None, max_grad_norm: MaxGradNorm, correlated: BandsRequest | None, simulated: bool
) -> None:
    """Refuse adaptive clipping where its accounting is not written: with per-layer norms,
    BandMF's correlated noise or a TAN simulation."""
    if adaptive is None:
        return
    clash = (
        "per-layer dp.max_grad_norm" if is_per_layer(max_grad_norm)
        else "no clipping (dp.max_grad_norm=null)" if max_grad_norm is None
        else "dp.mechanism=bandmf" if correlated is not None
        else "a TAN simulation (dp.simulated_batch_size)" if simulated
        else None
    )  # fmt: skip
    if clash:
        raise ConfigError(f"adaptive clipping (dp.clipping=adaptive) needs one starting norm C and DP-SGD; not with {clash}")


def _noise_for(
    target_epsilon: float | None, *, noise_multiplier: float | None, delta: float, q: float, steps: int,
    accountant: str, releases: tuple[AccountingSegment, ...], batches: BatchSampling = POISSON,
) -> tuple[float, bool]:  # fmt: skip
    """(sigma, whether it was calibrated): the given noise, or the one that spends ``target_epsilon``."""
    if noise_multiplier is not None:
        return float(noise_multiplier), False
    try:
        sigma = calibrate_noise_multiplier(
            target_epsilon=target_epsilon, delta=delta, sample_rate=q, steps=steps, kind=accountant, releases=releases,
            batches=batches,
        )  # fmt: skip
        return sigma, True
    except ValueError as err:
        raise ConfigError(f"{err}{_source_run_hint(releases)}") from err


def _source_run_hint(releases: tuple[AccountingSegment, ...]) -> str:
    """Advice for a budget that a source run (checkpoint extractor, model.init run) already uses
    up (or most of it)."""
    hints = [
        f"{role.prefix}:* is the run behind {role.key}, which trained on this run's training data: this run's "
        f"budget must cover it too; raise dp.epsilon, or set {role.public_key}=true to leave its cost out "
        "(every output then says so)"
        for role in SOURCE_ROLES.values()
        if any(r.label.startswith(f"{role.prefix}:") for r in releases)
    ]
    return f" ({'; '.join(hints)})" if hints else ""


def is_simulation(batch_size: float, simulated_batch_size: float | None) -> bool:
    """Whether a simulated batch size asks for a TAN simulation (one equal to the batch size is
    the reference run itself, with its guarantee)."""
    return simulated_batch_size is not None and simulated_batch_size != batch_size


def simulate_plan(reference: DPPlan, batch_size: float) -> DPPlan:
    """The TAN simulation of ``reference`` at expected batch size B: sigma_ref * B / B_ref, same S.

    Keeps S and eta_step = q / sigma exactly (so eta and eps_TAN too); the simulation's own epsilon
    is computed with RDP and is no useful guarantee (see ``DPPlan.caveats``).
    """
    if not reference.is_private:
        raise ConfigError("a TAN simulation needs a private reference run (noise_multiplier > 0)")
    if reference.simulation is not None:
        raise ConfigError("cannot simulate a simulation")
    if not 0 < batch_size <= reference.dataset_size:
        raise ConfigError(f"dp.simulated_batch_size={batch_size} must be in [1, N={reference.dataset_size}]")
    sigma = simulated_noise_multiplier(reference.noise_multiplier, reference.batch_size, batch_size)
    q = batch_size / reference.dataset_size
    own = compute_epsilon(
        sample_rate=q, noise_multiplier=sigma, steps=reference.steps, delta=reference.delta,
        kind=SIMULATION_OWN_ACCOUNTANT, releases=reference.releases,
    )  # fmt: skip
    return replace(
        reference,
        batch_size=batch_size,
        sample_rate=q,
        noise_multiplier=sigma,
        epsilon=own,
        simulation=TanSimulation(
            batch_size=reference.batch_size,
            noise_multiplier=reference.noise_multiplier,
            sample_rate=reference.sample_rate,
            epsilon=reference.epsilon,
            compute_fraction=batch_size / reference.batch_size,
        ),
    )

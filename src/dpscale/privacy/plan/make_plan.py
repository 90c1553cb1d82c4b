"""The DP plan for a run's numbers: sigma calibrated (or checked) for the budget, and a saved plan matched against them.

``make_dp_plan`` builds the frozen ``DPPlan`` (``dpscale.privacy.plan.dp_plan``) from plain numbers, never a
config (``dpscale.train.plan_config`` reads one); ``simulate_plan`` derives a TAN simulation from a
reference plan; ``check_plan_matches`` refuses a checkpoint's plan that no longer describes them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from dpscale.errors import ConfigError
from dpscale.privacy.accounting.accountant import FREE_CAP_TOLERANCE, compute_epsilon
from dpscale.privacy.accounting.segments import AccountingSegment, releases_under
from dpscale.privacy.clipping.adaptive import AdaptiveClipping
from dpscale.privacy.accounting.batch_sampling import POISSON, BatchSampling, batch_sampling_for
from dpscale.privacy.accounting.calibrate import calibrate_noise_multiplier
from dpscale.privacy.noise.correlated import (
    BandedNoisePlan,
    BandsRequest,
    choose_bands,
    compositions,
)

# check_compatible: tests import it here too
from dpscale.privacy.plan.compatibility import check_compatible, is_simulation
from dpscale.privacy.plan.numbers import PrivacyNumbers
from dpscale.privacy.plan.dp_plan import SIMULATION_OWN_ACCOUNTANT, DPPlan, TanSimulation
from dpscale.privacy.plan.sampling_plan import AUTO_CAP, accountant_for, resolve_batch_cap
from dpscale.privacy.plan.source_runs import SOURCE_ROLES, SourceRunPrivacy
from dpscale.privacy.spelling import CONFIG, Spelling
from dpscale.privacy.accounting.tan import simulated_noise_multiplier


def steps_for(epochs: float | None, steps: int | None, dataset_size: int, batch_size: float) -> int:
    """Logical steps for a run: ``steps`` if given, else round(epochs * N / B), at least 1."""
    if steps is not None:
        return int(steps)
    if epochs is None:  # a TypeError, as None * N was: the caller gives one of the two
        raise TypeError("steps_for needs epochs or steps")
    return max(1, round(epochs * dataset_size / batch_size))


def check_plan_matches(
    plan: DPPlan,
    numbers: PrivacyNumbers,
    *,
    dataset_size: int,
    steps: int,
    releases: tuple[AccountingSegment, ...] = (),
    correlated: BandsRequest | None = None,
) -> None:
    """Raise ConfigError if a saved plan (from a checkpoint) does not describe these numbers.

    The labels ``seeded``, ``extractor``, ``init_run``, ``engine_unchecked`` and ``secure_noise`` are not compared: they
    derive from the config (the caller sets them afresh); what a source run costs is in ``releases``, recomputed
    from that run.

    Args:
        plan: the plan saved in the checkpoint.
        numbers: the privacy numbers asked for now (as for ``make_dp_plan``); their adaptive
            clipping settings must match (the current C is the mechanism state's), and so must a
            numeric batch cap ("auto" keeps the cap it chose).
        dataset_size: N of the training set now; steps: the run's total logical steps.
        releases: the releases recomputed now (a checkpoint extractor's run's history, a
            model.init run's, then the feature normalisation's).
        correlated: BandMF's request now (its mechanism and a fixed b must match; the saved
            strategy itself is kept, never re-optimised).
    """
    n = numbers
    batch_size, simulated_batch_size, max_batch_size = (
        n.batch_size,
        n.simulated_batch_size,
        n.max_batch_size,
    )
    releases = releases_under(releases, plan.batch_sampling)  # as make_dp_plan labelled them
    _check_source_releases(plan, releases)
    simulated = is_simulation(batch_size, simulated_batch_size)
    expected = {
        "releases": tuple(releases) if plan.is_private else (),
        "dataset_size": dataset_size,
        "batch_size": simulated_batch_size if simulated else batch_size,
        "steps": steps,
        "max_grad_norm": n.max_grad_norm,
        "delta": n.delta,
        "target_epsilon": n.target_epsilon,
        "sampling": n.sampling,
        "accountant": accountant_for(n.sampling, max_batch_size, n.accountant),
        "adaptive": n.adaptive,
        "clip_gamma": n.clip_gamma,
    }
    if max_batch_size != "auto":
        expected["max_batch_size"] = max_batch_size
    expected["mechanism"] = "dpsgd" if correlated is None else "bandmf"
    if correlated is not None and correlated.bands != "auto":
        expected["bands"] = int(correlated.bands)
    actual: dict[str, Any] = {k: getattr(plan, k) for k in expected}
    actual["simulation_of_batch_size"] = plan.simulation.batch_size if plan.simulation else None
    expected["simulation_of_batch_size"] = batch_size if simulated else None
    if n.noise_multiplier is not None:
        # the reference's, for a simulation
        expected["noise_multiplier"] = float(n.noise_multiplier)
        actual["noise_multiplier"] = (
            plan.simulation.noise_multiplier if plan.simulation else plan.noise_multiplier
        )
    wrong = [
        f"{k}: checkpoint {actual[k]!r} vs now {v!r}" for k, v in expected.items() if actual[k] != v
    ]
    if wrong:
        raise ConfigError(
            "the checkpoint's DP plan does not match this config and data ("
            + "; ".join(wrong)
            + ")"
        )


def _check_source_releases(plan: DPPlan, releases: tuple[AccountingSegment, ...]) -> None:
    """Refuse to continue a run whose source run (checkpoint extractor, model.init run) is no
    longer the one its plan composed (it trained on, or was resumed, since): the saved epsilon
    would no longer cover it."""
    if not plan.is_private:
        return

    def shown(segments: list[AccountingSegment]) -> Any:
        return [
            (r.label, r.sample_rate, r.noise_multiplier, r.steps) for r in segments
        ] or "nothing"

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
    numbers: PrivacyNumbers,
    *,
    dataset_size: int,
    steps: int,
    releases: tuple[AccountingSegment, ...] = (),
    seeded: bool = False,
    extractor: SourceRunPrivacy | None = None,
    correlated: BandsRequest | None = None,
    privacy_unit: str = "example",
    max_examples_per_user: int | None = None,
    spell: Spelling = CONFIG,
) -> DPPlan:
    """The frozen DP plan for ``numbers``: sigma calibrated to their ``target_epsilon``, or their
    ``noise_multiplier`` checked against it.

    Args:
        numbers: the privacy numbers asked for (``PrivacyNumbers``: B, C, delta, the target or
            sigma, the sampling and its cap, the accountant, adaptive or automatic clipping, a TAN
            simulation's batch size). The accountant is replaced by the one that composes the
            sampling (``accountant_for``).
        dataset_size: N (q = B / N); steps: logical DP-SGD steps S.
        releases: one-off Gaussian mechanisms on the data before training (see
            ``dpscale.privacy.gaussian_release``), and the history of a checkpoint extractor's or model.init run
            on the same data; sigma is calibrated for the composition.
        seeded: the seed is fixed (a caveat of the plan).
        extractor: how a ``checkpoint:`` extractor's run enters the guarantee (None otherwise).
        correlated: BandMF (dp.mechanism=bandmf): its bands and workload; None for DP-SGD. The
            steps are then accounted as ceil(S/b) compositions at p = b*q, sigma calibrated for the b chosen.
        privacy_unit: "example", or "user": then dataset_size and the batch size count users (q = B / U),
            and ``max_examples_per_user`` (k >= 1) bounds a drawn user's examples per step.
        spell: how the door names the settings in a refusal (``dpscale.privacy.spelling``: the config's
            ``dp.`` keys by default, ``make_private``'s typed options).

    Returns:
        The plan (the TAN simulation's, with ``simulated_batch_size``).

    With ``simulated_batch_size`` set, the plan of the reference run (batch_size, its sigma
    calibrated or checked as usual) is resolved first and the TAN simulation derived from it:
    B = simulated_batch_size, sigma = sigma_ref * B / B_ref, same S.

    Raises:
        ConfigError: batch larger than the dataset, releases that alone spend the budget, or a
            given sigma that overspends target_epsilon.
    """
    check_compatible(
        numbers,
        dataset_size=dataset_size,
        correlated=correlated,
        privacy_unit=privacy_unit,
        max_examples_per_user=max_examples_per_user,
        spell=spell,
    )
    simulated = is_simulation(numbers.batch_size, numbers.simulated_batch_size)
    q = numbers.batch_size / dataset_size
    accountant = accountant_for(numbers.sampling, numbers.max_batch_size, numbers.accountant)
    noise = _choose_noise(
        numbers,
        dataset_size=dataset_size,
        steps=steps,
        q=q,
        accountant=accountant,
        releases=tuple(releases),
        correlated=correlated,
        spell=spell,
    )
    plan = _plan_of(
        numbers,
        noise,
        dataset_size=dataset_size,
        steps=steps,
        q=q,
        accountant=accountant,
        seeded=seeded,
        extractor=extractor,
        correlated=correlated,
        privacy_unit=privacy_unit,
        max_examples_per_user=max_examples_per_user,
    )
    _check_adaptive_noise(numbers.adaptive, noise.sigma)
    if numbers.simulated_batch_size is None or not simulated:
        return plan
    return simulate_plan(plan, numbers.simulated_batch_size)


@dataclass(frozen=True)
class _Noise:
    """What the noise step of ``make_dp_plan`` settles: sigma, whether it was calibrated, the releases
    as the sampling composes them, the cap of Poisson batches and BandMF's strategy (None: DP-SGD)."""

    sigma: float
    calibrated: bool
    releases: tuple[AccountingSegment, ...]
    cap: int | None = None
    correlated: BandedNoisePlan | None = None


def _choose_noise(
    numbers: PrivacyNumbers,
    *,
    dataset_size: int,
    steps: int,
    q: float,
    accountant: str,
    releases: tuple[AccountingSegment, ...],
    correlated: BandsRequest | None,
    spell: Spelling,
) -> _Noise:
    """Sigma calibrated to the target (or the given one), for the sampling: Poisson batches with
    their cap, fixed-size or shuffled batches, or BandMF's bands."""
    n = numbers
    if correlated is None:
        noise_for = functools.partial(
            _noise_for,
            noise_multiplier=n.noise_multiplier,
            delta=n.delta,
            q=q,
            steps=steps,
            accountant=accountant,
        )
        if n.sampling == "poisson":
            sigma, calibrated, cap = _noise_and_cap(
                noise_for,
                n.target_epsilon,
                n.max_batch_size,
                dataset_size=dataset_size,
                batch_size=n.batch_size,
                steps=steps,
                delta=n.delta,
                releases=releases,
            )
            return _Noise(sigma, calibrated, releases, cap=cap)
        # fixed-size or shuffled batches: the releases join their replace-one history
        batches = batch_sampling_for(n.sampling, dataset_size)
        releases = _releases_for(releases, batches)
        sigma, calibrated = noise_for(n.target_epsilon, releases=releases, batches=batches)
        return _Noise(sigma, calibrated, releases)
    noise_plan, sigma, calibrated = choose_bands(
        correlated,
        steps=steps,
        sample_rate=q,
        spell=spell,
        sigma_for=lambda b: _noise_for(
            n.target_epsilon,
            noise_multiplier=n.noise_multiplier,
            delta=n.delta,
            q=min(1.0, b * q),
            steps=compositions(steps, b),
            accountant=accountant,
            releases=releases,
        ),
    )
    return _Noise(sigma, calibrated, releases, correlated=noise_plan)


def _plan_of(
    numbers: PrivacyNumbers,
    noise: _Noise,
    *,
    dataset_size: int,
    steps: int,
    q: float,
    accountant: str,
    seeded: bool,
    extractor: SourceRunPrivacy | None,
    correlated: BandsRequest | None,
    privacy_unit: str,
    max_examples_per_user: int | None,
) -> DPPlan:
    """The plan of the noise chosen, with its epsilon after all ``steps`` (``_planned_epsilon``
    refuses a given sigma that overspends the target)."""
    n = numbers
    bands = noise.correlated.bands if noise.correlated is not None else 1
    epsilon = _planned_epsilon(
        q,
        noise.sigma,
        bands,
        steps,
        n.delta,
        accountant,
        noise.releases,
        n.target_epsilon,
        batch_sampling_for(n.sampling, dataset_size, noise.cap),
    )
    return DPPlan(
        dataset_size=dataset_size,
        batch_size=n.batch_size,
        sample_rate=q,
        steps=steps,
        noise_multiplier=noise.sigma,
        max_grad_norm=n.max_grad_norm,
        delta=n.delta,
        target_epsilon=n.target_epsilon,
        epsilon=epsilon,
        sampling=n.sampling,
        accountant=accountant,
        calibrated=noise.calibrated,
        releases=noise.releases if noise.sigma > 0 else (),
        seeded=seeded,
        extractor=extractor,
        mechanism="dpsgd" if correlated is None else "bandmf",
        correlated=noise.correlated,
        adaptive=n.adaptive,
        privacy_unit=privacy_unit,
        max_examples_per_user=max_examples_per_user,
        max_batch_size=noise.cap,
        clip_gamma=n.clip_gamma,
    )


def _check_adaptive_noise(adaptive: AdaptiveClipping | None, sigma: float) -> None:
    """Refuse a sigma that adaptive clipping cannot share between the gradient and the count."""
    if adaptive is not None:
        try:
            adaptive.gradient_noise_multiplier(sigma)
        except ValueError as err:
            raise ConfigError(str(err)) from err


def _noise_and_cap(
    noise_for: Callable[..., tuple[float, bool]],
    target_epsilon: float | None,
    max_batch_size: int | str | None,
    *,
    dataset_size: int,
    batch_size: float,
    steps: int,
    delta: float,
    releases: tuple[AccountingSegment, ...],
) -> tuple[float, bool, int | None]:
    """(sigma, calibrated, cap) of a DP-SGD plan with Poisson batches, capped or not.

    A given cap: sigma calibrated (or checked) for the truncated event. "auto": sigma calibrated for
    uncapped Poisson batches at target / 1.01, then the smallest cap within 1% of that epsilon at that
    sigma (``resolve_batch_cap``): the capped run spends at most the target without a second, ~10x dearer,
    calibration on the truncated event (it forgoes < 1% of the budget)."""
    if max_batch_size != AUTO_CAP:
        cap = resolve_batch_cap(
            max_batch_size,
            dataset_size=dataset_size,
            batch_size=batch_size,
            steps=steps,
            delta=delta,
            releases=releases,
            noise_multiplier=None,
        )
        batches = batch_sampling_for("poisson", dataset_size, cap)
        return (*noise_for(target_epsilon, releases=releases, batches=batches), cap)
    aim = None if target_epsilon is None else target_epsilon / (1 + FREE_CAP_TOLERANCE)
    sigma, calibrated = noise_for(aim, releases=releases, batches=POISSON)
    cap = resolve_batch_cap(
        AUTO_CAP,
        dataset_size=dataset_size,
        batch_size=batch_size,
        steps=steps,
        delta=delta,
        releases=releases,
        noise_multiplier=sigma,
    )
    return sigma, calibrated, cap


def _releases_for(
    releases: Sequence[AccountingSegment], batches: BatchSampling
) -> tuple[AccountingSegment, ...]:
    """``releases_under`` as a ConfigError (a source run's Poisson steps in a replace-one run)."""
    try:
        return releases_under(releases, batches)
    except ValueError as err:
        raise ConfigError(f"dp.sampling={batches.mode}: {err}") from err


def _planned_epsilon(
    q: float,
    sigma: float,
    bands: int,
    steps: int,
    delta: float,
    accountant: str,
    releases: tuple[AccountingSegment, ...],
    target_epsilon: float | None,
    batches: BatchSampling = POISSON,
) -> float:
    """Epsilon after all ``steps`` (ceil(S/b) compositions at p = b*q; inf without noise).

    Raises:
        ConfigError: a given sigma that spends more than ``target_epsilon``.
    """
    if not sigma > 0:
        return math.inf
    epsilon = compute_epsilon(
        sample_rate=min(1.0, q * bands),
        noise_multiplier=sigma,
        steps=compositions(steps, bands),
        delta=delta,
        kind=accountant,
        releases=releases,
        batches=batches,
    )
    if target_epsilon is not None and epsilon > target_epsilon:
        what = " with " + ", ".join(r.label for r in releases) if releases else ""
        raise ConfigError(
            f"dp.noise_multiplier={sigma} for {steps} steps at q={q:.5g}{what} spends epsilon={epsilon:.4g} "
            f"> dp.epsilon={target_epsilon}; raise the noise, train fewer steps, or set dp.noise_multiplier=null "
            f"to calibrate it{_source_run_hint(releases)}"
        )
    return epsilon


def _noise_for(
    target_epsilon: float | None,
    *,
    noise_multiplier: float | None,
    delta: float,
    q: float,
    steps: int,
    accountant: str,
    releases: tuple[AccountingSegment, ...],
    batches: BatchSampling = POISSON,
) -> tuple[float, bool]:
    """(sigma, whether it was calibrated): the given noise, or the one that spends ``target_epsilon``."""
    if noise_multiplier is not None:
        return float(noise_multiplier), False
    # a TypeError, as calibrating to None was: the caller gives one of the two
    if target_epsilon is None:
        raise TypeError("make_dp_plan needs target_epsilon or noise_multiplier")
    try:
        sigma = calibrate_noise_multiplier(
            target_epsilon=target_epsilon,
            delta=delta,
            sample_rate=q,
            steps=steps,
            kind=accountant,
            releases=releases,
            batches=batches,
        )
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
        raise ConfigError(
            f"dp.simulated_batch_size={batch_size} must be in [1, N={reference.dataset_size}]"
        )
    sigma = simulated_noise_multiplier(reference.noise_multiplier, reference.batch_size, batch_size)
    q = batch_size / reference.dataset_size
    own = compute_epsilon(
        sample_rate=q,
        noise_multiplier=sigma,
        steps=reference.steps,
        delta=reference.delta,
        kind=SIMULATION_OWN_ACCOUNTANT,
        releases=reference.releases,
    )
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

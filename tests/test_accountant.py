"""Accountant and calibration against independently obtained golden values.

Golden values (computed 2026-11-21 with /tmp scripts, reproduced in docs/privacy.md):
  * ``opacus_rdp``: Opacus 1.6.0 ``RDPAccountant`` (default orders, Balle et al. 2020
    RDP->DP conversion), an independent RDP implementation.
  * ``prv_lower`` / ``prv_upper``: Microsoft ``prv-accountant`` 0.2.0 (Gopi et al. 2021),
    ``PRVAccountant(eps_error=0.01, delta_error=delta/1000).compute_epsilon``; the true
    epsilon lies in [lower, upper].
  * case G (q = 1, no subsampling) also has the exact answer: 10 compositions of the
    Gaussian mechanism with sigma = 5 are one Gaussian with sigma_eff = 5/sqrt(10), whose
    exact delta(eps) is Phi(-eps s + 1/(2s)) - e^eps Phi(-eps s - 1/(2s)) (Balle & Wang
    2018); root-finding gives eps = 2.594383 at delta = 1e-5 (recomputed below with scipy).
  * Published: the Opacus docs state q = 0.01, sigma = 1.0, 300 steps, delta = 1e-5 with RDP
    orders [2, 5, 10, 20, 100] gives epsilon = 2.39.
"""

import math

import pytest
from dp_accounting import rdp as dp_rdp
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import brentq
from scipy.stats import norm

from dpscale.privacy import (
    PrivacyAccountant,
    calibrate_noise_multiplier,
    calibrate_steps,
    compute_epsilon,
    gaussian_release,
)
from dpscale.privacy.accounting.tan import eps_tan, tan_eta

# case: (q, sigma, steps, delta, opacus_rdp, prv_lower, prv_upper)
GOLDEN = {
    "A: MNIST B=256 60 epochs": (256 / 60000, 1.1, 14062, 1e-5, 2.596556, 2.371456, 2.391744),
    "B: MNIST B=256 15 epochs": (256 / 60000, 1.1, 3515, 1e-5, 1.281144, 1.123633, 1.143790),
    "C: q=0.01 sigma=1 300 steps": (0.01, 1.0, 300, 1e-5, 1.451368, 1.057994, 1.078196),
    "D: MNIST sigma=1.12": (256 / 60000, 1.12, 14062, 1e-5, 2.518590, 2.299957, 2.320237),
    "E: q=0.064 sigma=1.5": (0.064, 1.5, 500, 1e-5, 5.464323, 4.994021, 5.014590),
    "F: q=0.001 sigma=0.8 delta=1e-6": (0.001, 0.8, 10000, 1e-6, 1.703625, 0.937121, 0.957280),
    "G: full batch sigma=5 10 steps": (1.0, 5.0, 10, 1e-5, 2.813653, 2.584236, 2.604536),
}


@pytest.mark.parametrize("case", list(GOLDEN))
def test_rdp_matches_opacus(case):
    q, sigma, steps, delta, opacus_rdp, _, _ = GOLDEN[case]
    assert compute_epsilon(
        sample_rate=q, noise_multiplier=sigma, steps=steps, delta=delta, kind="rdp"
    ) == pytest.approx(opacus_rdp, rel=1e-3)


@pytest.mark.parametrize("case", list(GOLDEN))
def test_pld_within_prv_bounds(case):
    q, sigma, steps, delta, _, lower, upper = GOLDEN[case]
    eps = compute_epsilon(
        sample_rate=q, noise_multiplier=sigma, steps=steps, delta=delta, kind="pld"
    )
    assert lower <= eps <= upper
    # PLD is the tighter one
    assert eps < compute_epsilon(
        sample_rate=q, noise_multiplier=sigma, steps=steps, delta=delta, kind="rdp"
    )


def test_gaussian_without_subsampling_matches_exact_formula():
    s = 5.0 / math.sqrt(10)

    def exact_delta(eps: float) -> float:
        return norm.cdf(-eps * s + 1 / (2 * s)) - math.exp(eps) * norm.cdf(-eps * s - 1 / (2 * s))

    exact = brentq(lambda e: exact_delta(e) - 1e-5, 0.01, 20)
    assert exact == pytest.approx(2.594383, abs=1e-5)
    assert compute_epsilon(
        sample_rate=1.0, noise_multiplier=5.0, steps=10, delta=1e-5, kind="pld"
    ) == pytest.approx(exact, rel=1e-3)
    # pessimistic, never below
    assert (
        compute_epsilon(sample_rate=1.0, noise_multiplier=5.0, steps=10, delta=1e-5, kind="pld")
        >= exact - 1e-9
    )


def test_published_opacus_docs_figure_with_their_orders():
    # dp_accounting's RDP with the orders used in the Opacus docs reproduces their 2.39.
    from dpscale.privacy.accounting.rdp_history import dp_sgd_event

    accountant = dp_rdp.RdpAccountant(orders=[2, 5, 10, 20, 100])
    accountant.compose(dp_sgd_event(0.01, 1.0, 300))
    assert accountant.get_epsilon(1e-5) == pytest.approx(2.39, abs=0.005)


def test_history_merges_and_recomputes_for_any_delta():
    acc = PrivacyAccountant("rdp")
    for _ in range(10):
        acc.step(sample_rate=0.01, noise_multiplier=1.0)
    acc.step(sample_rate=0.02, noise_multiplier=2.0, num_steps=5)
    assert [(s.sample_rate, s.noise_multiplier, s.steps) for s in acc.history] == [
        (0.01, 1.0, 10),
        (0.02, 2.0, 5),
    ]
    assert acc.steps == 15
    assert acc.epsilon(1e-6) > acc.epsilon(1e-5) > acc.epsilon(1e-3) > 0
    # Composition of the two segments equals accounting them together.
    both = PrivacyAccountant("rdp")
    both.step(sample_rate=0.01, noise_multiplier=1.0, num_steps=10)
    both.step(sample_rate=0.02, noise_multiplier=2.0, num_steps=5)
    assert both.epsilon(1e-5) == acc.epsilon(1e-5)
    assert acc.delta(acc.epsilon(1e-5)) == pytest.approx(1e-5, rel=0.05)


def test_state_dict_round_trip_replaces_history():
    acc = PrivacyAccountant("pld")
    acc.step(sample_rate=0.05, noise_multiplier=1.2, num_steps=40)
    restored = PrivacyAccountant.from_state_dict(acc.state_dict())
    assert restored.epsilon(1e-5) == acc.epsilon(1e-5)
    restored.load_state_dict(acc.state_dict())  # loading twice must not double-count
    assert restored.steps == 40
    with pytest.raises(ValueError, match="accountant"):
        PrivacyAccountant("rdp").load_state_dict(acc.state_dict())


def test_epsilon_is_zero_before_any_step_and_grows():
    acc = PrivacyAccountant()
    assert acc.epsilon(1e-5) == 0.0
    previous = 0.0
    for _ in range(3):
        acc.step(sample_rate=0.05, noise_multiplier=1.0, num_steps=20)
        eps = acc.epsilon(1e-5)
        assert eps > previous
        previous = eps


@pytest.mark.parametrize(
    "args, match",
    [
        ((0.0, 1.0, 10, 1e-5), "sample_rate"),
        ((1.5, 1.0, 10, 1e-5), "sample_rate"),
        ((0.1, 0.0, 10, 1e-5), "noise"),
        ((0.1, 1.0, 10, 1.0), "delta"),
        ((0.1, 1.0, -1, 1e-5), "steps"),
    ],
)
def test_bad_mechanism_arguments_raise(args, match):
    q, sigma, steps, delta = args
    with pytest.raises(ValueError, match=match):
        compute_epsilon(sample_rate=q, noise_multiplier=sigma, steps=steps, delta=delta)


@pytest.mark.parametrize(
    "call",
    [
        lambda: compute_epsilon(0.01, 1.0, 10, 1e-5),
        lambda: calibrate_noise_multiplier(3.0, 1e-5, 0.01, 100),
        lambda: calibrate_steps(3.0, 1e-5, 0.01, 1.0),
        lambda: PrivacyAccountant("rdp").step(0.01, 1.0),
    ],
    ids=["compute_epsilon", "calibrate_noise_multiplier", "calibrate_steps", "accountant.step"],
)
def test_privacy_numbers_are_keyword_only(call):
    # q, sigma, steps and delta are all plain numbers: a positional call that swapped two of them
    # would give a plausible wrong epsilon, so it must not run at all.
    with pytest.raises(TypeError, match="positional"):
        call()


def test_unknown_accountant_raises():
    with pytest.raises(ValueError, match="unknown accountant"):
        PrivacyAccountant("moments")


@settings(max_examples=15, deadline=None)
@given(target=st.floats(0.3, 12.0), q=st.floats(0.001, 1.0), steps=st.integers(1, 20000))
def test_noise_calibration_round_trip_rdp(target, q, steps):
    sigma = calibrate_noise_multiplier(
        target_epsilon=target, delta=1e-5, sample_rate=q, steps=steps, kind="rdp"
    )
    eps = compute_epsilon(
        sample_rate=q, noise_multiplier=sigma, steps=steps, delta=1e-5, kind="rdp"
    )
    assert target * (1 - 1e-3) <= eps <= target


@pytest.mark.parametrize(
    "target, q, steps", [(3.0, 256 / 60000, 14062), (1.0, 0.064, 235), (8.0, 1.0, 10)]
)
def test_noise_calibration_round_trip_pld(target, q, steps):
    sigma = calibrate_noise_multiplier(
        target_epsilon=target, delta=1e-5, sample_rate=q, steps=steps, kind="pld"
    )
    eps = compute_epsilon(
        sample_rate=q, noise_multiplier=sigma, steps=steps, delta=1e-5, kind="pld"
    )
    assert target * (1 - 1e-3) <= eps <= target


def test_noise_calibration_is_monotone():
    sigmas = [
        calibrate_noise_multiplier(
            target_epsilon=eps, delta=1e-5, sample_rate=256 / 60000, steps=2000, kind="rdp"
        )
        for eps in (0.5, 1.0, 2.0, 4.0, 8.0)
    ]
    assert all(a > b for a, b in zip(sigmas, sigmas[1:]))
    # More steps at the same budget need more noise.
    longer, shorter = (
        calibrate_noise_multiplier(
            target_epsilon=2.0, delta=1e-5, sample_rate=0.01, steps=steps, kind="rdp"
        )
        for steps in (4000, 1000)
    )
    assert longer > shorter


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_steps_calibration_round_trip(kind):
    steps = calibrate_steps(
        target_epsilon=3.0, delta=1e-5, sample_rate=0.01, noise_multiplier=1.1, kind=kind
    )
    fits, one_more = (
        compute_epsilon(sample_rate=0.01, noise_multiplier=1.1, steps=s, delta=1e-5, kind=kind)
        for s in (steps, steps + 1)
    )
    assert fits <= 3.0 < one_more


@settings(max_examples=10, deadline=None)
@given(target=st.floats(0.5, 10.0), q=st.floats(0.001, 0.5), sigma=st.floats(0.6, 10.0))
def test_steps_calibration_round_trip_rdp(target, q, sigma):
    steps = calibrate_steps(
        target_epsilon=target,
        delta=1e-5,
        sample_rate=q,
        noise_multiplier=sigma,
        kind="rdp",
        max_steps=10**6,
    )
    if steps == 0:
        assert (
            compute_epsilon(sample_rate=q, noise_multiplier=sigma, steps=1, delta=1e-5, kind="rdp")
            > target
        )
    elif steps < 10**6:
        fits, one_more = (
            compute_epsilon(sample_rate=q, noise_multiplier=sigma, steps=s, delta=1e-5, kind="rdp")
            for s in (steps, steps + 1)
        )
        assert fits <= target < one_more


def test_calibration_rejects_impossible_targets():
    with pytest.raises(ValueError, match="positive"):
        calibrate_noise_multiplier(target_epsilon=0.0, delta=1e-5, sample_rate=0.01, steps=100)
    assert (
        calibrate_steps(target_epsilon=1e-4, delta=1e-5, sample_rate=1.0, noise_multiplier=0.5) == 0
    )


def test_eps_tan_closed_form_and_privacy_wall():
    q, sigma, steps, delta = 0.01, 4.0, 5000, 1e-5
    eta = q * math.sqrt(steps) / (math.sqrt(2) * sigma)
    assert tan_eta(q, sigma, steps) == pytest.approx(eta)
    assert eps_tan(q, sigma, steps, delta) == pytest.approx(
        eta**2 + 2 * eta * math.sqrt(math.log(1 / delta))
    )
    # TAN Section 3.2: for sigma >= 2 the RDP epsilon is close to eps_TAN (eps_TAN uses the classic
    # RDP->DP conversion, dp_accounting a tighter one, hence the loose tolerance); below the wall it blows up.
    rdp_eps = compute_epsilon(
        sample_rate=q, noise_multiplier=sigma, steps=steps, delta=delta, kind="rdp"
    )
    assert rdp_eps == pytest.approx(eps_tan(q, sigma, steps, delta), rel=0.25)
    # Same eta with sigma = 0.5 (q / 8, same steps): epsilon is far above eps_TAN.
    assert compute_epsilon(
        sample_rate=q / 8, noise_multiplier=0.5, steps=steps, delta=delta, kind="rdp"
    ) > 1.5 * eps_tan(q / 8, 0.5, steps, delta)


@pytest.mark.parametrize(
    "segments", [[(0.032, 1.1, 300)], [(0.01, 0.9, 100), (0.05, 2.0, 40)], [(1.0, 4.0, 7)]]
)
def test_cached_pld_composition_equals_dp_accounting_pld_accountant(segments):
    from dp_accounting import pld

    from dpscale.privacy.accounting.rdp_history import dp_sgd_event

    reference = pld.PLDAccountant()
    ours = PrivacyAccountant("pld")
    for q, sigma, steps in segments:
        reference.compose(dp_sgd_event(q, sigma, steps))
        ours.step(sample_rate=q, noise_multiplier=sigma, num_steps=steps)
    for delta in (1e-5, 1e-3):
        assert ours.epsilon(delta) == pytest.approx(reference.get_epsilon(delta), rel=1e-9)


# ---------------------------------------------------------------- releases composed with DP-SGD
def _exact_gaussian_epsilon(sigma_eff: float, delta: float) -> float:
    """Exact epsilon of one Gaussian mechanism with noise multiplier sigma_eff (Balle & Wang 2018)."""

    def exact_delta(eps: float) -> float:
        s = sigma_eff
        return norm.cdf(-eps * s + 1 / (2 * s)) - math.exp(eps) * norm.cdf(-eps * s - 1 / (2 * s))

    return brentq(lambda e: exact_delta(e) - delta, 1e-6, 200)


def test_release_composition_matches_exact_gaussian_composition():
    # Full-batch DP-SGD (q = 1) and the two data-norm sums are all Gaussian mechanisms; their
    # composition is exactly one Gaussian with 1/sigma_eff^2 = S/sigma^2 + 2/sigma_norm^2.
    sigma, steps, sigma_norm, delta = 20.0, 30, 8.0, 1e-5
    sigma_eff = 1.0 / math.sqrt(steps / sigma**2 + 2 / sigma_norm**2)
    exact = _exact_gaussian_epsilon(sigma_eff, delta)
    release = gaussian_release("data-norm", sigma_norm, 2)
    eps = compute_epsilon(
        sample_rate=1.0,
        noise_multiplier=sigma,
        steps=steps,
        delta=delta,
        kind="pld",
        releases=(release,),
    )
    assert exact - 1e-9 <= eps == pytest.approx(exact, rel=1e-3)
    # The release alone is one Gaussian with sigma_norm / sqrt(2).
    alone = PrivacyAccountant("pld")
    alone.record(release)
    assert alone.epsilon(delta) == pytest.approx(
        _exact_gaussian_epsilon(sigma_norm / math.sqrt(2), delta), rel=1e-3
    )


def test_release_composition_in_rdp_adds_claim_b5():
    # Tramer & Boneh Claim B.5: PrivDataNorm is (alpha, alpha / sigma_norm^2)-RDP. Adding that to the
    # DP-SGD RDP curve and converting must give the accountant's composed epsilon.
    q, sigma, steps, sigma_norm, delta = 0.1, 1.2, 400, 6.0, 1e-5
    orders = dp_rdp.RdpAccountant()._orders
    from dpscale.privacy.accounting.rdp_history import dp_sgd_event

    sgd_only = dp_rdp.RdpAccountant(orders)
    sgd_only.compose(dp_sgd_event(q, sigma, steps))
    rdp_curve = [r + a / sigma_norm**2 for r, a in zip(sgd_only._rdp, orders)]
    expected, _ = dp_rdp.rdp_privacy_accountant.compute_epsilon(orders, rdp_curve, delta)
    composed = compute_epsilon(
        sample_rate=q,
        noise_multiplier=sigma,
        steps=steps,
        delta=delta,
        kind="rdp",
        releases=(gaussian_release("data-norm", sigma_norm, 2),),
    )
    assert composed == pytest.approx(expected, rel=1e-9)
    assert composed > compute_epsilon(
        sample_rate=q, noise_multiplier=sigma, steps=steps, delta=delta, kind="rdp"
    )


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_calibration_with_a_release_meets_the_target(kind):
    q, steps, target, delta = 256 / 50000, 2000, 3.0, 1e-5
    releases = (gaussian_release("data-norm", 8.0, 2),)
    sigma_alone = calibrate_noise_multiplier(
        target_epsilon=target, delta=delta, sample_rate=q, steps=steps, kind=kind
    )
    sigma = calibrate_noise_multiplier(
        target_epsilon=target, delta=delta, sample_rate=q, steps=steps, kind=kind, releases=releases
    )
    assert sigma > sigma_alone  # the release uses part of the budget
    eps = compute_epsilon(
        sample_rate=q,
        noise_multiplier=sigma,
        steps=steps,
        delta=delta,
        kind=kind,
        releases=releases,
    )
    assert target * (1 - 1e-3) <= eps <= target
    # DP-SGD alone spends less
    assert (
        compute_epsilon(sample_rate=q, noise_multiplier=sigma, steps=steps, delta=delta, kind=kind)
        < eps
    )
    steps_fit = calibrate_steps(
        target_epsilon=target,
        delta=delta,
        sample_rate=q,
        noise_multiplier=sigma,
        kind=kind,
        max_steps=10**5,
        releases=releases,
    )
    assert steps_fit >= steps
    assert (
        compute_epsilon(
            sample_rate=q,
            noise_multiplier=sigma,
            steps=steps_fit + 1,
            delta=delta,
            kind=kind,
            releases=releases,
        )
        > target
    )


def test_release_that_spends_the_budget_is_refused():
    with pytest.raises(ValueError, match="data-norm alone spends"):
        calibrate_noise_multiplier(
            target_epsilon=1.0,
            delta=1e-5,
            sample_rate=0.01,
            steps=100,
            kind="rdp",
            releases=(gaussian_release("data-norm", 1.0, 2),),
        )


def test_releases_are_labelled_not_steps_and_survive_state_dict():
    acc = PrivacyAccountant("rdp")
    acc.record(gaussian_release("data-norm", 8.0, 2))
    acc.step(sample_rate=0.01, noise_multiplier=1.0, num_steps=10)
    assert acc.steps == 10
    assert [r.label for r in acc.releases] == ["data-norm"]
    parts = acc.epsilon_by_label(1e-5)
    assert set(parts) == {"data-norm", "dp-sgd"}
    assert max(parts.values()) < acc.epsilon(1e-5) < sum(parts.values())
    restored = PrivacyAccountant.from_state_dict(acc.state_dict())
    assert restored.history == acc.history and restored.epsilon(1e-5) == acc.epsilon(1e-5)
    # Checkpoints written before labels existed ([q, sigma, steps]) still load as DP-SGD steps.
    old = PrivacyAccountant.from_state_dict({"kind": "rdp", "history": [[0.01, 1.0, 10]]})
    assert old.steps == 10 and not old.releases
    with pytest.raises(ValueError, match="reserved"):
        gaussian_release("dp-sgd", 1.0)


def test_dp_plan_calibrates_for_the_composition_and_round_trips():
    from dataclasses import asdict

    from dpscale.config import DPConfig
    from dpscale.errors import ConfigError
    from dpscale.privacy.plan.dp_plan import DPPlan
    from dpscale.train.plan_config import check_plan_against_config, plan_from_config

    dp = DPConfig(epsilon=3.0, batch_size=500, accountant="rdp")
    releases = (gaussian_release("data-norm", 8.0, 2),)
    plain = plan_from_config(dp, 50000, 1000)
    plan = plan_from_config(dp, 50000, 1000, releases)
    assert plan.noise_multiplier > plain.noise_multiplier and plan.epsilon <= 3.0
    assert plan.release_noise("data-norm") == 8.0 and "data-norm" in plan.describe()
    restored = DPPlan(**asdict(plan))
    assert restored == plan
    check_plan_against_config(restored, dp, 50000, 1000, releases)
    with pytest.raises(ConfigError, match="releases"):
        check_plan_against_config(restored, dp, 50000, 1000, ())
    with pytest.raises(ConfigError, match="data-norm alone spends"):
        plan_from_config(
            DPConfig(epsilon=0.5, batch_size=500, accountant="rdp"),
            50000,
            1000,
            (gaussian_release("data-norm", 2.0, 2),),
        )
    # A given sigma is checked against the budget including the release.
    with pytest.raises(ConfigError, match="with data-norm"):
        plan_from_config(
            DPConfig(
                epsilon=3.0,
                noise_multiplier=plain.noise_multiplier,
                batch_size=500,
                accountant="rdp",
            ),
            50000,
            1000,
            releases,
        )


def test_rdp_order_exclusion_notices_are_silenced_but_other_absl_logs_are_not(caplog):
    import logging

    from dpscale.privacy.accounting.rdp_history import _DropOrderExclusionNotices

    with caplog.at_level(logging.WARNING, logger="absl"):
        # small sigma: dp_accounting drops orders
        epsilon = compute_epsilon(
            sample_rate=0.128, noise_multiplier=0.95, steps=10, delta=1e-5, kind="rdp"
        )
        logging.getLogger("absl").warning("something else")
    messages = [r.getMessage() for r in caplog.records]
    assert not any("failed to converge" in m for m in messages) and "something else" in messages
    assert math.isfinite(epsilon) and epsilon > 0
    keep = _DropOrderExclusionNotices().filter
    record = lambda msg: logging.LogRecord("absl", logging.WARNING, __file__, 1, msg, None, None)  # noqa: E731
    assert not keep(record("_compute_log_a_frac failed to converge after 1000 iterations"))
    assert keep(record("an unrelated warning"))


def test_epsilon_is_cached_per_history_and_delta(monkeypatch):
    from dpscale.privacy.accounting import accountant as module

    calls = []
    original = module.pld_epsilon_of  # patched where the accountant's cache looks it up
    monkeypatch.setattr(module, "pld_epsilon_of", lambda *a: calls.append(a) or original(*a))
    module._cached_epsilon.cache_clear()
    acc = module.PrivacyAccountant("pld")
    acc.step(sample_rate=0.01, noise_multiplier=1.1, num_steps=37)
    first = acc.epsilon(1e-5)
    assert acc.epsilon(1e-5) == first and len(calls) == 1  # asked again: no recomputation
    assert first == original(list(acc.history), 1e-5, acc.pld_discretization)
    acc.epsilon(1e-6)
    # one more step: a new history, recomputed, and larger
    acc.step(sample_rate=0.01, noise_multiplier=1.1)
    assert acc.epsilon(1e-5) > first and len(calls) == 3

"""The guarantee as an attacker's odds (issue 45): membership-test power from the run's privacy
profile, against independent references: the Gaussian mechanism's closed form, randomized
response's exact trade-off, the limits (epsilon -> 0, composition), and dp_accounting's own
delta(epsilon); and through ``dpscale account`` and ``dpscale train``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy.stats import norm

from dpscale.cli import main
from dpscale.privacy.accounting import pld_history
from dpscale.privacy.accounting.accountant import PrivacyAccountant
from dpscale.privacy.accounting.segments import gaussian_release
from dpscale.privacy.accounting.tradeoff import EPSILON_GRID, attacker_odds, gdp_mu, tpr_at_fpr

FPRS = (0.001, 0.01, 0.05, 0.1, 0.3)


@pytest.mark.parametrize("sigma", [0.7, 1.0, 2.0, 5.0])
def test_one_gaussian_mechanism_is_its_closed_form(sigma):
    """One Gaussian release of sensitivity 1 is exactly (1/sigma)-GDP: TPR = Phi(Phi^-1(a) + 1/sigma)."""
    pld = PrivacyAccountant("pld")
    pld.record(gaussian_release("g", sigma))
    got = tpr_at_fpr(pld.privacy_profile(), FPRS)
    for a in FPRS:
        exact = norm.cdf(norm.ppf(a) + 1 / sigma)
        assert exact - 1e-4 <= got[a] <= exact + 2e-3  # the PLD is pessimistic, its grid discrete
    assert gdp_mu(pld.privacy_profile()) == pytest.approx(1 / sigma, rel=2e-3)


def test_randomized_response_gives_its_exact_trade_off():
    """A pure eps0-DP profile (randomized response): delta(eps) = (e^eps0 - e^eps)/(1 + e^eps0) below
    eps0, 0 above; its trade-off is exactly min(e^eps0 a, 1 - e^-eps0 (1 - a))."""
    eps0 = 1.0

    def profile(eps):
        return np.where(eps < eps0, (math.exp(eps0) - np.exp(eps)) / (1 + math.exp(eps0)), 0.0)

    got = tpr_at_fpr(profile, FPRS)
    for a in FPRS:
        assert got[a] == pytest.approx(
            min(math.exp(eps0) * a, 1 - math.exp(-eps0) * (1 - a)), abs=1e-12
        )


def test_no_privacy_loss_means_no_better_than_guessing_and_composition_only_helps_the_attacker():
    quiet = PrivacyAccountant("pld")
    quiet.record(gaussian_release("g", 2000.0))
    for a, t in tpr_at_fpr(quiet.privacy_profile(), FPRS).items():
        assert a <= t <= a + 2e-3
    one, many = PrivacyAccountant("pld"), PrivacyAccountant("pld")
    one.step(sample_rate=0.01, noise_multiplier=1.0, num_steps=1)
    many.step(sample_rate=0.01, noise_multiplier=1.0, num_steps=500)
    single, composed = (
        tpr_at_fpr(one.privacy_profile(), FPRS),
        tpr_at_fpr(many.privacy_profile(), FPRS),
    )
    assert all(composed[a] >= single[a] for a in FPRS) and composed[0.01] > single[0.01] + 0.01


def test_rdp_gives_a_valid_looser_reading_than_pld():
    pld, rdp = PrivacyAccountant("pld"), PrivacyAccountant("rdp")
    for acc in (pld, rdp):
        acc.step(sample_rate=256 / 60000, noise_multiplier=1.1, num_steps=2000)
    tight, loose = tpr_at_fpr(pld.privacy_profile(), FPRS), tpr_at_fpr(rdp.privacy_profile(), FPRS)
    assert all(loose[a] >= tight[a] - 1e-9 for a in FPRS)
    # each profile is what its accountant says at the run's delta
    for acc in (pld, rdp):
        eps = acc.epsilon(1e-5)
        assert float(acc.privacy_profile()(np.array([eps]))[0]) == pytest.approx(1e-5, rel=0.05)


def test_the_vectorised_pld_profile_equals_dp_accountings_own():
    acc = PrivacyAccountant("pld")
    acc.record(gaussian_release("norm", 8.0))
    acc.step(sample_rate=0.03, noise_multiplier=0.9, num_steps=40)
    pld = pld_history.composed_pld(list(acc.history), acc.pld_discretization)
    reference = pld.get_delta_for_epsilon(EPSILON_GRID)
    np.testing.assert_allclose(
        pld_history.pld_profile(pld)(EPSILON_GRID), reference, rtol=1e-12, atol=1e-18
    )


def test_dpscale_account_prints_and_returns_the_odds(capsys):
    args = [
        "account",
        "--dataset-size",
        "60000",
        "--batch-size",
        "256",
        "--noise",
        "1.1",
        "--steps",
        "2000",
    ]
    assert main(args + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["tpr_at_fpr"]) == {"0.001", "0.01", "0.1"}
    acc = PrivacyAccountant("pld")
    acc.step(sample_rate=256 / 60000, noise_multiplier=1.1, num_steps=2000)
    assert result["tpr_at_fpr"]["0.01"] == pytest.approx(
        attacker_odds(acc)["tpr_at_fpr"]["0.01"], rel=1e-12
    )
    assert 0.01 < result["tpr_at_fpr"]["0.01"] < 0.05 and 0.1 < result["gdp_mu"] < 1.0
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "no membership test can tell whether any one image was used with better than" in out
    assert "at 1% false positives" in out


@pytest.mark.parametrize("sampling", ["poisson", "fixed", "shuffle"])
def test_dpscale_train_reports_the_odds_of_its_own_accounting(tmp_path, sampling, capsys):
    """The header states the planned odds, the summary carries the run's (from its accountant's
    history) and the result line says them; fixed-size and shuffled batches, accounted under
    replace-one adjacency, say which of two images."""
    from dpscale.train.loop import Trainer
    from dpscale.train.run import result_line
    from helpers import tiny_config

    config = tiny_config(tmp_path / "run", f"dp.sampling={sampling}")
    trainer = Trainer.create(config, progress=False, report=True)
    summary = trainer.run()
    header, line = capsys.readouterr().err, result_line(summary, tmp_path / "run")
    # planned = spent: the run took all its steps
    assert f"After all 3 steps, {summary['odds']}" in header
    assert summary["tpr_at_fpr"] == attacker_odds(trainer.mechanism.accountant)["tpr_at_fpr"]
    assert 0.01 < summary["tpr_at_fpr"]["0.01"] < 1 and summary["gdp_mu"] > 0
    question = (
        "whether any one image was used"
        if sampling == "poisson"
        else "which of two images was used"
    )
    assert f"no membership test can tell {question}" in line
    assert summary["adjacency"] == ("add/remove" if sampling == "poisson" else "replace-one")
    # the result line names it
    assert (f"{sampling} sampling, replace-one)" in line) == (sampling != "poisson")
    # its own bound (no amplification), never the Poisson figure, anywhere
    if sampling == "shuffle":
        from dpscale.privacy.accounting.accountant import compute_epsilon
        from dpscale.privacy.accounting.batch_sampling import BatchSampling

        plan = trainer.plan
        poisson = compute_epsilon(
            sample_rate=plan.sample_rate, noise_multiplier=1.0, steps=3, delta=plan.delta
        )
        own = compute_epsilon(
            sample_rate=plan.sample_rate,
            noise_multiplier=1.0,
            steps=3,
            delta=plan.delta,
            batches=BatchSampling("shuffle", plan.dataset_size),
        )
        assert summary["epsilon"] == own == plan.epsilon and own > 2 * poisson
        assert f"{poisson:.4g}" not in header + line and f"{poisson:.3f}" not in header + line


def test_each_evaluation_records_the_odds_so_far(tmp_path):
    """metrics.jsonl: every evaluation's TPR bounds are those of the accountant at its step, and grow."""
    from dpscale.train.loop import Trainer
    from helpers import tiny_config

    config = tiny_config(
        tmp_path / "run", "train.steps=6", "train.eval_every_epochs=0.032", "dp.accountant=rdp"
    )
    trainer = Trainer.create(config, progress=False)
    trainer.run()
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(records) >= 2
    for record in records:
        acc = PrivacyAccountant("rdp")
        acc.step(
            sample_rate=trainer.plan.sample_rate, noise_multiplier=1.0, num_steps=record["step"]
        )
        assert record["tpr_at_fpr"] == pytest.approx(attacker_odds(acc)["tpr_at_fpr"], rel=1e-12)
    assert records[-1]["tpr_at_fpr"]["0.01"] > records[0]["tpr_at_fpr"]["0.01"]

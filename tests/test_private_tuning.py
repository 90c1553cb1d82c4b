"""Accounting for hyper-parameter tuning (Papernot & Steinke 2022): the composed bound against
the paper's closed forms (Corollaries 3 and 4, Theorem 6), the distribution of K, and
``dpscale sweep --private-tuning``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from dp_accounting import dp_event

from dpscale.cli import main
from dpscale.config import ConfigError
from dpscale.features.extract import read_source_run
from dpscale.privacy.accountant import AccountingSegment, compute_epsilon
from dpscale.privacy.tuning import (
    TuningDistribution,
    parse_tuning_distribution,
    repeat_and_select,
    run_event,
    truncated_negbin_mean,
    tuned_epsilon,
)


@pytest.mark.parametrize("kind, eta", [("logarithmic", 0.0), ("geometric", 1.0), ("negbin", 0.5), ("negbin", 2.0)])
def test_pure_dp_runs_give_corollary_3(kind, eta):
    # Corollary 3: if every run is eps-DP, the best of K ~ D_{eta,gamma} is (2 + eta) eps-DP
    # (geometric: 3 eps, Liu & Talwar's bound). Pure DP = RDP at order -> infinity.
    eps = 1.0
    tuning = TuningDistribution(kind, 1000.0, eta)
    accountant = repeat_and_select(dp_event.LaplaceDpEvent(1 / eps), tuning, orders=[1e10])
    assert accountant._rdp[0] == pytest.approx((2 + eta) * eps, rel=1e-6)


@pytest.mark.parametrize("eta, gamma", [(0.0, 0.1), (1.0, 0.1), (1.0, 0.01), (0.5, 0.05)])
def test_gaussian_runs_give_corollary_4(eta, gamma):
    # Corollary 4: a rho-zCDP run (one Gaussian sum, rho = 1 / (2 sigma^2)), rho <= log(1/gamma):
    # eps'(lam) = rho (lam - 1) + log E[K] / (lam - 1) + 2 (1 + eta) sqrt(rho log(1/gamma)) - eta rho,
    # when the orders hold the optimal lam_hat = sqrt(log(1/gamma) / rho).
    sigma = 2.0
    rho = 1 / (2 * sigma**2)
    mean = truncated_negbin_mean(gamma, eta)
    kind = {0.0: "logarithmic", 1.0: "geometric"}.get(eta, "negbin")
    tuning = TuningDistribution(kind, mean, eta)
    lam_hat = math.sqrt(math.log(1 / gamma) / rho)
    orders = sorted({lam_hat, 1.5, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0})
    accountant = repeat_and_select(run_event((AccountingSegment(1.0, sigma, 1, "dp-sgd"),)), tuning, orders=orders)
    for lam, got in zip(accountant._orders, accountant._rdp):
        if lam > 1 + math.sqrt(math.log(mean) / rho):
            closed = rho * (lam - 1) + math.log(mean) / (lam - 1) + 2 * (1 + eta) * math.sqrt(rho * math.log(1 / gamma)) - eta * rho
            assert got == pytest.approx(closed, rel=1e-6)


def test_poisson_pure_dp_gives_theorem_6():
    # Theorem 6 with an eps-DP run (delta_hat = 0 at eps_hat = eps = log(1 + 1/(alpha - 1))):
    # eps'(alpha) = eps(alpha) + log(mu) / (alpha - 1), eps(alpha) the Laplace mechanism's RDP.
    eps, mu = 0.5, 20.0
    alpha = 1 + 1 / math.expm1(eps)
    accountant = repeat_and_select(dp_event.LaplaceDpEvent(1 / eps), TuningDistribution("poisson", mu), orders=[alpha, 1e10, 1e100])
    laplace = eps + math.log1p(math.expm1((1 - 2 * alpha) * eps) * (alpha - 1) / (2 * alpha - 1)) / (alpha - 1)
    assert accountant._rdp[0] == pytest.approx(laplace + math.log(mu) * math.expm1(eps), rel=1e-3)


def test_tuned_epsilon_of_a_dp_sgd_run():
    history = (AccountingSegment(0.05, 1.1, 500, "dp-sgd"),)
    alone = compute_epsilon(0.05, 1.1, 500, 1e-5, kind="rdp")
    # one run for sure (mean 1): Theorem 2 still charges (1 + eta) min (1 - 1/lam) eps(lam), a few percent here
    assert alone < tuned_epsilon(history, 1e-5, TuningDistribution("geometric", 1.0)) < 1.05 * alone
    costs = [tuned_epsilon(history, 1e-5, TuningDistribution(kind, mean)) for kind, mean in (("logarithmic", 10), ("geometric", 10), ("poisson", 10))]
    assert alone < costs[0] < costs[1]  # more concentrated K costs less (Papernot & Steinke, Section 3)
    assert all(c > alone for c in costs)
    with pytest.raises(ValueError, match="not private"):
        tuned_epsilon((), 1e-5, TuningDistribution("poisson", 10))


@pytest.mark.parametrize("text", ["poisson:4", "geometric:4", "logarithmic:4", "negbin:0.5:4", "negbin:3:4", "negbin:3:1.2"])
def test_number_of_runs_has_the_stated_distribution(text):
    tuning = parse_tuning_distribution(text)
    rng = np.random.default_rng(0)
    draws = np.array([tuning.sample(rng) for _ in range(20000)])
    assert abs(draws.mean() - tuning.mean) < 5 * draws.std() / math.sqrt(len(draws))
    assert draws.min() >= (0 if tuning.kind == "poisson" else 1)
    if tuning.kind == "negbin":  # Definition 1's pmf at k = 1, 2, 3
        gamma, eta = tuning.gamma(), tuning.eta
        for k in (1, 2, 3):
            pmf = (1 - gamma) ** k / (gamma**-eta - 1) * math.prod((l + eta) / (l + 1) for l in range(k))
            assert abs((draws == k).mean() - pmf) < 5 * math.sqrt(pmf * (1 - pmf) / len(draws))


def test_a_mean_of_one_is_one_run():
    rng = np.random.default_rng(0)
    for text in ("geometric:1", "logarithmic:1", "negbin:0.5:1", "negbin:3:1"):
        assert {parse_tuning_distribution(text).sample(rng) for _ in range(100)} == {1}


def test_bad_distributions_are_refused():
    for text in ("poisson", "uniform:3", "geometric:0.5", "negbin:0:3", "poisson:x", "poisson:0.5"):
        with pytest.raises(ValueError):
            parse_tuning_distribution(text)


def _sweep(tmp_path, *extra):
    return main(["sweep", "--quiet", "--out", str(tmp_path / "sw"), "--grid", "optim.lr=0.5,1,2",
                 "--set", "train.steps=4", "--set", "run.seed=0", *extra])  # fmt: skip


def test_private_tuning_sweep_releases_the_best_with_its_cost(tmp_path, monkeypatch):
    import dpscale.tune.sweep as sweep_module

    monkeypatch.setattr(sweep_module, "draw_trials", lambda tuning, points: [2, 0, 2])  # a repeated point too
    assert _sweep(tmp_path, "--private-tuning", "poisson:3") == 0
    manifest = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert manifest["trials"] == [2, 0, 2]
    runs = sorted(p.name for p in (tmp_path / "sw" / "runs").iterdir())
    assert runs == ["trial-000-optim.lr=2", "trial-001-optim.lr=0.5", "trial-002-optim.lr=2"]
    release = json.loads((tmp_path / "sw" / "release.json").read_text())
    history = read_source_run(release["released_run"]).history
    assert release["tuned_epsilon"] == pytest.approx(tuned_epsilon(history, 1e-5, TuningDistribution("poisson", 3.0)))
    assert release["tuned_epsilon"] > release["run_epsilon_rdp"]
    table = (tmp_path / "sw" / "sweep.md").read_text()
    assert "release only" in table and "Papernot & Steinke" in table and "3 of 3 trials" in table
    # rerunning resumes the same draws (even if a fresh draw would differ): nothing is trained again
    monkeypatch.setattr(sweep_module, "draw_trials", lambda tuning, points: [1])
    assert _sweep(tmp_path, "--private-tuning", "poisson:3") == 0
    assert json.loads((tmp_path / "sw" / "sweep.json").read_text())["trials"] == [2, 0, 2]
    assert sorted(p.name for p in (tmp_path / "sw" / "runs").iterdir()) == runs
    assert json.loads((tmp_path / "sw" / "release.json").read_text()) == release
    # another grid in the same directory is a different sweep
    assert main(["sweep", "--quiet", "--out", str(tmp_path / "sw"), "--grid", "optim.lr=3", "--set", "train.steps=4",
                 "--set", "run.seed=0", "--private-tuning", "poisson:3"]) == 2  # fmt: skip


def test_no_trials_release_nothing_and_failed_trials_are_final(tmp_path, monkeypatch):
    import dpscale.tune.sweep as sweep_module

    monkeypatch.setattr(sweep_module, "draw_trials", lambda tuning, points: [])
    assert _sweep(tmp_path, "--private-tuning", "poisson:3") == 0
    assert json.loads((tmp_path / "sw" / "release.json").read_text())["released_run"] is None
    assert "nothing to release" in (tmp_path / "sw" / "sweep.md").read_text()
    assert "0 of 0 trials" in (tmp_path / "sw" / "sweep.md").read_text()
    monkeypatch.setattr(sweep_module, "draw_trials", lambda tuning, points: [0])
    calls = []

    def failing_create(config, progress=True, hooks=None):
        calls.append(config.run.out_dir)
        raise RuntimeError("planted failure")

    monkeypatch.setattr(sweep_module.Trainer, "create", staticmethod(failing_create))
    out = ["--out", str(tmp_path / "f")]
    args = ["sweep", "--quiet", *out, "--grid", "optim.lr=1", "--set", "train.steps=4", "--private-tuning", "geometric:2"]
    assert main(args) == 1 and main(args) == 1
    assert len(calls) == 1  # the failed trial is not run again
    assert json.loads((tmp_path / "f" / "release.json").read_text())["released_run"] is None


def test_private_tuning_refusals(tmp_path, capsys):
    assert main(["sweep", "--out", str(tmp_path / "a"), "--grid", "dp.batch_size=64,128", "--private-tuning", "geometric:3"]) == 2
    assert "same privacy cost" in capsys.readouterr().err
    assert main(["tune", "clip-lr", "--out", str(tmp_path / "b"), "--private-tuning", "geometric:3"]) == 2
    assert "sigma=0" in capsys.readouterr().err
    assert main(["sweep", "--out", str(tmp_path / "c"), "--grid", "optim.lr=1,2", "--set", "dp.epsilon=null",
                 "--set", "dp.noise_multiplier=0", "--private-tuning", "geometric:3"]) == 2  # fmt: skip
    assert "without noise" in capsys.readouterr().err and not (tmp_path / "c" / "runs").exists()
    assert main(["sweep", "--out", str(tmp_path / "d"), "--grid", "optim.lr=1,2", "--private-tuning", "poisson:0.5"]) == 2
    assert ">= 1" in capsys.readouterr().err
    assert _sweep(tmp_path) == 0  # without it, the caveat stays
    assert "NOT covered" in (tmp_path / "sw" / "sweep.md").read_text()

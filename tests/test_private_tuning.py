"""Accounting for hyper-parameter tuning (Papernot & Steinke 2022): the composed bound against
the paper's closed forms (Corollaries 3 and 4, Theorem 6), the distribution of K, and
``dpscale sweep --private-tuning``."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from dp_accounting import dp_event

from dpscale.cli import main
from dpscale.features.source_run import read_source_run
from dpscale.privacy.accounting.accountant import compute_epsilon
from dpscale.privacy.accounting.segments import AccountingSegment
from dpscale.privacy.accounting.tuning import (
    TuningDistribution,
    parse_tuning_distribution,
    repeat_and_select,
    run_event,
    truncated_negbin_mean,
    tuned_epsilon,
)


@pytest.mark.parametrize(
    "kind, eta", [("logarithmic", 0.0), ("geometric", 1.0), ("negbin", 0.5), ("negbin", 2.0)]
)
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
    accountant = repeat_and_select(
        run_event((AccountingSegment(1.0, sigma, 1, "dp-sgd"),)), tuning, orders=orders
    )
    for lam, got in zip(accountant._orders, accountant._rdp):
        if lam > 1 + math.sqrt(math.log(mean) / rho):
            closed = (
                rho * (lam - 1)
                + math.log(mean) / (lam - 1)
                + 2 * (1 + eta) * math.sqrt(rho * math.log(1 / gamma))
                - eta * rho
            )
            assert got == pytest.approx(closed, rel=1e-6)


def test_poisson_pure_dp_gives_theorem_6():
    # Theorem 6 with an eps-DP run (delta_hat = 0 at eps_hat = eps = log(1 + 1/(alpha - 1))):
    # eps'(alpha) = eps(alpha) + log(mu) / (alpha - 1), eps(alpha) the Laplace mechanism's RDP.
    eps, mu = 0.5, 20.0
    alpha = 1 + 1 / math.expm1(eps)
    accountant = repeat_and_select(
        dp_event.LaplaceDpEvent(1 / eps),
        TuningDistribution("poisson", mu),
        orders=[alpha, 1e10, 1e100],
    )
    laplace = eps + math.log1p(
        math.expm1((1 - 2 * alpha) * eps) * (alpha - 1) / (2 * alpha - 1)
    ) / (alpha - 1)
    assert accountant._rdp[0] == pytest.approx(laplace + math.log(mu) * math.expm1(eps), rel=1e-3)


def test_tuned_epsilon_of_a_dp_sgd_run():
    history = (AccountingSegment(0.05, 1.1, 500, "dp-sgd"),)
    alone = compute_epsilon(
        sample_rate=0.05, noise_multiplier=1.1, steps=500, delta=1e-5, kind="rdp"
    )
    # one run for sure (mean 1): Theorem 2 still charges (1 + eta) min (1 - 1/lam) eps(lam), a few percent here
    assert alone < tuned_epsilon(history, 1e-5, TuningDistribution("geometric", 1.0)) < 1.05 * alone
    costs = [
        tuned_epsilon(history, 1e-5, TuningDistribution(kind, mean))
        for kind, mean in (("logarithmic", 10), ("geometric", 10), ("poisson", 10))
    ]
    # more concentrated K costs less (Papernot & Steinke, Section 3)
    assert alone < costs[0] < costs[1]
    assert all(c > alone for c in costs)
    with pytest.raises(ValueError, match="not private"):
        tuned_epsilon((), 1e-5, TuningDistribution("poisson", 10))


@pytest.mark.parametrize(
    "text",
    ["poisson:4", "geometric:4", "logarithmic:4", "negbin:0.5:4", "negbin:3:4", "negbin:3:1.2"],
)
def test_number_of_runs_has_the_stated_distribution(text):
    tuning = parse_tuning_distribution(text)
    rng = np.random.default_rng(0)
    draws = np.array([tuning.sample(rng) for _ in range(20000)])
    assert abs(draws.mean() - tuning.mean) < 5 * draws.std() / math.sqrt(len(draws))
    assert draws.min() >= (0 if tuning.kind == "poisson" else 1)
    if tuning.kind == "negbin":  # Definition 1's pmf at k = 1, 2, 3
        gamma, eta = tuning.gamma(), tuning.eta
        for k in (1, 2, 3):
            pmf = (
                (1 - gamma) ** k
                / (gamma**-eta - 1)
                * math.prod((j + eta) / (j + 1) for j in range(k))
            )
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
    return main(
        [
            "sweep",
            "--quiet",
            "--out",
            str(tmp_path / "sw"),
            "--grid",
            "optim.lr=0.5,1,2",
            "--set",
            "train.steps=4",
            "--set",
            "run.seed=0",
            *extra,
        ]
    )


def test_private_tuning_sweep_releases_the_best_with_its_cost(tmp_path, monkeypatch):
    import dpscale.tune.sweep as sweep_module

    # a repeated point too
    monkeypatch.setattr(sweep_module, "draw_trials", lambda tuning, points: [2, 0, 2])
    assert _sweep(tmp_path, "--private-tuning", "poisson:3") == 0
    manifest = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert manifest["trials"] == [2, 0, 2]
    runs = sorted(p.name for p in (tmp_path / "sw" / "runs").iterdir())
    assert runs == ["trial-000-optim.lr=2", "trial-001-optim.lr=0.5", "trial-002-optim.lr=2"]
    release = json.loads((tmp_path / "sw" / "released" / "release.json").read_text())
    assert release["released"] and release["tuned_epsilon"] > release["run_epsilon_rdp"]
    assert release["hyperparameters"] == {"optim.lr": 2} and any(
        "run.seed is fixed" in n for n in release["guarantee_caveats"]
    )
    table = (tmp_path / "sw" / "sweep.md").read_text()
    assert "release only" in table and "Papernot & Steinke" in table and "3 of 3 trials" in table
    # rerunning resumes the same draws (even if a fresh draw would differ): nothing is trained again
    monkeypatch.setattr(sweep_module, "draw_trials", lambda tuning, points: [1])
    assert _sweep(tmp_path, "--private-tuning", "poisson:3") == 0
    assert json.loads((tmp_path / "sw" / "sweep.json").read_text())["trials"] == [2, 0, 2]
    assert sorted(p.name for p in (tmp_path / "sw" / "runs").iterdir()) == runs
    assert json.loads((tmp_path / "sw" / "released" / "release.json").read_text()) == release
    # another grid in the same directory is a different sweep
    assert (
        main(
            [
                "sweep",
                "--quiet",
                "--out",
                str(tmp_path / "sw"),
                "--grid",
                "optim.lr=3",
                "--set",
                "train.steps=4",
                "--set",
                "run.seed=0",
                "--private-tuning",
                "poisson:3",
            ]
        )
        == 2
    )


def test_no_trials_release_nothing_and_failed_trials_are_final(tmp_path, monkeypatch):
    import dpscale.tune.sweep as sweep_module

    monkeypatch.setattr(sweep_module, "draw_trials", lambda tuning, points: [])
    assert _sweep(tmp_path, "--private-tuning", "poisson:3") == 0
    assert (
        json.loads((tmp_path / "sw" / "released" / "release.json").read_text())["released"] is False
    )
    assert sorted(p.name for p in (tmp_path / "sw" / "released").iterdir()) == ["release.json"]
    assert "nothing to release" in (tmp_path / "sw" / "sweep.md").read_text()
    assert "0 of 0 trials" in (tmp_path / "sw" / "sweep.md").read_text()
    monkeypatch.setattr(sweep_module, "draw_trials", lambda tuning, points: [0])
    calls = []

    def failing_create(config, progress=True, hooks=None):
        calls.append(config.run.out_dir)
        raise RuntimeError("planted failure")

    monkeypatch.setattr(sweep_module.Trainer, "create", staticmethod(failing_create))
    out = ["--out", str(tmp_path / "f")]
    args = [
        "sweep",
        "--quiet",
        *out,
        "--grid",
        "optim.lr=1",
        "--set",
        "train.steps=4",
        "--private-tuning",
        "geometric:2",
    ]
    assert main(args) == 1 and main(args) == 1
    assert len(calls) == 1  # the failed trial is not run again
    assert (
        json.loads((tmp_path / "f" / "released" / "release.json").read_text())["released"] is False
    )


def test_private_tuning_refusals(tmp_path, capsys):
    assert (
        main(
            [
                "sweep",
                "--out",
                str(tmp_path / "a"),
                "--grid",
                "dp.batch_size=64,128",
                "--private-tuning",
                "geometric:3",
            ]
        )
        == 2
    )
    assert "same privacy cost" in capsys.readouterr().err
    assert (
        main(["tune", "clip-lr", "--out", str(tmp_path / "b"), "--private-tuning", "geometric:3"])
        == 2
    )
    assert "sigma=0" in capsys.readouterr().err
    assert (
        main(
            [
                "sweep",
                "--out",
                str(tmp_path / "c"),
                "--grid",
                "optim.lr=1,2",
                "--set",
                "dp.epsilon=null",
                "--set",
                "dp.noise_multiplier=0",
                "--private-tuning",
                "geometric:3",
            ]
        )
        == 2
    )
    assert "without noise" in capsys.readouterr().err and not (tmp_path / "c" / "runs").exists()
    assert (
        main(
            [
                "sweep",
                "--out",
                str(tmp_path / "d"),
                "--grid",
                "optim.lr=1,2",
                "--private-tuning",
                "poisson:0.5",
            ]
        )
        == 2
    )
    assert ">= 1" in capsys.readouterr().err
    # without it, the caveat stays (in the table written to disk; test_tune checks the printed one).
    # One point of two steps: the caveat is written whatever the grid (sweep.tuning_text)
    assert (
        main(
            [
                "sweep",
                "--quiet",
                "--out",
                str(tmp_path / "sw"),
                "--grid",
                "optim.lr=1",
                "--set",
                "train.steps=2",
                "--set",
                "run.seed=0",
            ]
        )
        == 0
    )
    assert "NOT covered" in (tmp_path / "sw" / "sweep.md").read_text()


# ------------------------------------------------- K stays hidden (issue 24)
DRAWS = [2, 0, 2, 1]  # K = 4, a repeated point; every index > 0 names a trial after the first


def _published(sweep_dir):
    """What a user would publish: the release record (wherever the sweep put it) and its folder."""
    (path,) = sweep_dir.rglob("release.json")
    return path, json.loads(path.read_text())


def _leaves(value):
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, list):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One private-tuning sweep with K = 4 drawn, and what it printed: (sweep dir, stdout, stderr)."""
    import contextlib
    import io

    import dpscale.tune.sweep as sweep_module

    where, out, err = tmp_path_factory.mktemp("tuned"), io.StringIO(), io.StringIO()
    with (
        pytest.MonkeyPatch.context() as patch,
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        patch.setattr(sweep_module, "draw_trials", lambda tuning, points: list(DRAWS))
        assert _sweep(where, "--private-tuning", "poisson:3") == 0
    return where / "sw", out.getvalue(), err.getvalue()


TRIAL = re.compile(r"trial-\d")  # a trial's run name: its index bounds K from below


def test_the_release_does_not_hold_k(tuned):
    sweep_dir, out, err = tuned
    _, release = _published(sweep_dir)
    ints = [v for v in _leaves(release) if isinstance(v, int) and not isinstance(v, bool)]
    assert len(DRAWS) not in ints
    assert "must stay secret" in release["k_secret"]
    # the printed release line (stdout) neither; the tuner's console and table say they are private
    assert (
        "must stay secret" in out
        and f"{len(DRAWS)} trials" not in out
        and f"of {len(DRAWS)}" not in out
    )
    assert "private to the tuner" in err.lower()
    assert "private to the tuner" in (sweep_dir / "sweep.md").read_text().lower()


def test_the_released_model_is_not_named_after_its_trial(tuned):
    from dpscale.config import load_config
    from dpscale.models.init import read_weights

    sweep_dir, out, _ = tuned
    path, release = _published(sweep_dir)
    assert not TRIAL.search(json.dumps(release)) and not TRIAL.search(out)
    assert not any(TRIAL.search(str(p.relative_to(sweep_dir))) for p in path.parent.rglob("*"))
    # the released config withholds the trial's seed (seed + index) and its run directory
    config = load_config(path.parent / "config.yaml")
    assert config.run.seed is None and config.run.out_dir is None
    # the released weights are the best trial's (found from the tuner's private records)
    records = [json.loads(line) for line in (sweep_dir / "sweep.jsonl").read_text().splitlines()]
    best = max(records, key=lambda r: r["summary"]["test_accuracy"])
    released, trained = read_weights(str(path.parent / "model.pt")), read_weights(best["run_dir"])
    assert released.keys() == trained.keys() and all(
        (released[k] == trained[k]).all() for k in trained
    )
    history = read_source_run(best["run_dir"]).history
    assert release["tuned_epsilon"] == pytest.approx(
        tuned_epsilon(history, 1e-5, TuningDistribution("poisson", 3.0))
    )


@pytest.mark.parametrize("metric", ["train_loss", "wall_time_s", "epsilon"])
def test_private_tuning_selects_on_test_metrics_only(tmp_path, capsys, metric):
    args = [
        "sweep",
        "--out",
        str(tmp_path / "m"),
        "--grid",
        "optim.lr=1,2",
        "--set",
        "train.steps=4",
        "--metric",
        metric,
        "--private-tuning",
        "poisson:3",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1
        and metric in err
        and "test_accuracy" in err
        and "test_loss" in err
    )
    assert not (tmp_path / "m").exists()  # refused before anything is drawn or trained


def test_a_test_split_metric_is_accepted(tmp_path):
    from dpscale.tune.sweep import Sweep, SweepSpec

    # geometric: K >= 1 always (with poisson:3, K = 0 in 5% of draws prepared nothing and failed this test)
    spec = SweepSpec(
        None, ("train.steps=4",), (("optim.lr", ("1", "2")),), "test_loss", None, "geometric:3"
    )
    assert Sweep(tmp_path / "ok", spec, progress=False).prepare()  # prepared: nothing is trained

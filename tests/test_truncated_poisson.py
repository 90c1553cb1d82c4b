"""Poisson batches capped at a maximum size (issue 45, item 1's accounting): truncated-Poisson
epsilon against dp_accounting's event built by hand and the issue's golden values, the smallest
free cap's search, and ``dpscale account --max-batch-size``."""

from __future__ import annotations

import json

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant

from dpscale.cli import main
from dpscale.privacy.accounting import accountant as accounting
from dpscale.privacy.accounting.accountant import (
    TruncatedPoissonResult,
    smallest_free_cap,
    truncated_poisson_epsilon,
)
from dpscale.privacy.accounting.segments import data_norm_release

SMALL = {
    "dataset_size": 1000,
    "batch_size": 50,
    "noise_multiplier": 1.0,
    "steps": 20,
    "delta": 1e-5,
}


def test_the_capped_epsilon_is_dp_accountings_event_built_by_hand():
    """With a release composed first (a data-norm Gaussian), at a cap that truncates often."""
    release = data_norm_release(6.0)
    got = truncated_poisson_epsilon(**SMALL, max_batch_size=55, releases=(release,))
    by_hand = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    by_hand.compose(dp_accounting.GaussianDpEvent(6.0), 2)  # Data Normalization: two Gaussian sums
    by_hand.compose(dp_accounting.TruncatedSubsampledGaussianDpEvent(1000, 0.05, 55, 1.0), 20)
    # summed in another order
    assert got.epsilon == pytest.approx(by_hand.get_epsilon(1e-5), rel=1e-9)
    uncapped = accounting.compute_epsilon(
        sample_rate=0.05,
        noise_multiplier=1.0,
        steps=20,
        delta=1e-5,
        kind="pld",
        releases=(release,),
    )
    assert got.poisson_epsilon == uncapped and got.epsilon > uncapped
    # the odds' profile is this PLD's
    assert float(got.profile([got.epsilon])[0]) == pytest.approx(1e-5, rel=0.05)


# The golden cap (N = 60000, B = 256, sigma = 1.1, 2000 steps: 0.847 uncapped, 2.08 capped at
# 300) is checked once, against dp_accounting's event, in test_batch_sampling.


@pytest.mark.slow
def test_a_generous_cap_costs_nothing():
    got = truncated_poisson_epsilon(
        dataset_size=60000,
        batch_size=256,
        max_batch_size=400,
        noise_multiplier=1.1,
        steps=2000,
        delta=1e-5,
    )
    assert got.epsilon == pytest.approx(got.poisson_epsilon, rel=1e-6)


def test_the_smallest_free_cap_is_found_exactly(monkeypatch):
    """A synthetic epsilon falling with the cap: the search returns the smallest integer cap within 1%."""
    calls = []

    def fake(*, max_batch_size, **plan):
        calls.append(max_batch_size)
        epsilon = 1.0 + 3.0 / max(1, max_batch_size - 90)  # free (<= 1.01) from cap 390 on
        return TruncatedPoissonResult(max_batch_size, epsilon, 1.0, None)

    monkeypatch.setattr(accounting, "truncated_poisson_epsilon", fake)
    assert smallest_free_cap(dataset_size=60000, batch_size=256).max_batch_size == 390
    assert len(calls) <= 20
    # nothing smaller: no cap at all
    assert smallest_free_cap(dataset_size=300, batch_size=256).max_batch_size == 300


def test_the_search_never_offers_a_cap_below_the_expected_batch(monkeypatch):
    """Caps below B cut most batches and can have a lower epsilon than Poisson (B = N, cap 1 came out
    'free'): with every cap free the answer is ceil(B), and no cap below it is tried."""
    tried = []

    def every_cap_free(*, max_batch_size, **plan):
        tried.append(max_batch_size)
        return TruncatedPoissonResult(max_batch_size, 1.0, 1.0, None)

    monkeypatch.setattr(accounting, "truncated_poisson_epsilon", every_cap_free)
    assert smallest_free_cap(dataset_size=1000, batch_size=1000).max_batch_size == 1000
    assert smallest_free_cap(dataset_size=60000, batch_size=255.5).max_batch_size == 256
    assert min(tried) == 256


def test_dpscale_account_prices_a_cap_and_refuses_what_it_cannot_account(capsys):
    # the hand-built test's run (its PLD is cached)
    args = "account --dataset-size 1000 --batch-size 50 --noise 1.0 --steps 20 --data-norm-noise 6".split()
    assert main(args + ["--max-batch-size", "55", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    want = truncated_poisson_epsilon(**SMALL, max_batch_size=55, releases=(data_norm_release(6.0),))
    assert (
        result["epsilon"] == pytest.approx(want.epsilon, rel=1e-12)
        and result["poisson_epsilon"] == want.poisson_epsilon
    )
    assert result["max_batch_size"] == 55 and result["sampling"] == "poisson, truncated at 55"
    assert set(result["tpr_at_fpr"]) == {"0.001", "0.01", "0.1"}
    # the text form (it raised a KeyError on the sampling's name)
    assert main(args + ["--max-batch-size", "55"]) == 0
    text = capsys.readouterr().out
    assert (
        text.startswith("DP-SGD with capped Poisson sampling q = 50/1000")
        and "batches capped at 55 (the cap given;" in text
    )
    assert (
        f"epsilon = {want.epsilon:.4f}" in text
        and f"uncapped Poisson {want.poisson_epsilon:.4f}" in text
    )
    # the wall warning says whose epsilon it reads: the uncapped Poisson steps' (releases apart), as eps_TAN's
    steps_alone = accounting.compute_epsilon(
        sample_rate=0.05, noise_multiplier=1.0, steps=20, delta=1e-5, kind="pld"
    )
    assert (
        f"WARNING: of the uncapped Poisson steps: privacy wall: sigma=1 < 2 makes epsilon={steps_alone:.4g} "
        in text
    )
    # one example a step is cheaper, and says so with its sign
    assert main(args + ["--max-batch-size", "1"]) == 0
    assert "the cap saves " in capsys.readouterr().out
    for extra, message in (
        (["--max-batch-size", "0"], "positive integer"),
        (
            ["--max-batch-size", "55", "--target-epsilon", "3", "--steps", "20"],
            "solving the length",
        ),
    ):
        flags = (
            [a for a in args if a not in ("--steps", "20")] if "--target-epsilon" in extra else args
        )
        assert main(flags + extra) == 2
        assert message in capsys.readouterr().err
    # --accountant rdp under a cap: PLD, as a run's plan does (issue 62's review: account refused what train switched)
    assert main(args + ["--max-batch-size", "55", "--accountant", "rdp", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["epsilon"] == result["epsilon"]


def test_a_cap_below_n_at_q_one_is_accounted_as_the_truncated_event():
    """B = N with a cap M < N: every batch is a random M-subset. It was accounted as the uncapped
    full-batch Gaussian (7.51 where dp_accounting's truncated event gives 16.0: a review found it)."""
    from dpscale.privacy.accounting.batch_sampling import BatchSampling

    mechanism = {
        "sample_rate": 1.0,
        "noise_multiplier": 2.0,
        "steps": 10,
        "delta": 1e-5,
        "kind": "pld",
    }
    ours = accounting.compute_epsilon(**mechanism, batches=BatchSampling("truncated", 1000, 500))
    by_hand = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    by_hand.compose(dp_accounting.TruncatedSubsampledGaussianDpEvent(1000, 1.0, 500, 2.0), 10)
    assert ours == pytest.approx(by_hand.get_epsilon(1e-5), rel=1e-9)  # composed in another order
    full_batch = accounting.compute_epsilon(**mechanism)
    assert ours > 2 * full_batch
    # never cut
    assert (
        accounting.compute_epsilon(**mechanism, batches=BatchSampling("truncated", 1000, 1000))
        == full_batch
    )


def test_a_run_with_the_whole_dataset_per_step_and_a_cap_plans_the_truncated_epsilon(tmp_path):
    """The same through a run's plan (dp.batch_size = N = 4000, dp.max_batch_size = 2000)."""
    from dpscale.config import load_config
    from dpscale.privacy.accounting.batch_sampling import BatchSampling
    from dpscale.train.loop import Trainer

    sets = [
        "dp.batch_size=4000",
        "dp.max_batch_size=2000",
        "dp.noise_multiplier=2",
        "dp.epsilon=null",
        "train.steps=10",
        "model.name=linear",
        f"run.out_dir={tmp_path / 'r'}",
    ]
    plan = Trainer.create(load_config(None, sets), progress=False).plan
    want = accounting.compute_epsilon(
        sample_rate=1.0,
        noise_multiplier=2.0,
        steps=10,
        delta=plan.delta,
        kind="pld",
        batches=BatchSampling("truncated", 4000, 2000),
    )
    assert plan.sample_rate == 1.0 and plan.epsilon == want
    assert plan.epsilon > 2 * accounting.compute_epsilon(
        sample_rate=1.0, noise_multiplier=2.0, steps=10, delta=plan.delta, kind="pld"
    )


def test_a_capped_runs_wall_warning_reads_the_uncapped_poisson_steps(tmp_path):
    """eps_TAN estimates Poisson steps: a cap's own cost must not be read as the privacy wall."""
    from dpscale.config import load_config
    from dpscale.train.loop import Trainer

    sets = [
        "dp.batch_size=200",
        "dp.max_batch_size=205",
        "dp.noise_multiplier=0.8",
        "dp.epsilon=null",
        "train.steps=20",
        "model.name=linear",
        f"run.out_dir={tmp_path / 'r'}",
    ]
    plan = Trainer.create(load_config(None, sets), progress=False).plan
    poisson = accounting.compute_epsilon(
        sample_rate=0.05, noise_multiplier=0.8, steps=20, delta=plan.delta, kind="pld"
    )
    assert plan.epsilon > poisson  # the cap costs something here
    assert plan.wall_warning().startswith(
        f"of the uncapped Poisson steps: privacy wall: sigma=0.8 < 2 makes epsilon={poisson:.4g} "
    )


@pytest.mark.parametrize("cap", ["55", "auto"])
def test_account_calibrates_under_a_cap_as_a_runs_plan_does(cap, capsys):
    """dpscale account refused --target-epsilon with --max-batch-size while make_private and dpscale
    train calibrated it (the doors disagreed): both now ask make_dp_plan, and the capped epsilon of the
    sigma found is at most the target."""
    from dpscale.privacy.plan.make_plan import make_dp_plan
    from dpscale.privacy.plan.numbers import PrivacyNumbers

    args = [
        "account",
        "--dataset-size",
        "1000",
        "--batch-size",
        "50",
        "--steps",
        "20",
        "--target-epsilon",
        "3",
        "--max-batch-size",
        cap,
        "--json",
    ]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    numbers = PrivacyNumbers(
        batch_size=50,
        max_grad_norm=1.0,
        delta=1e-5,
        target_epsilon=3.0,
        max_batch_size=cap if cap == "auto" else int(cap),
    )
    plan = make_dp_plan(numbers, dataset_size=1000, steps=20)
    assert (
        result["noise_multiplier"] == plan.noise_multiplier
        and result["max_batch_size"] == plan.max_batch_size
    )
    assert result["epsilon"] == pytest.approx(plan.epsilon, rel=1e-9) and result["epsilon"] <= 3.0
    want = truncated_poisson_epsilon(
        dataset_size=1000,
        batch_size=50,
        noise_multiplier=plan.noise_multiplier,
        steps=20,
        delta=1e-5,
        max_batch_size=plan.max_batch_size,
    )
    assert result["epsilon"] == pytest.approx(want.epsilon, rel=1e-12)


@pytest.mark.parametrize("cap", ["20", "14"])
def test_account_with_a_cap_of_n_or_more_says_uncapped_as_a_run_does(cap, capsys):
    """A cap of N or more cuts nothing: a run's plan drops it (max_batch_size null, poisson), and
    dpscale account said 'batches capped at 20' (review 2; the epsilons were already equal)."""
    base = [
        "account",
        "--dataset-size",
        "14",
        "--batch-size",
        "3",
        "--noise",
        "1",
        "--steps",
        "5",
        "--json",
    ]
    assert main(base) == 0
    uncapped = json.loads(capsys.readouterr().out)
    assert main([*base, "--max-batch-size", cap]) == 0
    capped = json.loads(capsys.readouterr().out)
    assert capped["max_batch_size"] is None and capped["epsilon"] == uncapped["epsilon"]
    assert main([*base[:-1], "--max-batch-size", cap]) == 0
    assert "batches capped" not in capsys.readouterr().out

"""A batch cap at the user unit (issue 62, point 1): ``dp.max_batch_size`` / ``make_private(max_batch_size=M)``
with user ids is accounted as dp_accounting's ``TruncatedSubsampledGaussianDpEvent(U, q, M, sigma)``,
so the user sampler must cut a draw of more than M users to a uniformly random M of them. Checked
through ``make_private`` and ``dpscale train``: no realised batch holds more than M users, the kept
users are uniform (chi-square), the epsilon is dp_accounting's event composed here by hand, ``dpscale
account --unit user`` gives the train path's epsilon, and a capped run resumes bit-identically."""

from __future__ import annotations

import itertools
import json

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import pld_privacy_accountant
from scipy import stats
from torch import nn

import dpscale
from dpscale._io import load_checkpoint
from dpscale.cli import main
from dpscale.config import load_config
from dpscale.data.user_ids import UserIndex
from dpscale.privacy.sampling.units import UserPoissonSampler
from dpscale.errors import ConfigError
from dpscale.rng import DPRandom
from dpscale.train.loop import Trainer

# the make_private case (q = 0.1, P(cut) ~ 1)
USERS, PER_STEP, CAP, SIGMA = (1000, 100, 5, 4.0)


def linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def capped_mechanism(steps: int = 300, **options):
    """make_private over USERS people (user u holds 1 + u % 3 examples), capped at CAP users a step."""
    ids = np.repeat(np.arange(USERS), 1 + np.arange(USERS) % 3)
    model = linear()
    recipe = dict(
        dataset_size=len(ids),
        batch_size=PER_STEP,
        max_grad_norm=1.0,
        noise_multiplier=SIGMA,
        delta=1e-5,
        steps=steps,
        seed=0,
        user_ids=ids,
        max_examples_per_user=2,
        max_batch_size=CAP,
    )
    mechanism = dpscale.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), **{**recipe, **options}
    )
    g = torch.Generator().manual_seed(0)
    return (
        mechanism,
        torch.randn(len(ids), 4, generator=g),
        torch.randint(0, 2, (len(ids),), generator=g),
        ids,
    )


def users_per_step(mechanism, x, y, ids, steps: int) -> list[int]:
    """The people each of ``steps`` private steps trained on, through batches() and step()."""
    counts = []
    # range first: no draw past the last step
    for _, indices in zip(range(steps), mechanism.batches()):
        counts.append(len(set(ids[indices.numpy()].tolist())))
        mechanism.step(x[indices], y[indices], indices=indices)
    return counts


def test_make_private_never_trains_on_more_users_than_the_cap():
    mechanism, x, y, ids = capped_mechanism()
    assert mechanism.plan.max_batch_size == CAP and mechanism.plan.user_level
    counts = users_per_step(mechanism, x, y, ids, 40)
    assert max(counts) <= CAP
    # P(Binomial(1000, 0.1) <= 5) ~ 1e-36: every step is cut to exactly M
    assert counts.count(CAP) == 40


def by_hand(units: int, q: float, cap: int, sigma: float, steps: int, delta: float) -> float:
    """The independent reference: dp_accounting's truncated event composed ``steps`` times (PLD)."""
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(
        dp_accounting.TruncatedSubsampledGaussianDpEvent(units, q, cap, sigma), steps
    )
    return accountant.get_epsilon(delta)


def test_make_privates_epsilon_is_dp_accountings_truncated_event_over_users():
    """The printed epsilon was 0.293 while the uncapped draw that ran spends 1.770: the event now describes what runs."""
    mechanism, x, y, ids = capped_mechanism()
    assert mechanism.plan.epsilon == pytest.approx(
        by_hand(USERS, 0.1, CAP, SIGMA, 300, 1e-5), rel=1e-9
    )
    users_per_step(mechanism, x, y, ids, 7)
    assert mechanism.epsilon() == pytest.approx(by_hand(USERS, 0.1, CAP, SIGMA, 7, 1e-5), rel=1e-9)
    assert "batches capped at 5 users (" in mechanism.plan.describe()


def uniform_sampler(users: int, cap: int, seed: int = 7) -> UserPoissonSampler:
    """Every user drawn at every step (q = 1), one example each: a step's users are exactly the kept subset."""
    return UserPoissonSampler(
        UserIndex.from_ids(np.arange(users)), 1.0, 1, DPRandom(seed), max_batch_size=cap
    )


def test_the_kept_users_are_a_uniformly_random_subset():
    """6 users all drawn, 2 kept: each of the 15 pairs about 1/15 of 15,000 steps (a fixed seed: the
    statistic is one number, far inside the bound; a 'first M drawn' or 'lowest ids' cut gives ~210,000)."""
    sampler = uniform_sampler(6, 2)
    pairs = [tuple(sampler.sample_units().indices.tolist()) for _ in range(15_000)]
    assert all(len(p) == 2 and p[0] < p[1] for p in pairs)  # ascending, as the uncut draw is
    counts = np.array([pairs.count(p) for p in itertools.combinations(range(6), 2)])
    assert counts.sum() == 15_000
    statistic, p_value = stats.chisquare(counts)
    assert p_value > 1e-4, (statistic, counts)


def test_a_sampler_refuses_a_bad_cap_and_a_state_of_another_cap():
    users = UserIndex.from_ids(np.arange(10))
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1"):
            UserPoissonSampler(users, 0.5, 1, DPRandom(0), max_batch_size=bad)
    with pytest.raises(ValueError, match="cyclic sampling \\(bands=2\\) takes none"):
        UserPoissonSampler(users, 0.5, 1, DPRandom(0), bands=2, partition_seed=1, max_batch_size=3)
    state = uniform_sampler(10, 3).state_dict()
    assert state["max_batch_size"] == 3
    for other, written in ((4, 3), (None, 3)):
        with pytest.raises(
            ValueError, match=f"written with a cap of {written} users a step, not {other}"
        ):
            UserPoissonSampler(users, 1.0, 1, DPRandom(0), max_batch_size=other).load_state_dict(
                state
            )
    # a state written before the cap ran
    uncapped = {k: v for k, v in state.items() if k != "max_batch_size"}
    with pytest.raises(
        ValueError,
        match="written with a cap of None users a step, not 3.*begun before dpscale applied",
    ):
        uniform_sampler(10, 3).load_state_dict(uncapped)


def test_a_capped_mechanism_resumes_bit_identically():
    def run(cut: int | None):
        mechanism, x, y, ids = capped_mechanism(steps=6)
        model = mechanism.model
        if cut is not None:
            users_per_step(mechanism, x, y, ids, cut)
            state, weights = (
                mechanism.state_dict(),
                {k: v.clone() for k, v in model.state_dict().items()},
            )
            mechanism, x, y, ids = capped_mechanism(steps=6)
            mechanism.model.load_state_dict(weights)
            mechanism.load_state_dict(state)
        drawn = []
        for indices in mechanism.batches():
            drawn.append(indices.tolist())
            mechanism.step(x[indices], y[indices], indices=indices)
        return drawn, mechanism.model.state_dict()

    straight, resumed = run(None), run(3)
    assert straight[0][3:] == resumed[0] and len(resumed[0]) == 3
    assert all(torch.equal(straight[1][k], resumed[1][k]) for k in straight[1])
    mechanism, *_ = capped_mechanism(steps=6, max_batch_size=6)
    # the plan holds the cap
    with pytest.raises(ValueError, match="written under a different DP plan"):
        mechanism.load_state_dict(capped_mechanism(steps=6)[0].state_dict())


CLI_USERS = 60  # user i holds 1 + i % 3 images; 20 of 60 people a step, capped at 3


def write_users_npz(path):
    g = np.random.default_rng(0)
    ids = np.repeat([f"u{i}" for i in range(CLI_USERS)], 1 + np.arange(CLI_USERS) % 3)
    x = g.integers(0, 256, (len(ids), 8, 8), dtype=np.uint8)
    np.savez(
        path,
        x_train=x,
        y_train=np.arange(len(ids)) % 3,
        x_test=x[:6],
        y_test=np.arange(6) % 3,
        user_ids=ids,
    )
    return path


def train_settings(tmp_path, cap: str, name: str = "run") -> list[str]:
    return [
        f"run.out_dir={tmp_path / name}",
        "run.seed=0",
        "model.name=linear",
        "data.name=npz",
        f"data.root={write_users_npz(tmp_path / 'd.npz')}",
        "data.privacy_unit=user",
        "dp.max_examples_per_user=2",
        "dp.batch_size=20",
        f"dp.max_batch_size={cap}",
        "dp.noise_multiplier=3",
        "dp.epsilon=null",
        "dp.delta=1e-3",
        "train.steps=10",
        "train.eval_every_epochs=100",
    ]


def account_json(capsys, cap: str) -> dict:
    args = [
        "account",
        "--unit",
        "user",
        "--dataset-size",
        str(CLI_USERS),
        "--batch-size",
        "20",
        "--noise",
        "3",
        "--steps",
        "10",
        "--delta",
        "1e-3",
        "--max-batch-size",
        cap,
        "--json",
    ]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_dpscale_train_at_the_user_unit_trains_on_at_most_the_cap_and_reports_what_ran(
    tmp_path, capsys, monkeypatch
):
    realised = []
    draw = UserPoissonSampler.sample_units

    def recorded(self):  # the real draw, its users counted on the way out
        batch = draw(self)
        realised.append(batch.num_units)
        return batch

    monkeypatch.setattr(UserPoissonSampler, "sample_units", recorded)
    assert (
        main(
            ["train", "--quiet", *(a for s in train_settings(tmp_path, "3") for a in ("--set", s))]
        )
        == 0
    )
    # P(Binomial(60, 1/3) <= 3) ~ 4e-7 a step: all cut
    assert len(realised) >= 10 and max(realised) == 3
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["max_batch_size"], summary["sampling"], summary["privacy_unit"]) == (
        3,
        "truncated poisson",
        "user",
    )
    assert summary["epsilon"] == pytest.approx(
        by_hand(CLI_USERS, 1 / 3, 3, 3.0, 10, 1e-3), rel=1e-9
    )
    capsys.readouterr()
    account = account_json(capsys, "3")  # the doors agree: one accountant, one event
    assert (
        account["epsilon"] == pytest.approx(summary["epsilon"], rel=1e-9)
        and account["max_batch_size"] == 3
    )
    assert account["unit"] == "user" and "one person" in account["odds"]


def test_an_auto_cap_at_the_user_unit_counts_users_and_dpscale_account_finds_the_same(
    tmp_path, capsys
):
    plan = Trainer.create(load_config(None, train_settings(tmp_path, "auto")), progress=False).plan
    account = account_json(capsys, "auto")
    assert (plan.max_batch_size, plan.epsilon) == (
        account["max_batch_size"],
        pytest.approx(account["epsilon"], rel=1e-9),
    )
    assert plan.epsilon == pytest.approx(
        by_hand(CLI_USERS, 1 / 3, plan.max_batch_size, 3.0, 10, 1e-3), rel=1e-9
    )
    assert f"batches capped at {plan.max_batch_size} users (" in plan.describe()
    assert (
        main(
            [
                "account",
                "--unit",
                "user",
                "--dataset-size",
                "60",
                "--batch-size",
                "20",
                "--noise",
                "3",
                "--steps",
                "10",
                "--delta",
                "1e-3",
                "--max-batch-size",
                "3",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "batches capped at 3 people (the cap given;" in text and "dp.max_batch_size=3" in text


def test_a_capped_user_level_run_resumes_bit_identically(tmp_path):
    Trainer.create(load_config(None, train_settings(tmp_path, "3", "full")), progress=False).run()
    Trainer.create(load_config(None, train_settings(tmp_path, "3", "cut")), progress=False).run(
        max_steps=4
    )
    Trainer.resume(tmp_path / "cut", progress=False).run()
    a, b = (
        load_checkpoint(tmp_path / "full" / "checkpoint.pt"),
        load_checkpoint(tmp_path / "cut" / "checkpoint.pt"),
    )
    assert all(torch.equal(tensor, b["model"][name]) for name, tensor in a["model"].items())
    with pytest.raises(ConfigError, match="max_batch_size: checkpoint 3 vs now 4"):
        Trainer.resume(
            tmp_path / "cut", progress=False, overrides=["dp.max_batch_size=4", "train.steps=12"]
        )


@pytest.mark.parametrize(
    ("k", "words"),
    [(1, "at most 1 example of a drawn user"), (2, "at most 2 examples of a drawn user")],
)
def test_the_header_counts_examples_per_user_in_english(k, words):
    """The header read "at most 1 examples" (issue 62's review)."""
    mechanism, *_ = capped_mechanism(steps=3, max_examples_per_user=k)
    assert words in mechanism.plan.describe()

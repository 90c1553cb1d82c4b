"""Group privacy and the privacy unit (issue 43, item 5): ``dpscale account --group-size K`` and
``--unit user --examples-per-user K``.

Golden values, computed independently of ``dpscale.privacy.accounting.group_privacy``:
  * the group bound of an (eps, delta)-DP run for k examples is (k eps, delta sum_{i<k} e^(i eps)),
    the chaining of (eps, delta)-DP over k neighbours (Dwork & Roth 2014 Thm 2.2; Vadhan 2017
    Lemma 2.2 states the looser k e^(k eps) delta). ``_chained_delta`` below sums it term by term.
  * the delta' search is checked against the exact epsilon(delta) curve of the Gaussian mechanism
    (Balle & Wang 2018, delta(eps) = Phi(-eps s + 1/(2s)) - e^eps Phi(-eps s - 1/(2s)), s = sigma),
    inverted with scipy's brentq, and a brute-force scan of delta' on a fine grid.
  * the Fashion-MNIST numbers in docs/privacy.md (q = 2048/50000, sigma = 1.9578, 977 steps,
    PLD, delta = 1e-5; epsilon 2.9979): printed by ``dpscale account ... --group-size 4`` and
    ``--group-size 16``, re-checked here with ``compute_epsilon`` at the delta' it reports.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from dpscale.cli import main
from dpscale.privacy import compute_epsilon
from dpscale.privacy.accounting.group_privacy import (
    best_group_bound,
    direct_group_bound,
    group_delta,
    group_epsilon,
    meaning,
    unit_text,
)
from dpscale.privacy.plan.numbers import PrivacyNumbers

FMNIST = [
    "account",
    "--dataset-size",
    "50000",
    "--batch-size",
    "2048",
    "--steps",
    "977",
    "--noise",
    "1.9578",
]
FMNIST_Q, FMNIST_SIGMA, FMNIST_STEPS = 2048 / 50000, 1.9578, 977
SMALL = [
    "account",
    "--dataset-size",
    "10000",
    "--batch-size",
    "100",
    "--steps",
    "500",
    "--noise",
    "2",
    "--accountant",
    "rdp",
]


def _chained_delta(eps: float, delta: float, k: int) -> float:
    """delta (1 + e^eps + ... + e^((k-1) eps)), term by term."""
    return delta * sum(math.exp(i * eps) for i in range(k))


def _meets(eps: float, delta: float, k: int, target: float) -> bool:
    """The chained delta meets the target, up to float rounding (1e-12 relative)."""
    return _chained_delta(eps, delta, k) <= target * (1 + 1e-12)


def _gaussian_delta(eps: float, sigma: float) -> float:
    """The exact delta(eps) of the Gaussian mechanism with sensitivity 1 and noise sigma (Balle & Wang 2018)."""
    return norm.cdf(-eps * sigma + 1 / (2 * sigma)) - math.exp(eps) * norm.cdf(
        -eps * sigma - 1 / (2 * sigma)
    )


def _gaussian_epsilons(sigma: float):
    """Its epsilon(delta), by root finding, for several deltas at once."""
    return lambda deltas: [
        brentq(lambda e, d=d: _gaussian_delta(e, sigma) - d, 0.0, 100.0, xtol=1e-13) for d in deltas
    ]


def _json(capsys, argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ------------------------------------------------------------------ the math (pure functions)


@pytest.mark.parametrize(
    "eps, delta, k", [(0.5, 1e-6, 2), (1.0, 1e-5, 4), (3.0, 1e-5, 4), (0.1, 1e-8, 16)]
)
def test_group_bound_is_k_eps_and_the_chained_delta(eps, delta, k):
    assert group_epsilon(epsilon=eps, group_size=k) == k * eps
    delta_k = group_delta(epsilon=eps, delta=delta, group_size=k)
    assert delta_k == pytest.approx(_chained_delta(eps, delta, k), rel=1e-12)
    assert delta_k <= k * math.exp((k - 1) * eps) * delta  # the textbook form
    bound = direct_group_bound(epsilon=eps, delta=delta, group_size=k)
    assert (bound.epsilon, bound.example_epsilon, bound.example_delta) == (k * eps, eps, delta)


def test_group_bound_edge_cases():
    # a person with one image: the run's own
    assert group_delta(epsilon=2.0, delta=1e-5, group_size=1) == 1e-5
    assert group_delta(epsilon=0.0, delta=1e-5, group_size=7) == pytest.approx(7e-5)
    # e^(99 * 50) overflows
    assert group_delta(epsilon=50.0, delta=1e-5, group_size=100) == math.inf
    assert group_delta(epsilon=math.inf, delta=1e-5, group_size=2) == math.inf


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"epsilon": 1.0, "delta": 1e-5, "group_size": 0}, "group_size must be an integer >= 1"),
        ({"epsilon": 1.0, "delta": 1e-5, "group_size": 2.5}, "group_size must be an integer >= 1"),
        ({"epsilon": -1.0, "delta": 1e-5, "group_size": 2}, "epsilon must be >= 0"),
        ({"epsilon": math.nan, "delta": 1e-5, "group_size": 2}, "epsilon must be >= 0"),
        ({"epsilon": 1.0, "delta": 1.5, "group_size": 2}, r"delta must be in \[0, 1\]"),
    ],
)
def test_bad_numbers_are_refused_in_one_line(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern) as caught:
        group_delta(**kwargs)
    assert "\n" not in str(caught.value)


def test_privacy_numbers_are_keyword_only():
    with pytest.raises(TypeError):
        group_delta(1.0, 1e-5, 2)  # type: ignore[misc]
    with pytest.raises(TypeError):
        best_group_bound(lambda d: d, 1e-5, 2, 1e-12)  # type: ignore[misc]


def test_delta_search_on_the_exact_gaussian_curve_meets_its_delta_and_is_optimal():
    sigma, k, target = 2.0, 3, 1e-5
    curve = _gaussian_epsilons(sigma)
    best = best_group_bound(epsilons_at=curve, target_delta=target, group_size=k, min_delta=1e-30)
    assert best is not None and best.delta == target
    assert best.epsilon == pytest.approx(k * curve([best.example_delta])[0], rel=1e-9)
    assert _meets(best.example_epsilon, best.example_delta, k, target)  # meets its delta
    # brute force over eps' (delta' = delta(eps') in closed form): the smallest k eps' whose chained delta meets it
    eps = np.arange(1, 100_000) * 1e-4
    deltas = norm.cdf(-eps * sigma + 1 / (2 * sigma)) - np.exp(eps) * norm.cdf(
        -eps * sigma - 1 / (2 * sigma)
    )
    chained = deltas * sum(np.exp(i * eps) for i in range(k))
    brute = k * eps[chained <= target].min()
    assert brute * (1 - 1e-3) <= best.epsilon <= brute * (1 + 1e-4)


def test_delta_search_at_the_direct_bounds_delta_is_no_worse_than_it():
    curve = _gaussian_epsilons(2.0)
    eps = curve([1e-5])[0]
    for k in (2, 3, 5):
        direct = direct_group_bound(epsilon=eps, delta=1e-5, group_size=k)
        search = {
            "epsilons_at": curve,
            "target_delta": direct.delta,
            "group_size": k,
            "min_delta": 1e-30,
        }
        grid_only = best_group_bound(**search)  # the grid comes within 1e-4 of the run's own delta
        assert grid_only.epsilon <= direct.epsilon * (1 + 1e-4)
        best = best_group_bound(**search, extra_deltas=[1e-5])
        assert best is not None and best.epsilon <= direct.epsilon
        assert _meets(best.example_epsilon, best.example_delta, k, direct.delta)


def test_delta_search_says_none_when_no_delta_prime_meets_it():
    curve = _gaussian_epsilons(0.5)  # eps(1e-5) ~ 13: a group of 8 is far out of reach
    assert (
        best_group_bound(epsilons_at=curve, target_delta=1e-5, group_size=8, min_delta=1e-12)
        is None
    )
    # 1e-5 / k = 1e-13 is below the floor: no delta' to try
    assert (
        best_group_bound(epsilons_at=curve, target_delta=1e-5, group_size=10**8, min_delta=1e-12)
        is None
    )


def test_a_group_of_one_is_the_run_itself():
    curve = _gaussian_epsilons(2.0)
    best = best_group_bound(epsilons_at=curve, target_delta=1e-5, group_size=1, min_delta=1e-12)
    assert best.example_delta == 1e-5 and best.epsilon == pytest.approx(curve([1e-5])[0], rel=1e-12)


def test_meaning_is_dpplans_sentence_word_for_word_for_one_image():
    from dpscale.privacy.plan.make_plan import make_dp_plan

    plan = make_dp_plan(
        PrivacyNumbers(
            batch_size=100, max_grad_norm=1.0, delta=1e-5, noise_multiplier=2.0, accountant="rdp"
        ),
        dataset_size=10000,
        steps=500,
    )
    assert plan.meaning() == meaning(
        epsilon=plan.epsilon, delta=plan.delta, unit_words=unit_text("example")
    )
    assert unit_text("example", group_size=4) == "any one person's 4 training images"
    assert "person" in unit_text("user") and "all of them" in unit_text("user")
    with pytest.raises(ValueError, match="unit must be one of"):
        unit_text("image")


# ------------------------------------------------------------------ dpscale account --group-size


def test_group_size_reports_k_eps_and_the_searched_bound(capsys):
    result = _json(capsys, [*SMALL, "--group-size", "3"])
    eps = compute_epsilon(sample_rate=0.01, noise_multiplier=2.0, steps=500, delta=1e-5, kind="rdp")
    group = result["group_privacy"]
    assert result["epsilon"] == eps and result["unit"] == "example"
    assert group["group_size"] == 3 and group["direct_epsilon"] == pytest.approx(3 * eps, rel=1e-12)
    assert group["direct_delta"] == pytest.approx(_chained_delta(eps, 1e-5, 3), rel=1e-12)
    # the searched bound: 3 x the accountant's epsilon at delta', whose chained delta meets 1e-5
    example = compute_epsilon(
        sample_rate=0.01, noise_multiplier=2.0, steps=500, delta=group["example_delta"], kind="rdp"
    )
    assert group["epsilon"] == pytest.approx(3 * example, rel=1e-12) and group["delta"] == 1e-5
    assert _meets(example, group["example_delta"], 3, 1e-5)
    assert group["epsilon"] > group["direct_epsilon"]  # a smaller delta costs epsilon
    assert (
        "upper bound" in group["bound"]
        and group["unit_text"] == "any one person's 3 training images"
    )


def test_group_size_search_is_no_worse_than_k_eps_at_its_own_delta():
    from dpscale.privacy import PrivacyAccountant

    accountant = PrivacyAccountant("rdp")
    accountant.step(sample_rate=0.01, noise_multiplier=2.0, num_steps=500)
    eps = accountant.epsilon(1e-5)
    for k in (2, 4):
        direct = direct_group_bound(epsilon=eps, delta=1e-5, group_size=k)
        best = best_group_bound(
            epsilons_at=accountant.epsilons,
            target_delta=direct.delta,
            group_size=k,
            min_delta=1e-100,
            extra_deltas=[1e-5],
        )
        assert best.epsilon <= direct.epsilon
        assert _meets(accountant.epsilon(best.example_delta), best.example_delta, k, direct.delta)


def test_fashion_mnist_numbers_in_the_docs(capsys):
    """docs/privacy.md: epsilon 3 (PLD) at N=50,000, B=2048, 977 steps, sigma 1.9578, for 4 and 16 images."""
    four = _json(capsys, [*FMNIST, "--group-size", "4"])
    assert four["epsilon"] == pytest.approx(2.9979, abs=5e-5)
    group = four["group_privacy"]
    assert group["direct_epsilon"] == pytest.approx(11.9914, abs=5e-4)
    assert group["direct_delta"] == pytest.approx(0.0847, abs=5e-5)
    assert group["epsilon"] == pytest.approx(20.54, abs=0.01)
    example = compute_epsilon(
        sample_rate=FMNIST_Q,
        noise_multiplier=FMNIST_SIGMA,
        steps=FMNIST_STEPS,
        delta=group["example_delta"],
    )
    assert group["epsilon"] == pytest.approx(4 * example, rel=1e-9) and _meets(
        example, group["example_delta"], 4, 1e-5
    )
    sixteen = _json(capsys, [*FMNIST, "--group-size", "16"])["group_privacy"]
    # group privacy promises nothing
    assert sixteen["epsilon"] is None and sixteen["direct_delta"] > 1


def test_group_size_text_says_upper_bound_and_names_the_person(capsys):
    assert main([*SMALL, "--group-size", "3"]) == 0
    out = capsys.readouterr().out
    assert "adding or removing any one training image" in out
    assert "For a person with 3 images (group privacy: an upper bound" in out
    assert (
        "the true guarantee may be better" in out
        and "adding or removing any one person's 3 training images" in out
    )
    assert main([*SMALL, "--group-size", "40"]) == 0  # eps ~ 1.4: nothing at 1e-5 for 40 images
    assert "no guarantee at delta = 1e-05" in capsys.readouterr().out


# ------------------------------------------------------------------ dpscale account --unit user


def test_unit_user_has_the_example_level_epsilon_and_names_the_person(capsys):
    example = _json(capsys, SMALL)
    user = _json(capsys, [*SMALL, "--unit", "user", "--examples-per-user", "10"])
    assert (
        user["epsilon"] == example["epsilon"]
        and user["sample_rate"] == example["sample_rate"] == 0.01
    )
    assert (example["unit"], example["examples_per_user"]) == ("example", None)
    assert example["unit_text"] == "any one training image"
    assert (user["unit"], user["examples_per_user"]) == ("user", 10)
    assert user["unit_text"] == "any one person's training images (all of them together)"
    assert "any one person's training images" in user["meaning"] and user["group_privacy"] is None


def test_unit_user_text_names_people_and_how_to_train_it(capsys):
    assert main([*SMALL, "--unit", "user", "--examples-per-user", "10"]) == 0
    out = capsys.readouterr().out
    assert "Poisson sampling of people q = 100/10000" in out and "passes over the people" in out
    assert "adding or removing any one person's training images (all of them together)" in out
    assert "10 images each" in out and "data.privacy_unit=user" in out


@pytest.mark.parametrize(
    "extra, pattern",
    [
        (["--examples-per-user", "10"], "--examples-per-user needs --unit user"),
        (["--unit", "user", "--group-size", "4"], "--group-size is for example-level runs"),
        (["--group-size", "0"], "--group-size must be >= 1"),
        (["--unit", "user", "--examples-per-user", "0"], "--examples-per-user must be >= 1"),
        (["--unit", "user", "--mechanism", "bandmf"], "dpsgd"),
        (["--group-size", "4", "--mechanism", "bandmf"], "dpsgd"),
    ],
)
def test_bad_combinations_are_refused_in_one_line(capsys, extra, pattern):
    assert main([*SMALL, *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("dpscale account: error: ")
    assert len(captured.err.strip().splitlines()) == 1 and pattern in captured.err


def test_unit_and_group_flags_do_not_import_torch():
    """``dpscale account`` stays torch-free (docs/benchmarks.md) with the new flags."""
    import subprocess
    import sys

    code = (
        "import sys; from dpscale.cli import main; "
        f"assert main({[*SMALL, '--group-size', '3', '--json']!r}) == 0; "
        f"assert main({[*SMALL, '--unit', 'user', '--examples-per-user', '5', '--json']!r}) == 0; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_the_docs_show_the_commands_and_numbers_pinned_above():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "privacy.md").read_text(encoding="utf-8")
    section = text.split("## What an example-level epsilon means for a person")[1].split("\n## ")[0]
    for k in (4, 16):
        assert "dpscale " + " ".join([*FMNIST, "--group-size", str(k)]) in section
    assert (
        "| 4 | (11.99, 0.0847) | 20.54 " in section
        and "| 16 | (47.97, 3.6e14): no guarantee |" in section
    )

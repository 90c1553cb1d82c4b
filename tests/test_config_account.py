"""The ``dpscale account`` command: epsilon, or sigma or the steps solved for, its one-line errors
and the releases it composes.

Golden value: Opacus 1.6.0 ``RDPAccountant`` (an independent RDP implementation) gives
epsilon = 2.596556 for q = 256/60000, sigma = 1.1, 14062 steps, delta = 1e-5
(see tests/test_accountant.py, case A).
"""

import json
import math
import re

import pytest

from dpscale.cli import main
from dpscale.privacy import compute_epsilon

MNIST = ["account", "--dataset-size", "60000", "--batch-size", "256"]
Q = 256 / 60000


def _account_json(capsys, *args):
    assert main([*MNIST, *args, "--json"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert len(lines) == 1, captured.out
    result = json.loads(lines[0])
    assert isinstance(result, dict)
    return result


def test_account_epsilon_matches_opacus(capsys):
    result = _account_json(
        capsys, "--noise", "1.1", "--epochs", "60", "--delta", "1e-5", "--accountant", "rdp"
    )
    assert {"epsilon", "noise_multiplier", "steps", "sample_rate", "eps_tan"} <= set(result)
    assert result["epsilon"] == pytest.approx(2.596556, rel=1e-3)  # Opacus 1.6.0 RDPAccountant
    assert result["steps"] == 14062  # round(60 * 60000 / 256) = round(14062.5) (banker's) = 14062
    assert result["sample_rate"] == 256 / 60000
    assert result["noise_multiplier"] == 1.1
    assert result["delta"] == 1e-5 and result["accountant"] == "rdp"
    assert result["solved_for"] == "epsilon"
    # TAN eq. 4 by hand: eta = q sqrt(S) / (sqrt(2) sigma); eps_TAN = eta^2 + 2 eta sqrt(log(1/delta)).
    eta = Q * math.sqrt(14062) / (math.sqrt(2) * 1.1)
    assert result["eps_tan"] == pytest.approx(eta**2 + 2 * eta * math.sqrt(math.log(1e5)), rel=1e-9)
    assert result["eps_tan"] == pytest.approx(2.3129, abs=1e-4)


def test_account_steps_flag_equals_epochs(capsys):
    by_steps = _account_json(capsys, "--noise", "1.1", "--steps", "14062", "--accountant", "rdp")
    assert by_steps["epsilon"] == pytest.approx(2.596556, rel=1e-3)
    assert by_steps["epochs"] == pytest.approx(14062 * Q)


def test_account_calibrates_noise(capsys):
    result = _account_json(capsys, "--target-epsilon", "3", "--epochs", "60", "--accountant", "rdp")
    assert result["solved_for"] == "noise_multiplier" and result["steps"] == 14062
    sigma = result["noise_multiplier"]
    assert sigma < 1.1  # sigma = 1.1 spends only ~2.6 < 3
    eps = compute_epsilon(
        sample_rate=Q, noise_multiplier=sigma, steps=14062, delta=1e-5, kind="rdp"
    )
    assert 2.997 <= eps <= 3.0
    assert result["epsilon"] == pytest.approx(eps, rel=1e-12)


def test_account_solves_for_steps(capsys):
    result = _account_json(capsys, "--target-epsilon", "3", "--noise", "1.1", "--accountant", "rdp")
    assert result["solved_for"] == "steps" and result["noise_multiplier"] == 1.1
    steps = result["steps"]
    assert steps > 14062  # 14062 steps cost only ~2.6
    assert (
        compute_epsilon(sample_rate=Q, noise_multiplier=1.1, steps=steps, delta=1e-5, kind="rdp")
        <= 3.0
    )
    # the largest such step count
    assert (
        compute_epsilon(
            sample_rate=Q, noise_multiplier=1.1, steps=steps + 1, delta=1e-5, kind="rdp"
        )
        > 3.0
    )
    assert result["epsilon"] <= 3.0


@pytest.mark.parametrize(
    "argv, pattern",
    [
        (
            [
                "account",
                "--dataset-size",
                "100",
                "--batch-size",
                "256",
                "--noise",
                "1.1",
                "--epochs",
                "1",
            ],
            "batch-size",
        ),
        (
            [
                "account",
                "--dataset-size",
                "100",
                "--batch-size",
                "0",
                "--noise",
                "1.1",
                "--epochs",
                "1",
            ],
            "batch-size",
        ),
        ([*MNIST, "--epochs", "60"], "--noise .*--target-epsilon"),
        (
            [*MNIST, "--noise", "1.1", "--epochs", "60", "--delta", "1"],
            r"--delta must be in \(0, 1\)",
        ),
        (
            [*MNIST, "--noise", "1.1", "--epochs", "60", "--delta", "2.5"],
            r"--delta must be in \(0, 1\)",
        ),
        ([*MNIST, "--noise", "0", "--epochs", "60"], "--noise must be > 0"),
        ([*MNIST, "--noise", "1.1"], "--epochs or --steps"),
        ([*MNIST, "--target-epsilon", "-1", "--epochs", "60"], "target.epsilon must be"),
        ([*MNIST, "--target-epsilon", "0.0001", "--noise", "0.5"], "not even one step"),
    ],
)
def test_account_errors_exit_2_without_traceback(capsys, argv, pattern):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("dpscale account: error: ")
    assert "Traceback" not in captured.err
    assert len(captured.err.strip().splitlines()) == 1
    assert re.search(pattern, captured.err)


@pytest.mark.parametrize("epochs", ["-5", "0"])
def test_account_rejects_non_positive_epochs(capsys, epochs):
    assert (
        main([*MNIST, "--noise", "1.1", "--epochs", epochs, "--accountant", "rdp", "--json"]) == 2
    )
    assert "error:" in capsys.readouterr().err


def test_account_human_readable_rdp(capsys):
    assert main([*MNIST, "--noise", "1.1", "--epochs", "60", "--accountant", "rdp"]) == 0
    out = capsys.readouterr().out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)
    assert "eps_TAN = 2.3129" in out
    assert "epsilon = 2.5966 at delta = 1e-05" in out
    assert "[rdp accountant]" in out
    assert "14062 steps" in out
    assert "privacy wall" in out  # sigma = 1.1 < 2


def test_account_human_readable_default_pld(capsys):
    assert main([*MNIST, "--noise", "2.5", "--epochs", "15"]) == 0
    out = capsys.readouterr().out
    assert "[pld accountant]" in out
    assert "eps_TAN" in out
    assert "privacy wall" not in out  # sigma >= 2


def test_account_composes_private_data_normalization(capsys):
    from dpscale.privacy.accounting.segments import data_norm_release, feature_mean_release
    from dpscale.privacy import compute_epsilon

    alone = _account_json(capsys, "--noise", "1.1", "--epochs", "15", "--accountant", "rdp")
    both = _account_json(
        capsys, "--noise", "1.1", "--epochs", "15", "--accountant", "rdp", "--data-norm-noise", "8"
    )
    expected = compute_epsilon(
        sample_rate=Q,
        noise_multiplier=1.1,
        steps=both["steps"],
        delta=1e-5,
        kind="rdp",
        releases=(data_norm_release(8.0),),
    )
    assert both["epsilon"] == pytest.approx(expected) and both["epsilon"] > alone["epsilon"]
    centred = _account_json(
        capsys,
        "--noise",
        "1.1",
        "--epochs",
        "15",
        "--accountant",
        "rdp",
        "--data-norm-noise",
        "8",
        "--feature-mean-noise",
        "6",
    )
    releases = (data_norm_release(8.0), feature_mean_release(6.0))
    assert (
        centred["epsilon"]
        == pytest.approx(
            compute_epsilon(
                sample_rate=Q,
                noise_multiplier=1.1,
                steps=both["steps"],
                delta=1e-5,
                kind="rdp",
                releases=releases,
            )
        )
        and centred["epsilon"] > both["epsilon"]
    )
    assert main([*MNIST, "--noise", "1.1", "--epochs", "15", "--feature-mean-noise", "0"]) == 2
    assert "--feature-mean-noise must be > 0" in capsys.readouterr().err
    calibrated = _account_json(
        capsys,
        "--target-epsilon",
        "3",
        "--epochs",
        "15",
        "--data-norm-noise",
        "8",
        "--accountant",
        "rdp",
    )
    assert (
        calibrated["epsilon"] <= 3.0
        and calibrated["noise_multiplier"]
        > _account_json(capsys, "--target-epsilon", "3", "--epochs", "15", "--accountant", "rdp")[
            "noise_multiplier"
        ]
    )

"""Extreme privacy parameters (issue 25, "Faults and bad input").

Row: ``dp.epsilon=1e6`` ran ~5 minutes and died allocating 42.4 GiB: at a tiny noise multiplier
the PLD on its 1e-4 grid needs ~1e8 points. Now the grid is coarsened past a size cap (still an
upper bound), calibration takes seconds, and a budget beyond what a PLD can represent at all is
refused in one line.
Row: ``dp.epsilon=1e-4``, ``dp.delta=1e-300`` and ``dpscale account --target-epsilon 1e-4`` printed
``error:`` with nothing after it (an exception without a message). Each now says what is impossible
and what would work.

The sizes are small (q = 0.064 over 234 steps is the default run on the embedded MNIST sample) so
the file runs in seconds; ``_array_size_sentinel`` turns any PLD array above the caps into an
immediate failure, so a regression fails fast instead of allocating tens of GiB.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
from dp_accounting.pld import common as pld_common
from scipy import fft as scipy_fft
from dp_accounting.pld import privacy_loss_mechanism

from dpscale.cli import main
from dpscale.privacy.accounting import accountant as accountant_module
from dpscale.privacy.accounting import pld_history
from dpscale.privacy import calibrate_noise_multiplier, compute_epsilon
from dpscale.privacy.accounting.accountant import PrivacyAccountant
from dpscale.privacy.accounting.pld_history import (
    PLD_MAX_COMPOSED_POINTS,
    PLD_MAX_STEP_POINTS,
    PLD_VALUE_DISCRETIZATION,
    PLDRangeError,
    pld_grid,
)
from dpscale.privacy.accounting.segments import AccountingSegment

# the default run: B = 256 of the 4000 training images, 15 epochs
Q, STEPS, DELTA = (256 / 4000, 234, 1e-5)
ACCOUNT = ["account", "--dataset-size", "4000", "--batch-size", "256", "--steps", str(STEPS)]


@pytest.fixture(autouse=True)
def _no_debug_tracebacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """DPSCALE_DEBUG=1 would turn the one-line errors under test into tracebacks."""
    monkeypatch.delenv("DPSCALE_DEBUG", raising=False)


@pytest.fixture(autouse=True)
def _array_size_sentinel(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Fail at once, before allocating, on a step PLD or a composition larger than the caps (x2 slack).
    Returns the noise multipliers of the Gaussian PLDs it checked."""
    build = pld_history.gaussian_pld  # every Gaussian PLD the accountant builds
    checked: list[float] = []

    def checked_build(standard_deviation: float, *args: Any, **kwargs: Any) -> Any:
        checked.append(standard_deviation)
        grid, q = (
            kwargs.get("value_discretization_interval", 1e-4),
            kwargs.get("sampling_prob", 1.0),
        )
        bounds = privacy_loss_mechanism.GaussianPrivacyLoss(
            standard_deviation, sampling_prob=q
        ).connect_dots_bounds()
        points = (bounds.epsilon_upper - bounds.epsilon_lower) / grid
        assert points <= 2 * PLD_MAX_STEP_POINTS, (
            f"step PLD of {points:.3g} points (sigma={standard_deviation:.3g})"
        )
        return build(standard_deviation, *args, **kwargs)

    class CheckedFft:  # dp_accounting sizes each composition's FFT with fft.next_fast_len, before allocating
        def __getattr__(self, name: str) -> Any:
            return getattr(scipy_fft, name)

        @staticmethod
        def next_fast_len(target: int, *args: Any, **kwargs: Any) -> int:
            assert target <= 2 * PLD_MAX_COMPOSED_POINTS, f"composed PLD of {target:.3g} points"
            return scipy_fft.next_fast_len(target, *args, **kwargs)

    monkeypatch.setattr(pld_history, "gaussian_pld", checked_build)
    monkeypatch.setattr(pld_common, "fft", CheckedFft())
    return checked


def test_the_sentinel_sees_the_accountants_pld_builds(_array_size_sentinel: list[float]):
    """The sentinel is patched where the accountant builds its PLDs: a history not built before goes through it."""
    compute_epsilon(sample_rate=0.0123, noise_multiplier=1.234, steps=7, delta=DELTA, kind="pld")
    assert 1.234 in _array_size_sentinel


def _assert_one_line(message: str, *patterns: str) -> None:
    """A non-empty single line containing every regular expression in ``patterns``."""
    assert message.strip() and "\n" not in message, repr(message)
    for pattern in patterns:
        assert re.search(pattern, message), (pattern, message)


def _number_after(text: str, prefix: str) -> float:
    """The number following ``prefix`` in ``text``."""
    match = re.search(re.escape(prefix) + r"\s*([0-9.eE+-]+)", text)
    assert match, (prefix, text)
    return float(match.group(1))


# ------------------------------------------------------------------ budgets too small to reach
@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_an_unreachable_epsilon_names_the_least_reachable_one_and_that_one_calibrates(kind):
    with pytest.raises(ValueError) as err:
        calibrate_noise_multiplier(
            target_epsilon=1e-4, delta=DELTA, sample_rate=Q, steps=STEPS, kind=kind
        )
    message = str(err.value)
    _assert_one_line(
        message,
        r"cannot reach epsilon=0\.0001",
        "noise multiplier 10000",
        "at least",
        "fewer steps|at most",
    )
    suggested = _number_after(message, "raise the target epsilon to at least")
    sigma = calibrate_noise_multiplier(
        target_epsilon=suggested, delta=DELTA, sample_rate=Q, steps=STEPS, kind=kind
    )
    assert (
        compute_epsilon(sample_rate=Q, noise_multiplier=sigma, steps=STEPS, delta=DELTA, kind=kind)
        <= suggested
    )


def test_the_suggested_number_of_steps_fits_the_budget():
    with pytest.raises(ValueError) as err:
        calibrate_noise_multiplier(
            target_epsilon=1e-4, delta=DELTA, sample_rate=Q, steps=STEPS, kind="pld"
        )
    steps = int(_number_after(str(err.value), "train at most"))
    assert 1 <= steps < STEPS
    sigma = calibrate_noise_multiplier(
        target_epsilon=1e-4, delta=DELTA, sample_rate=Q, steps=steps, kind="pld"
    )
    assert (
        compute_epsilon(sample_rate=Q, noise_multiplier=sigma, steps=steps, delta=DELTA, kind="pld")
        <= 1e-4
    )


def test_an_epsilon_of_the_order_of_the_coarse_search_grid_still_calibrates():
    # 6e-4 is reachable (sigma = 1e4 spends 5.2e-4), but the coarse 1e-3 grid alone over-reports it.
    sigma = calibrate_noise_multiplier(
        target_epsilon=6e-4, delta=DELTA, sample_rate=Q, steps=STEPS, kind="pld"
    )
    assert (
        6e-4 * (1 - 1e-3)
        <= compute_epsilon(
            sample_rate=Q, noise_multiplier=sigma, steps=STEPS, delta=DELTA, kind="pld"
        )
        <= 6e-4
    )


# ------------------------------------------------------------------ deltas the PLD cannot resolve
def test_a_delta_below_what_the_pld_resolves_is_refused_in_one_line():
    for call in (
        lambda: calibrate_noise_multiplier(
            target_epsilon=3.0, delta=1e-300, sample_rate=Q, steps=STEPS, kind="pld"
        ),
        lambda: compute_epsilon(
            sample_rate=Q, noise_multiplier=1.0, steps=STEPS, delta=1e-300, kind="pld"
        ),  # used to return inf
    ):
        with pytest.raises(ValueError) as err:
            call()
        _assert_one_line(str(err.value), r"delta=1e-300", r"1e-12", r"1/N", r"1e-5 to 1e-10", "rdp")
    # the floor itself works
    assert math.isfinite(
        compute_epsilon(sample_rate=Q, noise_multiplier=2.0, steps=20, delta=1e-12, kind="pld")
    )


def test_the_rdp_accountant_calibrates_a_tiny_delta():
    sigma = calibrate_noise_multiplier(
        target_epsilon=3.0, delta=1e-300, sample_rate=Q, steps=STEPS, kind="rdp"
    )
    assert (
        3.0 * (1 - 1e-3)
        <= compute_epsilon(
            sample_rate=Q, noise_multiplier=sigma, steps=STEPS, delta=1e-300, kind="rdp"
        )
        <= 3.0
    )


# ------------------------------------------------------------------ budgets too large for a fine PLD
def test_a_budget_beyond_what_a_pld_represents_is_refused_in_one_line():
    with pytest.raises(ValueError) as err:
        calibrate_noise_multiplier(
            target_epsilon=1e9, delta=DELTA, sample_rate=0.1, steps=50, kind="pld"
        )
    patterns = (r"cannot calibrate epsilon=1e\+09", "cannot represent", "noise multiplier 0", "rdp")
    _assert_one_line(str(err.value), *patterns)
    # RDP has no grid: it calibrates
    sigma = calibrate_noise_multiplier(
        target_epsilon=1e9, delta=DELTA, sample_rate=0.1, steps=50, kind="rdp"
    )
    assert (
        compute_epsilon(sample_rate=0.1, noise_multiplier=sigma, steps=50, delta=DELTA, kind="rdp")
        <= 1e9
    )


def test_too_little_noise_for_the_pld_raises_one_line_instead_of_allocating():
    with pytest.raises(PLDRangeError) as err:
        compute_epsilon(
            sample_rate=256 / 60000, noise_multiplier=0.001, steps=14062, delta=DELTA, kind="pld"
        )
    _assert_one_line(str(err.value), "noise multiplier 0.001", "more noise", "rdp", "non-private")


def test_a_coarsened_grid_is_still_an_upper_bound(monkeypatch: pytest.MonkeyPatch):
    history = (AccountingSegment(0.01, 1.0, 100),)
    fine = compute_epsilon(
        sample_rate=0.01, noise_multiplier=1.0, steps=100, delta=DELTA, kind="pld"
    )
    monkeypatch.setattr(pld_history, "PLD_MAX_STEP_POINTS", 2**10)
    monkeypatch.setattr(pld_history, "PLD_MAX_COMPOSED_POINTS", 2**12)
    accountant_module._cached_epsilon.cache_clear()  # cached per requested grid, not per grid used
    try:
        assert pld_grid(history) >= 8 * PLD_VALUE_DISCRETIZATION
        coarse = compute_epsilon(
            sample_rate=0.01, noise_multiplier=1.0, steps=100, delta=DELTA, kind="pld"
        )
        accountant = PrivacyAccountant("pld")
        accountant.step(sample_rate=0.01, noise_multiplier=1.0, num_steps=100)
        assert accountant.delta(coarse) <= DELTA * (1 + 1e-9)  # delta() uses the same grid
    finally:
        accountant_module._cached_epsilon.cache_clear()
    assert fine <= coarse <= 1.05 * fine


# ------------------------------------------------------------------ through the CLI
def _one_line_error(capsys: pytest.CaptureFixture, argv: list[str], *patterns: str) -> str:
    """Run the CLI; assert exit code 2 and one stderr line, with a message, matching ``patterns``."""
    code = main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, lines)
    prefix = f"dpscale {argv[0]}: error: "
    # a message, not a bare type name
    assert lines[0].startswith(prefix) and len(lines[0]) > len(prefix) + 20
    _assert_one_line(lines[0], *patterns)
    return lines[0]


@pytest.mark.parametrize(
    "extra, patterns",
    [
        (["--target-epsilon", "1e-4"], [r"cannot reach epsilon=0\.0001", "at least"]),
        (
            ["--target-epsilon", "1e-4", "--accountant", "rdp"],
            [r"cannot reach epsilon=0\.0001", "at least"],
        ),
        (["--target-epsilon", "3", "--delta", "1e-300"], [r"delta=1e-300", "rdp"]),
        (["--noise", "1", "--delta", "1e-300"], [r"delta=1e-300", "rdp"]),
    ],
)
def test_dpscale_account_refuses_in_one_line(capsys, extra, patterns):
    _one_line_error(capsys, ACCOUNT + extra, *patterns)


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_dpscale_account_calibrates_a_huge_epsilon_within_budget(capsys, kind):
    argv = [
        "account",
        "--dataset-size",
        "1000",
        "--batch-size",
        "100",
        "--steps",
        "50",
        "--target-epsilon",
        "1e6",
    ]
    assert main(argv + ["--accountant", kind, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    sigma = result["noise_multiplier"]
    assert 1e6 * (1 - 1e-3) <= result["epsilon"] <= 1e6 and sigma > 0
    assert (
        compute_epsilon(sample_rate=0.1, noise_multiplier=sigma, steps=50, delta=DELTA, kind=kind)
        == result["epsilon"]
    )
    if kind == "pld":  # the 1e-4 grid would need ~2e10 points here (the sentinel allows 4e6)
        assert pld_grid((AccountingSegment(0.1, sigma, 50),)) > 1000 * PLD_VALUE_DISCRETIZATION


@pytest.mark.parametrize(
    "setting, patterns",
    [
        ("dp.epsilon=1e-4", [r"cannot reach epsilon=0\.0001", "at least"]),
        ("dp.delta=1e-300", [r"delta=1e-300", "rdp"]),
    ],
)
def test_dpscale_train_refuses_before_training(tmp_path, capsys, setting, patterns):
    out = tmp_path / "run"
    _one_line_error(
        capsys, ["train", "--quiet", "--set", setting, "--set", f"run.out_dir={out}"], *patterns
    )
    assert not (out / "checkpoint").exists() and not list(out.glob("**/*.pt"))

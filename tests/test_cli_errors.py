"""The command line catches user errors only (issue 26): a user error is one line and exit code 2,
a bug keeps its traceback, DPSCALE_DEBUG=1 shows a user error's traceback with its cause; and every
list of allowed values is one constant, shared by config validation and argparse."""

from __future__ import annotations

import argparse

import pytest

from dpscale import cli
from dpscale.choices import ACCOUNTANT_KINDS, ENGINE_NAMES, PRECISIONS
from dpscale.cli import account, build_parser, main
from dpscale.config import load_config
from dpscale.errors import ConfigError
from dpscale.errors import UserError

ACCOUNT = ["account", "--dataset-size", "60000", "--batch-size", "256", "--steps", "1000"]


@pytest.fixture(autouse=True)
def _no_debug_tracebacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DPSCALE_DEBUG", raising=False)


def _one_line(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """Run the CLI; assert exit code 2 and one stderr line; return it."""
    code = main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, lines)
    return lines[0]


def test_a_library_refusal_of_typed_numbers_is_one_line(capsys):
    line = _one_line(capsys, [*ACCOUNT, "--noise", "1", "--delta", "1e-300"])
    assert line.startswith("dpscale account: error: delta=1e-300")


def test_dpscale_debug_shows_the_user_error_with_its_cause(monkeypatch):
    monkeypatch.setenv("DPSCALE_DEBUG", "1")
    with pytest.raises(ConfigError, match="delta=1e-300") as caught:
        main([*ACCOUNT, "--noise", "1", "--delta", "1e-300"])
    # the accountant's refusal, kept as the cause
    assert isinstance(caught.value.__cause__, ValueError)


@pytest.mark.parametrize(
    "bug", [ValueError("a mistake in our code"), RuntimeError("another"), KeyError("x")]
)
def test_a_bug_keeps_its_traceback(monkeypatch, capsys, bug):
    def broken(*args, **kwargs):
        raise bug

    monkeypatch.setattr(account, "_account", broken)
    with pytest.raises(type(bug)):
        main([*ACCOUNT, "--noise", "1"])
    assert "error:" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "error", [OSError(28, "No space left on device"), PermissionError("denied"), MemoryError()]
)
def test_file_system_and_memory_errors_stay_one_line(monkeypatch, capsys, error):
    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(account, "_account", failing)
    line = _one_line(capsys, [*ACCOUNT, "--noise", "1"])
    assert line.startswith("dpscale account: error: ") and ("out of memory" in line) == isinstance(
        error, MemoryError
    )


def test_the_user_errors_are_user_errors_and_still_value_errors():
    from dpscale._io import DamagedFileError, ForeignFileError
    from dpscale.data import DatasetError
    from dpscale.train.rundir import RunDirBusy

    for error in (ConfigError, DamagedFileError, ForeignFileError, DatasetError, RunDirBusy):
        assert issubclass(error, UserError) and issubclass(error, ValueError), error
    assert cli.USER_ERRORS == (UserError, OSError, MemoryError)


def _choices(parser: argparse.ArgumentParser, *path: str, flag: str) -> tuple[str, ...]:
    """The ``choices`` of ``flag`` in the sub-command ``path`` (e.g. "tan", "wall")."""
    for name in path:
        parser = next(
            a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
        ).choices[name]
    return tuple(next(a for a in parser._actions if flag in a.option_strings).choices)


def test_every_accountant_and_precision_flag_offers_the_one_list():
    parser = build_parser()
    for path in (["account"], ["tan", "privacy-search"], ["tan", "wall"], ["tan", "data-size"]):
        assert _choices(parser, *path, flag="--accountant") == ACCOUNTANT_KINDS, path
    assert _choices(parser, "bench", "step-time", flag="--precision") == PRECISIONS


@pytest.mark.parametrize(
    "key, names",
    [
        ("dp.accountant", ACCOUNTANT_KINDS),
        ("train.engine", ENGINE_NAMES),
        ("train.precision", PRECISIONS),
    ],
)
def test_config_validation_refuses_with_the_same_list(key, names):
    with pytest.raises(ConfigError, match=key) as caught:
        load_config(None, [f"{key}=nope"])
    assert all(name in str(caught.value) for name in names)
    for name in names:  # and accepts every name on it
        load_config(None, [f"{key}={name}"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.name=nope", "unknown model 'nope'"),
        ("model.kwargs={bogus: 1}", "bad options for model"),
    ],
)
def test_a_bad_model_in_the_config_is_one_line(tmp_path, capsys, override, message):
    """The model registry's refusals are user errors: one line, exit 2 (they were bare ValueErrors,
    which the CLI now keeps as tracebacks)."""
    code = main(["train", "--set", f"run.out_dir={tmp_path / 'r'}", "--set", override, "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0]


SMALL_ACCOUNT = ["account", "--dataset-size", "1000", "--batch-size", "50", "--steps", "20"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            [*SMALL_ACCOUNT, "--noise", "1", "--mechanism", "bandmf", "--bands", "four"],
            "--bands: expected an integer >= 1",
        ),
        (
            [*SMALL_ACCOUNT, "--target-epsilon", "3", "--mechanism", "bandmf", "--max-bands", "0"],
            "--max-bands: expected an integer >= 1",
        ),
        (
            [
                *SMALL_ACCOUNT,
                "--noise",
                "1",
                "--mechanism",
                "bandmf",
                "--bands",
                "4",
                "--momentum",
                "1.5",
            ],
            "momentum must be in [0, 1)",
        ),
        (
            ["tan", "wall", "--no-plot", "--steps", "0", "--sigmas", "1"],
            "--steps: expected integers >= 1",
        ),
        (
            ["tan", "wall", "--no-plot", "--steps", "100", "--sigmas", "0"],
            "--sigmas: expected numbers > 0",
        ),
        (
            ["data", "prepare", "src", "dest", "--size", "28", "--workers", "-3"],
            "--workers: expected an integer >= 0",
        ),
        # solving for the steps: the release is what spends the budget (it said "not even one step fits")
        (
            [
                *SMALL_ACCOUNT[:5],
                "--target-epsilon",
                "1",
                "--noise",
                "2",
                "--data-norm-noise",
                "0.5",
            ],
            "data-norm alone spends epsilon=15.46",
        ),
    ],
)
def test_typed_numbers_out_of_range_are_refused_clearly(capsys, argv, message):
    """Each of these raised a traceback (ValueError, ZeroDivisionError) or a message naming nothing the user typed."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own refusal of a flag's value
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err

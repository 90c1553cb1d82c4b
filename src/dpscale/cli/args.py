"""Argument types and small helpers that several command families share."""

from __future__ import annotations

import argparse
import contextlib
from datetime import datetime
from typing import Iterator

from dpscale.errors import ConfigError, UserError


def float_list(text: str) -> tuple[float, ...]:
    """argparse type: comma-separated numbers, at least one (``0.5,1,2`` -> (0.5, 1.0, 2.0))."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from err
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def int_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated integers, at least one."""
    values = float_list(text)
    if any(v != int(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return tuple(int(v) for v in values)


def positive_int_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated integers >= 1 (numbers of steps, say)."""
    values = int_list(text)
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def positive_float_list(text: str) -> tuple[float, ...]:
    """argparse type: comma-separated numbers > 0 (noise multipliers, factors)."""
    values = float_list(text)
    if not all(v > 0 for v in values):  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected numbers > 0, got {text!r}")
    return values


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def bands_arg(text: str) -> int | str:
    """argparse type of BandMF's b: ``auto`` or an integer >= 1."""
    return "auto" if text == "auto" else positive_int(text)


def number_arg(text: str) -> int | float:
    """argparse type: an int when the text is one (batch sizes print as 256, not 256.0), else a float."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from err


def time_stamp() -> str:
    """Local time as YYYYmmdd-HHMMSS, for default output directory names."""
    return f"{datetime.now():%Y%m%d-%H%M%S}"


@contextlib.contextmanager
def refusals_as_config_errors() -> Iterator[None]:
    """Turn the library's refusals of the numbers a user typed (the accountant's and calibration's
    ValueErrors: a delta it cannot resolve, a budget no noise reaches) into one-line ConfigErrors,
    keeping the refusal as the cause. Wrap only calls whose ValueErrors are such refusals."""
    try:
        yield
    except UserError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from err

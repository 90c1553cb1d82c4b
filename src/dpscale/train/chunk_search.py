"""The search behind ``train.max_physical_batch_size: auto`` (``dpscale.train.chunk_size``): from
peaks measured at two small probe sizes and at the sizes it checks, the largest chunk that fits a
memory budget. Pure arithmetic over the measurer's answers; nothing here runs a model."""

from __future__ import annotations

from typing import Callable

from dpscale.errors import ConfigError

PROBE_UNITS = (2, 16)  # examples (users) per probe chunk: small, so a probe itself fits any device
ROUND_TO = 8  # a chunk below the largest batch is a multiple of 8 examples (users), from 8 up
CHECK_TRIES = 5  # checking runs at most (one where the fitted line holds)

Measure = Callable[[int], "float | None"]  # units -> peak bytes, or None for out of memory


def gigabytes(size: float) -> str:
    """``size`` bytes for a message: "1.23 GB", "45.6 MB" or "7.8 kB"."""
    if size >= 1e9:
        return f"{size / 1e9:.2f} GB"
    return f"{size / 1e6:.1f} MB" if size >= 1e5 else f"{size / 1e3:.1f} kB"


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(fixed bytes, bytes per unit) of the line through the first and last measured points
    (one point: all of it per unit, the conservative reading)."""
    (n1, p1), (n2, p2) = points[0], points[-1]
    if n2 == n1:
        return 0.0, p1 / n1
    # a flat or falling pair (methods that change with the size): barely rising
    per_unit = max((p2 - p1) / (n2 - n1), 1.0)
    return max(p1 - per_unit * n1, 0.0), per_unit


def _too_small(fixed: float, per_unit: float, budget: float) -> ConfigError:
    return ConfigError(
        f"max_physical_batch_size=auto: one example needs about {gigabytes(fixed + per_unit)} ({gigabytes(fixed)} fixed + "
        f"{gigabytes(per_unit)} per example) but the memory budget is {gigabytes(budget)}"
    )


def choose_units(
    probe: Measure, check: Measure, budget: float, max_units: int, extra: float = 0.0
) -> tuple[int, float]:
    """The largest chunk (examples, or users) whose step fits ``budget``.

    Args:
        probe: measures the peak bytes of a chunk of n units (None: out of memory), at the probe sizes.
        check: the same, for the checking runs at the chosen size.
        budget: bytes; max_units: the largest logical batch (no chunk is larger).
        extra: bytes the step holds beside the chunk's peak (``STEP_PARAMETER_COPIES``).

    Returns:
        (units, peak bytes measured at that size, ``extra`` included).

    Raises:
        ConfigError: one example does not fit the budget (saying how much it needs), or no checked size fits.
    """
    points: list[tuple[int, float]] = []
    for n in sorted({min(size, max_units) for size in PROBE_UNITS}):
        peak = probe(n)
        if peak is None:  # out of memory (CUDA): fit on what was measured
            break
        points.append((n, peak + extra))
    if not points:
        raise ConfigError(
            f"max_physical_batch_size=auto: a chunk of {min(PROBE_UNITS[0], max_units)} examples ran out of memory"
        )
    fixed, per_unit = _fit(points)
    if fixed + per_unit > budget:
        raise _too_small(fixed, per_unit, budget)
    fits = [p for p in points if p[1] <= budget]
    # the line allows one example, the smallest probe did not fit: one example, measured
    if not fits:
        one = check(1)
        if one is None or one + extra > budget:
            needs = (
                f"peaked at {gigabytes(one + extra)}" if one is not None else "ran out of memory"
            )
            raise ConfigError(
                f"max_physical_batch_size=auto: one example {needs}, above the memory budget of {gigabytes(budget)}"
            )
        fits = [(1, one + extra)]
    low, high, checked = fits[-1], None, False
    units: int | None = _within(int((budget - fixed) // per_unit), max_units)
    for _ in range(CHECK_TRIES):
        assert units is not None
        peak = check(units)
        if peak is not None and peak + extra <= budget:
            low, checked = (units, peak + extra), True
        else:
            high = (units, None if peak is None else peak + extra)
        units = _next_size(points[0], low, high, budget, max_units)
        if units is None:
            break
    return low if checked else _checked_below(check, low[0], budget, extra)


def _checked_below(check: Measure, units: int, budget: float, extra: float) -> tuple[int, float]:
    """No checked size fit: ``units`` (a probe's size) checked, halved until a check fits. The probes
    may measure another engine than the checks (a compiled engine's eager twin), so a probe's peak
    is never the answer on its own."""
    while units >= 1:
        peak = check(units)
        if peak is not None and peak + extra <= budget:
            return units, peak + extra
        units //= 2
    raise ConfigError(
        f"max_physical_batch_size=auto: no checked chunk fit the memory budget of {gigabytes(budget)}"
    )


def _within(units: int, max_units: int) -> int:
    """``units`` as a chunk size: the largest logical batch, or below it a multiple of 8 from 8 up."""
    if units >= max_units:
        return max_units
    return units if units < ROUND_TO else units - units % ROUND_TO


def _next_size(
    first: tuple[int, float],
    low: tuple[int, float],
    high: tuple[int, float | None] | None,
    budget: float,
    max_units: int,
) -> int | None:
    """The next size to check, or None when done. Nothing known too large yet: where the line through
    the first probe and ``low`` (the largest size seen to fit, and its peak) meets the budget, if that
    is over a tenth larger (memory that grows slower than the probes' line). Else between ``low`` and
    ``high`` (the smallest size that did not fit; its peak, None for out of memory): the larger of
    the midpoint and where the line through both meets the budget (near ``high`` when it missed by
    little). Sizes in multiples of 8, or the largest logical batch."""
    (n_low, p_low) = low
    if high is None:
        if n_low >= max_units or n_low == first[0]:
            return None
        fixed, per_unit = _fit([first, low])
        units = _within(int((budget - fixed) // per_unit), max_units)
        return units if units > 1.1 * n_low else None
    n_high, p_high = high
    guess = (
        n_low + (budget - p_low) * (n_high - n_low) / (p_high - p_low) if p_high is not None else 0
    )
    units = _within(max(int(guess), (n_low + n_high) // 2), max_units)
    return units if n_low < units < n_high else None

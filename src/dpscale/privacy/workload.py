"""BandMF's workload (torch-free): the linear map the optimizer applies to the noisy gradients, the one
typed option BandMF's strategy is optimised for (``BandMF(workload=Workload(...))``)."""

from __future__ import annotations

import hashlib
import json
import math
import operator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Workload:
    """The linear map the optimizer applies to the noisy gradients.

    Attributes:
        steps: S, the number of noisy steps (>= 1).
        momentum: beta in [0, 1) (heavy-ball momentum as in torch.optim.SGD, dampening 0).
        lr_multipliers: eta_0..eta_{S-1}, the learning rate of each step relative to a base
            rate (unitless, finite, >= 0, not all 0); None means all 1.
    """

    steps: int
    momentum: float = 0.0
    lr_multipliers: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        steps = check_count(self.steps, "steps")
        momentum = float(self.momentum)
        if not 0.0 <= momentum < 1.0:  # also refuses NaN
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")
        lr = self.lr_multipliers
        if lr is not None:
            lr = tuple(float(x) for x in lr)
            if len(lr) != steps:
                raise ValueError(
                    f"lr_multipliers has {len(lr)} entries, expected one per step ({steps})"
                )
            bad = [x for x in lr if not (math.isfinite(x) and x >= 0.0)]
            if bad:
                raise ValueError(f"lr_multipliers must be finite and >= 0, got {bad[0]!r}")
            if not any(lr):
                raise ValueError("lr_multipliers are all 0: the workload releases nothing")
        object.__setattr__(self, "steps", steps)
        object.__setattr__(self, "momentum", momentum)
        object.__setattr__(self, "lr_multipliers", lr)

    def key(self) -> str:
        """A stable 16-hex-digit hash of (steps, momentum, lr multipliers), for caching.

        Returns:
            the same string for equal workloads in every process and version of Python
            (floats are hashed by their exact hex form; all-ones multipliers hash as None).
        """
        lr = self.lr_multipliers
        canonical_lr = None if lr is None or uniform_lr(self) == 1.0 else [x.hex() for x in lr]
        text = json.dumps(
            {"steps": self.steps, "momentum": self.momentum.hex(), "lr": canonical_lr}
        )
        return hashlib.sha256(text.encode("ascii")).hexdigest()[:16]

    def describe(self) -> str:
        """A short English description, e.g. "prefix sums with momentum 0.9, S=500"."""
        parts = []
        if self.momentum:
            parts.append(f"momentum {self.momentum:g}")
        uniform = uniform_lr(self)
        if uniform is None:
            parts.append("a learning-rate schedule")
        elif uniform != 1.0:
            parts.append(f"a constant learning-rate multiplier {uniform:g}")
        with_ = f" with {' and '.join(parts)}" if parts else ""
        return f"prefix sums{with_}, S={self.steps}"


def uniform_lr(workload: Workload) -> float | None:
    """The common multiplier when all steps share one (1.0 for None), else None: then A is a
    scaled Toeplitz matrix and the error has an O(S b) form."""
    lr = workload.lr_multipliers
    if lr is None:
        return 1.0
    return lr[0] if all(x == lr[0] for x in lr) else None


def check_count(value: Any, what: str) -> int:
    """``value`` as an int >= 1 (bools and non-integers refused with a clear message).

    Args:
        value: a count (steps, bands).
        what: its name in the error message.

    Returns:
        the count as an int.

    Raises:
        ValueError: a bool, a non-integer or a count below 1.
    """
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    try:
        count = operator.index(value)
    except TypeError as err:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}") from err
    if count < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {count}")
    return count

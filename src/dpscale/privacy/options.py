"""The privacy settings of ``dpscale.make_private`` as typed options: one frozen, keyword-only class
per choice of each concern (jax_privacy's split of what decides the guarantee from the performance
flags that never change it).

* sampling: ``Poisson`` (optionally capped), ``FixedSize``, ``Shuffle``;
* clipping: ``Flat`` (one C), ``PerLayer`` (a C per name pattern, or per tensor), ``Adaptive`` (C
  follows a quantile of the norms), ``Automatic`` (Bu et al.'s normalisation);
* noise: ``Independent`` (DP-SGD), ``BandMF`` (banded matrix factorization);
* budget: ``TargetEpsilon`` (sigma calibrated) or ``NoiseMultiplier`` (sigma given);
* unit: ``PerExample`` or ``PerUser`` (a person's examples protected together);
* ``PerformanceFlags``: engine, precision, chunk size, compile, fixed shapes.

Each class checks its own fields when made, in one line that names the class and the field
(``Adaptive.quantile must be in (0, 1), got 5.0``); the settings of a strategy belong to its class,
so an option of a strategy not chosen cannot be given at all. Torch-free: ``dpscale account`` and
the config's checks import it without torch.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Mapping, Union

from dpscale.choices import (
    ACCOUNTANT_KINDS,
    DEFAULT_MAX_BANDS,
    DEFAULT_MAX_NOISE_MEMORY_MB,
    ENGINE_NAMES,
    PRECISIONS,
)
from dpscale.privacy.workload import Workload


AccountantName = Literal["pld", "rdp"]
EngineName = Literal["auto", "bk", "ghost", "vmap"]
PrecisionName = Literal["fp32", "tf32", "bf16", "fp16"]
ClipPer = Literal["group", "tensor"]
AUTO: Literal["auto"] = "auto"

# the options users import from dpscale (its __all__ reads this tuple)
OPTION_CLASSES = (
    "Adaptive",
    "Automatic",
    "BandMF",
    "FixedSize",
    "Flat",
    "Independent",
    "NoiseMultiplier",
    "PerExample",
    "PerLayer",
    "PerUser",
    "PerformanceFlags",
    "Poisson",
    "Shuffle",
    "TargetEpsilon",
    "Workload",
)
__all__ = [*OPTION_CLASSES, "OptionError", "check_accountant"]


class OptionError(ValueError):
    """An option's field out of range: "Class.field must be <wanted>, got <value>". A door that
    spells its settings otherwise (the config's ``dp.key``) rewords it from ``owner`` and ``field``."""

    def __init__(self, owner: str, field: str, wanted: str, value: Any) -> None:
        super().__init__(f"{owner}.{field} must be {wanted}, got {value!r}")
        self.owner, self.field, self.wanted, self.value = owner, field, wanted, value


def _refused(owner: object, name: str, wanted: str, value: Any) -> OptionError:
    return OptionError(type(owner).__name__, name, wanted, value)


def _is_number(value: Any) -> bool:
    """A finite real number, numpy's scalars included (``numbers.Real``); never a bool."""
    is_bool = isinstance(value, bool) or type(value).__name__ == "bool_"
    return isinstance(value, numbers.Real) and not is_bool and math.isfinite(value)


def _plain(value: Any) -> Any:
    """A numpy (or other ``numbers``) scalar as Python's int or float; anything else as it is."""
    if isinstance(value, (bool, int, float)) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _keep(owner: object, name: str, value: Any) -> None:
    """Set a checked field to its plain Python value (the classes are frozen)."""
    object.__setattr__(owner, name, _plain(value))


def _check_positive(owner: object, name: str, value: Any) -> None:
    if not (_is_number(value) and value > 0):
        raise _refused(owner, name, "a finite number > 0", value)
    _keep(owner, name, value)


def _check_norm(owner: object, name: str, value: Any) -> None:
    """One clipping norm C > 0 (a list is Opacus' per-layer form, said so)."""
    # the hint before the value: "got [...]" closes every refusal
    if isinstance(value, (list, tuple)):
        wanted = "one positive number (a list is Opacus' clipping='per_layer' form: give a mapping pattern -> C, per tensor)"
        raise _refused(owner, name, wanted, value)
    if not (_is_number(value) and value > 0):
        raise _refused(owner, name, "one positive number", value)
    _keep(owner, name, value)


def _check_count(
    owner: object, name: str, value: Any, *, auto: bool = False, none: bool = False
) -> None:
    """``value`` a positive integer (or "auto", or None, where allowed)."""
    if (none and value is None) or (auto and value == AUTO):
        return
    # 64, np.int64(64) and 64.0: the count 64
    whole = _is_number(value) and float(value).is_integer()
    if not whole or value < 1:
        others = (['"auto"'] if auto else []) + (["None"] if none else [])
        wanted = (
            "a positive integer"
            + (", " if len(others) > 1 else " or " if others else "")
            + ", ".join(others[:-1])
        )
        wanted += (" or " if len(others) > 1 else "") + (others[-1] if others else "")
        raise _refused(owner, name, wanted, value)
    object.__setattr__(owner, name, int(value))


def _check_choice(owner: object, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise _refused(owner, name, "one of " + ", ".join(repr(c) for c in choices), value)


def check_accountant(accountant: Any) -> None:
    """Refuse an accountant name that is not ``ACCOUNTANT_KINDS``' (every door: make_private, the
    config, the saved plan), rather than plan silently with another.

    Raises:
        ValueError: e.g. "prv" or the typo "rpd".
    """
    if accountant not in ACCOUNTANT_KINDS:
        raise ValueError(
            f"accountant must be one of {', '.join(repr(k) for k in ACCOUNTANT_KINDS)}, got {accountant!r}"
        )


# ------------------------------------------------------------------------------- sampling


@dataclass(frozen=True, kw_only=True)
class Poisson:
    """Poisson sampling: each example (user) joins a step independently with probability q = B / N.

    Attributes:
        batch_size: the expected batch B (examples; users at the user unit).
        max_batch_size: cap each batch at this many (truncated Poisson: a larger draw keeps a
            uniformly random subset, accounted with PLD), "auto" (the smallest cap within 1% of the
            uncapped epsilon) or None (uncapped).
    """

    batch_size: float
    max_batch_size: int | Literal["auto"] | None = None
    mode: ClassVar[str] = "poisson"

    def __post_init__(self) -> None:
        _check_positive(self, "batch_size", self.batch_size)
        _check_count(self, "max_batch_size", self.max_batch_size, auto=True, none=True)


@dataclass(frozen=True, kw_only=True)
class FixedSize:
    """Exactly ``batch_size`` distinct examples each step, drawn uniformly (RDP, replace-one adjacency)."""

    batch_size: int
    mode: ClassVar[str] = "fixed"

    def __post_init__(self) -> None:
        _check_count(self, "batch_size", self.batch_size)


@dataclass(frozen=True, kw_only=True)
class Shuffle:
    """A fresh permutation each epoch cut into batches of ``batch_size`` (accounted without amplification)."""

    batch_size: int
    mode: ClassVar[str] = "shuffle"

    def __post_init__(self) -> None:
        _check_count(self, "batch_size", self.batch_size)


Sampling = Union[Poisson, FixedSize, Shuffle]

# ------------------------------------------------------------------------------- clipping

Bounds = Union[float, Mapping[str, float]]


def _check_bounds(owner: object, name: str, bounds: Any) -> None:
    """C > 0, or a non-empty mapping from name patterns to C_g > 0."""
    if isinstance(bounds, Mapping):
        if not bounds or not all(
            isinstance(k, str) and k and _is_number(v) and v > 0 for k, v in bounds.items()
        ):
            raise _refused(
                owner, name, "a non-empty mapping from name patterns to norms > 0", dict(bounds)
            )
        object.__setattr__(owner, name, {k: _plain(v) for k, v in bounds.items()})
        return
    _check_norm(owner, name, bounds)


@dataclass(frozen=True, kw_only=True)
class Flat:
    """One norm C clips each example's whole gradient.

    Attributes:
        max_grad_norm: C; None: no clipping (a non-private run only, ``NoiseMultiplier(sigma=0)``).
    """

    max_grad_norm: float | None
    mode: ClassVar[str] = "fixed"

    def __post_init__(self) -> None:
        if self.max_grad_norm is not None:
            _check_norm(self, "max_grad_norm", self.max_grad_norm)


@dataclass(frozen=True, kw_only=True)
class PerLayer:
    """A norm per group of tensors, or per tensor (the noise then scaled to sqrt(sum of C^2)).

    Attributes:
        bounds: name pattern -> C_g (fnmatch, first match wins, every trainable tensor matched);
            with ``per="tensor"`` also one C for every tensor.
        per: "group": each pattern's tensors clipped together to C_g; "tensor": each tensor on
            its own (Opacus' ``clipping="per_layer"``).
    """

    bounds: Bounds
    per: ClipPer = "group"
    mode: ClassVar[str] = "fixed"

    def __post_init__(self) -> None:
        _check_choice(self, "per", self.per, ("group", "tensor"))
        _check_bounds(self, "bounds", self.bounds)
        if self.per == "group" and not isinstance(self.bounds, Mapping):
            raise _refused(
                self,
                "bounds",
                'a mapping of name patterns with per="group" (one C: Flat)',
                self.bounds,
            )


@dataclass(frozen=True, kw_only=True)
class Adaptive:
    """C follows a quantile of the per-example norms (Andrew et al. 2021), through a count
    released with noise; the plan's sigma covers both.

    Attributes:
        max_grad_norm: C_0, the starting norm.
        quantile: the share of examples that should end up unclipped, in (0, 1).
        learning_rate: the geometric step of C per unit of quantile error (> 0).
        count_noise: sigma_b of the unclipped count (examples, > 0); None: batch_size / 20.
    """

    max_grad_norm: float
    quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise: float | None = None
    mode: ClassVar[str] = "adaptive"

    def __post_init__(self) -> None:
        _check_norm(self, "max_grad_norm", self.max_grad_norm)
        if not (_is_number(self.quantile) and 0 < self.quantile < 1):
            raise _refused(self, "quantile", "in (0, 1)", self.quantile)
        _keep(self, "quantile", self.quantile)
        _check_positive(self, "learning_rate", self.learning_rate)
        if self.count_noise is not None:
            _check_positive(self, "count_noise", self.count_noise)


@dataclass(frozen=True, kw_only=True)
class Automatic:
    """Every per-example gradient scaled by C / (||g|| + gamma) (Bu et al. 2023): its norm stays
    below C, the sensitivity, and the learning rate absorbs C.

    Attributes:
        max_grad_norm: C, or per-layer bounds as ``PerLayer.bounds``; per: as ``PerLayer.per``.
        gamma: the stabiliser (> 0).
    """

    max_grad_norm: Bounds = 1.0
    per: ClipPer = "group"
    gamma: float = 0.01
    mode: ClassVar[str] = "automatic"

    def __post_init__(self) -> None:
        _check_choice(self, "per", self.per, ("group", "tensor"))
        _check_bounds(self, "max_grad_norm", self.max_grad_norm)
        _check_positive(self, "gamma", self.gamma)


Clipping = Union[Flat, PerLayer, Adaptive, Automatic]

# ---------------------------------------------------------------------------------- noise


@dataclass(frozen=True, kw_only=True)
class Independent:
    """DP-SGD: fresh Gaussian noise (std sigma x C) on each step's clipped sum."""

    mechanism: ClassVar[str] = "dpsgd"


@dataclass(frozen=True, kw_only=True, eq=False)
class BandMF:
    """Banded matrix factorization (correlated noise over b steps; cyclic Poisson sampling,
    amplified BandMF accounting: docs/correlated_noise.md).

    Attributes:
        bands: b, or "auto" (the least expected error x sigma; needs ``TargetEpsilon``).
        max_bands: the largest b "auto" tries.
        max_noise_memory_mb: refuse a b whose noise history, (b - 1) x trainable parameters x 4
            bytes, is larger (MB).
        workload: what the strategy is optimised for (``dpscale.Workload``); None:
            prefix sums with the optimizer's SGD momentum.
    """

    bands: int | Literal["auto"] = "auto"
    max_bands: int = DEFAULT_MAX_BANDS
    max_noise_memory_mb: float = DEFAULT_MAX_NOISE_MEMORY_MB
    workload: Workload | None = None
    mechanism: ClassVar[str] = "bandmf"

    def __post_init__(self) -> None:
        _check_count(self, "bands", self.bands, auto=True)
        _check_count(self, "max_bands", self.max_bands)
        _check_positive(self, "max_noise_memory_mb", self.max_noise_memory_mb)


Noise = Union[Independent, BandMF]

# --------------------------------------------------------------------------------- budget


def _check_delta(owner: object, delta: Any) -> None:
    if not (_is_number(delta) and 0 < delta < 1):
        raise _refused(owner, "delta", "in (0, 1) (use < 1/N)", delta)
    _keep(owner, "delta", delta)


@dataclass(frozen=True, kw_only=True)
class TargetEpsilon:
    """Calibrate sigma so that the planned steps spend exactly ``epsilon`` at ``delta``."""

    epsilon: float
    delta: float

    def __post_init__(self) -> None:
        _check_positive(self, "epsilon", self.epsilon)
        _check_delta(self, self.delta)


@dataclass(frozen=True, kw_only=True)
class NoiseMultiplier:
    """sigma given: the noise std on the clipped sum is sigma x C (0: not private)."""

    sigma: float
    delta: float

    def __post_init__(self) -> None:
        if not (_is_number(self.sigma) and self.sigma >= 0):
            raise _refused(self, "sigma", "a finite number >= 0", self.sigma)
        _keep(self, "sigma", self.sigma)
        _check_delta(self, self.delta)


Budget = Union[TargetEpsilon, NoiseMultiplier]

# ----------------------------------------------------------------------------------- unit


@dataclass(frozen=True, kw_only=True)
class PerExample:
    """The guarantee protects each training example."""


@dataclass(frozen=True, kw_only=True, eq=False)
class PerUser:
    """The guarantee protects a person: all of their examples together (docs/privacy-units.md).

    Attributes:
        user_ids: one id per dataset index, all ints or all strings.
        max_examples_per_user: k, the examples a drawn person contributes per step (a fresh random
            k-subset when they have more), clipped together as one.
    """

    user_ids: Any
    max_examples_per_user: int

    def __repr__(self) -> str:  # the ids are a dataset's worth: their count, not their values
        count = len(self.user_ids) if hasattr(self.user_ids, "__len__") else "?"
        return (
            f"PerUser(user_ids=<{count} ids>, max_examples_per_user={self.max_examples_per_user!r})"
        )

    def __post_init__(self) -> None:
        if self.user_ids is None:
            raise _refused(self, "user_ids", "one id per dataset index", None)
        _check_count(self, "max_examples_per_user", self.max_examples_per_user)


Unit = Union[PerExample, PerUser]

# ---------------------------------------------------------------------------- performance


@dataclass(frozen=True, kw_only=True)
class PerformanceFlags:
    """How the steps run; none of it changes the guarantee.

    Attributes:
        engine: the per-example clipping engine (docs/engines.md).
        precision: docs/precision.md.
        max_physical_batch_size: rows per chunk; "auto": the largest that fits the memory
            (needs ``check_batch``); None: a logical batch in one chunk.
        compile: capture each chunk's clipped sum with ``torch.compile`` (engine auto or vmap, fp32).
        fixed_shapes: pad every chunk to one size (None: with ``compile`` where batches have a largest size).
    """

    engine: EngineName = "auto"
    precision: PrecisionName = "fp32"
    max_physical_batch_size: int | Literal["auto"] | None = None
    compile: bool = False
    fixed_shapes: bool | None = None

    def __post_init__(self) -> None:
        _check_choice(self, "engine", self.engine, ENGINE_NAMES)
        _check_choice(self, "precision", self.precision, PRECISIONS)
        _check_count(
            self, "max_physical_batch_size", self.max_physical_batch_size, auto=True, none=True
        )
        # 0 and 1 as False and True, as if-tests read them
        for name, none in (("compile", False), ("fixed_shapes", True)):
            value = getattr(self, name)
            if not (
                (none and value is None)
                or (value in (0, 1) and not isinstance(value, (str, float)))
            ):
                raise _refused(
                    self, name, "True, False or None" if none else "True or False", value
                )
            object.__setattr__(self, name, value if value is None else bool(value))

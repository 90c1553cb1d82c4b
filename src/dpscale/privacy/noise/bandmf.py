"""BandMF's strategy: the b-banded Toeplitz C that minimises a workload's error (L-BFGS), cached.

Choquette-Choo et al., "(Amplified) Banded Matrix Factorization", NeurIPS 2023; McKenna,
"Scaling up the banded matrix factorization mechanism", ICLR 2025. The workload, the strategy
matrices and the error are in ``dpscale.privacy.noise.bandmf_math``; the online noise C^{-1} Z that a
strategy defines is ``dpscale.privacy.noise.banded.BandedNoise``.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dpscale._io import atomic_write_text
from dpscale.privacy.noise.bandmf_math import (
    DTYPE,
    check_coefficients,
    error_graph,
    normalize,
    squared_error,
)
from dpscale.privacy.workload import Workload, check_count

# Workload is part of this module's API (make_private documents ``dpscale.privacy.noise.bandmf.Workload``).
__all__ = ["BandedStrategy", "Workload", "optimize_strategy"]

_MAX_ITER = 300  # L-BFGS iterations (the loss is smooth in b parameters; it stops earlier)
_CACHE_FORMAT = 2
# Returned to L-BFGS where the error overflows (a root of c(x) inside the unit circle makes
# C^{-1} grow exponentially): finite, so its strong-Wolfe line search simply backtracks.
_DIVERGED_LOSS = 1e30

_MEMORY_CACHE: dict[tuple[str, int], "BandedStrategy"] = {}


# ---------------------------------------------------------------------------- optimisation


@dataclass(frozen=True)
class BandedStrategy:
    """An optimised banded strategy for one workload.

    Attributes:
        coefficients: c_0..c_{b-1}, normalised (||c||_2 = 1), c_0 > 0.
        workload: the workload it was optimised for.
        squared_error: ||A C^{-1}||_F^2 in units of (sigma * C_clip)^2 = 1.
        relative_error: RMSE relative to DP-SGD on the same workload (square-root ratio).
    """

    coefficients: tuple[float, ...]
    workload: Workload
    squared_error: float
    relative_error: float

    @property
    def bands(self) -> int:
        """b: steps of one participation must be >= b apart (b-min-separation)."""
        return len(self.coefficients)

    @property
    def rmse(self) -> float:
        """sqrt(squared_error / S): the per-step RMS error in units of sigma * C_clip."""
        return math.sqrt(self.squared_error / self.workload.steps)


def _sqrt_prefix_coefficients(bands: int) -> tuple[float, ...]:
    """The first ``bands`` coefficients of (1 - x)^{-1/2}, c_k = binom(2k, k) / 4^k, the
    square root of the prefix-sum matrix (Fichtenberger et al. 2023), normalised."""
    values = [1.0]
    for k in range(1, bands):
        values.append(values[-1] * (2 * k - 1) / (2 * k))
    return normalize(values)


def _log_error_closure(params: torch.Tensor, workload: Workload) -> float:
    """log ||A C^{-1}||_F^2 at c = params / ||params||, its gradient left in params.grad.

    The log makes the loss scale-free (L-BFGS tolerances become relative). Where the error
    overflows, the gradient is zero and the value a huge constant, so the line search backs off.
    """
    params.grad = None
    error = error_graph(params / params.norm(), workload)
    value = error.item()
    if math.isfinite(value) and value > 0:
        error.log().backward()
    if (
        not (math.isfinite(value) and value > 0)
        or params.grad is None
        or not torch.isfinite(params.grad).all()
    ):
        params.grad = torch.zeros_like(params)
        return _DIVERGED_LOSS
    return math.log(value)


def _optimize(workload: Workload, init: tuple[float, ...]) -> tuple[float, ...]:
    """L-BFGS (float64, strong-Wolfe) on the unnormalised band, from ``init``.

    Returns:
        the final band (unnormalised, possibly non-finite or with c_0 <= 0: checked by the caller).
    """
    params = torch.tensor(init, dtype=DTYPE, requires_grad=True)
    optimizer = torch.optim.LBFGS(
        [params],
        lr=1.0,
        max_iter=_MAX_ITER,
        history_size=20,
        tolerance_grad=1e-10,
        tolerance_change=1e-13,
        line_search_fn="strong_wolfe",
    )
    optimizer.step(lambda: _log_error_closure(params, workload))
    return tuple(params.detach().tolist())


def _best_coefficients(workload: Workload, bands: int) -> tuple[tuple[float, ...], float, float]:
    """The best of {optimised, sqrt(prefix-sum) init, DP-SGD} by exact error: never worse than
    DP-SGD (or the init) whatever the optimiser did.

    Returns:
        (normalised coefficients, their squared error, DP-SGD's squared error).
    """
    init = _sqrt_prefix_coefficients(bands)
    candidates = [init, (1.0,) + (0.0,) * (bands - 1)]
    optimised = _optimize(workload, init)
    if all(math.isfinite(x) for x in optimised) and optimised[0] != 0.0:
        # C and -C give the same error; the convention is c_0 > 0.
        sign = 1.0 if optimised[0] > 0 else -1.0
        candidates.insert(0, normalize([sign * x for x in optimised]))
    errors = [squared_error(c, workload) for c in candidates]
    best = min(range(len(candidates)), key=errors.__getitem__)
    return candidates[best], errors[best], errors[-1]


def _check_bands(bands: Any, steps: int) -> int:
    """``bands`` as an int in [1, steps]."""
    count = check_count(bands, "bands")
    if count > steps:
        raise ValueError(f"bands must be between 1 and the number of steps ({steps}), got {count}")
    return count


def _make_strategy(
    coefficients: tuple[float, ...],
    workload: Workload,
    error: float | None = None,
    reference: float | None = None,
) -> BandedStrategy:
    """A BandedStrategy for (normalised) ``coefficients``; errors computed unless given."""
    error = squared_error(coefficients, workload) if error is None else error
    reference = squared_error((1.0,), workload) if reference is None else reference
    return BandedStrategy(coefficients, workload, error, math.sqrt(error / reference))


def _cache_path(cache_dir: str | Path, workload: Workload, bands: int) -> Path:
    return Path(cache_dir).expanduser() / f"bandmf-v{_CACHE_FORMAT}-{workload.key()}-b{bands}.json"


def _read_cache(path: Path, workload: Workload, bands: int) -> BandedStrategy | None:
    """The strategy stored at ``path``, or None when the file is missing, unreadable or not a
    valid band for this workload (then the caller recomputes it).

    A file this module wrote carries the exact bits that were computed (JSON floats round-trip),
    its coefficients and errors are used as stored: re-normalising an already normalised band
    changes its last bits on some inputs, so a run resumed from the cache would use another
    strategy than the one computed (seen on an AVX-512 machine, where L-BFGS landed elsewhere)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # missing, unreadable, not UTF-8, not JSON
        return None
    if (
        not isinstance(data, dict)
        or data.get("key") != workload.key()
        or data.get("bands") != bands
    ):
        return None
    values = data.get("coefficients")
    if not isinstance(values, list) or len(values) != bands:
        return None
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in values):
        return None
    try:
        stored = check_coefficients(values)
    except ValueError:  # non-finite or c_0 <= 0
        return None
    # Privacy rests on ||c|| = 1, not on the stored values being optimal: a band that is not
    # normalised to rounding (edited by hand) is re-normalised and its errors recomputed.
    if abs(math.fsum(x * x for x in stored) - 1.0) > len(stored) * 2.0**-52:
        return _make_strategy(normalize(stored), workload)
    stored_errors = [data.get(key) for key in ("squared_error", "relative_error")]
    errors = [e for e in stored_errors if isinstance(e, float) and math.isfinite(e) and e > 0]
    if len(errors) != len(stored_errors):
        return _make_strategy(stored, workload)
    return BandedStrategy(stored, workload, *errors)


def _write_cache(path: Path, strategy: BandedStrategy) -> None:
    """Store ``strategy`` atomically (temporary file in the same directory, os.replace), its
    floats with every bit; a cache that cannot be written only costs a recomputation next time,
    so it warns."""
    workload = strategy.workload
    record = {
        "format": _CACHE_FORMAT,
        "key": workload.key(),
        "workload": workload.describe(),
        "bands": strategy.bands,
        "coefficients": list(strategy.coefficients),
        "squared_error": strategy.squared_error,
        "relative_error": strategy.relative_error,
    }
    try:
        atomic_write_text(path, json.dumps(record, indent=1) + "\n")
    except OSError as error:
        warnings.warn(f"could not write the BandMF cache file {path}: {error}", stacklevel=3)


def optimize_strategy(
    workload: Workload, bands: int, *, cache_dir: str | Path | None = None
) -> BandedStrategy:
    """The b-banded Toeplitz strategy minimising ||A C^{-1}||_F^2 for ``workload``.

    L-BFGS in float64 (strong-Wolfe line search, at most 300 iterations, deterministic) on the
    log-error of the unnormalised band, started from the truncated square root of the
    prefix-sum matrix; the best of {optimised, that init, DP-SGD (1, 0, ..., 0)} is returned,
    so the result is never worse than DP-SGD. b = 1 returns (1.0,) without optimising.

    Measured on one CPU thread (x86, torch 2.13, b = 2..64, L-BFGS stops after 10-17
    evaluations): without a learning-rate schedule 0.02-0.15 s for S = 500..5000 and 0.2 s
    for S = 20000; with momentum 0.9 and a warmup-cosine schedule 0.1-0.25 s (S=500),
    0.2-0.35 s (S=2000), 0.8-1.2 s (S=5000) and 24 s (S=20000, b=64, ~20 MiB extra memory).
    The first L-BFGS step of a process adds about 1.5 s once (torch.optim imports torch._dynamo).

    Args:
        workload: the optimizer's workload (steps, momentum, lr multipliers).
        bands: b, 1 <= b <= S. Participations of one example must be >= b steps apart.
        cache_dir: a directory for one JSON file per (workload, b) (e.g.
            ~/.cache/dpscale/bandmf); None keeps results in this process only.

    Returns:
        the strategy, with its error in units of (sigma * C_clip)^2.

    Raises:
        ValueError: bands outside [1, S].
    """
    if not isinstance(workload, Workload):
        raise ValueError(f"workload must be a Workload, got {type(workload).__name__}")
    bands = _check_bands(bands, workload.steps)
    memory_key = (workload.key(), bands)
    path = None if cache_dir is None or bands == 1 else _cache_path(cache_dir, workload, bands)
    strategy = _MEMORY_CACHE.get(memory_key)
    if strategy is None:
        stored = None if path is None else _read_cache(path, workload, bands)
        if bands == 1:
            reference = squared_error((1.0,), workload)
            strategy = _make_strategy((1.0,), workload, reference, reference)
        elif stored is not None:
            strategy = stored
        else:
            coefficients, error, reference = _best_coefficients(workload, bands)
            strategy = _make_strategy(coefficients, workload, error, reference)
        _MEMORY_CACHE[memory_key] = strategy
        if path is not None and stored is None:
            _write_cache(path, strategy)
    elif path is not None and not path.exists():
        _write_cache(path, strategy)
    # Equal keys are equivalent workloads (e.g. lr None and all ones): report the caller's.
    return strategy if strategy.workload == workload else replace(strategy, workload=workload)

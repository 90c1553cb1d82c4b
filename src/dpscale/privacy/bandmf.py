"""Banded matrix factorization (BandMF): the strategy and its online correlated noise.

Choquette-Choo et al., "(Amplified) Banded Matrix Factorization", NeurIPS 2023; McKenna,
"Scaling up the banded matrix factorization mechanism", ICLR 2025.

DP-SGD adds independent noise z_t at each step t = 0..S-1. BandMF adds w = C^{-1} Z instead,
where C (S x S) is lower-triangular banded Toeplitz: C[i, j] = c_{i-j} for 0 <= i-j < b, else 0,
with c_0 > 0 and ||c||_2 = 1 (the maximum column norm of C when S >= b). A participation
pattern whose steps are pairwise >= b apart touches columns of C with disjoint supports, so
each participation adds at most C_clip in its own orthogonal direction: the sensitivity is
that of DP-SGD and the same accountant (with b-min-separated sampling) applies.

The optimizer applies a linear workload A to the noisy gradients. With momentum beta and
per-step learning-rate multipliers eta_s, the parameter change after step t is
A[t, r] = sum_{s=r}^{t} eta_s beta^(s-r) (r <= t), i.e. A = P D M with P the prefix-sum
matrix, D = diag(eta) and M[s, r] = beta^(s-r). The mechanism's error is
sigma^2 C_clip^2 ||A C^{-1}||_F^2; DP-SGD is C = I (b = 1).

Everything here is float64 except ``BandedNoise``, which runs in the gradients' dtype.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
import warnings
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from dpscale._io import atomic_write_text
from dpscale.privacy.noise import Params

__all__ = [
    "BandedNoise",
    "BandedStrategy",
    "Workload",
    "inverse_column",
    "normalize",
    "optimize_strategy",
    "relative_error",
    "squared_error",
    "strategy_matrix",
    "workload_matrix",
]

_DTYPE = torch.float64
# Block length of the inverse-column recursion: blocks of this many entries follow from the
# previous block by one small matrix-vector product (few Python-level steps, exact recursion).
_BLOCK = 256
# Elements of one column chunk of the lr-schedule error (S rows x chunk columns, float64):
# 2 MiB buffers stay in cache (measured 3x faster than 16 MiB) and bound memory whatever S is.
_CHUNK_ELEMENTS = 1 << 18
_MAX_ITER = 300  # L-BFGS iterations (the loss is smooth in b parameters; it stops earlier)
_CACHE_FORMAT = 2
# Returned to L-BFGS where the error overflows (a root of c(x) inside the unit circle makes
# C^{-1} grow exponentially): finite, so its strong-Wolfe line search simply backtracks.
_DIVERGED_LOSS = 1e30

_MEMORY_CACHE: dict[tuple[str, int], "BandedStrategy"] = {}


# --------------------------------------------------------------------------------- workload


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
        steps = _check_count(self.steps, "steps")
        momentum = float(self.momentum)
        if not 0.0 <= momentum < 1.0:  # also refuses NaN
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")
        lr = self.lr_multipliers
        if lr is not None:
            lr = tuple(float(x) for x in lr)
            if len(lr) != steps:
                raise ValueError(f"lr_multipliers has {len(lr)} entries, expected one per step ({steps})")
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
        canonical_lr = None if lr is None or _uniform_lr(self) == 1.0 else [x.hex() for x in lr]
        text = json.dumps({"steps": self.steps, "momentum": self.momentum.hex(), "lr": canonical_lr})
        return hashlib.sha256(text.encode("ascii")).hexdigest()[:16]

    def describe(self) -> str:
        """A short English description, e.g. "prefix sums with momentum 0.9, S=500"."""
        parts = []
        if self.momentum:
            parts.append(f"momentum {self.momentum:g}")
        uniform = _uniform_lr(self)
        if uniform is None:
            parts.append("a learning-rate schedule")
        elif uniform != 1.0:
            parts.append(f"a constant learning-rate multiplier {uniform:g}")
        with_ = f" with {' and '.join(parts)}" if parts else ""
        return f"prefix sums{with_}, S={self.steps}"


def _uniform_lr(workload: Workload) -> float | None:
    """The common multiplier when all steps share one (1.0 for None), else None: then A is a
    scaled Toeplitz matrix and the error has an O(S b) form."""
    lr = workload.lr_multipliers
    if lr is None:
        return 1.0
    return lr[0] if all(x == lr[0] for x in lr) else None


def _check_count(value: Any, what: str) -> int:
    """``value`` as an int >= 1 (bools and non-integers refused with a clear message)."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    try:
        count = operator.index(value)
    except TypeError as err:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}") from err
    if count < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {count}")
    return count


def _lr_tensor(workload: Workload) -> torch.Tensor:
    """eta_0..eta_{S-1} as float64."""
    lr = workload.lr_multipliers
    if lr is None:
        return torch.ones(workload.steps, dtype=_DTYPE)
    return torch.tensor(lr, dtype=_DTYPE)


def workload_matrix(workload: Workload) -> torch.Tensor:
    """The dense workload A[t, r] = sum_{s=r}^{t} eta_s beta^(s-r) (reference; O(S^2) memory).

    Args:
        workload: the optimizer's workload.

    Returns:
        float64 tensor (S, S), lower triangular; A[t, r] is the parameter change after step t
        per unit of noise at step r (in units of the base learning rate).
    """
    steps = workload.steps
    momentum = _powers_toeplitz(workload.momentum, steps, _DTYPE)  # 0.0^0 == 1: beta = 0 gives I
    prefix = torch.tril(torch.ones(steps, steps, dtype=_DTYPE))
    return prefix @ (_lr_tensor(workload)[:, None] * momentum)


# ------------------------------------------------------------------------------- strategy


def _check_coefficients(coefficients: Sequence[float], steps: int | None = None) -> tuple[float, ...]:
    """``coefficients`` as floats: non-empty, finite, c_0 > 0, and at most ``steps`` of them."""
    try:
        values = tuple(float(x) for x in coefficients)
    except (TypeError, ValueError) as err:
        raise ValueError(f"coefficients must be a sequence of numbers, got {coefficients!r}") from err
    if not values:
        raise ValueError("coefficients must not be empty (b >= 1 bands)")
    if not all(math.isfinite(x) for x in values):
        raise ValueError(f"coefficients must be finite, got {values}")
    if not values[0] > 0.0:
        raise ValueError(f"c_0 must be > 0 (C must be invertible), got {values[0]!r}")
    if steps is not None and len(values) > steps:
        raise ValueError(f"{len(values)} bands need at least as many steps, got steps={steps}")
    return values


def normalize(coefficients: Sequence[float]) -> tuple[float, ...]:
    """Scale the band so that ||c||_2 = 1, i.e. C's maximum column norm is 1 (for S >= b).

    Args:
        coefficients: c_0..c_{b-1}, finite, c_0 > 0 (any scale).

    Returns:
        c / ||c||_2 as a tuple of floats ((x,) gives exactly (1.0,)).
    """
    values = _check_coefficients(coefficients)
    # Scaling by the largest entry first keeps the sum of squares from overflowing.
    largest = max(abs(x) for x in values)
    scaled = [x / largest for x in values]
    norm = math.sqrt(math.fsum(x * x for x in scaled))
    return tuple(x / norm for x in scaled)


def strategy_matrix(coefficients: Sequence[float], steps: int) -> torch.Tensor:
    """The dense banded Toeplitz strategy C[i, j] = c_{i-j} for 0 <= i-j < b (reference).

    Args:
        coefficients: c_0..c_{b-1} as given (not normalised here), c_0 > 0, b <= steps.
        steps: S.

    Returns:
        float64 tensor (S, S), lower triangular.
    """
    steps = _check_count(steps, "steps")
    band = torch.tensor(_check_coefficients(coefficients, steps), dtype=_DTYPE)
    return _toeplitz(band, steps)


def _toeplitz(band: torch.Tensor, size: int) -> torch.Tensor:
    """Lower-triangular Toeplitz (size x size) with first column ``band`` (zero-padded);
    differentiable in ``band``."""
    index = torch.arange(size)
    return _gather_band(band, index[:, None] - index[None, :])


def _gather_band(band: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """band[offset] where 0 <= offset < len(band), else 0 (a gather, so autograd flows)."""
    width = band.numel()
    padded = torch.cat([band, band.new_zeros(1)])
    inside = (offset >= 0) & (offset < width)
    return padded[torch.where(inside, offset, torch.full_like(offset, width))]


def inverse_column(coefficients: Sequence[float], steps: int) -> torch.Tensor:
    """First column of C^{-1} (C^{-1} is lower-triangular Toeplitz, so this defines it).

    It solves g_t = (delta_{t,0} - sum_{i=1}^{b-1} c_i g_{t-i}) / c_0 in O(S b) time (plus one
    L x L triangular solve, L = max(256, b-1)) and O(S + L b) memory.

    Args:
        coefficients: c_0..c_{b-1} as given (not normalised here), c_0 > 0, b <= steps.
        steps: S.

    Returns:
        float64 tensor (S,).
    """
    steps = _check_count(steps, "steps")
    band = torch.tensor(_check_coefficients(coefficients, steps), dtype=_DTYPE)
    with torch.no_grad():
        return _inverse_column_t(band, steps)


def _inverse_column_t(band: torch.Tensor, steps: int) -> torch.Tensor:
    """First ``steps`` entries of 1 / band(x) (power series), differentiable in ``band``.

    Blocked recursion: with T0 the L x L banded Toeplitz of ``band`` and T1 its part reaching
    back into the previous block, block k+1 = -T0^{-1} T1 (block k), and T1 only reads the
    previous block's last m-1 entries. So one triangular solve gives an L x (m-1) transfer
    matrix and the rest is ceil(S / L) small matrix-vector products (exact, no FFT rounding).
    """
    band = band[:steps]  # entries beyond S never reach the first S outputs
    width = band.numel()
    size = min(steps, max(_BLOCK, width - 1))
    index = torch.arange(size)
    head = _toeplitz(band, size)
    unit = torch.zeros(size, 1, dtype=band.dtype)
    unit[0, 0] = 1.0
    blocks = [torch.linalg.solve_triangular(head, unit, upper=False)[:, 0]]
    if size >= steps or width == 1:
        return torch.cat(blocks + [band.new_zeros(max(steps - size, 0))])
    # T1[i, size-width+1+j] = band[i + width-1 - j]: row i of block k+1 reads the last width-1
    # entries of block k.
    reach = _gather_band(band, index[:, None] + (width - 1) - torch.arange(width - 1)[None, :])
    transfer = -torch.linalg.solve_triangular(head, reach, upper=False)
    for _ in range(1, math.ceil(steps / size)):
        blocks.append(transfer @ blocks[-1][size - width + 1 :])
    return torch.cat(blocks)[:steps]


# ---------------------------------------------------------------------------------- error


def _momentum_t(values: torch.Tensor, momentum: float) -> torch.Tensor:
    """M @ values, i.e. y_t = values_t + beta y_{t-1}, differentiable, O(S * 256) time.

    Blocks of _BLOCK entries are filtered by one matrix product; the value carried from
    block to block follows from a small Toeplitz product of the block ends. Filtering
    separately (rather than inverting c(x)(1 - beta x)(1 - x) as one polynomial, whose unit
    root makes rounding errors grow with t) keeps the error near 1e-15 relative.
    """
    if not momentum:
        return values
    steps = values.numel()
    size = min(steps, _BLOCK)
    count = math.ceil(steps / size)
    blocks = torch.nn.functional.pad(values, (0, count * size - steps)).view(count, size)
    within = _powers_toeplitz(momentum, size, values.dtype)
    filtered = blocks @ within.T  # filtered[k, i] = sum_{j <= i} beta^(i-j) values[k*size + j]
    ends = _powers_toeplitz(momentum**size, count, values.dtype) @ filtered[:, -1]
    carried = torch.cat([ends.new_zeros(1), ends[:-1]])
    rise = torch.pow(torch.tensor(momentum, dtype=values.dtype), torch.arange(1, size + 1, dtype=values.dtype))
    return (filtered + carried[:, None] * rise[None, :]).reshape(-1)[:steps]


def _powers_toeplitz(base: float, size: int, dtype: torch.dtype) -> torch.Tensor:
    """Lower-triangular T[i, j] = base^(i-j) (size x size); entries <= 1 for base <= 1."""
    index = torch.arange(size)
    lag = index[:, None] - index[None, :]
    powers = torch.pow(torch.tensor(base, dtype=dtype), lag.clamp(min=0).to(dtype))
    return torch.where(lag >= 0, powers, torch.zeros((), dtype=dtype))


def _toeplitz_error_t(band: torch.Tensor, workload: Workload, uniform: float) -> torch.Tensor:
    """||A C^{-1}||_F^2 for a Toeplitz A (uniform learning rate), differentiable, O(S b):
    A C^{-1} = uniform * P M C^{-1} is lower-triangular Toeplitz with first column h, and
    column k of it repeats h_k on S-k diagonal entries."""
    steps = workload.steps
    h = torch.cumsum(_momentum_t(_inverse_column_t(band, steps), workload.momentum), dim=0)
    weights = torch.arange(steps, 0, -1, dtype=band.dtype)
    return (weights * h * h).sum() * (uniform * uniform)


def _schedule_error(q: torch.Tensor, lr: torch.Tensor, want_grad: bool) -> tuple[float, torch.Tensor | None]:
    """||P D Q||_F^2 with Q the lower-triangular Toeplitz of ``q`` (= M C^{-1}), in column chunks.

    Column r of P D Q is cumsum_s(eta_s q_{s-r}). Indexed by (j = s - r, r), a chunk of
    columns is q_j * eta_{j+r} (a Hankel view of eta: no copy) cumulated over j, valid where
    j + r < S. O(S^2) time, O(S * chunk) memory. The gradient is written by hand (a reversed
    cumulative sum per chunk, in the same buffer): about three times faster than autograd.

    Args:
        q: float64 (S,), no autograd graph.
        lr: float64 (S,) learning-rate multipliers.
        want_grad: also return d(error)/dq.

    Returns:
        (the squared Frobenius norm, its gradient with respect to q or None).
    """
    steps = q.numel()
    chunk = max(1, min(steps, _CHUNK_ELEMENTS // steps))
    padded = torch.cat([lr, lr.new_zeros(chunk)])
    total = q.new_zeros(())
    grad = torch.zeros_like(q) if want_grad else None
    for start in range(0, steps, chunk):
        width = min(chunk, steps - start)
        rows = steps - start
        hankel = padded[start:].as_strided((rows, width), (1, 1))
        x = torch.mul(q[:rows, None], hankel).cumsum_(0)
        # Rows below rows-width+1 are valid in every column; the last width-1 rows only above
        # the anti-diagonal j + r < S (beyond it eta is padding and the cumsum just repeats).
        tail = torch.arange(width - 1)
        x[rows - width + 1 :].mul_((tail[:, None] + torch.arange(width)[None, :]) <= width - 2)
        total += torch.dot(x.view(-1), x.view(-1))
        if grad is not None:
            # d/dq_j = 2 sum_r eta_{j+r} sum_{j' >= j} x[j', r]; the suffix sums from j+1 on
            # are colsum - cumsum, computed in x's own buffer.
            colsum = x.sum(0)
            torch.sub(colsum, x.cumsum_(0), out=x)
            grad[0] += 2.0 * torch.dot(colsum, hankel[0])
            grad[1:rows] += 2.0 * x[:-1].mul_(hankel[1:]).sum(1)
    return float(total), grad


class _ScheduleError(torch.autograd.Function):
    """_schedule_error as an autograd function of q (its gradient comes from the same pass)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, lr: torch.Tensor) -> torch.Tensor:
        value, grad = _schedule_error(q.detach(), lr, want_grad=True)
        ctx.save_for_backward(grad)
        return q.new_tensor(value)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        (grad,) = ctx.saved_tensors
        return grad_output * grad, None


def _error_graph(band: torch.Tensor, workload: Workload) -> torch.Tensor:
    """||A C^{-1}||_F^2 for ``band`` as given, differentiable in it (O(S b) for a uniform
    learning rate, O(S^2) time and O(S * chunk) memory with a schedule)."""
    uniform = _uniform_lr(workload)
    if uniform is not None:
        return _toeplitz_error_t(band, workload, uniform)
    q = _momentum_t(_inverse_column_t(band, workload.steps), workload.momentum)
    return _ScheduleError.apply(q, _lr_tensor(workload))


def _error_t(band: torch.Tensor, workload: Workload) -> float:
    """||A C^{-1}||_F^2 for ``band`` as given (no gradient)."""
    with torch.no_grad():
        uniform = _uniform_lr(workload)
        if uniform is not None:
            return float(_toeplitz_error_t(band, workload, uniform))
        q = _momentum_t(_inverse_column_t(band, workload.steps), workload.momentum)
        return _schedule_error(q, _lr_tensor(workload), want_grad=False)[0]


def squared_error(coefficients: Sequence[float], workload: Workload) -> float:
    """||A C^{-1}||_F^2 for the normalised ``coefficients``, without dense S x S matrices.

    Uniform learning rate (A Toeplitz): O(S b) time, O(S) memory. With a learning-rate
    schedule: O(S^2) time in column chunks, O(S * chunk) memory (2 MiB buffers).

    Args:
        coefficients: c_0..c_{b-1} (any scale: normalised here), c_0 > 0, b <= S.
        workload: the optimizer's workload.

    Returns:
        the total squared error over all S x S entries of A C^{-1}, in units of
        (sigma * C_clip * base learning rate)^2; inf if C^{-1} overflows float64.
    """
    band = torch.tensor(normalize(_check_coefficients(coefficients, workload.steps)), dtype=_DTYPE)
    value = _error_t(band, workload)
    return value if math.isfinite(value) else math.inf


def relative_error(coefficients: Sequence[float], workload: Workload) -> float:
    """RMSE of the strategy relative to DP-SGD on the same workload.

    Returns:
        sqrt(squared_error(coefficients) / squared_error((1.0,))), unitless (1.0 for DP-SGD).
    """
    return math.sqrt(squared_error(coefficients, workload) / squared_error((1.0,), workload))


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
    error = _error_graph(params / params.norm(), workload)
    value = error.item()
    if math.isfinite(value) and value > 0:
        error.log().backward()
    if not (math.isfinite(value) and value > 0) or params.grad is None or not torch.isfinite(params.grad).all():
        params.grad = torch.zeros_like(params)
        return _DIVERGED_LOSS
    return math.log(value)


def _optimize(workload: Workload, init: tuple[float, ...]) -> tuple[float, ...]:
    """L-BFGS (float64, strong-Wolfe) on the unnormalised band, from ``init``.

    Returns:
        the final band (unnormalised, possibly non-finite or with c_0 <= 0: checked by the caller).
    """
    params = torch.tensor(init, dtype=_DTYPE, requires_grad=True)
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
    count = _check_count(bands, "bands")
    if count > steps:
        raise ValueError(f"bands must be between 1 and the number of steps ({steps}), got {count}")
    return count


def _make_strategy(
    coefficients: tuple[float, ...], workload: Workload, error: float | None = None, reference: float | None = None
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
    if not isinstance(data, dict) or data.get("key") != workload.key() or data.get("bands") != bands:
        return None
    values = data.get("coefficients")
    if not isinstance(values, list) or len(values) != bands:
        return None
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in values):
        return None
    try:
        stored = _check_coefficients(values)
    except ValueError:  # non-finite or c_0 <= 0
        return None
    # Privacy rests on ||c|| = 1, not on the stored values being optimal: a band that is not
    # normalised to rounding (edited by hand) is re-normalised and its errors recomputed.
    if abs(math.fsum(x * x for x in stored) - 1.0) > len(stored) * 2.0**-52:
        return _make_strategy(normalize(stored), workload)
    errors = [data.get(key) for key in ("squared_error", "relative_error")]
    if not all(isinstance(e, float) and math.isfinite(e) and e > 0 for e in errors):
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


def optimize_strategy(workload: Workload, bands: int, *, cache_dir: str | Path | None = None) -> BandedStrategy:
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


# --------------------------------------------------------------------------- online noise


class BandedNoise:
    """Correlated noise w_t = (C^{-1} Z)_t generated online: w_t = (z_t - sum_{i=1}^{b-1}
    c_i w_{t-i}) / c_0, keeping only the last b-1 w's (O((b-1) x parameters) memory).

    The recursion runs in the noise's dtype on its device (float32 in training), with one
    multi-tensor kernel per band, always summed newest first, so that a run resumed from
    ``state_dict`` continues bit for bit. Scale the result by sigma * C_clip as DP-SGD's z.
    """

    def __init__(self, coefficients: Sequence[float]) -> None:
        """Args:
        coefficients: c_0..c_{b-1}, normalised (||c||_2 = 1 within 1e-9), c_0 > 0: the
            normalisation is what makes the noise private, so it is checked, not applied.
        """
        values = _check_coefficients(coefficients)
        norm = math.sqrt(math.fsum(x * x for x in values))
        if abs(norm - 1.0) > 1e-9:
            raise ValueError(f"BandedNoise needs normalised coefficients (||c||_2 = 1), got norm {norm!r}")
        self._coefficients = values
        # Newest first; a deque with maxlen drops w_{t-b+1} when w_t arrives.
        self._history: deque[Params] = deque(maxlen=len(values) - 1)

    @property
    def bands(self) -> int:
        """b, the number of coefficients."""
        return len(self._coefficients)

    @property
    def coefficients(self) -> tuple[float, ...]:
        """c_0..c_{b-1}."""
        return self._coefficients

    def next(self, z: Params) -> Params:
        """This step's correlated noise from this step's standard normals.

        Args:
            z: standard normal tensors by parameter name (same names and shapes every step).

        Returns:
            w_t by name, same dtype and device as z (unit variance scale: multiply by
            sigma * C_clip). For b = 1, z's own tensors. The tensors are the caller's to
            modify: the history keeps its own.
        """
        if self.bands == 1 or not z:
            return dict(z)  # c_0 == 1: w = z exactly, at no cost (and nothing to correlate)
        names = list(z)
        self._match_history(z)
        current = [z[name] for name in names]
        c0 = self._coefficients[0]
        if not self._history:
            noise = torch._foreach_div(current, c0)
        else:
            newest, *older = self._history
            noise = torch._foreach_mul([newest[name] for name in names], self._coefficients[1])
            for weight, past in zip(self._coefficients[2:], older):
                torch._foreach_add_(noise, [past[name] for name in names], alpha=weight)
            # (acc - z) / (-c0) is exactly (z - acc) / c0, computed in place.
            torch._foreach_sub_(noise, current)
            torch._foreach_div_(noise, -c0)
        self._history.appendleft(dict(zip(names, noise)))
        return {name: tensor.clone() for name, tensor in zip(names, noise)}

    def _match_history(self, z: Params) -> None:
        """Refuse a parameter set other than the history's; move the history to z's device and
        dtype where it is elsewhere (after load_state_dict, or a model moved between steps)."""
        if not self._history:
            return
        newest = self._history[0]
        if set(newest) != set(z):
            raise ValueError(f"BandedNoise: the parameter names changed (history has {sorted(newest)}, got {sorted(z)})")
        for name, tensor in z.items():
            if newest[name].shape != tensor.shape:
                before, now = tuple(newest[name].shape), tuple(tensor.shape)
                raise ValueError(f"BandedNoise: {name} changed shape from {before} to {now}")
        moved = [n for n, t in z.items() if (newest[n].device, newest[n].dtype) != (t.device, t.dtype)]
        if moved:
            for entry in self._history:
                for name in moved:
                    entry[name] = entry[name].to(device=z[name].device, dtype=z[name].dtype)

    def snapshot(self) -> tuple[Params, ...]:
        """The history as it stands (references: ``next`` never writes into a past entry), for
        ``rewind`` when a step is refused after its noise was made."""
        return tuple(self._history)

    def rewind(self, snapshot: tuple[Params, ...]) -> None:
        """Put the history back to ``snapshot`` (a step that was not released leaves no trace)."""
        self._history.clear()
        self._history.extend(snapshot)

    def memory_bytes(self, like: Params) -> int:
        """Bytes of the full history for parameters shaped like ``like``: (b-1) x their size."""
        return (self.bands - 1) * sum(t.numel() * t.element_size() for t in like.values())

    def state_dict(self) -> dict[str, Any]:
        """{"coefficients": [c_0, ...], "history": [w_{t-1}, w_{t-2}, ...]} (CPU copies)."""
        history = [{name: t.detach().to("cpu", copy=True) for name, t in entry.items()} for entry in self._history]
        return {"coefficients": list(self._coefficients), "history": history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict``; the history moves to the noise's device at the next ``next``.

        Raises:
            ValueError: other coefficients (the noise would not be C^{-1} Z for one C), or a
                malformed history.
        """
        if not isinstance(state, dict) or "coefficients" not in state or "history" not in state:
            raise ValueError("BandedNoise state must be a dict with 'coefficients' and 'history'")
        try:
            theirs = tuple(float(x) for x in state["coefficients"])
        except (TypeError, ValueError) as err:
            raise ValueError(f"BandedNoise state has unreadable coefficients {state['coefficients']!r}") from err
        if theirs != self._coefficients:
            raise ValueError(f"BandedNoise state was made with coefficients {theirs}, not {self._coefficients}")
        history = state["history"]
        if not isinstance(history, (list, tuple)) or len(history) > self.bands - 1:
            raise ValueError(f"BandedNoise state history must be a list of at most {self.bands - 1} steps")
        names = [set(entry) if isinstance(entry, dict) else None for entry in history]
        if any(n is None or n != names[0] for n in names):
            raise ValueError("BandedNoise state history entries must be dicts with the same parameter names")
        if not all(isinstance(t, torch.Tensor) for entry in history for t in entry.values()):
            raise ValueError("BandedNoise state history must hold tensors")
        self._history = deque((dict(entry) for entry in history), maxlen=self.bands - 1)

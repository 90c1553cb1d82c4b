"""BandMF's linear algebra: the workload A, the banded strategy C, C^{-1} and the error ||A C^{-1}||_F^2.

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

Everything here is float64 (``dpscale.privacy.noise.banded.BandedNoise`` runs in the gradients' dtype).
The strategy's optimisation is in ``dpscale.privacy.noise.bandmf``.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch


from dpscale.privacy.workload import Workload, check_count, uniform_lr

__all__ = [
    "DTYPE",
    "check_coefficients",
    "check_count",
    "error_graph",
    "inverse_column",
    "normalize",
    "relative_error",
    "squared_error",
    "strategy_matrix",
    "workload_matrix",
]

# The dtype of all strategy math (and of the optimiser's parameters in ``bandmf``).
DTYPE = torch.float64
# Block length of the inverse-column recursion: blocks of this many entries follow from the
# previous block by one small matrix-vector product (few Python-level steps, exact recursion).
_BLOCK = 256
# Elements of one column chunk of the lr-schedule error (S rows x chunk columns, float64):
# 2 MiB buffers stay in cache (measured 3x faster than 16 MiB) and bound memory whatever S is.
_CHUNK_ELEMENTS = 1 << 18


# --------------------------------------------------------------------------------- workload


def _lr_tensor(workload: Workload) -> torch.Tensor:
    """eta_0..eta_{S-1} as float64."""
    lr = workload.lr_multipliers
    if lr is None:
        return torch.ones(workload.steps, dtype=DTYPE)
    return torch.tensor(lr, dtype=DTYPE)


def workload_matrix(workload: Workload) -> torch.Tensor:
    """The dense workload A[t, r] = sum_{s=r}^{t} eta_s beta^(s-r) (reference; O(S^2) memory).

    Args:
        workload: the optimizer's workload.

    Returns:
        float64 tensor (S, S), lower triangular; A[t, r] is the parameter change after step t
        per unit of noise at step r (in units of the base learning rate).
    """
    steps = workload.steps
    momentum = _powers_toeplitz(workload.momentum, steps, DTYPE)  # 0.0^0 == 1: beta = 0 gives I
    prefix = torch.tril(torch.ones(steps, steps, dtype=DTYPE))
    return prefix @ (_lr_tensor(workload)[:, None] * momentum)


# ------------------------------------------------------------------------------- strategy


def check_coefficients(
    coefficients: Sequence[float], steps: int | None = None
) -> tuple[float, ...]:
    """``coefficients`` as floats: non-empty, finite, c_0 > 0, and at most ``steps`` of them.

    Args:
        coefficients: c_0..c_{b-1} (any scale: not normalised here).
        steps: S, the most bands allowed (None: no limit).

    Returns:
        the coefficients as a tuple of floats.

    Raises:
        ValueError: not numbers, empty, non-finite, c_0 <= 0, or more than ``steps`` of them.
    """
    try:
        values = tuple(float(x) for x in coefficients)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"coefficients must be a sequence of numbers, got {coefficients!r}"
        ) from err
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
    values = check_coefficients(coefficients)
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
    steps = check_count(steps, "steps")
    band = torch.tensor(check_coefficients(coefficients, steps), dtype=DTYPE)
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
    steps = check_count(steps, "steps")
    band = torch.tensor(check_coefficients(coefficients, steps), dtype=DTYPE)
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
    rise = torch.pow(
        torch.tensor(momentum, dtype=values.dtype), torch.arange(1, size + 1, dtype=values.dtype)
    )
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


def _schedule_error(
    q: torch.Tensor, lr: torch.Tensor, want_grad: bool
) -> tuple[float, torch.Tensor | None]:
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


def error_graph(band: torch.Tensor, workload: Workload) -> torch.Tensor:
    """||A C^{-1}||_F^2 for ``band`` as given, differentiable in it (O(S b) for a uniform
    learning rate, O(S^2) time and O(S * chunk) memory with a schedule).

    Args:
        band: float64 (b,) coefficients c_0..c_{b-1}, used as given (not normalised here).
        workload: the optimizer's workload.

    Returns:
        a float64 scalar tensor with its autograd graph, in units of (sigma * C_clip * base learning rate)^2.
    """
    uniform = uniform_lr(workload)
    if uniform is not None:
        return _toeplitz_error_t(band, workload, uniform)
    q = _momentum_t(_inverse_column_t(band, workload.steps), workload.momentum)
    return _ScheduleError.apply(q, _lr_tensor(workload))


def _error_t(band: torch.Tensor, workload: Workload) -> float:
    """||A C^{-1}||_F^2 for ``band`` as given (no gradient)."""
    with torch.no_grad():
        uniform = uniform_lr(workload)
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
    band = torch.tensor(normalize(check_coefficients(coefficients, workload.steps)), dtype=DTYPE)
    value = _error_t(band, workload)
    return value if math.isfinite(value) else math.inf


def relative_error(coefficients: Sequence[float], workload: Workload) -> float:
    """RMSE of the strategy relative to DP-SGD on the same workload.

    Returns:
        sqrt(squared_error(coefficients) / squared_error((1.0,))), unitless (1.0 for DP-SGD).
    """
    return math.sqrt(squared_error(coefficients, workload) / squared_error((1.0,), workload))

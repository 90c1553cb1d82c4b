"""The PLD of a (Poisson-subsampled) Gaussian mechanism exactly as ``dp_accounting`` builds it, up to 9x faster.

``dp_accounting.pld.privacy_loss_distribution.from_gaussian_mechanism`` discretises the privacy
loss by the connect-the-dots algorithm: it asks the mechanism for delta(epsilon) at every grid
point (~10^4-10^5 of them), and ``get_delta_for_epsilon`` inverts the privacy loss one grid point at
a time in Python (``inverse_privacy_loss``: 9.5 million calls, a quarter of the time of
tests/test_train.py and three other files under a profiler). Building one step's PLD took 448 ms
at q = 256/60000, sigma = 1.1 on the 2-core AVX2 AMD EPYC VM (51 ms here; thread clock,
``benchmarks/pld_build_time.py``), and a calibration builds 5-10 of them.

``_VectorisedGaussianLoss`` is dp_accounting's ``GaussianPrivacyLoss`` with that inversion done
by numpy over the whole grid, by the same floating-point operations in the same order (the
library's ``log_a_times_exp_b_plus_c`` and its ``math.isclose`` test at the boundary), so the PMF is
bit-identical: tests/test_pld_gaussian.py compares every probability, the lower loss and the
infinity mass with ``from_gaussian_mechanism`` over a grid of (sigma, q, grid), and the
accountant's epsilons with dp_accounting's own ``PLDAccountant``. Everything else (the noise's
CDFs, the connect-the-dots bounds, the pessimistic PMF, composition) is dp_accounting's code.
The same inversion for replace-one adjacency (``gaussian_pld(..., replace_one=True)``, the library's
``_inverse_privacy_loss_replace`` over the grid) makes ``truncated_gaussian_pld``, the library's
truncated-Poisson step rebuilt from its two Gaussian parts, ~7x faster (0.49 s against 3.72 at
N = 1000, q = 0.05, cap 55, grid 1e-4 on the AVX2 VM); ``smallest_free_cap`` builds one per cap tried.
Where a dp_accounting version lacks the private helpers or attributes this relies on (or takes
other arguments), ``gaussian_pld`` falls back to the public ``from_gaussian_mechanism``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting.pld import privacy_loss_distribution, privacy_loss_mechanism
from scipy import stats

_Adjacency = privacy_loss_mechanism.AdjacencyType
_PRIVATE_HELPERS = ("_create_pld_pmf_from_monotone_privacy_loss", "_pld_for_subsampled_mechanism")
# dp_accounting's default for the Gaussian's mass truncation, kept so both builds discretise the same range
_LOG_MASS_TRUNCATION_BOUND = -50.0


def gaussian_pld(
    standard_deviation: float,
    sampling_prob: float = 1.0,
    value_discretization_interval: float = 1e-4,
    *,
    replace_one: bool = False,
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """``from_gaussian_mechanism(standard_deviation, sensitivity=1, pessimistic_estimate=True,
    sampling_prob=..., value_discretization_interval=..., use_connect_dots=True, neighboring_relation=...)``
    bit for bit, with the privacy loss inverted over the whole grid at once.

    Args:
        standard_deviation: the noise multiplier sigma (sensitivity 1).
        sampling_prob: Poisson sampling rate q in (0, 1].
        value_discretization_interval: the PLD's grid, in nats.
        replace_one: replace-one adjacency (the library's REPLACE_ONE: one symmetric side) instead
            of add/remove.

    Returns:
        the pessimistic privacy loss distribution (add and remove sides when q < 1 under add/remove).
    """
    relations = dp_accounting.NeighboringRelation
    relation = relations.REPLACE_ONE if replace_one else relations.ADD_OR_REMOVE_ONE

    def public() -> privacy_loss_distribution.PrivacyLossDistribution:
        return privacy_loss_distribution.from_gaussian_mechanism(
            standard_deviation,
            sampling_prob=sampling_prob,
            value_discretization_interval=value_discretization_interval,
            neighboring_relation=relation,
        )

    if not all(hasattr(privacy_loss_distribution, name) for name in _PRIVATE_HELPERS):
        return public()

    def single(adjacency: Any) -> Any:
        loss = _VectorisedGaussianLoss(
            standard_deviation,
            sensitivity=1,
            pessimistic_estimate=True,
            log_mass_truncation_bound=_LOG_MASS_TRUNCATION_BOUND,
            sampling_prob=sampling_prob,
            adjacency_type=adjacency,
        )
        return privacy_loss_distribution._create_pld_pmf_from_monotone_privacy_loss(
            loss,
            pessimistic_estimate=True,
            value_discretization_interval=value_discretization_interval,
            use_connect_dots=True,
        )

    try:
        if replace_one:
            return privacy_loss_distribution.PrivacyLossDistribution(single(_Adjacency.REPLACE))
        return privacy_loss_distribution._pld_for_subsampled_mechanism(single, sampling_prob)
    # another version's helpers or attributes differ: the library's own build
    except (AttributeError, TypeError):
        return public()


def truncated_gaussian_pld(
    dataset_size: int,
    sampling_prob: float,
    max_batch_size: int,
    noise_multiplier: float,
    value_discretization_interval: float = 1e-4,
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """``from_truncated_subsampled_gaussian_mechanism`` (add/remove adjacency, connect the dots) bit for
    bit, from the two vectorised Gaussian builds it mixes: the add/remove subsampled Gaussian, and a
    replace-one Gaussian at sigma/2 for a step whose batch was cut (the library's own construction).

    Args:
        dataset_size: N.
        sampling_prob: Poisson sampling rate q in (0, 1].
        max_batch_size: the cap M: a Poisson batch of more than M examples keeps a random M.
        noise_multiplier: sigma.
        value_discretization_interval: the PLD's grid, in nats.

    Returns:
        the pessimistic privacy loss distribution of one capped step.
    """
    grid = value_discretization_interval
    uncut = gaussian_pld(noise_multiplier, sampling_prob, grid)
    # P(the batch is cut | the example was drawn), and P(drawn | cut): the library's formulas
    cut = stats.binom.sf(max_batch_size - 1, dataset_size - 1, sampling_prob)
    if cut == 0.0:
        return uncut
    drawn_if_cut = (
        stats.binom.sf(max_batch_size, dataset_size, sampling_prob)
        * max_batch_size
        / cut
        / dataset_size
    )
    swapped = gaussian_pld(noise_multiplier / 2, drawn_if_cut, grid, replace_one=True)
    return swapped.compute_mixture(uncut, cut)


class _VectorisedGaussianLoss(privacy_loss_mechanism.GaussianPrivacyLoss):
    """dp_accounting's Gaussian privacy loss whose ``get_delta_for_epsilon`` inverts the loss
    for a whole array of epsilons at once (add or remove adjacency); anything else, and any input
    the library would refuse, goes to the library's own method."""

    def get_delta_for_epsilon(self, epsilon: Any) -> Any:
        if isinstance(epsilon, numbers.Number) or self.adjacency_type not in (
            _Adjacency.ADD,
            _Adjacency.REMOVE,
            _Adjacency.REPLACE,
        ):
            return super().get_delta_for_epsilon(epsilon)
        if self.adjacency_type == _Adjacency.REPLACE:
            return self._replace_deltas(np.asarray(epsilon, dtype=float))
        epsilons = np.asarray(epsilon, dtype=float)
        deltas = np.zeros_like(epsilons, dtype=float)
        q = self.sampling_prob
        if q == 1.0:
            inverted = np.full_like(epsilons, True, dtype=bool)
        elif self.adjacency_type == _Adjacency.ADD:
            inverted = epsilons < -math.log1p(-q)  # the divergence is 0 beyond
        else:
            inverted = epsilons > math.log1p(-q)
            deltas[~inverted] = -np.expm1(epsilons[~inverted])
        cutoffs = self._inverse_privacy_losses(epsilons[inverted])
        if cutoffs is None:  # a loss the library refuses: let it raise its own error
            return super().get_delta_for_epsilon(epsilon)
        deltas[inverted] = self.mu_upper_cdf(cutoffs) - np.exp(
            epsilons[inverted] + self.mu_lower_log_cdf(cutoffs)
        )
        return np.clip(deltas, 0, 1)

    def _inverse_privacy_losses(self, losses: np.ndarray) -> np.ndarray | None:
        """``inverse_privacy_loss`` of each loss (the largest x whose loss is at least it), None
        where the library would raise (a loss outside the subsampled mechanism's range)."""
        s, variance, q = self.sensitivity, self._standard_deviation**2, self.sampling_prob
        add = self.adjacency_type == _Adjacency.ADD
        if q == 1.0:
            unsampled = losses
        else:
            edge = -math.log(1 - q) if add else math.log(1 - q)
            # math.isclose, rel_tol 1e-9
            near = np.abs(losses - edge) <= 1e-9 * np.maximum(np.abs(losses), abs(edge))
            logged = _log_a_times_exp_b_plus_c(1 / q, -losses if add else losses, 1 - 1 / q)
            if logged is None or bool(np.isnan(logged[~near]).any()):
                return None
            unsampled = -logged if add else logged
            unsampled[near] = math.inf if add else -math.inf  # the library's inverse at +-infinity
        # inf * variance at the boundary, as the library computes it
        with np.errstate(invalid="ignore"):
            remove = -0.5 * s - unsampled * variance / s
        return s + remove if add else remove

    def _replace_deltas(self, epsilons: np.ndarray) -> np.ndarray:
        """The library's delta(epsilon) under replace-one adjacency: every epsilon inverted."""
        cutoffs = self._inverse_replace_losses(epsilons)
        return np.clip(
            self.mu_upper_cdf(cutoffs) - np.exp(epsilons + self.mu_lower_log_cdf(cutoffs)), 0, 1
        )

    def _inverse_replace_losses(self, losses: np.ndarray) -> np.ndarray:
        """The library's ``_inverse_privacy_loss_replace`` of each loss, by its operations: its
        ``log_sinh`` per element with ``math`` (numpy's exp and log1p may round otherwise), its
        ``asinh_exp`` (b = -sign(loss), so log|b| = 0) and the rest elementwise."""
        s, variance, q = self.sensitivity, self._standard_deviation**2, self.sampling_prob
        if q == 1.0:
            out = -losses * variance / s / 2
        else:
            log_alpha = 0.5 * (s / self._standard_deviation) ** 2 + math.log1p(-q) - math.log(q)
            halves = np.abs(losses) / 2
            log_sinh = np.array(
                [
                    h + math.log1p(-math.exp(-2 * h)) - math.log(2) if h else 0.0
                    for h in halves.tolist()
                ]
            )
            exponent = log_alpha + log_sinh
            sign_b = np.where(losses >= 0, -1.0, 1.0)
            asinh = sign_b * np.logaddexp(0.5 * np.logaddexp(0, 2 * exponent), exponent)
            out = variance / s * (asinh - losses / 2)
        out[losses == 0] = 0.0
        return out


def _log_a_times_exp_b_plus_c(a: float, b: np.ndarray, c: float) -> np.ndarray | None:
    """``dp_accounting.pld.common.log_a_times_exp_b_plus_c`` elementwise for a > 0 > c (q < 1):
    log(a exp(b) + c) by its operations, NaN where it would raise; None for other signs."""
    if not a > 0 > c:
        return None
    log_a, log_minus_c = np.log(a), np.log(-c)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = b + log_a
        out = d + np.log1p(-np.exp(log_minus_c - d))  # the library's _log_sub(d, log(-c))
    out[log_minus_c >= d] = np.nan  # the library raises: "a must be greater than b"
    zero = b == 0
    out[zero] = np.log(a + c)  # the library's b == 0 branch
    return out

"""The vectorised Gaussian PLD (``dpscale.privacy.accounting.pld_gaussian``) is dp_accounting's, bit for bit:
every probability, the lower loss and the infinity mass of both sides equal
``from_gaussian_mechanism``'s over a grid of noise, sampling rates and grids, and delta(epsilon)
equals the library's at the awkward epsilons (the subsampled range's edge and one ulp either
side, 0 and -0, far outside)."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution, privacy_loss_mechanism

from dpscale.privacy.accounting import pld_gaussian
from dpscale.privacy.accounting.pld_gaussian import gaussian_pld, truncated_gaussian_pld

ADD, REMOVE = privacy_loss_mechanism.AdjacencyType.ADD, privacy_loss_mechanism.AdjacencyType.REMOVE
REPLACE = privacy_loss_mechanism.AdjacencyType.REPLACE


def _pmfs(pld: privacy_loss_distribution.PrivacyLossDistribution) -> list:
    return [pld._pmf_remove.to_dense_pmf()] + (
        [] if pld._symmetric else [pld._pmf_add.to_dense_pmf()]
    )


def _assert_identical(
    got: privacy_loss_distribution.PrivacyLossDistribution,
    want: privacy_loss_distribution.PrivacyLossDistribution,
) -> None:
    assert got._symmetric == want._symmetric
    for ours, theirs in zip(_pmfs(got), _pmfs(want), strict=True):
        assert ours._lower_loss == theirs._lower_loss
        assert ours._infinity_mass == theirs._infinity_mass
        assert ours._discretization == theirs._discretization
        assert np.array_equal(ours._probs, theirs._probs)


CASES = [  # (sigma, q, grid): tiny to certain sampling, little to much noise, both grids accounting uses
    (0.5, 0.004, 1e-3),
    (1.1, 256 / 60000, 1e-4),
    (0.8, 0.05, 1e-3),
    (2.0, 0.5, 1e-3),
    (4.0, 0.999, 1e-3),
    (1.0, 1.0, 1e-3),
    (3.0, 1.0, 1e-4),
    (20.0, 0.01, 1e-4),
    (0.3, 1e-4, 1e-3),
    (1.1, 0.004, 2e-3),
]


@pytest.mark.parametrize("sigma,q,grid", CASES)
def test_the_pmf_is_dp_accountings_bit_for_bit(sigma, q, grid):
    want = privacy_loss_distribution.from_gaussian_mechanism(
        sigma, sampling_prob=q, value_discretization_interval=grid
    )
    _assert_identical(
        gaussian_pld(sigma, sampling_prob=q, value_discretization_interval=grid), want
    )


REPLACE_CASES = [
    (0.55, 0.3, 1e-3),
    (0.5, 0.02, 1e-3),
    (2.0, 1.0, 1e-3),
    (1.5, 0.9, 1e-4),
    (5.0, 1e-4, 1e-3),
]


@pytest.mark.parametrize("sigma,q,grid", REPLACE_CASES)
def test_the_replace_one_pmf_is_dp_accountings_bit_for_bit(sigma, q, grid):
    want = privacy_loss_distribution.from_gaussian_mechanism(
        sigma,
        sampling_prob=q,
        value_discretization_interval=grid,
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE,
    )
    _assert_identical(
        gaussian_pld(sigma, sampling_prob=q, value_discretization_interval=grid, replace_one=True),
        want,
    )


# (N, q, cap, sigma, grid): capped often, rarely, at the expected size, and never (cap >= N: the plain step)
TRUNCATED_CASES = [
    (1000, 0.05, 55, 1.0, 1e-3),
    (2000, 0.02, 60, 0.8, 1e-3),
    (500, 0.1, 50, 2.0, 1e-3),
    (300, 0.2, 300, 1.0, 1e-3),
]


@pytest.mark.parametrize("n,q,cap,sigma,grid", TRUNCATED_CASES)
def test_the_truncated_step_is_dp_accountings_bit_for_bit(n, q, cap, sigma, grid):
    want = privacy_loss_distribution.from_truncated_subsampled_gaussian_mechanism(
        n, q, cap, sigma, value_discretization_interval=grid
    )
    _assert_identical(truncated_gaussian_pld(n, q, cap, sigma, grid), want)


@pytest.mark.parametrize("adjacency", [ADD, REMOVE, REPLACE])
@pytest.mark.parametrize("q", [0.004, 0.3, 1.0])
def test_delta_at_the_awkward_epsilons_is_the_librarys(adjacency, q):
    # q = 1 (or replace): no edge
    edge = (-math.log(1 - q) if adjacency == ADD else math.log(1 - q)) if q < 1 else -1.0
    epsilons = np.array(
        [
            edge,
            np.nextafter(edge, -np.inf),
            np.nextafter(edge, np.inf),
            edge * (1 + 1e-10),
            0.0,
            -0.0,
            -math.log1p(-q) if q < 1 else 2.0,
            1e-12,
            -3.0,
            0.5,
            7.0,
            40.0,
        ]
    )
    epsilons = epsilons[np.isfinite(epsilons)]
    args = dict(
        sensitivity=1,
        pessimistic_estimate=True,
        log_mass_truncation_bound=-50,
        sampling_prob=q,
        adjacency_type=adjacency,
    )
    ours = pld_gaussian._VectorisedGaussianLoss(0.9, **args)
    theirs = privacy_loss_mechanism.GaussianPrivacyLoss(0.9, **args)
    assert np.array_equal(
        ours.get_delta_for_epsilon(epsilons), theirs.get_delta_for_epsilon(epsilons)
    )
    # scalars: the library's own
    assert ours.get_delta_for_epsilon(0.5) == theirs.get_delta_for_epsilon(0.5)
    # where the library's inverse is defined
    inside = np.array([e for e in epsilons if _inverts(theirs, e)])
    want = np.array([theirs.inverse_privacy_loss(float(e)) for e in inside])
    inverse = ours._inverse_replace_losses if adjacency == REPLACE else ours._inverse_privacy_losses
    assert len(inside) >= 6 and np.array_equal(inverse(inside), want)  # +-infinity at the edge


def _inverts(loss: privacy_loss_mechanism.GaussianPrivacyLoss, epsilon: float) -> bool:
    try:
        loss.inverse_privacy_loss(float(epsilon))
    except ValueError:  # beyond the subsampled mechanism's range
        return False
    return True


def test_without_the_private_helpers_the_public_builder_is_used(monkeypatch):
    """Another dp_accounting version without the helpers: the library's public function, same PMF."""
    calls = []
    public = privacy_loss_distribution.from_gaussian_mechanism

    def counted(*args, **kwargs):
        calls.append(args)
        return public(*args, **kwargs)

    monkeypatch.setattr(
        pld_gaussian, "_PRIVATE_HELPERS", (*pld_gaussian._PRIVATE_HELPERS, "_gone_in_this_version")
    )
    monkeypatch.setattr(privacy_loss_distribution, "from_gaussian_mechanism", counted)
    got = gaussian_pld(1.1, sampling_prob=0.01, value_discretization_interval=1e-3)
    assert calls == [(1.1,)]
    _assert_identical(got, public(1.1, sampling_prob=0.01, value_discretization_interval=1e-3))


def test_a_version_whose_loss_lacks_an_attribute_falls_back_to_the_public_builder(monkeypatch):
    """A dp_accounting whose Gaussian loss keeps its sigma under another name (or whose helpers take
    other arguments): the library's own build, not a crash in the accountant."""
    want = privacy_loss_distribution.from_gaussian_mechanism(
        1.1, sampling_prob=0.01, value_discretization_interval=1e-3
    )

    def renamed(self, losses):
        raise AttributeError("'GaussianPrivacyLoss' object has no attribute '_standard_deviation'")

    monkeypatch.setattr(pld_gaussian._VectorisedGaussianLoss, "_inverse_privacy_losses", renamed)
    _assert_identical(
        gaussian_pld(1.1, sampling_prob=0.01, value_discretization_interval=1e-3), want
    )

"""pld_epsilons against dp_accounting's own get_epsilon_for_delta: equal, bit for bit."""

import math

import numpy as np
import pytest
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from dpscale.privacy.accounting import pld_epsilon
from dpscale.privacy.accounting.accountant import PrivacyAccountant
from dpscale.privacy.accounting.pld_epsilon import pld_epsilons
from dpscale.privacy.accounting.pld_gaussian import gaussian_pld

DELTAS = [
    0.0,
    1e-300,
    1e-12,
    1e-9,
    1e-6,
    1e-5,
    3e-5,
    1e-3,
    0.01,
    0.1,
    0.15,
    0.4,
    0.5,
    0.7,
    0.9,
    1.0,
]


def _dense(
    discretization: float, lower_loss: int, probs: list[float], infinity_mass: float = 0.0
) -> pld_pmf.DensePLDPmf:
    return pld_pmf.DensePLDPmf(discretization, lower_loss, np.array(probs), infinity_mass, True)


def _cases() -> dict[str, pld_lib.PrivacyLossDistribution]:
    # exp(-loss) is 0: the loop's zero-mass return
    beyond_exp = _dense(1.0, 760, [0.1, 0.2, 0.3, 0.25, 0.15])
    subnormal = _dense(1.0, 740, [0.1, 0.2, 0.3, 0.25, 0.15])  # exp(-loss) subnormal
    small = _dense(0.5, -4, [0.05, 0.1, 0.2, 0.3, 0.2, 0.1, 0.05], infinity_mass=1e-7)
    return {
        "dp-sgd 20 steps": gaussian_pld(1.0, 0.004, 1e-4).self_compose(20),
        "dp-sgd 200 steps": gaussian_pld(0.6, 0.01, 1e-4).self_compose(200),
        "full batch": gaussian_pld(2.0, 1.0, 1e-3).self_compose(5),
        "laplace": pld_lib.from_laplace_mechanism(
            1.0, value_discretization_interval=1e-3
        ).self_compose(3),
        "beyond exp": pld_lib.PrivacyLossDistribution(beyond_exp),
        "subnormal": pld_lib.PrivacyLossDistribution(subnormal),
        "asymmetric": pld_lib.PrivacyLossDistribution(small, beyond_exp),
        "asymmetric, reversed": pld_lib.PrivacyLossDistribution(beyond_exp, small),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_every_epsilon_is_dp_accountings(name):
    pld = _cases()[name]
    infinity = pld._pmf_remove._infinity_mass
    deltas = [
        *DELTAS,
        infinity,
        float(np.nextafter(infinity, 1.0)),
        float(np.nextafter(infinity, 0.0)),
    ]
    with np.errstate(over="ignore"):  # both divide by a subnormal mass on "subnormal"
        want = [float(pld.get_epsilon_for_delta(d)) for d in deltas]
        got = pld_epsilons(pld, deltas)
    assert got == want  # exact: same floats, inf where the library gives inf


def test_small_chunks_walk_the_same_path(monkeypatch):
    """Chunks of 3 grid points: the running sums continue across chunk borders unchanged."""
    monkeypatch.setattr(pld_epsilon, "FIRST_CHUNK", 3)
    pld = gaussian_pld(1.0, 0.004, 1e-4).self_compose(20)
    assert pld_epsilons(pld, DELTAS) == [float(pld.get_epsilon_for_delta(d)) for d in DELTAS]


def test_a_walk_that_reaches_an_overflowing_exp_raises_as_the_librarys_does():
    """Losses down to -800: exp(800) overflows. Deltas whose walk stops above it agree; one that
    walks to the bottom (delta 1: the mass never exceeds it) raises OverflowError in both."""
    probs = np.full(801, 1 / 801)
    pld = pld_lib.PrivacyLossDistribution(_dense(1.0, -800, list(probs)))
    stops = [1e-3, 0.1, 0.5]
    assert pld_epsilons(pld, stops) == [float(pld.get_epsilon_for_delta(d)) for d in stops]
    with pytest.raises(OverflowError):
        pld.get_epsilon_for_delta(1.0)
    with pytest.raises(OverflowError):
        pld_epsilons(pld, [1.0])


def test_a_sparse_pmf_is_left_to_the_library():
    pld = pld_lib.from_privacy_parameters(
        pld_lib.common.DifferentialPrivacyParameters(1.0, 1e-6), 1e-4
    )
    assert not isinstance(pld._pmf_remove, pld_pmf.DensePLDPmf)
    assert pld_epsilons(pld, DELTAS) == [float(pld.get_epsilon_for_delta(d)) for d in DELTAS]


def test_the_accountant_reports_the_librarys_numbers():
    """epsilon and the epsilon-delta curve of a composed history, against the library's walk of
    the same PLD (the PLD built once, so only the epsilon search is compared)."""
    from dpscale.privacy.accounting.pld_history import composed_pld

    accountant = PrivacyAccountant(kind="pld")
    accountant.step(sample_rate=0.01, noise_multiplier=0.9, num_steps=300)
    pld = composed_pld(list(accountant.history), accountant.pld_discretization)
    deltas = [1e-8, 1e-5, 1e-3]
    want = [float(pld.get_epsilon_for_delta(d)) for d in deltas]
    assert accountant.epsilons(deltas) == want
    assert [accountant.epsilon(d) for d in deltas] == want
    assert all(math.isfinite(e) and e > 0 for e in want)

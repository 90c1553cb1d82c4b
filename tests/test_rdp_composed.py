"""The RDP accountant's history composed from cached step curves equals dp_accounting's accountant
composing the same events, bit for bit, and computes each distinct step's curve once."""

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant

from dpscale.privacy.accounting.accountant import PrivacyAccountant
from dpscale.privacy.accounting.batch_sampling import BatchSampling
from dpscale.privacy.accounting.rdp_composed import composed_rdp
from dpscale.privacy.accounting.segments import AccountingSegment

ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE
DELTAS = (1e-3, 1e-5, 1e-9)


def _poisson(q: float, sigma: float, steps: int) -> dp_accounting.DpEvent:
    step = (
        dp_accounting.GaussianDpEvent(sigma)
        if q == 1.0
        else dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    )
    return dp_accounting.SelfComposedDpEvent(step, steps)


def _library(events, relation=ADD_REMOVE) -> rdp_privacy_accountant.RdpAccountant:
    accountant = rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)
    for event in events:
        accountant.compose(event)
    return accountant


HISTORIES = {
    "one segment": ([_poisson(0.01, 1.1, 1000)], ADD_REMOVE),
    "q near one half (the slow series)": ([_poisson(0.5, 0.9, 16)], ADD_REMOVE),
    "release then steps then a second segment": (
        [_poisson(1.0, 6.0, 2), _poisson(0.125, 1.3, 40), _poisson(0.25, 0.8, 7)],
        ADD_REMOVE,
    ),
    "small sigma, orders left out": ([_poisson(0.3, 0.3, 5)], ADD_REMOVE),
    "nested counts": ([dp_accounting.SelfComposedDpEvent(_poisson(0.02, 1.0, 3), 7)], ADD_REMOVE),
    "fixed-size batches (replace-one)": (
        [
            dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(4.0), 2),
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.SampledWithoutReplacementDpEvent(
                    6000, 256, dp_accounting.GaussianDpEvent(0.55)
                ),
                300,
            ),
        ],
        REPLACE_ONE,
    ),
}


@pytest.mark.parametrize("name", list(HISTORIES))
def test_the_composed_curve_is_the_library_accountants_bit_for_bit(name):
    events, relation = HISTORIES[name]
    ours, library = composed_rdp(events, relation), _library(events, relation)
    assert np.array_equal(ours.orders, library.orders)
    assert np.array_equal(ours.rdp, library.rdp)  # inf where an order was left out, in both
    for delta in DELTAS:
        assert ours.get_epsilon(delta) == library.get_epsilon(delta)
    for epsilon in (0.5, 2.0, 8.0):
        assert ours.get_delta(epsilon) == library.get_delta(epsilon)


def test_the_accountant_gives_the_librarys_numbers_through_its_public_methods():
    acc = PrivacyAccountant("rdp")
    acc.record(AccountingSegment(1.0, 6.0, 2, "data-norm"))
    acc.step(sample_rate=0.125, noise_multiplier=1.3, num_steps=40)
    library = _library([_poisson(1.0, 6.0, 2), _poisson(0.125, 1.3, 40)])
    assert acc.epsilon(1e-5) == library.get_epsilon(1e-5)
    assert acc.epsilons(list(DELTAS)) == [library.get_epsilon(d) for d in DELTAS]
    assert acc.delta(2.0) == library.get_delta(2.0)
    fixed = PrivacyAccountant("rdp")
    fixed.step(
        sample_rate=256 / 6000,
        noise_multiplier=1.1,
        num_steps=300,
        batches=BatchSampling("fixed", 6000),
    )
    sampled = dp_accounting.SampledWithoutReplacementDpEvent(
        6000, 256, dp_accounting.GaussianDpEvent(0.55)
    )
    assert fixed.epsilon(1e-5) == _library(
        [dp_accounting.SelfComposedDpEvent(sampled, 300)], REPLACE_ONE
    ).get_epsilon(1e-5)


def test_a_growing_history_computes_its_step_curve_once(monkeypatch):
    """A run's evaluations ask for epsilon with one more step each time: one library computation in all."""
    calls = []
    real = rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian

    def counted(q, noise_multiplier, orders):
        calls.append((q, noise_multiplier))
        return real(q, noise_multiplier, orders)

    monkeypatch.setattr(rdp_privacy_accountant, "_compute_rdp_poisson_subsampled_gaussian", counted)
    acc = PrivacyAccountant("rdp")
    epsilons = []
    for _ in range(5):
        # parameters no other test uses: a cold cache
        acc.step(sample_rate=0.0371, noise_multiplier=1.234)
        epsilons.append(acc.epsilon(1e-5))
        acc.delta(1.0)
    assert calls == [(0.0371, 1.234)]
    assert epsilons == sorted(epsilons) and len(set(epsilons)) == 5
    assert epsilons[-1] == _library([_poisson(0.0371, 1.234, 5)]).get_epsilon(1e-5)


def test_the_cached_curve_cannot_be_changed_through_a_result():
    ours = composed_rdp([_poisson(0.05, 1.0, 10)])
    with pytest.raises(ValueError, match="read-only"):
        ours.orders[0] = 0.0
    ours.rdp[0] = 123.0  # the composed total is the caller's own array
    assert composed_rdp([_poisson(0.05, 1.0, 10)]).rdp[0] != 123.0


@pytest.mark.parametrize("count", [0, -1])
def test_a_count_below_one_is_refused_as_the_library_refuses_it(count):
    """A negative count would take privacy loss away from the history (a review's find; no caller builds one)."""
    step = dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0))
    with pytest.raises(ValueError, match="must be positive"):
        composed_rdp([_poisson(0.01, 1.0, 1000), dp_accounting.SelfComposedDpEvent(step, count)])
    with pytest.raises(ValueError, match="must be positive"):
        _library([dp_accounting.SelfComposedDpEvent(step, count)])

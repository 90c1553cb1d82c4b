"""The simulated reference for random allocation (tests/allocation_reference.py) checked where the
answer is known: one step per epoch is the Gaussian mechanism, and more steps per epoch amplify."""

import math

from scipy.stats import norm

from allocation_reference import allocation_delta


def _gaussian_delta(epsilon: float, sigma: float) -> float:
    """Balle & Wang 2018: delta(eps) of the Gaussian mechanism with sensitivity 1 and noise sigma."""
    return norm.cdf(0.5 / sigma - epsilon * sigma) - math.exp(epsilon) * norm.cdf(
        -0.5 / sigma - epsilon * sigma
    )


def test_one_step_per_epoch_is_the_gaussian_mechanism_composed():
    for sigma, epochs, epsilon in [(1.0, 1, 1.0), (2.0, 3, 0.5)]:
        exact = _gaussian_delta(
            epsilon, sigma / math.sqrt(epochs)
        )  # epochs compose as one sigma / sqrt(E)
        estimate, upper = allocation_delta(
            epsilon, sigma=sigma, steps=1, epochs=epochs, samples=200_000, seed=1
        )
        assert exact <= upper and abs(estimate - exact) < 0.1 * exact + 1e-3, (
            estimate,
            upper,
            exact,
        )


def test_more_steps_per_epoch_release_less_about_each_example():
    one, _ = allocation_delta(1.0, sigma=1.0, steps=1, epochs=2, samples=100_000, seed=2)
    _, four = allocation_delta(1.0, sigma=1.0, steps=4, epochs=2, samples=100_000, seed=2)
    assert four < 0.5 * one  # the example hides among 4 steps of each epoch

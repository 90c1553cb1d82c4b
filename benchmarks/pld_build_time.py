"""Time to build one Gaussian step's PLD: dp_accounting's ``from_gaussian_mechanism`` against
dpscale's ``gaussian_pld`` (the same PMF, the privacy loss inverted by numpy over the grid).

Each case is built ``--repeats`` times by each, interleaved, on the thread-CPU clock; the table gives
the medians, the ratio, and whether the two PMFs are bit-identical (every probability, the lower
loss, the infinity mass).

Usage:
    python benchmarks/pld_build_time.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from dp_accounting.pld import privacy_loss_distribution

from dpscale.privacy.accounting.pld_gaussian import gaussian_pld

# (sigma, q, grid): an MNIST run's step (B = 256 of 60000), a noisier and a less noisy one, a release (q = 1)
CASES = [(1.1, 256 / 60000, 1e-4), (0.6, 0.01, 1e-4), (2.0, 0.004, 1e-4), (0.8, 0.05, 1e-3), (1.0, 1.0, 1e-4), (8.0, 0.001, 1e-4)]


def identical(a: privacy_loss_distribution.PrivacyLossDistribution, b: privacy_loss_distribution.PrivacyLossDistribution) -> bool:
    """Whether both sides' dense PMFs agree in every bit."""
    for x, y in ((a._pmf_remove, b._pmf_remove), (a._pmf_add, b._pmf_add)):
        x, y = x.to_dense_pmf(), y.to_dense_pmf()
        if (x._lower_loss, x._infinity_mass) != (y._lower_loss, y._infinity_mass) or not np.array_equal(x._probs, y._probs):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print("| sigma | q | grid | dp_accounting ms | dpscale ms | speed-up | bit-identical |")
    print("|---|---|---|---|---|---|---|")
    for sigma, q, grid in CASES:
        theirs, ours = [], []
        for _ in range(args.repeats):
            start = time.thread_time()
            want = privacy_loss_distribution.from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=grid)
            theirs.append(time.thread_time() - start)
            start = time.thread_time()
            got = gaussian_pld(sigma, sampling_prob=q, value_discretization_interval=grid)
            ours.append(time.thread_time() - start)
        slow, fast = statistics.median(theirs) * 1e3, statistics.median(ours) * 1e3
        print(f"| {sigma} | {q:.4g} | {grid:g} | {slow:.1f} | {fast:.1f} | {slow / fast:.1f}x | {identical(got, want)} |")


if __name__ == "__main__":
    main()

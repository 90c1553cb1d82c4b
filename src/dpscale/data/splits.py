"""The seeded, stratified hold-out every loader uses when a dataset has no official test split."""

from __future__ import annotations

import numpy as np
import torch

SPLIT_SEED = 0  # seed of every held-out test split; changing it changes N-independent results


def stratified_holdout(y: np.ndarray, n_test: int, seed: int = SPLIT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """Split indices into (train, test) with exactly ``n_test`` test items, stratified by label.

    Each class contributes ``floor(count * n_test / N)`` items, and the leftover slots go to the
    classes with the largest fractional parts, so class proportions are kept as closely as possible.
    Both index arrays are sorted, keeping the original file order within each part.
    """
    n = len(y)
    classes, counts = np.unique(y, return_counts=True)
    exact = counts * (n_test / n)
    quota = np.floor(exact).astype(np.int64)
    leftover = n_test - int(quota.sum())
    quota[np.argsort(-(exact - quota), kind="stable")[:leftover]] += 1
    gen = torch.Generator().manual_seed(seed)
    test_parts = []
    for c, q in zip(classes, quota):
        members = np.flatnonzero(y == c)
        perm = torch.randperm(len(members), generator=gen).numpy()
        test_parts.append(members[perm[:q]])
    test = np.sort(np.concatenate(test_parts))
    is_test = np.zeros(n, dtype=bool)
    is_test[test] = True
    return np.flatnonzero(~is_test), test


def holdout_description(n_test: int, n_total: int) -> str:
    return f"held out {n_test} of {n_total} images, stratified by class (seed {SPLIT_SEED})"

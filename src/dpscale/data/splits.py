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


def user_holdout(user_ids: np.ndarray, n_test: int, seed: int = SPLIT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """Split indices into (train, test) by whole users: no user has examples on both sides.

    Users are taken in a seeded random order into the test side while that brings its size closer
    to ``n_test`` examples, so the test side holds about ``n_test`` examples (off by less than the
    largest user's count). With a user-level guarantee (issue 43) a person on both sides would be
    evaluated on images of themselves that the model trained on.

    Args:
        user_ids: one id per example (any comparable type).
        n_test: the examples wanted on the test side, 0 <= n_test <= N.
        seed: the split's seed.

    Returns:
        (train, test) sorted index arrays, disjoint, covering 0..N-1.
    """
    ids = np.asarray(user_ids)
    if not 0 <= n_test <= len(ids):
        raise ValueError(f"n_test must be in [0, {len(ids)}], got {n_test}")
    _, codes, counts = np.unique(ids, return_inverse=True, return_counts=True)
    order = torch.randperm(len(counts), generator=torch.Generator().manual_seed(seed)).numpy()
    held = np.zeros(len(counts), dtype=bool)
    size = 0
    for user in order:  # a user joins the test side while that moves its size towards n_test
        if abs(size + counts[user] - n_test) < abs(size - n_test):
            held[user], size = True, size + int(counts[user])
    is_test = held[codes]
    return np.flatnonzero(~is_test), np.flatnonzero(is_test)

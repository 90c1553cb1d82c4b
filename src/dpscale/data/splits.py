"""The held-out test split a loader makes when a dataset has no official test split.

Where the data names a stable id for each unit (a person's id, or an image's path in a folder),
a unit is held out iff a keyed hash of that id falls below the test fraction (:func:`hashed_holdout`):
a function of the unit alone, so adding or removing one person or image moves no other between
the training and the test set, and the training set of two neighbouring collections differs by
that unit at most, as the DP guarantee assumes. Arrays that name no id (IDX, mnist-5k) keep an
exact seeded split stratified by class (:func:`stratified_holdout`): a function of the whole
collection, which their runs say (:func:`selection_note`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from .formats import DatasetError

SPLIT_SEED = 0  # seed of every held-out test split; changing it changes N-independent results
# The hash's key: public and fixed (a split any reader can recompute from the ids), distinct
# from BandMF's secret partition key (units.user_groups).
_SPLIT_KEY = f"dpscale held-out split {SPLIT_SEED}".encode()

# The rules of the whole collection that can choose a training set (DatasetInfo.selected_by), each
# with how to choose by unit instead; :func:`selection_note` makes them the run's one sentence.
HELD_OUT_BY_INDEX = (
    "the held-out test split, made by index (the data names no ids; to hold out by id give user ids: an npz "
    "user_ids array, a train-user-ids.txt/.npy side file, or an official test split: t10k files, x_test/y_test)"
)
MAX_PER_CLASS_CHOICE = (
    "data.max_per_class's seeded choice within each class (to choose by unit, subset the data by a rule of "
    "each image alone, e.g. a keyed hash of its id, before dpscale reads it)"
)


def selection_note(selected_by: Sequence[str]) -> str | None:
    """What a run says (header, summary.json, model card) when rules of the whole collection chose
    its training set: the guarantee covers that set, not the collection (None: no such rule).

    Args:
        selected_by: the rules (``DatasetInfo.selected_by``, e.g. :data:`HELD_OUT_BY_INDEX`).
    """
    if not selected_by:
        return None
    return (
        f"the guarantee covers the selected training set only: {' and '.join(selected_by)} chose it from the "
        "whole collection, so adding or removing one image (or person) can change which others train, which no "
        "epsilon here accounts for"
    )


def stratified_holdout(
    y: np.ndarray, n_test: int, seed: int = SPLIT_SEED
) -> tuple[np.ndarray, np.ndarray]:
    """Split indices into (train, test) with exactly ``n_test`` test items, stratified by label.

    Each class contributes ``floor(count * n_test / N)`` items, and the leftover slots go to the
    classes with the largest fractional parts, so class proportions are kept as closely as possible.
    Both index arrays are sorted, keeping the original file order within each part. A function of
    the whole collection (indices are no stable ids): only for data without ids, whose runs say so.
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


def unit_hashes(ids: Sequence[object] | np.ndarray) -> np.ndarray:
    """Each id's keyed BLAKE2b hash under the split's public key, as uint64 (of ``str(id)``: the
    same for the integer 17 in an npz and the string "17" in a users.csv; not Python's ``hash``,
    which changes from process to process).

    Args:
        ids: (N,) ids (integers or strings).

    Returns:
        (N,) uint64 hashes.
    """
    distinct, inverse = np.unique(np.asarray(ids), return_inverse=True)  # hash each id once
    return keyed_hashes(distinct, _SPLIT_KEY)[inverse.reshape(-1)]


def keyed_hashes(ids: np.ndarray, key: bytes) -> np.ndarray:
    """Each id's keyed BLAKE2b hash of ``str(id)`` as a little-endian uint64: a function of the id
    and the key alone (the held-out split's public key here; BandMF's secret partition key in
    ``units.user_groups``). Surrogateescape: a file name that is not UTF-8 (os.listdir's
    surrogates) hashes as its bytes on disk; every other string as its UTF-8.

    Args:
        ids: (N,) ids; key: up to 64 bytes.

    Returns:
        (N,) uint64.
    """
    digests = (
        hashlib.blake2b(str(i).encode("utf-8", "surrogateescape"), key=key, digest_size=8).digest()
        for i in ids.tolist()
    )
    return np.fromiter(
        (int.from_bytes(d, "little") for d in digests), dtype=np.uint64, count=len(ids)
    )


def hashed_holdout(
    ids: Sequence[object] | np.ndarray, fraction: float, what: str
) -> tuple[np.ndarray, np.ndarray]:
    """Split indices into (train, test) by each example's stable id alone: an example is held out
    iff its id's keyed hash (:func:`unit_hashes`) / 2^64 < ``fraction``. Examples sharing an id (a
    person's images) land on one side; adding or removing a unit moves no other unit.

    Args:
        ids: (N,) one stable id per example: a user id, or an image's path relative to its root.
        fraction: the expected share of units held out, in (0, 1).
        what: the data, for errors (e.g. "image folder DIR").

    Returns:
        (train, test) sorted index arrays, disjoint, covering 0..N-1 (the test side about
        ``fraction`` of the units, not exactly: each unit decides alone).

    Raises:
        DatasetError: a side left empty (too few units for a hold-out by id).
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"the held-out fraction must be in (0, 1), got {fraction}")
    if len(ids) == 0:
        raise DatasetError(f"{what} holds no example to split into training and test sets")
    is_test = unit_hashes(ids) < np.uint64(int(fraction * 2.0**64))
    if is_test.all() or not is_test.any():
        side = "training" if is_test.all() else "test"
        raise DatasetError(
            f"{what}: holding out {fraction:.0%} of its {len(np.unique(np.asarray(ids)))} units by a hash of each one's id "
            f"left the {side} set empty (too few units); give an official test split"
        )
    return np.flatnonzero(~is_test), np.flatnonzero(is_test)


def hashed_holdout_description(
    ids: np.ndarray, test: np.ndarray, fraction: float, by_user: bool
) -> str:
    """How :func:`hashed_holdout` split ``ids`` (the test split's description, in DatasetInfo)."""
    n = len(ids)
    if by_user:
        people = f"{len(np.unique(ids[test]))} of {len(np.unique(ids))} people"
        return (
            f"held out {len(test)} of {n} images by whole users ({people}: each person held out iff a keyed hash "
            f"of their id < {fraction:.3g}, seed {SPLIT_SEED}; adding or removing one moves no other)"
        )
    return (
        f"held out {len(test)} of {n} images (each held out iff a keyed hash of its path < {fraction:.3g}, "
        f"seed {SPLIT_SEED}; adding or removing one moves no other)"
    )

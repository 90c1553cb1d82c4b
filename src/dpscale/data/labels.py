"""The labels a run trains and is tested on: one line naming those of each split, and a refusal
when the splits disagree (a stray label, a test split with classes never trained on).

The number of classes K is read from the data (its labels, or a loader's fixed K such as
CIFAR-10's 10), as dpscale always has: the label set is taken to be public, and no privacy is
spent on it. ``data.num_classes`` declares K instead.
"""

from __future__ import annotations

import numpy as np

from .formats import DatasetError


def label_ranges(labels: np.ndarray) -> str:
    """Distinct labels as compact ranges.

    Args:
        labels: integer labels, in any order, repeats allowed.

    Returns:
        E.g. "0-3, 5, 12" for the labels {0, 1, 2, 3, 5, 12}; "none" when there are none.
    """
    present = np.unique(np.asarray(labels)).tolist()
    runs: list[list[int]] = []
    for label in present:
        if runs and label == runs[-1][1] + 1:
            runs[-1][1] = label
        else:
            runs.append([label, label])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


def labels_line(y_train: np.ndarray, y_test: np.ndarray, num_classes: int) -> str:
    """The progress line naming the labels present in each split.

    Args:
        y_train, y_test: the splits' labels.
        num_classes: K, the model's outputs.

    Returns:
        E.g. "labels: train 0-9 (10 classes), test 0-9 (10 classes); a 10-class model".
    """
    train, test = np.unique(y_train), np.unique(y_test)
    return (
        f"labels: train {label_ranges(train)} ({len(train)} classes), test {label_ranges(test)} "
        f"({len(test)} classes); a {num_classes}-class model"
    )


def check_labels(
    y_train: np.ndarray,
    y_test: np.ndarray,
    num_classes: int,
    declared: int | None,
    source: str,
    *,
    k_from_labels: bool = True,
) -> int:
    """The number of classes K to train with, after checking the splits' labels agree.

    Args:
        y_train, y_test: the splits' labels.
        num_classes: K as the loader read it (an npz file's: the largest label + 1).
        declared: ``data.num_classes`` (None: not set).
        source: the data's file or folder, first in every message.
        k_from_labels: whether the loader took K from the largest label (npz), so that a stray
            label makes the model larger; a format that fixes K (CIFAR-10's 10, one class per
            folder) may train on a subset without some classes, which the labels line shows.

    Returns:
        ``declared`` when set, else ``num_classes``.

    Raises:
        DatasetError: a label not below ``declared``; without ``declared``, a test label no
            training example has, or (``k_from_labels``) training labels that leave a gap below K.
    """
    train, test = np.unique(y_train), np.unique(y_test)
    if declared is not None:
        for split, present in (("training", train), ("test", test)):
            if present.size and present[-1] >= declared:
                raise DatasetError(
                    f"{source}: the {split} split holds label {present[-1]}, but data.num_classes={declared} "
                    f"allows 0..{declared - 1}: raise data.num_classes or fix the labels"
                )
        return declared
    unseen = np.setdiff1d(test, train)
    if unseen.size:
        raise DatasetError(
            f"{source}: the test split holds label(s) {label_ranges(unseen)} that no training example has "
            f"(train {label_ranges(train)}, test {label_ranges(test)}), so its accuracy would count classes never "
            "trained on: fix the split, or set data.num_classes to evaluate on them anyway"
        )
    missing = np.setdiff1d(np.arange(num_classes), train)
    if missing.size and k_from_labels:
        raise DatasetError(
            f"{source}: the training labels {label_ranges(train)} leave out {label_ranges(missing)}, so the model "
            f"would have {num_classes} outputs of which {missing.size} are never trained (a stray label?): fix the "
            f"labels, or set data.num_classes={num_classes} if that is meant"
        )
    return num_classes

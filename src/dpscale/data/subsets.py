"""Class subsets and relabelling, for transfer sources and targets (Papernot et al. Section 4.1:
CIFAR-100 sources restricted to some classes or grouped into meta-classes).

Every selection is a deterministic function of the labels and a seed, applied to the training
and test splits alike; the training set that remains is the N the accountant sees. Keeping the
classes chosen decides each example by its own label; ``max_per_class`` does not (which images of
a class it keeps depends on the others), so a run with it says that its guarantee covers the
selected training set (``splits.MAX_PER_CLASS_CHOICE``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from .datasets import DatasetError, ImageDataset
from .formats import MIN_CLASSES, require_two_classes
from .splits import MAX_PER_CLASS_CHOICE


def random_classes(num_classes: int, count: int, seed: int) -> list[int]:
    """``count`` of the ``num_classes`` labels, drawn without replacement from ``seed`` (sorted)."""
    if count < MIN_CLASSES:
        raise DatasetError(f"data.random_classes={count}: a classifier needs at least two classes")
    if not count <= num_classes:
        raise DatasetError(f"cannot pick {count} random classes of {num_classes}")
    return sorted(
        np.random.default_rng(seed).choice(num_classes, size=count, replace=False).tolist()
    )


def meta_class_map(num_classes: int, groups: int, seed: int) -> np.ndarray:
    """Label -> meta-class: the classes shuffled by ``seed`` and dealt into ``groups`` groups whose
    sizes differ by at most one."""
    if groups < MIN_CLASSES:
        raise DatasetError(
            f"data.meta_classes={groups} puts every class in one group; a classifier needs at least two classes"
        )
    if not groups <= num_classes:
        raise DatasetError(f"cannot group {num_classes} classes into {groups} meta-classes")
    order = np.random.default_rng(seed).permutation(num_classes)
    mapping = np.empty(num_classes, dtype=np.int64)
    mapping[order] = np.arange(num_classes) % groups
    return mapping


def _keep(y: torch.Tensor, classes: list[int], cap: int | None, seed: int) -> torch.Tensor:
    """Indices of the examples of ``classes`` (in file order), at most ``cap`` per class (a seeded
    random choice of them when capped)."""
    labels = y.cpu().numpy()
    rng = np.random.default_rng(seed)
    kept = []
    for c in classes:
        members = np.flatnonzero(labels == c)
        if cap is not None and len(members) > cap:
            members = np.sort(rng.choice(members, size=cap, replace=False))
        kept.append(members)
    return torch.from_numpy(np.sort(np.concatenate(kept)) if kept else np.zeros(0, dtype=np.int64))


def select(
    data: ImageDataset,
    *,
    classes: Sequence[int] | None = None,
    meta_classes: int | None = None,
    max_per_class: int | None = None,
    seed: int = 0,
) -> ImageDataset:
    """The dataset restricted to ``classes`` (relabelled 0..k-1 in the order given), optionally
    grouped into ``meta_classes`` evenly sized groups (seeded) and capped at ``max_per_class``
    training examples per (original) class (seeded; the test split is not capped; recorded in
    ``info.selected_by``: a choice among the class's examples, not of each one alone).

    Raises:
        DatasetError: a class out of range, repeated, or a selection with no training example or
            fewer than two classes among its training examples.
    """
    k = data.info.num_classes
    chosen = list(range(k)) if classes is None else [int(c) for c in classes]
    bad = [c for c in chosen if not 0 <= c < k]
    if bad or len(set(chosen)) != len(chosen):
        raise DatasetError(f"data.classes must be distinct labels in 0..{k - 1}, got {chosen}")
    relabel = np.full(k, -1, dtype=np.int64)
    relabel[chosen] = np.arange(len(chosen))
    if meta_classes is not None:
        relabel[chosen] = meta_class_map(len(chosen), meta_classes, seed)
    train = _keep(data.y_train, chosen, max_per_class, seed)
    test = _keep(data.y_test, chosen, None, seed)
    if len(train) == 0:
        raise DatasetError(f"data.classes {chosen} leave no training example")
    table = torch.from_numpy(relabel)
    kept = data.y_train.cpu()[train]
    if meta_classes is None:  # the labels as the user chose them, not relabelled
        require_two_classes(kept.numpy(), f"data.classes {chosen}")
    else:
        require_two_classes(table[kept].numpy(), f"data.meta_classes={meta_classes}")
    out_classes = meta_classes if meta_classes is not None else len(chosen)
    names = data.info.classes and tuple(  # a meta-class is named by its members
        "+".join(data.info.classes[c] for c in chosen if relabel[c] == label)
        for label in range(out_classes)
    )
    # an exact count per class is a rule of the whole class: one image more or less changes which others stay
    selected_by = data.info.selected_by + (
        (MAX_PER_CLASS_CHOICE,) if max_per_class is not None else ()
    )
    info = replace(
        data.info,
        num_train=len(train),
        num_test=len(test),
        num_classes=out_classes,
        classes=names,
        selected_by=selected_by,
    )
    return ImageDataset(
        data.x_train[train.to(data.x_train.device)],
        table[data.y_train.cpu()[train]].to(data.y_train.device),
        data.x_test[test.to(data.x_test.device)],
        table[data.y_test.cpu()[test]].to(data.y_test.device),
        info,
        user_ids=None if data.user_ids is None else data.user_ids[train.numpy()],
    )

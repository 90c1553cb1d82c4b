"""The in-memory dataset (``ImageDataset`` and its ``DatasetInfo``) and its assembly from arrays,
with a held-out test split where the source has none.

A held-out split is made unit by unit from the data's ids where it names them
(``splits.hashed_holdout``), else stratified by class and drawn from
``torch.Generator().manual_seed(0)``; either is identical across calls, processes and machines.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .formats import DatasetError, require_two_classes
from .splits import (
    HELD_OUT_BY_INDEX,
    hashed_holdout,
    hashed_holdout_description,
    holdout_description,
    stratified_holdout,
)


@dataclass(frozen=True)
class DatasetInfo:
    """Provenance and shape of a loaded dataset.

    Attributes:
        name: Dataset name, one of :data:`DATASET_NAMES` (or the ``name`` given to :func:`load_idx`).
        num_train: N, the size of the private training set (used for q = B/N).
        num_test: Number of test images.
        num_classes: Number of classes K; labels are in ``0..K-1``.
        input_shape: (C, H, W) of one image.
        source: File or directory the data was read from.
        test_split: How the test set was obtained (``"official"`` or a description of the hold-out).
        skipped_files: Files that could not be read and were left out (``skip_corrupt``); N counts
            only the images trained on.
        classes: Class names, label i is ``classes[i]`` (image folders and shards: the folder
            names); empty when the source names none.
        selected_by: the rules of the whole collection (not of each unit alone) that chose the
            training set, e.g. ``splits.HELD_OUT_BY_INDEX``; a run then says that its guarantee
            covers the selected training set (``splits.selection_note``). Empty: each unit's
            membership is a function of that unit alone.
    """

    name: str
    num_train: int
    num_test: int
    num_classes: int
    input_shape: tuple[int, int, int]
    source: str
    test_split: str
    # unreadable files left out (data.skip_corrupt), with the reason
    skipped_files: tuple[str, ...] = ()
    classes: tuple[str, ...] = ()
    # what the loader left out or changed without a refusal (folder.FolderListing.notes)
    notes: tuple[str, ...] = ()
    selected_by: tuple[str, ...] = ()


@dataclass(frozen=True)
class ImageDataset:
    """Train and test images (float32 NCHW in [0, 1]) with int64 labels, and, when the source
    names them, each training example's user id (``user_ids``, (N,) integers or strings: the
    privacy unit ``user``, issue 43). Anything that subsets or reorders the training set must do
    the same to ``user_ids`` or drop them (None: then a user-level run is refused)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    info: DatasetInfo
    user_ids: np.ndarray | None = None


def images_from_uint8(x_uint8: np.ndarray) -> torch.Tensor:
    """uint8 (N, C, H, W) -> contiguous float32 tensor in [0, 1]."""
    # astype copies into a fresh writable array, so torch.from_numpy neither warns nor aliases the file buffer.
    return torch.from_numpy(x_uint8.astype(np.float32)).div_(255.0).contiguous()


def images_to_float(x: np.ndarray) -> torch.Tensor:
    """Decoded (N, C, H, W) pixels (``folder.image_array``) -> contiguous float32 tensor in [0, 1].

    Args:
        x: uint8 pixels (divided by 255), or float32 ones already in [0, 1] (a set with samples
            wider than 8 bits).

    Returns:
        A new tensor (never a view of ``x``, which may be a memory-mapped file).
    """
    if x.dtype == np.uint8:
        return images_from_uint8(x)
    return torch.from_numpy(np.array(x, dtype=np.float32)).contiguous()


def assemble_dataset(
    name: str,
    source: str,
    test_split: str,
    num_classes: int,
    x_train: torch.Tensor,
    y_train: np.ndarray,
    x_test: torch.Tensor,
    y_test: np.ndarray,
    user_ids: np.ndarray | None = None,
    selected_by: tuple[str, ...] = (),
) -> ImageDataset:
    """Assemble an :class:`ImageDataset`, deriving the counts in its :class:`DatasetInfo`.

    Args:
        name, source, test_split, num_classes, selected_by: as :class:`DatasetInfo` records them.
        x_train, x_test: float32 NCHW images; y_train, y_test: integer labels.
        user_ids: each training example's user id (None: the source names none).

    Returns:
        The dataset (int64 labels, contiguous images).

    Raises:
        DatasetError: no training image, or fewer than two classes among the training labels.
    """
    if len(x_train) == 0:
        raise DatasetError(f"{source} contains no training images")
    require_two_classes(y_train, source)
    info = DatasetInfo(
        name=name,
        num_train=len(x_train),
        num_test=len(x_test),
        num_classes=int(num_classes),
        input_shape=tuple(int(d) for d in x_train.shape[1:]),  # type: ignore[arg-type]
        source=source,
        test_split=test_split,
        selected_by=selected_by,
    )
    return ImageDataset(
        x_train=x_train.contiguous(),
        y_train=torch.from_numpy(y_train.astype(np.int64)),
        x_test=x_test.contiguous(),
        y_test=torch.from_numpy(y_test.astype(np.int64)),
        info=info,
        user_ids=user_ids,
    )


def dataset_from_pool(
    name: str,
    source: str,
    num_classes: int,
    x: torch.Tensor,
    y: np.ndarray,
    test_fraction: float,
    user_ids: np.ndarray | None = None,
) -> ImageDataset:
    """Build a dataset from a single labelled pool by holding out ``test_fraction`` of it: by a
    keyed hash of each user's id when the pool names users (whole users, each deciding alone against
    this constant fraction: a cut-off computed from the pool's size moved people when one left), else
    round(test_fraction * N) examples by index, stratified by class (then the run says its guarantee
    covers the selected training set).

    Args:
        name, source, num_classes: as :class:`DatasetInfo` records them.
        x, y: the pool's images and labels; test_fraction: the share held out.
        user_ids: each example's user id (None: the split is by example).

    Returns:
        The dataset, its ``test_split`` describing the hold-out.
    """
    selected_by: tuple[str, ...] = ()
    if user_ids is None:
        n_test = round(test_fraction * len(y))
        train, test = stratified_holdout(y, n_test)
        how, selected_by = holdout_description(n_test, len(y)), (HELD_OUT_BY_INDEX,)
    else:
        train, test = hashed_holdout(user_ids, test_fraction, source)
        how = hashed_holdout_description(user_ids, test, test_fraction, by_user=True)
    return assemble_dataset(
        name,
        source,
        how,
        num_classes,
        x[torch.from_numpy(train)],
        y[train],
        x[torch.from_numpy(test)],
        y[test],
        user_ids=None if user_ids is None else user_ids[train],
        selected_by=selected_by,
    )

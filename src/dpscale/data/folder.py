"""Image folders: one listing (files, labels, split) shared by the in-memory and the streaming loader.

Both loaders decode a file with :func:`image_array`, so an image streamed from disk is the same
array, bit for bit, as the one the in-memory loader holds: uint8 when every image has 8-bit
samples, else float32 in [0, 1], each image scaled by the full scale of its own sample type
(16-bit: value / 65535; ``formats.wide_samples`` has the rules).

Layouts (classes are the sorted sub-folder names of the training split; label i is the i-th):
  * ``root/train/<class>/*`` with ``root/test/<class>/*`` or ``root/val/<class>/*`` (official split);
  * ``root/train/<class>/*`` with a flat ``root/val/*`` folder and a label file
    (``val_labels``: one ``<file name> <class>`` per line, comma or whitespace separated, the class
    given by folder name or index; ImageNet's validation set);
  * ``root/<class>/*`` or ``root/train/<class>/*`` alone: about 20% is held out as the test set,
    each image by a keyed hash of its path (each person by their id with ``users.csv``).

A ``users.csv`` manifest in ``root`` names each training image's user (the privacy unit ``user``;
its format and what it accepts: :mod:`dpscale.data.users_csv`). With it, a held-out test split is
made by whole users.

The listing names what it leaves out or changes without a refusal (``FolderListing.notes``, printed
by ``dpscale train`` and ``dpscale data prepare``): files in class folders that are not images it
reads, a minority of colour images that makes every image 3-channel, and a manifest's people on
each side of the split.
"""

from __future__ import annotations

import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image

from .formats import (
    IMAGE_EXTENSIONS,
    MIN_CLASSES,
    DatasetError,
    ImageFormatError,
    WideSamples,
    read_image_samples,
    require_two_classes,
    wide_pixels,
    wide_samples,
    is_image_file,
)
from .users_csv import (
    USERS_MANIFEST,
    UsersManifest,
    look_alikes_note,
    read_manifest,
    read_users_manifest,
)

__all__ = [
    "SKIP_CORRUPT_HINT",
    "USERS_MANIFEST",
    "FolderListing",
    "decoder_pool",
    "image_array",
    "list_image_folder",
    "read_users_manifest",
]

GRAYSCALE_MODES = frozenset({"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"})
TEST_FRACTION = 0.2  # held out when a folder has no test split
SKIP_CORRUPT_HINT = (
    "data.skip_corrupt=true decodes every image first and leaves unreadable ones out"
)
NAMED_FILES = 3  # a note names this many files, then counts the rest


@dataclass(frozen=True)
class FolderListing:
    """The files of an image folder, with labels and the split, before any decoding.

    Attributes:
        root: the folder.
        classes: class names; label i is ``classes[i]``.
        train_files, train_labels: the private training set (labels int64).
        test_files, test_labels: the test set.
        test_split: "official" or how the test set was held out.
        mode: "L" when every image is grayscale, else "RGB" (alpha dropped).
        skipped: files left out because they could not be read (``skip_corrupt``), with the reason.
        dtype: the decoded pixels' type: "uint8" when every image has 8-bit samples, else
            "float32" (in [0, 1]; see :func:`image_array`).
        train_users: each training file's user (``USERS_MANIFEST``), or None without the manifest.
        left_out: what the class folders hold besides images it reads (other files, hidden
            files, sub-folders), relative to ``root``: named in ``notes``, never refused.
        colour_files: the colour images of a set whose other images (most) are grey, relative to
            ``root``: why ``mode`` is "RGB" (empty when there are none, or when most are colour).
        notes: lines for the run's report: what was left out or changed, and the manifest's people.
    """

    root: Path
    classes: tuple[str, ...]
    train_files: tuple[Path, ...]
    train_labels: np.ndarray
    test_files: tuple[Path, ...]
    test_labels: np.ndarray
    test_split: str
    mode: str = "RGB"
    skipped: tuple[str, ...] = ()
    dtype: str = "uint8"
    # each training file's user id (``USERS_MANIFEST``), or None
    train_users: np.ndarray | None = None
    left_out: tuple[str, ...] = ()
    colour_files: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def _class_folders(split_dir: Path) -> list[str]:
    return sorted(d.name for d in split_dir.iterdir() if d.is_dir() and not d.name.startswith("."))


def _images_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if is_image_file(p))


def _not_images(root: Path, split_dirs: list[Path]) -> tuple[str, ...]:
    """What the class folders of ``split_dirs`` hold besides images dpscale reads (other files,
    hidden files, sub-folders as ``name/``), relative to ``root``, sorted."""
    found = []
    for split_dir in split_dirs:
        for c in _class_folders(split_dir):
            for p in (split_dir / c).iterdir():
                if not is_image_file(p):
                    found.append(p.relative_to(root).as_posix() + ("/" if p.is_dir() else ""))
    return tuple(sorted(found))


def _named(files: tuple[str, ...] | list[str]) -> str:
    """The first ``NAMED_FILES`` of ``files``, then how many more."""
    more = f" and {len(files) - NAMED_FILES:,} more" if len(files) > NAMED_FILES else ""
    return ", ".join(files[:NAMED_FILES]) + more


def _list_classes(split_dir: Path) -> dict[str, list[Path]]:
    """Map each class sub-folder (sorted, hidden ones skipped) to its sorted image files."""
    classes = _class_folders(split_dir)
    if not classes:
        raise DatasetError(
            f"{split_dir} has no class sub-folders (expected {split_dir}/<class>/<image>)"
        )
    found = {}
    for c in classes:
        files = _images_in(split_dir / c)
        if not files:
            raise DatasetError(
                f"class folder {split_dir / c} contains no images ({', '.join(sorted(IMAGE_EXTENSIONS))})"
            )
        found[c] = files
    return found


def _flatten(
    by_class: dict[str, list[Path]], classes: list[str]
) -> tuple[tuple[Path, ...], np.ndarray]:
    files = tuple(p for c in classes for p in by_class[c])
    labels = np.array([i for i, c in enumerate(classes) for _ in by_class[c]], dtype=np.int64)
    return files, labels


def _read_label_file(
    path: Path, folder: Path, classes: list[str]
) -> tuple[tuple[Path, ...], np.ndarray]:
    """A flat validation folder's files and labels from ``<file name> <class>`` lines."""
    if not path.is_file():
        raise DatasetError(f"validation label file {path} does not exist")
    index = {c: i for i, c in enumerate(classes)}
    files, labels = [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        fields = [f for f in re.split(r"[,\s]+", line.strip()) if f]
        if not fields or line.lstrip().startswith("#"):
            continue
        if len(fields) < 2:
            raise DatasetError(f"{path}:{number}: expected '<file name> <class>', got {line!r}")
        name, label = fields[0], fields[1]
        if label in index:
            value = index[label]
        elif label.isdigit() and int(label) < len(classes):
            value = int(label)
        else:
            raise DatasetError(
                f"{path}:{number}: class {label!r} is neither a training class folder nor an index < {len(classes)}"
            )
        file = folder / name
        if not file.is_file():
            raise DatasetError(f"{path}:{number}: {file} does not exist")
        files.append(file)
        labels.append(value)
    if not files:
        raise DatasetError(f"validation label file {path} lists no images")
    return tuple(files), np.array(labels, dtype=np.int64)


def _test_split(
    root: Path, train_dir: Path, classes: list[str], val_labels: Path | None
) -> tuple[tuple[Path, ...], np.ndarray] | None:
    """The official test set of a ``root/train`` layout, if there is one."""
    if train_dir == root:
        return None
    for name in ("test", "val"):
        folder = root / name
        if not folder.is_dir():
            continue
        if val_labels is not None or not _class_folders(folder):
            if val_labels is None:
                raise DatasetError(
                    f"{folder} has no class sub-folders: pass data.val_labels (a '<file name> <class>' file)"
                )
            return _read_label_file(Path(val_labels), folder, classes)
        by_class = _list_classes(folder)
        if list(by_class) != classes:
            raise DatasetError(
                f"{folder} class folders {sorted(by_class)} differ from {train_dir} class folders {classes}"
            )
        return _flatten(by_class, classes)
    return None


Header = tuple[str, tuple[int, int], bool]  # (mode, (width, height), samples wider than 8 bits)


def _header(path: Path) -> Header:
    """The file's :data:`Header` from its header alone (no pixel decoding)."""
    try:
        with Image.open(path) as img:
            return img.mode, img.size, wide_samples(img, path) is not None
    except DatasetError:
        raise
    except (OSError, SyntaxError, ValueError) as e:
        raise DatasetError(f"could not read image {path}: {e}") from e


def _check(path: Path, full: bool) -> Header | str:
    """The header of ``path`` (decoding every pixel when ``full``), or why it cannot be read."""
    try:
        if full:
            img, wide = read_image_samples(path)
            return img.mode, img.size, wide is not None
        return _header(path)
    except ImageFormatError:
        raise  # not damaged: refused even with skip_corrupt
    except DatasetError as e:
        return str(e)


class _InProcess:
    """``map`` in this process (one worker: no pool to start)."""

    def __enter__(self) -> "_InProcess":
        return self

    def __exit__(self, *exc) -> None:
        return None

    map = staticmethod(map)


def decoder_pool(workers: int) -> ProcessPoolExecutor | _InProcess:
    """Decoding processes, started by a fork server: a plain fork of a process whose torch
    threads hold locks can hang in the child."""
    if workers <= 1:
        return _InProcess()
    return _forkserver_pool(workers)


def _forkserver_pool(workers: int) -> ProcessPoolExecutor:
    """``workers`` decoding processes (:func:`decoder_pool` with workers > 1)."""
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("forkserver"))


def _check_all(files: list[Path], full: bool, workers: int) -> list[Header | str]:
    if workers <= 1 or len(files) < 512:
        return [_check(p, full) for p in files]
    with _forkserver_pool(workers) as pool:  # a process pool: the in-process map takes no chunksize
        return list(pool.map(_check, files, [full] * len(files), chunksize=256))


def _scan(
    listing: FolderListing, image_size: int | None, skip_corrupt: bool, workers: int
) -> FolderListing:
    """Read every file's header (every pixel with ``skip_corrupt``): the colour mode of the set,
    one size when no ``image_size`` is given, and the unreadable files, refused or left out."""
    files = list(listing.train_files) + list(listing.test_files)
    results = _check_all(files, skip_corrupt, workers)
    bad = [(p, r) for p, r in zip(files, results) if isinstance(r, str)]
    if bad and not skip_corrupt:
        raise DatasetError(
            f"{bad[0][1]} ({len(bad)} unreadable file(s) in {listing.root}; {SKIP_CORRUPT_HINT})"
        )
    good = [(p, r) for p, r in zip(files, results) if not isinstance(r, str)]
    if image_size is None and good:
        first, (_, size, _) = good[0]
        for p, (_, other, _) in good:
            if other != size:
                raise DatasetError(
                    f"{p} is {other[0]}x{other[1]} but {first} is {size[0]}x{size[1]}; pass image_size to resize all images to one size"
                )
    mode = "L" if good and all(r[0] in GRAYSCALE_MODES for _, r in good) else "RGB"
    colour = [
        p.relative_to(listing.root).as_posix() for p, r in good if r[0] not in GRAYSCALE_MODES
    ]
    dropped = {p for p, _ in bad}
    train_keep = np.array([p not in dropped for p in listing.train_files], dtype=bool)
    test_keep = np.array([p not in dropped for p in listing.test_files], dtype=bool)
    return replace(
        listing,
        train_files=tuple(p for p, k in zip(listing.train_files, train_keep) if k),
        train_labels=listing.train_labels[train_keep],
        train_users=None if listing.train_users is None else listing.train_users[train_keep],
        test_files=tuple(p for p, k in zip(listing.test_files, test_keep) if k),
        test_labels=listing.test_labels[test_keep],
        mode=mode,
        skipped=tuple(reason for _, reason in bad),
        dtype="float32" if any(r[2] for _, r in good) else "uint8",
        # a few colour files among grey ones: named, since they make every image (and the model) 3-channel
        colour_files=tuple(colour) if 0 < len(colour) < len(good) - len(colour) else (),
    )


def list_image_folder(
    root: str | os.PathLike,
    *,
    image_size: int | None = None,
    val_labels: str | os.PathLike | None = None,
    skip_corrupt: bool = False,
    workers: int = 1,
) -> FolderListing:
    """List an image folder (layouts in the module docstring), check every file's header and split it.

    Args:
        root: the folder.
        image_size: images will be resized to this square size; None: all must share one size.
        val_labels: label file of a flat ``root/val`` folder.
        skip_corrupt: decode every image now and leave out those that fail (counted in
            ``skipped``); otherwise an unreadable header is an error naming the file.
        workers: processes for the check.

    Returns:
        The listing; with no official test split, about 20% of the (readable) images is held
        out unit by unit (:func:`_hold_out`), as the in-memory loaders do.

    Raises:
        DatasetError: a missing folder, an unreadable image (without ``skip_corrupt``), images of
            different sizes (without ``image_size``), or fewer than two classes to train on.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"image folder {root} does not exist or is not a directory")
    if image_size is not None and image_size <= 0:
        raise DatasetError(f"image_size must be positive, got {image_size}")
    train_dir = root / "train" if (root / "train").is_dir() else root
    by_class = _list_classes(train_dir)
    classes = list(by_class)
    if len(classes) < MIN_CLASSES:  # before reading any image: nothing to train on
        raise DatasetError(
            f"image folder {train_dir} has 1 class sub-folder ({classes[0]!r}); a classifier needs at least two classes, "
            f"one sub-folder each"
        )
    files, labels = _flatten(by_class, classes)
    test = _test_split(root, train_dir, classes, Path(val_labels) if val_labels else None)
    test_files, test_labels = test or ((), np.zeros(0, dtype=np.int64))
    manifest = read_manifest(root, files, labels, classes, test_files=test_files)
    listing = FolderListing(
        root,
        tuple(classes),
        files,
        labels,
        test_files,
        test_labels,
        "official" if test else "",
        train_users=None if manifest is None else manifest.train,
        left_out=_not_images(root, _split_dirs(root, train_dir)),
    )
    listing = _scan(listing, image_size, skip_corrupt, workers)
    people = None if listing.train_users is None else len(np.unique(listing.train_users))
    if test is None:
        listing = _hold_out(listing)
    listing = replace(
        listing, notes=_listing_notes(listing, people) + _manifest_notes(listing, manifest)
    )
    # Unreadable files left out, or a class's only image held out, can leave one class.
    note = f" ({len(listing.skipped)} unreadable file(s) left out)" if listing.skipped else ""
    require_two_classes(listing.train_labels, f"image folder {root}", listing.classes, note)
    return listing


def _split_dirs(root: Path, train_dir: Path) -> list[Path]:
    """The folders whose class sub-folders hold the listing's images: the training one, and an
    official test split's (``root/test`` or ``root/val``) when it has class sub-folders."""
    if train_dir == root:
        return [root]
    return [
        train_dir,
        *(
            root / name
            for name in ("test", "val")
            if (root / name).is_dir() and _class_folders(root / name)
        ),
    ]


def _listing_notes(listing: FolderListing, people: int | None) -> tuple[str, ...]:
    """The lines a run prints about the listing (``FolderListing.notes``).

    Args:
        listing: the split listing; people: the manifest's people before the split (None: no manifest).
    """
    notes = []
    if listing.left_out:
        notes.append(
            f"data: left out {len(listing.left_out):,} file(s) in the class folders that are not images dpscale reads "
            f"({', '.join(sorted(IMAGE_EXTENSIONS))}): {_named(listing.left_out)}"
        )
    if listing.colour_files:
        total = len(listing.train_files) + len(listing.test_files)
        notes.append(
            f"data: {len(listing.colour_files):,} of {total:,} images {'is' if len(listing.colour_files) == 1 else 'are'} "
            f"colour ({_named(listing.colour_files)}), the "
            "others greyscale: every image is read as 3 channels (a grey image's one repeated) and the model takes 3 "
            "channels; convert the colour ones to greyscale, or remove them, for 1-channel input"
        )
    if listing.train_users is not None and people is not None:
        train_people = len(np.unique(listing.train_users))
        side = f"training: {len(listing.train_files):,} images of {train_people:,} people"
        # held out by whole people: the others are the test set's
        if listing.test_split != "official":
            side += (
                f"; test: {len(listing.test_files):,} images of {people - train_people:,} people"
            )
        notes.append(f"{USERS_MANIFEST}: {people:,} people; {side}")
    return tuple(notes)


def _manifest_notes(listing: FolderListing, manifest: UsersManifest | None) -> tuple[str, ...]:
    """The listing's lines about what users.csv says beyond the split: an official test split's
    people (those also in training: the test accuracy is then partly on people the model saw), and
    ids that look alike (``users_csv.look_alike_ids``)."""
    if manifest is None or listing.train_users is None:
        return ()
    notes = []
    if listing.test_split == "official":
        named = [
            manifest.test[p]
            for p in (f.resolve() for f in listing.test_files)
            if p in manifest.test
        ]
        people, trained = set(named), set(listing.train_users.tolist())
        both = len(people & trained)
        notes.append(
            f"{USERS_MANIFEST}: the official test split's {len(listing.test_files):,} images: {len(named):,} named, of "
            f"{len(people):,} people"
            + (
                f", {both:,} of whom also train (their test images measure the model on people it saw)"
                if both
                else ""
            )
            + (
                ""
                if len(named) == len(listing.test_files)
                else f"; it names nobody for the other {len(listing.test_files) - len(named):,}"
            )
        )
    look_alikes = look_alikes_note(manifest.look_alikes)
    return tuple(notes) + ((look_alikes,) if look_alikes else ())


def _hold_out(listing: FolderListing) -> FolderListing:
    """Split a folder without an official test split, unit by unit: an image (or, with
    ``users.csv``, a person with all their images) is held out iff a keyed hash of its path
    relative to the root (the person's id) is below ``TEST_FRACTION`` (``splits.hashed_holdout``):
    adding or removing one moves no other between the training and the test set.

    Args:
        listing: the scanned listing, every image in its training split.

    Returns:
        The listing with its test split made.
    """
    from .splits import hashed_holdout, hashed_holdout_description

    users = listing.train_users
    ids = (
        users
        if users is not None
        else np.array([p.relative_to(listing.root).as_posix() for p in listing.train_files])
    )
    train, held = hashed_holdout(ids, TEST_FRACTION, f"image folder {listing.root}")
    how = hashed_holdout_description(ids, held, TEST_FRACTION, by_user=users is not None)
    pick = lambda idx: tuple(listing.train_files[i] for i in idx)  # noqa: E731
    return replace(
        listing,
        train_files=pick(train),
        train_labels=listing.train_labels[train],
        test_files=pick(held),
        test_labels=listing.train_labels[held],
        test_split=how,
        train_users=None if users is None else users[train],
    )


def image_array(path: Path, mode: str, image_size: int | None, dtype: str = "uint8") -> np.ndarray:
    """Decode one image file as a (C, H, W) array in ``mode``, resized (bilinear, aspect ratio not
    kept) to ``image_size`` squared when given. Errors name the file.

    Args:
        path: the image file.
        mode: "L" (one channel) or "RGB" (three; a grayscale image's channel repeated).
        image_size: the square side to resize to (None: as stored).
        dtype: the listing's pixel type: "uint8" (0..255), or "float32" (in [0, 1]: an 8-bit image
            as value / 255, a wider one as value / its type's full scale, resized in float).

    Returns:
        The C-contiguous array, of ``dtype``.
    """
    try:
        img, wide = read_image_samples(path)
    except ImageFormatError:
        raise  # readable but refused: skip_corrupt would not leave it out
    except DatasetError as err:  # damaged past its header: the listing's check read only that
        raise DatasetError(f"{err} ({SKIP_CORRUPT_HINT})") from err
    if wide is None:
        array = _eight_bit_array(img, mode, image_size)
        return array if dtype == "uint8" else array.astype(np.float32) / np.float32(255)
    if dtype != "float32":  # the listing read a header with 8-bit samples
        raise ImageFormatError(
            f"{path} holds {wide.kind} samples but had 8-bit ones when its folder was listed: run again"
        )
    return _wide_array(img, wide, path, mode, image_size)


def _eight_bit_array(img: Image.Image, mode: str, image_size: int | None) -> np.ndarray:
    """An image of 8-bit samples as a uint8 (C, H, W) array (see :func:`image_array`)."""
    img = img.convert(mode)
    if image_size is not None and img.size != (image_size, image_size):
        img = img.resize((image_size, image_size), Image.Resampling.BILINEAR)
    array = np.asarray(img, dtype=np.uint8)
    # C-contiguous: a stack of transposed views would keep the HWC memory order, and torch picks
    # other kernels (other rounding) for channels-last inputs
    return np.ascontiguousarray(array[None] if mode == "L" else array.transpose(2, 0, 1))


def _wide_array(
    img: Image.Image, wide: WideSamples, path: Path, mode: str, image_size: int | None
) -> np.ndarray:
    """An image of samples wider than 8 bits as a float32 (C, H, W) array in [0, 1]: scaled
    first, then resized in float (Pillow's mode F), so no precision is lost to 8 or 16 bits."""
    x = wide_pixels(img, wide, path)
    if image_size is not None and x.shape != (image_size, image_size):
        resized = Image.fromarray(x).resize((image_size, image_size), Image.Resampling.BILINEAR)
        # the filter's weights sum to 1 only up to rounding: keep the result inside [0, 1]
        x = np.clip(np.asarray(resized, dtype=np.float32), 0, 1)
    return np.ascontiguousarray(x[None] if mode == "L" else np.repeat(x[None], 3, axis=0))

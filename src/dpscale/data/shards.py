"""Prepared shards: decoded, fixed-size images in ``.npy`` files read by memory mapping.

``dpscale data prepare SRC DEST --size S`` decodes an image folder once (``folder.image_array``:
the pixels the folder loaders would produce) into ``DEST/<split>-NNNNN.npy`` arrays of shape
(count, C, S, S) plus ``<split>-labels.npy`` and a ``manifest.json`` holding the classes, the split,
the counts, the pixel type and each file's SHA-256. Reading an example is then a slice of a memory
map: no decoding. The pixels are uint8, or float32 in [0, 1] when the folder holds images with
samples wider than 8 bits (16-bit PNGs); a manifest without ``dtype`` is uint8.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .folder import FolderListing, decoder_pool, image_array
from .formats import DatasetError, require_two_classes

MANIFEST_NAME = "manifest.json"
USER_IDS_NAME = "train-user-ids.npy"  # each training image's user, when the folder named them
FORMAT = "dpscale-shards"
VERSION = 1
SHARD_BYTES = 1 << 30  # about 1 GiB of pixels per shard file
# opening checks every checksum of a set up to this size (else sizes only)
VERIFY_LIMIT_BYTES = 4 << 30
DTYPES = ("uint8", "float32")  # the pixel types image_array produces


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _decode_chunk(args: tuple[list[Path], str, int, str]) -> np.ndarray:
    files, mode, size, dtype = args
    return np.stack([image_array(p, mode, size, dtype) for p in files])


def _write_split(
    dest: Path,
    split: str,
    files: tuple[Path, ...],
    labels: np.ndarray,
    listing: FolderListing,
    size: int,
    workers: int,
    progress: Callable[[int], None],
) -> dict:
    """Decode ``files`` (of ``listing``) into shard files of ``split``; returns its manifest entry."""
    mode, dtype = listing.mode, listing.dtype
    channels = 1 if mode == "L" else 3
    per_shard = max(1, SHARD_BYTES // (channels * size * size * np.dtype(dtype).itemsize))
    batch = 256
    shards: list[dict[str, str | int]] = []  # the manifest's entry of each shard file
    with decoder_pool(workers) as pool:
        for first in range(0, max(len(files), 1), per_shard):
            part = files[first : first + per_shard]
            name = f"{split}-{len(shards):05d}.npy"
            array = np.lib.format.open_memmap(
                dest / name, mode="w+", dtype=dtype, shape=(len(part), channels, size, size)
            )
            jobs = [
                (list(part[i : i + batch]), mode, size, dtype) for i in range(0, len(part), batch)
            ]
            for i, decoded in zip(range(0, len(part), batch), pool.map(_decode_chunk, jobs)):
                array[i : i + len(decoded)] = decoded
                progress(len(decoded))
            array.flush()
            del array
            shards.append({"file": name, "count": len(part), "sha256": _sha256(dest / name)})
    labels_name = f"{split}-labels.npy"
    np.save(dest / labels_name, labels.astype(np.int64))
    return {
        "count": len(files),
        "labels": labels_name,
        "labels_sha256": _sha256(dest / labels_name),
        "shards": shards,
    }


def prepare_shards(
    listing: FolderListing,
    dest: str | os.PathLike,
    size: int,
    *,
    workers: int = 1,
    progress: Callable[[int], None] = lambda n: None,
) -> Path:
    """Write ``listing``'s images, decoded and resized to ``size`` squared, as shards in ``dest``.

    Args:
        listing: the folder (``folder.list_image_folder``), its split already made.
        dest: a new or empty directory.
        size: the square side in pixels.
        workers: decoding processes.
        progress: called with the number of images written after each batch.

    Returns:
        The manifest's path (written last, atomically: a half-written set has none).
    """
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise DatasetError(f"{dest} exists and is not empty; prepare into a new directory")
    if size <= 0:
        raise DatasetError(f"--size must be positive, got {size}")
    dest.mkdir(parents=True, exist_ok=True)
    splits = {
        split: _write_split(dest, split, files, labels, listing, size, workers, progress)
        for split, files, labels in (
            ("train", listing.train_files, listing.train_labels),
            ("test", listing.test_files, listing.test_labels),
        )
    }
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "image_shape": [1 if listing.mode == "L" else 3, size, size],
        "dtype": listing.dtype,
        "classes": list(listing.classes),
        "source": str(listing.root),
        "test_split": listing.test_split,
        "skipped_files": list(listing.skipped),
        "splits": splits,
    }
    if listing.train_users is not None:  # the image folder's users.csv: the privacy unit user
        np.save(dest / USER_IDS_NAME, listing.train_users)
        splits["train"].update(
            user_ids=USER_IDS_NAME, user_ids_sha256=_sha256(dest / USER_IDS_NAME)
        )
    path = dest / MANIFEST_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class ShardSplit:
    """One split of a prepared set: labels in memory, images as read-only memory maps."""

    labels: np.ndarray
    arrays: tuple[np.ndarray, ...]
    starts: np.ndarray  # index of each shard's first image
    user_ids: np.ndarray | None = None  # each image's user (train split of a folder with users.csv)

    def __len__(self) -> int:
        return len(self.labels)

    def read(self, index: int) -> np.ndarray:
        """Image ``index`` as a (C, H, W) array of the set's dtype (a copy: the map stays read-only)."""
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        return np.array(self.arrays[shard][index - self.starts[shard]])


def _bad(dest: Path, why: str) -> DatasetError:
    return DatasetError(
        f"bad prepared data in {dest}: {why} (re-run `dpscale data prepare` into a new directory)"
    )


def _read_manifest(dest: Path) -> dict:
    path = dest / MANIFEST_NAME
    if not path.is_file():
        raise _bad(dest, f"no {MANIFEST_NAME} (not prepared, or preparation did not finish)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _bad(dest, f"{MANIFEST_NAME} is not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise _bad(dest, f"{MANIFEST_NAME} is not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise _bad(
            dest,
            f"manifest version {manifest.get('version')!r}; this dpscale reads version {VERSION}",
        )
    for key in ("image_shape", "classes", "splits"):
        if key not in manifest:
            raise _bad(dest, f"manifest has no {key!r}")
    # written before float sets existed: uint8
    if manifest.setdefault("dtype", "uint8") not in DTYPES:
        raise _bad(dest, f"manifest dtype {manifest['dtype']!r} is none of {', '.join(DTYPES)}")
    return manifest


def _open_split(dest: Path, split: str, entry: dict, manifest: dict, verify: bool) -> ShardSplit:
    shape, classes, dtype = (
        tuple(int(d) for d in manifest["image_shape"]),
        len(manifest["classes"]),
        manifest["dtype"],
    )
    try:
        labels_path, shards = dest / entry["labels"], entry["shards"]
        names = [s["file"] for s in shards]
        counts = [int(s["count"]) for s in shards]
        if sum(counts) != int(entry["count"]):
            raise _bad(
                dest,
                f"{split}: shard counts add up to {sum(counts)}, manifest says {entry['count']}",
            )
        checks = [(labels_path, entry["labels_sha256"])] + [
            (dest / s["file"], s["sha256"]) for s in shards
        ]
        if "user_ids" in entry:
            checks.append((dest / entry["user_ids"], entry["user_ids_sha256"]))
    except (KeyError, TypeError, ValueError) as e:
        raise _bad(dest, f"{split} entry of the manifest is malformed ({e!r})") from e
    for path, digest in checks:
        if not path.is_file():
            raise _bad(dest, f"{path.name} is missing")
        if verify and _sha256(path) != digest:
            raise _bad(dest, f"{path.name} does not match its SHA-256 in the manifest")
    labels = np.load(labels_path)
    if labels.shape != (int(entry["count"]),) or (
        len(labels) and (labels.min() < 0 or labels.max() >= classes)
    ):
        raise _bad(
            dest,
            f"{labels_path.name} holds {labels.shape} labels, want {entry['count']} in 0..{classes - 1}",
        )
    arrays = []
    for name, count in zip(names, counts):
        try:
            array = np.load(dest / name, mmap_mode="r")
        except ValueError as e:
            raise _bad(dest, f"{name} is not a readable .npy file ({e})") from e
        if array.dtype != np.dtype(dtype) or array.shape != (count, *shape):
            raise _bad(
                dest,
                f"{name} is {array.dtype} {array.shape}, the manifest says {dtype} {(count, *shape)}",
            )
        arrays.append(array)
    users = np.load(dest / entry["user_ids"], allow_pickle=False) if "user_ids" in entry else None
    if users is not None and users.shape != labels.shape:
        raise _bad(
            dest, f"{entry['user_ids']} holds {users.shape} user ids for {len(labels)} images"
        )
    return ShardSplit(
        labels.astype(np.int64), tuple(arrays), np.cumsum([0, *counts[:-1]], dtype=np.int64), users
    )


def open_shards(
    dest: str | os.PathLike, verify: bool | None = None
) -> tuple[dict, ShardSplit, ShardSplit]:
    """Open a prepared set after checking its manifest.

    Args:
        dest: the directory ``prepare_shards`` wrote.
        verify: check every file's SHA-256 (None: when the set is at most 4 GiB; larger sets
            get the cheap checks only: sizes, shapes, labels).

    Returns:
        (manifest, train split, test split).
    """
    dest = Path(dest)
    manifest = _read_manifest(dest)
    shape = tuple(int(d) for d in manifest["image_shape"])
    splits = manifest["splits"]
    if not isinstance(splits, dict) or set(splits) != {"train", "test"}:
        raise _bad(dest, "manifest splits must be exactly 'train' and 'test'")
    if verify is None:
        total = (
            sum(int(s.get("count", 0)) for s in splits.values())
            * int(np.prod(shape))
            * np.dtype(manifest["dtype"]).itemsize
        )
        verify = total <= VERIFY_LIMIT_BYTES
    train, test = (
        _open_split(dest, name, splits[name], manifest, verify) for name in ("train", "test")
    )
    if len(train) == 0:
        raise _bad(dest, "no training images")
    # not _bad: preparing again cannot add a class
    require_two_classes(train.labels, f"prepared data in {dest}", manifest["classes"])
    return manifest, train, test

"""Synthetic dataset files in the formats the loaders read (IDX, CIFAR pickles, an image folder),
shared by test_data, test_stream and test_presets. Import it as ``from datafiles import ...``."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
from PIL import Image


def write_idx(
    path: Path, arr: np.ndarray, magic: int | None = None, gz: bool = False, cut: int = 0
) -> Path:
    arr = np.asarray(arr, dtype=np.uint8)
    if magic is None:
        magic = 0x803 if arr.ndim == 3 else 0x801
    blob = struct.pack(">I" + "I" * arr.ndim, magic, *arr.shape) + arr.tobytes()
    blob = blob[: len(blob) - cut]
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(blob))
    else:
        path.write_bytes(blob)
    return path


def write_batch(
    path: Path, n: int, label_key: bytes, num_classes: int, seed: int, protocol: int = 2
):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    labels = [int(v) for v in rng.integers(0, num_classes, n)]
    with open(path, "wb") as f:
        pickle.dump({b"batch_label": b"x", b"data": data, label_key: labels}, f, protocol=protocol)
    return data, labels


def make_cifar10(base: Path) -> tuple[np.ndarray, list[int]]:
    base.mkdir(parents=True)
    parts = [write_batch(base / f"data_batch_{i}", 3, b"labels", 10, i) for i in range(1, 6)]
    write_batch(base / "test_batch", 4, b"labels", 10, 99, protocol=5)
    return np.concatenate([p[0] for p in parts]), sum((p[1] for p in parts), [])


def write_image_folder(root, per_class=12, size=12, classes=3):
    rng = np.random.default_rng(0)
    for c in range(classes):
        folder = root / f"class{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            base = np.zeros((size, size, 3), np.uint8)
            base[..., c] = 150
            pixels = np.clip(base + rng.integers(0, 100, (size, size, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"{i:03d}.jpg", quality=90)
    return root

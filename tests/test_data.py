"""Tests for dpscale.data: embedded MNIST sample, IDX, CIFAR pickles, image folders, npz."""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dpscale.data import (
    DATASET_NAMES,
    DatasetError,
    ImageDataset,
    load_cifar,
    load_dataset,
    load_idx,
    load_image_folder,
    load_mnist_5k,
    load_npz,
)

from datafiles import make_cifar10, write_batch, write_idx
from helpers import SHARED_DATA


def check_contract(ds: ImageDataset) -> None:
    """Invariants every loader promises."""
    info = ds.info
    for x, y, n in (
        (ds.x_train, ds.y_train, info.num_train),
        (ds.x_test, ds.y_test, info.num_test),
    ):
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        assert x.is_contiguous()
        assert x.shape == (n, *info.input_shape) and y.shape == (n,)
        if n:
            assert 0.0 <= x.min() and x.max() <= 1.0
            assert 0 <= y.min() and y.max() < info.num_classes


def row_hashes(x: torch.Tensor) -> set[bytes]:
    return {hashlib.sha1(r.numpy().tobytes()).digest() for r in x.reshape(len(x), -1)}


# --------------------------------------------------------------------------- mnist-5k


@pytest.fixture(scope="module")
def mnist5k() -> ImageDataset:
    return load_mnist_5k()


def test_mnist5k_shapes_and_values(mnist5k: ImageDataset) -> None:
    check_contract(mnist5k)
    assert mnist5k.x_train.shape == (4000, 1, 28, 28)
    assert mnist5k.x_test.shape == (1000, 1, 28, 28)
    assert mnist5k.info.num_classes == 10 and mnist5k.info.name == "mnist-5k"
    assert "seed 0" in mnist5k.info.test_split
    # Stratified: every class appears, 100 per class in test.
    assert torch.bincount(mnist5k.y_test, minlength=10).tolist() == [100] * 10
    assert torch.bincount(mnist5k.y_train, minlength=10).tolist() == [400] * 10
    # Real digits: values are k/255, mostly background, with real ink.
    assert torch.allclose(mnist5k.x_train * 255, (mnist5k.x_train * 255).round(), atol=1e-4)
    assert 0.05 < mnist5k.x_train.mean() < 0.25


def test_mnist5k_train_test_disjoint(mnist5k: ImageDataset) -> None:
    assert not row_hashes(mnist5k.x_train) & row_hashes(mnist5k.x_test)


def test_mnist5k_deterministic_across_calls_and_processes(mnist5k: ImageDataset) -> None:
    again = load_dataset("mnist-5k")
    for a, b in zip(
        (mnist5k.x_train, mnist5k.y_train, mnist5k.x_test, mnist5k.y_test),
        (again.x_train, again.y_train, again.x_test, again.y_test),
    ):
        assert torch.equal(a, b)
    code = (
        "import hashlib; from dpscale.data import load_mnist_5k; d = load_mnist_5k(); "
        "print(hashlib.sha1(d.x_test.numpy().tobytes() + d.y_test.numpy().tobytes()).hexdigest())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert (
        out
        == hashlib.sha1(
            mnist5k.x_test.numpy().tobytes() + mnist5k.y_test.numpy().tobytes()
        ).hexdigest()
    )


def test_load_dataset_names_and_root() -> None:
    assert DATASET_NAMES == (
        "mnist-5k",
        "mnist",
        "fashion-mnist",
        "cifar10",
        "cifar100",
        "imagefolder",
        "shards",
        "npz",
    )
    with pytest.raises(DatasetError, match="valid names: mnist-5k, mnist"):
        load_dataset("imagenet")
    with pytest.raises(DatasetError, match="needs root"):
        load_dataset("cifar10")


def test_load_dataset_image_size_resizes(mnist5k: ImageDataset) -> None:
    ds = load_dataset("mnist-5k", image_size=32)
    check_contract(ds)
    assert ds.x_train.shape == (4000, 1, 32, 32) and ds.info.input_shape == (1, 32, 32)
    assert torch.equal(ds.y_train, mnist5k.y_train)


# --------------------------------------------------------------------------- IDX


def make_idx_dir(
    root: Path, n_train: int = 60, n_test: int = 12, gz: bool = False, with_test: bool = True
):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (n_train, 5, 4), dtype=np.uint8)
    y = np.arange(n_train) % 10
    write_idx(root / "train-images-idx3-ubyte", x, gz=gz)
    write_idx(root / "train-labels-idx1-ubyte", y, gz=gz)
    xt, yt = x[:n_test][:, ::-1].copy(), y[:n_test][::-1].copy()
    if with_test:
        write_idx(root / "t10k-images-idx3-ubyte", xt, gz=gz)
        write_idx(root / "t10k-labels-idx1-ubyte", yt, gz=gz)
    return x, y, xt, yt


@pytest.mark.parametrize("gz", [False, True])
def test_idx_round_trip(tmp_path: Path, gz: bool) -> None:
    x, y, xt, yt = make_idx_dir(tmp_path, gz=gz)
    ds = load_idx(tmp_path, name="fashion-mnist")
    check_contract(ds)
    assert ds.info.name == "fashion-mnist" and ds.info.test_split == "official"
    assert ds.info.input_shape == (1, 5, 4) and ds.info.num_classes == 10
    assert torch.allclose(ds.x_train[:, 0] * 255, torch.from_numpy(x).float())
    assert torch.equal(ds.y_train, torch.from_numpy(y))
    assert torch.allclose(ds.x_test[:, 0] * 255, torch.from_numpy(xt).float())
    assert torch.equal(ds.y_test, torch.from_numpy(yt))


def test_idx_holdout_without_t10k(tmp_path: Path) -> None:
    x, y, _, _ = make_idx_dir(tmp_path, n_train=120, with_test=False)
    ds = load_dataset("mnist", tmp_path)
    check_contract(ds)
    assert (ds.info.num_train, ds.info.num_test) == (100, 20)
    assert "held out 20 of 120" in ds.info.test_split
    assert torch.bincount(ds.y_test, minlength=10).tolist() == [2] * 10
    # Train and test partition the original images exactly.
    all_rows = row_hashes(torch.from_numpy(x).float() / 255)
    assert row_hashes(ds.x_train) | row_hashes(ds.x_test) == all_rows
    assert not row_hashes(ds.x_train) & row_hashes(ds.x_test)
    again = load_idx(tmp_path)
    assert torch.equal(again.x_test, ds.x_test)


def test_idx_truncated(tmp_path: Path) -> None:
    make_idx_dir(tmp_path)
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((60, 5, 4)), cut=7)
    with pytest.raises(
        DatasetError,
        match=r"train-images-idx3-ubyte is truncated: header says 60 images of 5x4 = 1200 bytes, file has 1193",
    ):
        load_idx(tmp_path)


def test_idx_truncated_gzip_stream(tmp_path: Path) -> None:
    make_idx_dir(tmp_path, gz=True)
    p = tmp_path / "t10k-images-idx3-ubyte.gz"
    p.write_bytes(p.read_bytes()[:-20])
    with pytest.raises(DatasetError, match="t10k-images-idx3-ubyte.gz"):
        load_idx(tmp_path)


def test_idx_bad_magic(tmp_path: Path) -> None:
    make_idx_dir(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(12), magic=0x802)
    with pytest.raises(
        DatasetError,
        match=r"t10k-labels-idx1-ubyte is not an IDX label file: magic number 0x00000802",
    ):
        load_idx(tmp_path)


def test_idx_count_mismatch_names_both_files(tmp_path: Path) -> None:
    make_idx_dir(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(59))
    with pytest.raises(
        DatasetError,
        match="train-images-idx3-ubyte has 60 images but .*train-labels-idx1-ubyte has 59",
    ):
        load_idx(tmp_path)


def test_idx_label_out_of_range(tmp_path: Path) -> None:
    make_idx_dir(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.r_[np.zeros(11), 10])
    with pytest.raises(
        DatasetError, match="t10k-labels-idx1-ubyte is mislabeled: .*found 10 at index 11"
    ):
        load_idx(tmp_path)


def test_idx_missing_files(tmp_path: Path) -> None:
    make_idx_dir(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte").unlink()
    with pytest.raises(
        DatasetError, match=r"missing training file\(s\) .*train-labels-idx1-ubyte\[\.gz\]"
    ):
        load_idx(tmp_path)
    make_idx_dir(tmp_path)
    (tmp_path / "t10k-images-idx3-ubyte").unlink()
    with pytest.raises(DatasetError, match="t10k-images-idx3-ubyte.* is missing"):
        load_idx(tmp_path)
    with pytest.raises(DatasetError, match="does not exist"):
        load_idx(tmp_path / "nowhere")


@pytest.mark.skipif(
    not (SHARED_DATA / "mnist-10k").is_dir(), reason="../shared/data/mnist-10k not present"
)
def test_real_mnist_10k() -> None:
    ds = load_dataset("mnist", SHARED_DATA / "mnist-10k")
    check_contract(ds)
    assert (ds.info.num_train, ds.info.num_test) == (8000, 2000)
    assert ds.info.test_split == "official" and ds.info.input_shape == (1, 28, 28)
    assert set(ds.y_test.tolist()) == set(range(10))


@pytest.mark.skipif(
    not (SHARED_DATA / "fashion-mnist").is_dir(), reason="../shared/data/fashion-mnist not present"
)
def test_real_fashion_mnist_holdout() -> None:
    ds = load_dataset("fashion-mnist", SHARED_DATA / "fashion-mnist")
    check_contract(ds)
    assert (ds.info.num_train, ds.info.num_test) == (50000, 10000)
    assert "held out 10000 of 60000" in ds.info.test_split
    assert torch.bincount(ds.y_test, minlength=10).tolist() == [1000] * 10


# --------------------------------------------------------------------------- CIFAR


@pytest.mark.parametrize("pass_parent", [False, True])
def test_cifar10_round_trip(tmp_path: Path, pass_parent: bool) -> None:
    data, labels = make_cifar10(tmp_path / "cifar-10-batches-py")
    ds = load_dataset("cifar10", tmp_path if pass_parent else tmp_path / "cifar-10-batches-py")
    check_contract(ds)
    assert (ds.info.num_train, ds.info.num_test, ds.info.num_classes) == (15, 4, 10)
    assert ds.info.input_shape == (3, 32, 32)
    assert ds.y_train.tolist() == labels
    # CHW row-major: pixel (c, h, w) of image i is data[i, c*1024 + h*32 + w].
    assert ds.x_train[7, 2, 5, 9] * 255 == pytest.approx(float(data[7, 2 * 1024 + 5 * 32 + 9]))
    assert torch.allclose(ds.x_train.reshape(15, -1) * 255, torch.from_numpy(data).float())


def test_cifar100_round_trip(tmp_path: Path) -> None:
    base = tmp_path / "cifar-100-python"
    base.mkdir()
    data, labels = write_batch(base / "train", 6, b"fine_labels", 100, 0, protocol=4)
    write_batch(base / "test", 2, b"fine_labels", 100, 1)
    ds = load_cifar(tmp_path, num_classes=100)
    check_contract(ds)
    assert ds.info.name == "cifar100" and ds.info.num_classes == 100
    assert ds.y_train.tolist() == labels
    assert torch.allclose(ds.x_train.reshape(6, -1) * 255, torch.from_numpy(data).float())


def test_cifar_errors(tmp_path: Path) -> None:
    base = tmp_path / "cifar-10-batches-py"
    make_cifar10(base)
    (base / "data_batch_3").unlink()
    with pytest.raises(DatasetError, match="missing batch file.*data_batch_3"):
        load_cifar(tmp_path)
    write_batch(base / "data_batch_3", 3, b"labels", 12, 0)
    with pytest.raises(DatasetError, match="data_batch_3 is mislabeled"):
        load_cifar(tmp_path)
    with open(base / "data_batch_3", "wb") as f:
        pickle.dump({b"data": np.zeros((3, 1024), np.uint8), b"labels": [0, 1, 2]}, f)
    with pytest.raises(DatasetError, match=r"data_batch_3: 'data' has shape \(3, 1024\)"):
        load_cifar(tmp_path)
    (base / "data_batch_3").write_bytes(b"not a pickle at all")
    with pytest.raises(DatasetError, match="data_batch_3 could not be unpickled"):
        load_cifar(tmp_path)


def test_cifar_reads_numpy1_pickles(tmp_path: Path) -> None:
    """The official batches were pickled by Python 2 / numpy 1.x, naming numpy.core.multiarray."""
    base = tmp_path / "cifar-10-batches-py"
    make_cifar10(base)
    data = np.arange(2 * 3072).reshape(2, 3072).astype(np.uint8)
    blob = pickle.dumps({b"data": data, b"labels": [3, 9]}, protocol=2)
    (base / "test_batch").write_bytes(
        blob.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    )
    ds = load_cifar(base)
    assert ds.y_test.tolist() == [3, 9]
    assert torch.allclose(ds.x_test.reshape(2, -1) * 255, torch.from_numpy(data).float())


class _Evil:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (self.target,))


def test_cifar_refuses_code_execution(tmp_path: Path) -> None:
    base = tmp_path / "cifar-10-batches-py"
    make_cifar10(base)
    marker = tmp_path / "pwned"
    with open(base / "test_batch", "wb") as f:
        pickle.dump({b"data": _Evil(str(marker)), b"labels": []}, f)
    with pytest.raises(DatasetError, match="test_batch could not be unpickled.*refusing"):
        load_cifar(base)
    assert not marker.exists()


# --------------------------------------------------------------------------- image folder


def write_png(path: Path, value: int, size=(6, 4), mode: str = "RGB") -> np.ndarray:
    path.parent.mkdir(parents=True, exist_ok=True)
    channels = 3 if mode == "RGB" else 1
    arr = (
        np.arange(size[0] * size[1] * channels).reshape(size[1], size[0], channels) + value
    ) % 256
    arr = arr.astype(np.uint8)
    Image.fromarray(arr if mode == "RGB" else arr[..., 0], mode=mode).save(path)
    return arr


def test_image_folder_train_test_layout(tmp_path: Path) -> None:
    a = write_png(tmp_path / "train" / "cat" / "a.png", 10)
    write_png(tmp_path / "train" / "cat" / "b.jpg", 20)  # decoded lossy, only shapes checked
    write_png(tmp_path / "train" / "dog" / "c.png", 30)
    write_png(tmp_path / "test" / "cat" / "d.png", 40)
    e = write_png(tmp_path / "test" / "dog" / "e.png", 50)
    (tmp_path / "train" / "dog" / "notes.txt").write_text("ignored")
    ds = load_dataset("imagefolder", tmp_path)
    check_contract(ds)
    assert ds.info.input_shape == (3, 4, 6) and ds.info.num_classes == 2
    assert ds.y_train.tolist() == [0, 0, 1] and ds.y_test.tolist() == [0, 1]
    assert ds.info.test_split == "official"
    assert torch.allclose(
        ds.x_train[0] * 255, torch.from_numpy(a).permute(2, 0, 1).float(), atol=1e-3
    )
    assert torch.allclose(
        ds.x_test[1] * 255, torch.from_numpy(e).permute(2, 0, 1).float(), atol=1e-3
    )


def test_image_folder_flat_layout_grayscale_holdout(tmp_path: Path) -> None:
    for c in ("b_one", "a_zero"):
        for i in range(10):
            write_png(tmp_path / c / f"{i}.png", i + (100 if c == "b_one" else 0), mode="L")
    ds = load_image_folder(tmp_path)
    check_contract(ds)
    assert ds.info.input_shape == (1, 4, 6)

    # an image is held out iff BLAKE2b(its path relative to the root, the split's key) / 2^64 < 0.2 (issue 62)
    def digest(p):
        return hashlib.blake2b(p.encode(), key=b"dpscale held-out split 0", digest_size=8).digest()

    held = [
        (c, i)
        for c in ("a_zero", "b_one")
        for i in range(10)
        if int.from_bytes(digest(f"{c}/{i}.png"), "little") < 0.2 * 2**64
    ]
    assert (ds.info.num_train, ds.info.num_test) == (20 - len(held), len(held)) == (14, 6)
    assert (
        "held out 6 of 20 images (each held out iff a keyed hash of its path < 0.2"
        in ds.info.test_split
    )
    assert ds.y_test.tolist() == [0 if c == "a_zero" else 1 for c, _ in held]
    assert (ds.x_test[:, 0, 0, 0] * 255).round().tolist() == [
        i + (100 if c == "b_one" else 0) for c, i in held
    ]
    # Class 0 is "a_zero" (sorted names): its images have small first pixels.
    assert (ds.x_train[ds.y_train == 0][:, 0, 0, 0] * 255 < 10).all()
    assert torch.equal(load_image_folder(tmp_path).x_test, ds.x_test)


def test_image_folder_sizes(tmp_path: Path) -> None:
    write_png(tmp_path / "train" / "x" / "a.png", 0, size=(6, 4))
    write_png(tmp_path / "train" / "y" / "b.png", 0, size=(5, 5))
    write_png(tmp_path / "test" / "x" / "c.png", 0, size=(6, 4))
    write_png(tmp_path / "test" / "y" / "d.png", 0, size=(6, 4))
    with pytest.raises(DatasetError, match=r"b\.png is 5x5 but .*a\.png is 6x4; pass image_size"):
        load_image_folder(tmp_path)
    ds = load_image_folder(tmp_path, image_size=8)
    check_contract(ds)
    assert ds.x_train.shape == (2, 3, 8, 8) and ds.info.input_shape == (3, 8, 8)


def test_image_folder_errors(tmp_path: Path) -> None:
    write_png(tmp_path / "train" / "x" / "a.png", 0)
    write_png(tmp_path / "test" / "x" / "b.png", 0)
    (tmp_path / "train" / "y").mkdir()
    with pytest.raises(DatasetError, match=r"class folder .*train/y contains no images"):
        load_image_folder(tmp_path)
    (tmp_path / "train" / "y" / "bad.png").write_bytes(b"\x89PNG garbage")
    with pytest.raises(DatasetError, match="class folders"):  # test/ lacks class y
        load_image_folder(tmp_path)
    write_png(tmp_path / "test" / "y" / "c.png", 0)
    with pytest.raises(DatasetError, match=r"could not read image .*bad\.png"):
        load_image_folder(tmp_path)


# --------------------------------------------------------------------------- npz


def test_npz_nhwc_uint8_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (5, 7, 6, 3), dtype=np.uint8)
    xt = rng.integers(0, 256, (2, 7, 6, 3), dtype=np.uint8)
    p = tmp_path / "d.npz"
    np.savez(
        p,
        x_train=x,
        y_train=np.array([[0], [4], [1], [2], [0]]),
        x_test=xt,
        y_test=np.array([3, 1]),
    )
    ds = load_dataset("npz", p)
    check_contract(ds)
    assert ds.info.input_shape == (3, 7, 6) and ds.info.num_classes == 5
    assert ds.y_train.tolist() == [0, 4, 1, 2, 0]
    assert torch.allclose(
        ds.x_train * 255, torch.from_numpy(x).permute(0, 3, 1, 2).float(), atol=1e-4
    )


def test_npz_nchw_float_and_nhw(tmp_path: Path) -> None:
    x = np.random.default_rng(0).random((4, 1, 5, 5)).astype(np.float64)
    p = tmp_path / "d.npz"
    np.savez(p, x_train=x, y_train=np.arange(4), x_test=x[:2, 0], y_test=np.array([0, 1], np.uint8))
    ds = load_npz(p)
    check_contract(ds)
    assert ds.info.input_shape == (1, 5, 5) and ds.info.num_classes == 4
    assert torch.allclose(ds.x_train, torch.from_numpy(x).float())
    assert torch.allclose(ds.x_test, torch.from_numpy(x[:2]).float())
    ds32 = load_dataset("npz", p, image_size=8)
    check_contract(ds32)
    assert ds32.x_train.shape == (4, 1, 8, 8)


def test_npz_errors(tmp_path: Path) -> None:
    x = np.zeros((3, 4, 4), np.uint8)
    p = tmp_path / "d.npz"
    np.savez(p, x_train=x, y_train=np.arange(3), x_test=x)
    with pytest.raises(DatasetError, match=r"d\.npz is missing key 'y_test'"):
        load_npz(p)
    np.savez(p, x_train=x, y_train=np.arange(2), x_test=x, y_test=np.arange(3))
    with pytest.raises(DatasetError, match=r"d\.npz: x_train has 3 images but y_train has 2"):
        load_npz(p)
    np.savez(p, x_train=x + 2.0, y_train=np.arange(3), x_test=x, y_test=np.arange(3))
    with pytest.raises(DatasetError, match=r"float x_train must lie in \[0, 1\]"):
        load_npz(p)
    np.savez(p, x_train=x, y_train=np.array([0.0, 1.0, 2.0]), x_test=x, y_test=np.arange(3))
    with pytest.raises(DatasetError, match="y_train has dtype float64"):
        load_npz(p)
    np.savez(p, x_train=x, y_train=np.array([0, -1, 2]), x_test=x, y_test=np.arange(3))
    with pytest.raises(DatasetError, match="mislabeled"):
        load_npz(p)

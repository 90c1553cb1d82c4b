"""A user's data, read faithfully or refused in one line (issue 42, rows 1, 4 and 8c).

Row 1: 16-bit grayscale PNGs went through Pillow's I;16 -> L conversion, which clips: 99.6% of
pixels became 1.0 (folder loader and ``dpscale data prepare``). Images with samples wider than
8 bits must be scaled by their type's full scale, in float; what cannot be read faithfully is
refused naming the file and mode.
Row 4: a stray label 12 made a 13-class model, and a test split with classes never trained on
was evaluated, both silently. Each split's labels are now printed, and both are refused unless
``data.num_classes`` declares K.
Row 8c: one NaN pixel in an npz said "found nan..nan"; it must say "1 NaN pixel in x_train[17]".
"""

from __future__ import annotations

import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dpscale.cli import main
from dpscale.config import load_config
from dpscale.data import DatasetError, load_dataset, load_npz
from dpscale.data.run_data import open_training_data
from dpscale.data.stream import open_stream, to_model_input
from dpscale.errors import ConfigError
from helpers import one_line_error

CHEAP = ["model.name=linear", "dp.batch_size=4", "train.steps=2", "train.self_check=false"]


@pytest.fixture(autouse=True)
def _no_debug_tracebacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """DPSCALE_DEBUG=1 would turn the one-line errors under test into tracebacks."""
    monkeypatch.delenv("DPSCALE_DEBUG", raising=False)


def _scaled(a: np.ndarray, full_scale: float) -> np.ndarray:
    """What a faithful reader gives: value / full scale in float64, rounded once to float32."""
    return (a.astype(np.float64) / full_scale).astype(np.float32)


def _png16_rgb(path: Path, a: np.ndarray) -> None:
    """A 16-bit-per-channel RGB PNG, written by hand (Pillow cannot write one)."""
    h, w, _ = a.shape
    rows = b"".join(b"\x00" + a[i].astype(">u2").tobytes() for i in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


def _tiff_uint32(path: Path, a: np.ndarray) -> None:
    """An unsigned 32-bit grayscale TIFF, written by hand (Pillow writes mode I as signed)."""
    h, w = a.shape
    data = a.astype("<u4").tobytes()
    tags = [
        (256, w),
        (257, h),
        (258, 32),
        (259, 1),
        (262, 1),
        (273, 8 + 2 + 12 * 10 + 4),
        (277, 1),
        (278, h),
        (279, len(data)),
        (339, 1),
    ]
    ifd = struct.pack("<H", len(tags)) + b"".join(
        struct.pack("<HHII", tag, 4, 1, value) for tag, value in tags
    )
    path.write_bytes(b"II*\x00" + struct.pack("<I", 8) + ifd + struct.pack("<I", 0) + data)


def _folder(
    root: Path, images: dict[str, list[np.ndarray]], write=lambda a, p: Image.fromarray(a).save(p)
) -> None:
    """``root/train/<class>/NN.png`` from all but the last image of each class, ``root/test/...``
    from the last: an official split, so the loaders keep this order."""
    for cls, arrays in images.items():
        for split, part in (("train", arrays[:-1]), ("test", arrays[-1:])):
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i, a in enumerate(part):
                write(a, root / split / cls / f"{i:02d}.png")


# --------------------------------------------------------------------------- row 1: 16-bit images


def _grey16(seed: int, count: int) -> list[np.ndarray]:
    """Mid-grey 16-bit images (25000..40000: every one clipped to 255 by an I;16 -> L conversion)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(25000, 40001, (8, 8), dtype=np.uint16) for _ in range(count)]


def test_16bit_pngs_load_divided_by_65535_in_the_folder_loader_and_the_stream(tmp_path):
    images = {"a": _grey16(0, 4), "b": _grey16(1, 4)}
    _folder(tmp_path / "png16", images)
    # a real 16-bit PNG
    assert Image.open(tmp_path / "png16" / "train" / "a" / "00.png").mode == "I;16"
    ds = load_dataset("imagefolder", tmp_path / "png16")
    # the old loader clipped: mean 1.0 (every pixel white)
    assert abs(ds.x_train.mean().item() - 0.5) < 0.05
    train = np.stack([a[None] for c in "ab" for a in images[c][:-1]])
    test = np.stack([images[c][-1][None] for c in "ab"])
    assert ds.x_train.dtype == torch.float32 and np.array_equal(
        ds.x_train.numpy(), _scaled(train, 65535)
    )
    assert np.array_equal(ds.x_test.numpy(), _scaled(test, 65535))
    streamed = open_stream("imagefolder", tmp_path / "png16", normalize=False)
    pixels = to_model_input(
        torch.from_numpy(np.stack([streamed.train.read(i) for i in range(len(train))])), False
    )
    assert torch.equal(pixels, ds.x_train)


def test_data_prepare_writes_16bit_pngs_divided_by_65535(tmp_path, capsys):
    images = {"a": _grey16(2, 3), "b": _grey16(3, 3)}
    _folder(tmp_path / "png16", images)
    code = main(
        [
            "data",
            "prepare",
            str(tmp_path / "png16"),
            str(tmp_path / "shards"),
            "--size",
            "8",
            "--quiet",
            "--workers",
            "1",
        ]
    )
    assert code == 0 and "1x8x8 float32" in capsys.readouterr().out
    ds = load_dataset("shards", tmp_path / "shards")
    train = np.stack([a[None] for c in "ab" for a in images[c][:-1]])
    assert np.array_equal(ds.x_train.numpy(), _scaled(train, 65535))  # the old shards: all 1.0
    assert np.array_equal(
        ds.x_test.numpy(), _scaled(np.stack([images[c][-1][None] for c in "ab"]), 65535)
    )


def test_a_folder_mixing_8bit_rgb_and_16bit_grey_scales_each_by_its_own_type(tmp_path):
    rng = np.random.default_rng(4)
    rgb = [rng.integers(0, 256, (8, 8, 3), dtype=np.uint8) for _ in range(3)]
    images = {"colour": rgb, "grey16": _grey16(5, 3)}
    _folder(tmp_path / "mixed", images)
    ds = load_dataset("imagefolder", tmp_path / "mixed")
    expected = [_scaled(a.transpose(2, 0, 1), 255) for a in rgb[:2]]
    expected += [np.repeat(_scaled(a, 65535)[None], 3, axis=0) for a in images["grey16"][:2]]
    assert np.array_equal(ds.x_train.numpy(), np.stack(expected))
    # resized in float: a constant 16-bit image stays its value / 65535
    (tmp_path / "flat" / "a").mkdir(parents=True)
    (tmp_path / "flat" / "b").mkdir(parents=True)
    for cls in "ab":
        for i in range(3):
            Image.fromarray(np.full((8, 8), 30000, np.uint16)).save(
                tmp_path / "flat" / cls / f"{i}.png"
            )
    small = load_dataset("imagefolder", tmp_path / "flat", image_size=4)
    assert small.x_train.shape[-2:] == (4, 4) and np.allclose(
        small.x_train.numpy(), 30000 / 65535, rtol=1e-6, atol=0
    )


def test_32bit_integer_and_float_tiffs_are_scaled_by_their_types_range(tmp_path):
    rng = np.random.default_rng(6)
    signed = [rng.integers(0, 2**31 - 1, (8, 8), dtype=np.int32) for _ in range(3)]
    unsigned = [rng.integers(0, 2**32 - 1, (8, 8), dtype=np.uint32) for _ in range(3)]
    floats = [rng.random((8, 8), dtype=np.float32) for _ in range(3)]
    _folder(
        tmp_path / "tiff",
        {"a": signed, "b": floats},
        write=lambda a, p: Image.fromarray(a).save(p.with_suffix(".tif")),
    )
    _folder(
        tmp_path / "tiff",
        {"c": unsigned},
        write=lambda a, p: _tiff_uint32(p.with_suffix(".tif"), a),
    )
    # unsigned
    assert Image.open(tmp_path / "tiff" / "train" / "c" / "00.tif").tile[0].args[0] == "I;32N"
    ds = load_dataset("imagefolder", tmp_path / "tiff")
    expected = (
        [_scaled(a, 2**31 - 1) for a in signed[:2]]
        + [a for a in floats[:2]]
        + [_scaled(a, 2**32 - 1) for a in unsigned[:2]]
    )
    assert np.array_equal(ds.x_train.numpy()[:, 0], np.stack(expected))


def test_images_that_cannot_be_read_faithfully_are_refused_naming_file_and_mode(tmp_path, capsys):
    grey = {"a": [np.zeros((8, 8), np.uint8)] * 3, "b": [np.zeros((8, 8), np.uint8)] * 3}
    _folder(tmp_path / "rgb16", grey)
    bad = tmp_path / "rgb16" / "train" / "b" / "01.png"
    _png16_rgb(bad, np.full((8, 8, 3), 40000, np.uint16))  # the old loader kept the high byte only
    argv = [
        "data",
        "prepare",
        str(tmp_path / "rgb16"),
        str(tmp_path / "out"),
        "--size",
        "8",
        "--quiet",
        "--workers",
        "1",
    ]
    one_line_error(
        capsys,
        argv,
        re.escape(str(bad)),
        "RGB image with more than 8 bits per sample",
        "else as 8-bit RGB",
    )
    # refused even with --skip-corrupt: the file is not damaged, and nothing is left out quietly
    one_line_error(capsys, [*argv, "--skip-corrupt"], re.escape(str(bad)), "more than 8 bits")
    _folder(tmp_path / "float", grey)
    bad = tmp_path / "float" / "train" / "a" / "00.tif"
    Image.fromarray(np.linspace(-0.5, 2.0, 64, dtype=np.float32).reshape(8, 8)).save(bad)
    argv[2:4] = [str(tmp_path / "float"), str(tmp_path / "out2")]
    one_line_error(
        capsys,
        argv,
        re.escape(str(bad)),
        r"32-bit float image \(mode F\) with pixels -0\.5\.\.2",
        r"\[0, 1\]",
    )
    negative = tmp_path / "float" / "train" / "a" / "00.tif"
    Image.fromarray(np.full((8, 8), -7, np.int32)).save(negative)
    with pytest.raises(
        DatasetError, match=f"{re.escape(str(negative))}: signed 32-bit image .* pixels -7\\.\\.-7"
    ):
        load_dataset("imagefolder", tmp_path / "float")


# --------------------------------------------------------------------------- row 4: labels


def _npz(path: Path, y_train: list[int], y_test: list[int]) -> Path:
    rng = np.random.default_rng(7)
    x = rng.integers(0, 256, (len(y_train), 8, 8), dtype=np.uint8)
    xt = rng.integers(0, 256, (len(y_test), 8, 8), dtype=np.uint8)
    np.savez(path, x_train=x, y_train=np.array(y_train), x_test=xt, y_test=np.array(y_test))
    return path


def _train(path: Path, tmp_path: Path, *extra: str) -> list[str]:
    sets = [f"run.out_dir={tmp_path / 'run'}", *CHEAP, "data.name=npz", f"data.root={path}", *extra]
    return ["train", "--quiet", *(a for s in sets for a in ("--set", s))]


STRAY = [i % 10 for i in range(39)] + [12]  # labels 0-9 and one stray 12


def test_a_stray_training_label_is_refused_naming_the_gap(tmp_path, capsys):
    path = _npz(tmp_path / "stray.npz", STRAY, list(range(10)))
    one_line_error(  # the old run trained a 13-class model without a word
        capsys,
        _train(path, tmp_path),
        re.escape(str(path)),
        "training labels 0-9, 12 leave out 10-11",
        "13 outputs of which 2 are never trained",
        "data.num_classes=13",
    )
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_test_split_with_classes_never_trained_on_is_refused_naming_both_sets(tmp_path, capsys):
    path = _npz(tmp_path / "split.npz", [i % 5 for i in range(20)], list(range(10)))
    one_line_error(
        capsys,
        _train(path, tmp_path),
        re.escape(str(path)),
        r"label\(s\) 5-9 that no training example has",
        r"train 0-4, test 0-9",
    )


def test_each_splits_labels_are_printed_and_data_num_classes_declares_k(tmp_path):
    lines: list[str] = []
    good = _npz(tmp_path / "good.npz", [i % 10 for i in range(20)], [3, 1, 2])
    config = load_config(overrides=["data.name=npz", f"data.root={good}"])
    assert open_training_data(config, torch.device("cpu"), lines.append).info.num_classes == 10
    assert "labels: train 0-9 (10 classes), test 1-3 (3 classes); a 10-class model" in lines
    stray = _npz(tmp_path / "stray.npz", STRAY, list(range(10)))
    config = load_config(overrides=["data.name=npz", f"data.root={stray}", "data.num_classes=16"])
    assert open_training_data(config, torch.device("cpu"), lines.append).info.num_classes == 16
    assert (
        lines[-1] == "labels: train 0-9, 12 (11 classes), test 0-9 (10 classes); a 16-class model"
    )
    config = load_config(overrides=["data.name=npz", f"data.root={stray}", "data.num_classes=12"])
    with pytest.raises(
        DatasetError, match=r"training split holds label 12, but data.num_classes=12 allows 0\.\.11"
    ):
        open_training_data(config, torch.device("cpu"), lines.append)
    with pytest.raises(ConfigError, match="data.num_classes must be >= 2"):
        load_config(overrides=["data.num_classes=1"])
    with pytest.raises(ConfigError, match="set one or the other"):
        load_config(overrides=["data.num_classes=10", "data.classes=[1, 2]"])


# --------------------------------------------------------------------------- row 8c: NaN pixels


def test_non_finite_pixels_are_counted_and_the_first_image_named(tmp_path, capsys):
    path = tmp_path / "nan.npz"
    x = np.random.default_rng(8).random((20, 8, 8))
    x[17, 3, 4] = np.nan
    np.savez(path, x_train=x, y_train=np.arange(20) % 2, x_test=x[:4], y_test=np.arange(4) % 2)
    line = one_line_error(capsys, _train(path, tmp_path), re.escape(str(path)))
    assert line.endswith(
        f"{path}: 1 NaN pixel in x_train[17]; pixels must be finite numbers in [0, 1]: fix or drop that image"
    )
    xt = x[:6].copy()
    xt[3, 0, :2], xt[5, 1, 1] = np.nan, np.inf
    np.savez(path, x_train=x[:16], y_train=np.arange(16) % 2, x_test=xt, y_test=np.arange(6) % 2)
    with pytest.raises(
        DatasetError,
        match=r"2 NaN pixels and 1 infinite pixel in 2 images of x_test, the first x_test\[3\]",
    ):
        load_npz(path)

"""Bad input refused with one line (issue 25, rows 7 and 8).

Row 7: a training set with fewer than two classes trained and reported 100.00% accuracy; every
loader (image folders in memory or streamed, ``dpscale data prepare``, prepared shards, npz,
IDX, class subsets) must refuse it when the data is loaded, naming the data.
Row 8: a malformed YAML config printed 4-8 lines; it must be one line with file:line:column,
and a ``--set`` value that is not YAML one line without PyYAML's multi-line excerpt.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dpscale.config import load_config
from dpscale.errors import ConfigError
from dpscale.data import DatasetError, load_dataset
from dpscale.data.folder import FolderListing, list_image_folder
from dpscale.data.shards import open_shards, prepare_shards
from dpscale.data.subsets import select
from helpers import one_line_error

# Cheap training settings: if a refusal regressed, the run would still end in seconds.
CHEAP = ["model.name=linear", "dp.batch_size=4", "train.steps=2", "train.self_check=false"]
ONE_CLASS = "a classifier needs at least two classes"


@pytest.fixture(autouse=True)
def _no_debug_tracebacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """DPSCALE_DEBUG=1 would turn the one-line errors under test into tracebacks."""
    monkeypatch.delenv("DPSCALE_DEBUG", raising=False)


def _write_images(folder: Path, count: int, value: int = 0) -> None:
    """``count`` small grayscale PNGs in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(value)
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8)).save(folder / f"{i:03d}.png")


def _train(root: Path, tmp_path: Path, *extra: str) -> list[str]:
    sets = [f"run.out_dir={tmp_path / 'run'}", *CHEAP, *extra]
    return [
        "train",
        "--quiet",
        *(a for s in sets for a in ("--set", s)),
        "--set",
        f"data.root={root}",
    ]


# --------------------------------------------------------------------------- row 7: one class


@pytest.mark.parametrize("loader", ["memory", "stream", "auto"])
def test_an_image_folder_with_one_class_is_refused_naming_it(tmp_path, capsys, loader):
    root = tmp_path / "one-class"
    _write_images(root / "cats", 20)
    argv = _train(
        root, tmp_path, "data.name=imagefolder", f"data.loader={loader}", "data.workers=0"
    )
    one_line_error(capsys, argv, re.escape(str(root)), "1 class", "'cats'", ONE_CLASS)
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_train_test_layout_or_label_file_with_one_training_class_is_refused(tmp_path):
    root = tmp_path / "split"
    _write_images(root / "train" / "cats", 6)
    _write_images(root / "test" / "cats", 2)
    with pytest.raises(DatasetError, match=ONE_CLASS):
        list_image_folder(root)
    flat = tmp_path / "flat-val"  # ImageNet-style flat val folder with a label file
    _write_images(flat / "train" / "cats", 6)
    _write_images(flat / "val", 2)
    (flat / "labels.txt").write_text("000.png cats\n001.png 0\n")
    with pytest.raises(DatasetError, match=f"{re.escape(str(flat))}.*{ONE_CLASS}"):
        list_image_folder(flat, val_labels=flat / "labels.txt")


def test_skip_corrupt_that_leaves_one_class_with_images_is_refused(tmp_path):
    root = tmp_path / "mostly-broken"
    _write_images(root / "cats", 10)
    (root / "dogs").mkdir()
    for i in range(5):
        (root / "dogs" / f"{i}.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(
        DatasetError,
        match=f"only one class \\('cats'\\) \\(5 unreadable file\\(s\\) left out\\); {ONE_CLASS}",
    ):
        list_image_folder(root, skip_corrupt=True)


def test_data_prepare_refuses_one_class_and_shards_with_one_class_are_refused(tmp_path, capsys):
    root = tmp_path / "one-class"
    _write_images(root / "cats", 10)
    one_line_error(
        capsys,
        ["data", "prepare", str(root), str(tmp_path / "out"), "--size", "8", "--quiet"],
        ONE_CLASS,
    )
    # A set prepared before this check (or by hand): one class in its manifest.
    files = tuple(sorted((root / "cats").iterdir()))
    listing = FolderListing(
        root,
        ("cats",),
        files[:8],
        np.zeros(8, np.int64),
        files[8:],
        np.zeros(2, np.int64),
        "official",
        "L",
    )
    prepare_shards(listing, tmp_path / "shards", 8)
    with pytest.raises(
        DatasetError,
        match=f"{re.escape(str(tmp_path / 'shards'))}: the training set has only one class \\('cats'\\); {ONE_CLASS}",
    ):
        open_shards(tmp_path / "shards")
    argv = _train(tmp_path / "shards", tmp_path, "data.name=shards", "data.loader=memory")
    one_line_error(capsys, argv, ONE_CLASS)


def test_an_npz_whose_training_labels_hold_one_class_is_refused(tmp_path, capsys):
    path = tmp_path / "d.npz"
    x = np.zeros((6, 8, 8), np.uint8)
    np.savez(path, x_train=x, y_train=np.zeros(6, np.int64), x_test=x[:2], y_test=np.array([0, 1]))
    one_line_error(
        capsys, _train(path, tmp_path, "data.name=npz"), re.escape(str(path)), "y_train", ONE_CLASS
    )


def test_idx_files_whose_labels_hold_one_class_are_refused(tmp_path):
    def write(path: Path, magic: int, array: np.ndarray) -> None:
        dims = b"".join(int(d).to_bytes(4, "big") for d in array.shape)
        path.write_bytes(magic.to_bytes(4, "big") + dims + array.astype(np.uint8).tobytes())

    write(tmp_path / "train-images-idx3-ubyte", 0x803, np.zeros((12, 4, 4)))
    write(tmp_path / "train-labels-idx1-ubyte", 0x801, np.full(12, 7))
    with pytest.raises(DatasetError, match=f"{re.escape(str(tmp_path))}.*{ONE_CLASS}"):
        load_dataset("mnist", tmp_path)


@pytest.mark.parametrize(
    "selection, message",
    [
        (
            "data.classes=[3]",
            r"data\.classes \[3\]: the training set has only one class \(label 3\)",
        ),
        ("data.random_classes=1", "data.random_classes"),
        ("data.meta_classes=1", "data.meta_classes=1 puts every class in one group"),
    ],
)
def test_a_class_subset_with_one_class_is_refused(tmp_path, capsys, selection, message):
    one_line_error(
        capsys, ["train", "--quiet", "--set", selection, *_sets(tmp_path)], message, ONE_CLASS
    )


def _sets(tmp_path: Path) -> list[str]:
    return [a for s in [*CHEAP, f"run.out_dir={tmp_path / 'run'}"] for a in ("--set", s)]


def test_select_refuses_a_selection_whose_training_set_holds_one_class():
    data = load_dataset("mnist-5k")
    with pytest.raises(DatasetError, match=ONE_CLASS):
        select(data, classes=[4])
    with pytest.raises(DatasetError, match=ONE_CLASS):
        select(data, classes=[0, 1, 2], meta_classes=1)
    assert select(data, classes=[4, 2]).info.num_classes == 2  # two classes stay fine


# --------------------------------------------------------------------------- row 8: malformed YAML


@pytest.mark.parametrize(
    "text, where, problem",
    [
        ("dp:\n  epsilon: 3\n  delta: x: 1\n", ":3:11:", "mapping values are not allowed here"),
        ("dp:\n  epsilon: [3\n", ":3:1:", r"expected ',' or '\]'.*flow sequence .*2:12"),
        ("dp:\n\tepsilon: 3\n", ":2:1:", "found character '\\\\t' that cannot start any token"),
        ("dp: {epsilon: 3\n", ":2:1:", r"expected ',' or '\}'"),
        ("data:\n  name: 'mnist\n", ":3:1:", "found unexpected end of stream"),
        # PyYAML keeps the last of two equal keys silently: the second epsilon would win unseen
        (
            "dp:\n  epsilon: 3\n  batch_size: 64\n  epsilon: 30\n",
            ":4:3:",
            r"duplicate key 'epsilon' \(first given on line 2\)",
        ),
    ],
)
def test_malformed_yaml_is_one_line_with_file_line_and_column(
    tmp_path, capsys, text, where, problem
):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    line = one_line_error(
        capsys,
        ["train", str(path)],
        re.escape(f"config file {path}{where} not valid YAML: "),
        problem,
    )
    assert "<unicode string>" not in line and "^" not in line
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "\n" not in str(err.value)


def test_yaml_merge_keys_may_override_what_they_merge(tmp_path):
    from dpscale.config.load import read_config_file

    path = tmp_path / "merge.yaml"
    path.write_text("base: &b {epsilon: 2, delta: 1.0e-6}\ndp:\n  <<: *b\n  epsilon: 4\n")
    assert read_config_file(path)["dp"] == {"epsilon": 4, "delta": 1e-6}


def test_a_config_file_that_is_not_text_is_one_line(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_bytes(b"dp:\n  epsilon: \xff\xfe3\n")
    one_line_error(capsys, ["train", str(path)], re.escape(f"config file {path}"), "UTF-8")
    path.write_bytes(b"dp:\n  epsilon: 3\x07\n")  # a control character PyYAML's reader refuses
    one_line_error(
        capsys,
        ["train", str(path)],
        re.escape(f"config file {path}:2:"),
        "special characters are not allowed",
    )


@pytest.mark.parametrize(
    "override, problem",
    [
        ("dp.epsilon=[1", r"dp\.epsilon: cannot parse value '\[1': expected ',' or '\]'.*column 3"),
        (
            "model.kwargs={a: [1}",
            r"model\.kwargs: cannot parse value '\{a: \[1\}': expected ',' or '\]', but got '\}'.*column 7",
        ),
        ("dp.epsilon", r"--set expects key=value, got 'dp\.epsilon'"),
        ("=3", r"--set expects key=value"),
    ],
)
def test_a_bad_set_value_is_one_line(capsys, override, problem):
    line = one_line_error(capsys, ["train", "--set", override], problem)
    assert "<unicode string>" not in line and "^" not in line and "  " not in line


def test_a_set_string_that_is_not_yaml_is_still_taken_as_typed():
    config = load_config(None, ["run.out_dir=runs/a: [b", "train.steps=1"])
    assert config.run.out_dir == "runs/a: [b"

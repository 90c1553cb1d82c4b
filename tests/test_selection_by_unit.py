"""Issue 62, point 2: every selection made before the plan is a function of the unit alone.

DP's neighbouring collections differ by one unit (an image, or a person with all their images).
The training set dpscale trains on must then differ by that unit at most: a held-out split or a
subset chosen by a rule of the whole collection (a seeded permutation walked towards 20%, a seeded
choice of max_per_class per class) lets one unit move others between training and test, which no
epsilon covers. Reproduced first through the loaders (users.csv, an IDX side file, a folder of
images); where the data names no id the run says its guarantee covers the selected training set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dpscale.cli import main
from dpscale.data.datasets import load_idx, load_image_folder
from dpscale.data.formats import DatasetError
from dpscale.data.splits import (
    HELD_OUT_BY_INDEX,
    MAX_PER_CLASS_CHOICE,
    hashed_holdout,
    selection_note,
    unit_hashes,
)
from dpscale.export import card_path
from dpscale.train.run import result_line


def _people(count: int = 150, seed: int = 0) -> dict[str, list[str]]:
    """Synthetic patients of 1 to 4 images, each image in class folder a or b."""
    rng = np.random.default_rng(seed)
    return {
        f"patient-{p}": [
            f"{'ab'[int(rng.integers(2))]}/p{p}-{i}.png" for i in range(int(rng.integers(1, 5)))
        ]
        for p in range(count)
    }


def _write_folder(root: Path, people: dict[str, list[str]], users_csv: bool = True) -> Path:
    rng = np.random.default_rng(1)
    for paths in people.values():
        for path in paths:
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (4, 4), dtype=np.uint8)).save(root / path)
    if users_csv:
        rows = [f"{path},{person}" for person, paths in people.items() for path in paths]
        (root / "users.csv").write_text("path,user\n" + "\n".join(rows) + "\n")
    return root


def _sides(root: Path) -> dict[str, str]:
    """Each training or held-out person's side (users.csv), or each image's (by path)."""
    data = load_image_folder(root)
    if data.user_ids is not None:
        train = set(data.user_ids.tolist())
        rows = [line.split(",") for line in (root / "users.csv").read_text().splitlines()[1:]]
        return {person: "train" if person in train else "test" for _, person in rows}
    return {p.relative_to(root).as_posix(): "train" for p in root.rglob("*.png")} | {
        _path_of(x, root): "test" for x in data.x_test
    }


def _path_of(image, root: Path) -> str:
    """The file under ``root`` holding ``image`` (a decoded test image)."""
    pixels = (image[0].numpy() * 255).round().astype(np.uint8)
    for path in root.rglob("*.png"):
        if np.array_equal(np.asarray(Image.open(path)), pixels):
            return path.relative_to(root).as_posix()
    raise AssertionError("a test image not on disk")


def _moved(before: dict, after: dict) -> int:
    """Units on both lists whose side changed."""
    return sum(before[unit] != side for unit, side in after.items() if unit in before)


def test_removing_one_person_from_a_users_csv_folder_moves_no_other_person(tmp_path):
    people = _people()
    before = _sides(_write_folder(tmp_path / "all", people))
    trained = next(p for p, side in before.items() if side == "train")
    held = next(p for p, side in before.items() if side == "test")
    for gone in (trained, held):  # a person trained on, and one who only was in the test set
        rest = {p: paths for p, paths in people.items() if p != gone}
        after = _sides(_write_folder(tmp_path / gone, rest))
        assert set(after) == set(before) - {gone}
        assert _moved(before, after) == 0, gone  # before this fix: 49 and 50 of the other 149 moved


def test_adding_or_removing_one_image_of_a_folder_moves_no_other_image(tmp_path):
    people = _people(60, seed=2)
    root = _write_folder(tmp_path / "f", people, users_csv=False)
    before = _sides(root)
    Image.fromarray(np.full((4, 4), 7, np.uint8)).save(root / "a" / "new.png")
    after = _sides(root)
    # before: 50 of 150 moved
    assert set(after) == set(before) | {"a/new.png"} and _moved(before, after) == 0
    gone = next(path for path, side in before.items() if side == "train")
    (root / gone).unlink()
    (root / "a" / "new.png").unlink()
    assert _moved(before, _sides(root)) == 0  # before: 20 of 149 moved


def test_removing_one_person_of_an_idx_side_file_moves_no_other_person(tmp_path):
    from datafiles import write_idx

    rng = np.random.default_rng(3)
    ids = rng.integers(0, 400, 1200)

    def sides(keep: np.ndarray, folder: Path) -> dict[int, str]:
        folder.mkdir()
        write_idx(folder / "train-images-idx3-ubyte", rng.integers(0, 256, (int(keep.sum()), 4, 4)))
        write_idx(folder / "train-labels-idx1-ubyte", np.arange(int(keep.sum())) % 10)
        (folder / "train-user-ids.txt").write_text("\n".join(map(str, ids[keep])) + "\n")
        train = set(load_idx(folder).user_ids.tolist())
        return {int(u): "train" if str(u) in train else "test" for u in np.unique(ids[keep])}

    before = sides(np.ones(len(ids), bool), tmp_path / "all")
    for gone in (next(u for u, s in before.items() if s == side) for side in ("train", "test")):
        after = sides(ids != gone, tmp_path / f"without-{gone}")
        # before: 116 and 107 of 379 moved
        assert len(after) == len(before) - 1 and _moved(before, after) == 0


def test_the_hashed_split_holds_out_about_the_fraction_keeps_people_whole_and_refuses_an_empty_side():
    rng = np.random.default_rng(4)
    ids = np.repeat(np.arange(3000), rng.integers(1, 6, 3000))
    train, test = hashed_holdout(ids, 0.2, "ids")
    assert not set(ids[train]) & set(ids[test])  # nobody on both sides
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(len(ids)))
    share = len(np.unique(ids[test])) / 3000
    assert abs(share - 0.2) < 0.025, share  # binomial sd 0.0073
    assert abs(len(test) / len(ids) - 0.2) < 0.03
    with pytest.raises(DatasetError, match="left the test set empty"):
        hashed_holdout(np.array(["only-one"] * 5), 0.2, "a tiny set")


def test_the_split_is_the_same_in_another_process_with_another_hash_seed():
    ids = ["patient-1", "a/p3-0.png", "17", "Zoë"]
    code = "import sys; from dpscale.data.splits import unit_hashes; print(unit_hashes(sys.argv[1:]).tolist())"
    other = subprocess.run(
        [sys.executable, "-c", code, *ids],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    ).stdout
    assert other == f"{unit_hashes(ids).tolist()}\n"
    # npz int = csv string
    assert unit_hashes(np.array([17])).tolist() == unit_hashes(np.array(["17"])).tolist()


def _train(tmp_path: Path, name: str, *sets: str) -> tuple[dict, str]:
    out = tmp_path / name
    args = ["model.name=linear", "dp.batch_size=16", "train.steps=2", f"run.out_dir={out}", *sets]
    assert main(["train", "--quiet", *(a for s in args for a in ("--set", s))]) == 0
    return json.loads((out / "summary.json").read_text()), str(out)


def test_a_split_by_index_is_said_in_the_header_the_summary_and_the_model_card(tmp_path, capsys):
    """mnist-5k names no ids: its 1,000 held-out images are chosen by index from the whole sample."""
    pytest.importorskip("safetensors")
    summary, run_dir = _train(tmp_path, "mnist5k")
    note = selection_note((HELD_OUT_BY_INDEX,))
    assert note and summary["training_set"] == note
    assert f"WARNING: {note}" in capsys.readouterr().err.splitlines()  # the header
    # after a run that printed none
    assert f"WARNING: {note}" in result_line(summary, Path(run_dir)).splitlines()
    model = tmp_path / "model.safetensors"
    assert main(["export", run_dir, "--format", "safetensors", "--out", str(model)]) == 0
    card = card_path(model).read_text()
    assert f"Training set: {note}." in card


def test_max_per_class_is_said_and_a_folder_split_by_path_says_nothing(tmp_path, capsys):
    root = _write_folder(tmp_path / "f", _people(40, seed=5), users_csv=False)
    folder = ["data.name=imagefolder", f"data.root={root}"]
    summary, _ = _train(tmp_path, "by-path", *folder)
    assert summary["training_set"] is None and "whole collection" not in capsys.readouterr().err
    summary, _ = _train(tmp_path, "capped", *folder, "data.max_per_class=20")
    assert summary["training_set"] == selection_note((MAX_PER_CLASS_CHOICE,))
    assert "data.max_per_class's seeded choice" in capsys.readouterr().err


def test_the_idx_side_file_split_uses_a_constant_fraction_not_one_computed_from_the_collection(
    tmp_path,
):
    """The review's case: 600 people of one image each; the cut-off was round(N/6)/N, so removing one
    person moved from 100/600 to 100/599 and took in a person whose hash lies between (now 0 moved)."""
    from datafiles import write_idx

    people = np.array([f"p{i}" for i in range(20000)])
    share = unit_hashes(people).astype(np.float64) / 2.0**64
    between = people[(share >= 100 / 600) & (share < 100 / 599)][0]  # moved by the old cut-off
    others = people[(share < 100 / 600 - 1e-3) | (share > 100 / 599 + 1e-3)][:599]
    ids = np.concatenate([[between], others])

    def training_people(chosen: np.ndarray, folder: Path) -> set[str]:
        folder.mkdir()
        write_idx(folder / "train-images-idx3-ubyte", np.zeros((len(chosen), 4, 4), dtype=np.uint8))
        write_idx(folder / "train-labels-idx1-ubyte", np.arange(len(chosen)) % 10)
        (folder / "train-user-ids.txt").write_text("\n".join(chosen) + "\n")
        return set(load_idx(folder).user_ids.tolist())

    before = training_people(ids, tmp_path / "all")
    after = training_people(ids[:-1], tmp_path / "without")
    assert (between in before) == (between in after)
    assert before - {ids[-1]} == after


def test_a_file_name_that_is_not_utf8_is_held_out_by_its_bytes(tmp_path):
    """A Latin-1 file name (os.listdir's surrogates) raised UnicodeEncodeError in the hash."""
    if sys.platform != "linux":
        pytest.skip("file names as raw bytes: Linux")
    root = _write_folder(tmp_path / "data", _people(40), users_csv=False)
    odd = os.fsdecode(b"a/caf\xe9.png")  # not UTF-8
    Image.fromarray(np.zeros((4, 4), dtype=np.uint8)).save(root / odd)
    data = load_image_folder(root)
    assert data.info.num_train + data.info.num_test == sum(1 for _ in root.rglob("*.png"))
    hashed = unit_hashes([odd])[0]
    # the same in every process: blake2b of the bytes on disk
    assert hashed == unit_hashes([odd])[0]

"""User ids that would merge two people are refused (issue 62, point 3): numpy turns [1, "1"] into
one string id, floats merge 2**53 and 2**53 + 1, a 'U' array drops the trailing NUL of "a\\x00", and
True == 1. One person's removal then moved the release by 2C against the C the guarantee assumes.
A side file's lines are stripped, as users.csv's cells are ("17" and "17 " are one person)."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest
import torch
from torch import nn

import dpscale
from dpscale.data.formats import DatasetError
from dpscale.data.user_ids import UserIndex, checked_user_ids, side_user_ids


def make_private_with(ids) -> dpscale.DPMechanism:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return dpscale.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        dataset_size=len(ids),
        batch_size=1,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        delta=1e-5,
        steps=2,
        seed=0,
        user_ids=ids,
        max_examples_per_user=2,
    )


def refused(ids, *words: str) -> str:
    """The one-line refusal ``make_private`` gives ``ids``, checked to name ``words``."""
    with pytest.raises(ValueError) as error:
        make_private_with(ids)
    message = str(error.value)
    assert "\n" not in message and all(w in message for w in words), message
    return message


def test_an_int_and_a_string_id_are_refused_not_merged():
    refused([1, "1", 2, 3], "example 1 is the str '1'", "example 0 is the int 1")
    refused(np.array([7, "x"], dtype=object), "example 1 is the str 'x'", "example 0 is the int 7")
    assert make_private_with(["1", "2", "1"]).plan.dataset_size == 2  # one type: as before


def test_python_integers_above_2_to_53_stay_apart_and_floats_are_refused():
    big = [2**53, 2**53 + 1]
    assert UserIndex.from_ids(big).num_users == 2 and make_private_with(big).plan.dataset_size == 2
    refused(
        [float(i) for i in big], "example 0 is the float 9007199254740992.0", "integers or strings"
    )
    refused(np.array(big, dtype=np.float64), "float64", "integers or strings")
    refused(torch.tensor([1.0, 2.0]), "float32")
    assert UserIndex.from_ids([2**63, 2**64 - 1]).num_users == 2  # uint64 keeps them
    with pytest.raises(
        ValueError, match="example 1's id 18446744073709551616 does not fit 64 bits"
    ):
        UserIndex.from_ids([-1, 2**64])


def test_a_trailing_nul_and_bools_are_refused():
    refused(["a", "a\x00"], "example 1's id 'a\\x00' holds a NUL character")
    refused(["a\x00b", "a"], "example 0")
    refused([True, 1], "example 0 is the bool True")
    refused(np.array([True, False]), "bool")
    refused(torch.tensor([1, 0], dtype=torch.bool), "bool")


def test_missing_ids_keep_their_sentences():
    for bad, words in (
        ([1.0, float("nan")], "example 1 has no user id (NaN)"),
        (["a", None], "example 1 has no user id (None)"),
        (["a", ""], "example 1 has an empty user id"),
        ([None, 1], "example 0 has no user id (None)"),
    ):
        with pytest.raises(ValueError, match=words.replace("(", "\\(").replace(")", "\\)")):
            UserIndex.from_ids(bad)


def test_checked_user_ids_refuses_the_same_as_dataset_errors():
    with pytest.raises(DatasetError, match="x.npz: user_ids: user ids: example 1's id .*NUL"):
        checked_user_ids(np.array(["a", "b\x00c"]), 2, "x.npz: user_ids")
    with pytest.raises(DatasetError, match="float64"):
        checked_user_ids(np.array([1.0, 2.0]), 2, "x.npz: user_ids")
    assert checked_user_ids(np.array([3, 4]), 2, "x").tolist() == [3, 4]


def test_a_side_files_lines_are_stripped_as_users_csv_cells_are(tmp_path):
    (tmp_path / "train-user-ids.txt").write_text("17\n17 \n\t18\n18\r\n")
    ids = side_user_ids(tmp_path, 4)
    assert ids.tolist() == ["17", "17", "18", "18"] and UserIndex.from_ids(ids).num_users == 2
    (tmp_path / "train-user-ids.txt").write_text("17\n  \n")
    with pytest.raises(DatasetError, match="example 1 has an empty user id"):
        side_user_ids(tmp_path, 2)


def _idx(path, array: np.ndarray, kind: str) -> None:
    dims = array.shape
    header = struct.pack(">HBB", 0, 8, len(dims)) + b"".join(struct.pack(">I", d) for d in dims)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_an_idx_loader_reads_a_padded_side_file_as_one_person_per_id(tmp_path):
    from dpscale.data.datasets import load_idx

    g = np.random.default_rng(1)
    _idx(tmp_path / "train-images-idx3-ubyte.gz", g.integers(0, 256, (60, 8, 8)), "images")
    _idx(tmp_path / "train-labels-idx1-ubyte.gz", np.arange(60) % 10, "labels")
    # each person's second image padded
    lines = [f"{i // 3}" + (" " if i % 3 == 1 else "") for i in range(60)]
    (tmp_path / "train-user-ids.txt").write_text("\n".join(lines) + "\n")
    data = load_idx(tmp_path, "mnist")
    # 20 people of 3, none split in two
    assert UserIndex.from_ids(data.user_ids).num_users * 3 == len(data.user_ids)


def test_ids_with_whitespace_around_them_are_refused_where_a_users_csv_would_strip_them():
    """ "17" and "17 " were two people through make_private or an npz and one through users.csv."""
    refused(["17", "17 ", "18"], "example 1's id '17 '", "strip")
    refused(np.array([" 17", "18"]), "example 0's id ' 17'")
    with pytest.raises(DatasetError, match="whitespace"):
        checked_user_ids(np.array(["17", "17\t"]), 2, "data.npz user_ids")
    refused(np.array(["a\x00b", "c"]), "'a\\x00b'")  # the NUL shown, not hidden in np.str_'s repr

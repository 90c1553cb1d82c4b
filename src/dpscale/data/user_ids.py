"""People in the data: which examples belong to one person (user-level DP, issue 43).

With ``data.privacy_unit: user`` the guarantee is about everything one person contributed. This
module reads and checks the user ids and groups the examples by user (``UserIndex``, compressed rows);
the sampler that draws users lives in ``dpscale.privacy.sampling.units``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from dpscale.data.formats import DatasetError


@dataclass(frozen=True)
class UserIndex:
    """The examples of each user, in compressed rows.

    Attributes:
        ids: (U,) the distinct user ids, sorted.
        offsets: (U + 1,) int64: user u's examples are ``examples[offsets[u]:offsets[u + 1]]``.
        examples: (N,) int64 example indices grouped by user, ascending within a user.
    """

    ids: np.ndarray
    offsets: np.ndarray
    examples: np.ndarray

    @classmethod
    def from_ids(cls, user_ids: Sequence[Any] | np.ndarray | torch.Tensor) -> "UserIndex":
        """Group examples by their user id.

        Args:
            user_ids: one id per example (all integers or all strings), in dataset order.

        Returns:
            the index.

        Raises:
            ValueError: no examples, an id that is missing (None, NaN or an empty string), or ids that
                could merge two people (``user_id_array``).
        """
        ids = user_id_array(user_ids)
        distinct, inverse = np.unique(ids, return_inverse=True)
        # grouped, ascending within a user
        examples = np.argsort(inverse, kind="stable").astype(np.int64)
        counts = np.bincount(inverse, minlength=len(distinct))
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return cls(ids=distinct, offsets=offsets, examples=examples)

    @property
    def num_users(self) -> int:
        """U, the number of distinct users (the N of a user-level guarantee)."""
        return len(self.ids)

    @property
    def sizes(self) -> np.ndarray:
        """(U,) int64: each user's number of examples."""
        return np.diff(self.offsets)

    def digest(self) -> str:
        """SHA-256 of the grouping (each example's user id, in dataset order): ties a sampler's
        state to the people it sampled."""
        digest = hashlib.sha256(
            f"{self.ids.dtype.kind}:{len(self.examples)}:{self.num_users}".encode()
        )
        digest.update("\x1f".join(map(str, self.ids.tolist())).encode())
        digest.update(self.codes.tobytes())
        return digest.hexdigest()

    @property
    def codes(self) -> np.ndarray:
        """(N,) int64: each example's user, as a row of ``ids`` (0..U-1), in dataset order."""
        codes = np.empty(len(self.examples), dtype=np.int64)
        codes[self.examples] = np.repeat(np.arange(self.num_users), self.sizes)
        return codes


def user_id_array(user_ids: Sequence[Any] | np.ndarray | torch.Tensor) -> np.ndarray:
    """``user_ids`` as a 1-d array in which two ids are equal only when the person is the same.

    numpy's coercion merges people silently: [1, "1"] becomes two strings "1", floats make one of
    2**53 and 2**53 + 1, a 'U' array drops the trailing NUL of "a\\x00", and True is 1. Each is refused:
    ids must be all integers (int64, or uint64 above 2**63) or all strings, with no NUL character,
    and a list's ids must come out of the array as they went in. Strings are kept as given (a side
    file's lines are stripped by ``side_user_ids``).

    Args:
        user_ids: one id per example: a list (or object array) of ints or strs, an integer or
            string array, or an integer tensor.

    Returns:
        an int64, uint64 or str ('U') array.

    Raises:
        ValueError: not one id per example, a missing id (None, NaN, ""), or ids that could merge
            (named with their example indices).
    """
    raw = user_ids.cpu().numpy() if isinstance(user_ids, torch.Tensor) else user_ids
    if isinstance(raw, np.ndarray) and raw.dtype.kind != "O":
        ids = raw
        _check_shape(ids)
        _check_present(ids)
        if ids.dtype.kind not in "iuU":
            raise ValueError(
                f"user ids must be integers or strings, got a {ids.dtype} array: {_WHY_TYPED}"
            )
        if ids.dtype.kind == "U":
            # (np.char.find cannot look for a NUL: it strips it too)
            for i, value in enumerate(ids.tolist()):
                _check_string_id(i, value)
        return ids
    values = raw.tolist() if isinstance(raw, np.ndarray) else list(raw)
    # an object array's own shape
    _check_shape(raw if isinstance(raw, np.ndarray) else np.empty(len(values)))
    return _id_array_of(values)


_WHY_TYPED = "a float, a bool or ids of two types can merge two people (2**53 + 1 == 2**53 as floats, True == 1, 1 and '1')"


def _check_shape(ids: np.ndarray) -> None:
    """Refuse anything but one id per example (a non-empty 1-d array)."""
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(
            f"user ids must be one id per example (a 1-d array), got shape {ids.shape}"
        )


def _id_kind(value: Any) -> str | None:
    """ "int" or "str" for an id numpy keeps apart from every other of its kind; None otherwise."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (int, np.integer)):
        return "int"
    return "str" if isinstance(value, str) else None


def _id_array_of(values: list[Any]) -> np.ndarray:
    """A list of ids as an array, refused where an id is missing, of another type than the first,
    not an int or a str, a string with a NUL, or an integer beyond 64 bits."""
    _check_present(np.array(values, dtype=object))  # a missing id first: None, NaN, ""
    first = values[0]
    kind = _id_kind(first)
    for i, value in enumerate(values):
        this = _id_kind(value)
        if this is None:
            raise ValueError(
                f"user ids: example {i} is the {type(value).__name__} {value!r}: ids must be integers or strings ({_WHY_TYPED})"
            )
        if this != kind:
            raise ValueError(
                f"user ids: example {i} is the {this} {value!r} but example 0 is the {kind} {first!r}: ids of two types can "
                "merge two people (numpy makes 1 and '1' one string); give all as integers or all as strings"
            )
        if this == "str":
            _check_string_id(i, value)
    return _round_tripped(values, kind)


def _round_tripped(values: list[Any], kind: str | None) -> np.ndarray:
    """``values`` as an int64 (uint64 above 2**63) or str array, each id checked to come back as it went in."""
    if kind == "str":
        ids = np.array(values, dtype=str)
    else:
        low, high = min(values), max(values)
        fits = (-(2**63), 2**63) if low < 0 else (0, 2**64)  # int64 with a negative id, else uint64
        if not (fits[0] <= low and high < fits[1]):
            i = next(j for j, v in enumerate(values) if not fits[0] <= v < fits[1])
            raise ValueError(
                f"user ids: example {i}'s id {values[i]!r} does not fit 64 bits beside the others: give the ids as strings"
            )
        ids = np.array(values, dtype=np.uint64 if high >= 2**63 else np.int64)
    back = ids.tolist()
    if back != values:  # what numpy changed would merge people or rename one
        i = next(j for j, (a, b) in enumerate(zip(back, values)) if a != b)
        raise ValueError(
            f"user ids: example {i}'s id {values[i]!r} becomes {back[i]!r} in an array: give ids that survive it"
        )
    return ids


def _check_string_id(index: int, value: str) -> None:
    """Refuse example ``index``'s string id with a NUL character (numpy drops trailing NULs: 'a\\x00'
    would be the person 'a'; an array holds only the NULs numpy did not already strip) or with
    whitespace around it ("17 " and "17" are one person in a users.csv, whose cells are stripped,
    and would be two here: every door now agrees by refusing what they would read differently)."""
    value = str(value)  # np.str_'s repr hides the NUL
    if "\x00" in value:
        raise ValueError(
            f"user ids: example {index}'s id {value!r} holds a NUL character: numpy drops trailing NULs ('a\\x00' would be "
            "the person 'a'), so ids with NULs are refused"
        )
    if value != value.strip():
        raise ValueError(
            f"user ids: example {index}'s id {value!r} has whitespace around it: a users.csv or side file strips it "
            f"(reading {value.strip()!r}), so strip the ids first"
        )


def _check_present(ids: np.ndarray, offset: int = 0) -> None:
    """Refuse a missing id: an example without a user cannot be attributed to anyone."""
    if ids.dtype.kind == "f" and np.isnan(ids).any():
        raise ValueError(
            f"user ids: example {offset + int(np.flatnonzero(np.isnan(ids))[0])} has no user id (NaN)"
        )
    if ids.dtype.kind == "O" and any(i is None or (isinstance(i, float) and i != i) for i in ids):
        j, value = next((j, i) for j, i in enumerate(ids) if i is None or i != i)
        raise ValueError(
            f"user ids: example {offset + j} has no user id ({'None' if value is None else 'NaN'})"
        )
    if ids.dtype.kind in "UO" and (ids == "").any():
        raise ValueError(
            f"user ids: example {offset + int(np.flatnonzero(ids == '')[0])} has an empty user id"
        )


# The side file naming each training example's user, for formats with no place for it (IDX, CIFAR):
# one id per line in training-file order (.txt), or a 1-d array (.npy).
USER_ID_FILES = ("train-user-ids.txt", "train-user-ids.npy")


def side_user_ids(root: Path, examples: int) -> np.ndarray | None:
    """The user ids in ``root``'s side file (``USER_ID_FILES``), or None when it has none. A .txt
    file's lines are stripped of surrounding whitespace, as users.csv's cells are: "17" and "17 " are
    one person, and a line of only whitespace is a missing id (refused).

    Args:
        root: the data directory; examples: N, the training examples the ids must match.

    Raises:
        DatasetError: both files, or a file that does not hold one id per training example.
    """
    found = [root / name for name in USER_ID_FILES if (root / name).is_file()]
    if not found:
        return None
    if len(found) > 1:
        raise DatasetError(f"{root} holds both {USER_ID_FILES[0]} and {USER_ID_FILES[1]}: keep one")
    path = found[0]
    try:
        ids = (
            np.load(path, allow_pickle=False)
            if path.suffix == ".npy"
            else _stripped_lines(path.read_text())
        )
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise DatasetError(f"{path} could not be read: {err}") from err
    return checked_user_ids(ids, examples, str(path))


def _stripped_lines(text: str) -> np.ndarray:
    """A side file's ids: one a line, surrounding whitespace stripped."""
    return np.array([line.strip() for line in text.splitlines()], dtype=str)


def checked_user_ids(ids: np.ndarray, examples: int, what: str) -> np.ndarray:
    """``ids`` as one present id per training example (integers or strings that keep people apart:
    ``user_id_array``).

    Raises:
        DatasetError: another count, another shape or type, a missing id, or ids that could merge.
    """
    ids = np.asarray(ids)
    if ids.ndim != 1 or len(ids) != examples:
        raise DatasetError(
            f"{what} holds {ids.shape} ids but the training set has {examples} examples: give one per example"
        )
    try:
        return user_id_array(ids)
    except ValueError as err:
        raise DatasetError(f"{what}: {err}") from err


def user_slices(offsets: torch.Tensor, per_chunk: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(first row, end row, local offsets) of each chunk of ``per_chunk`` consecutive users."""
    offsets = offsets.cpu()
    users = len(offsets) - 1
    for first in range(0, users, per_chunk):
        local = offsets[first : min(users, first + per_chunk) + 1]
        yield int(local[0]), int(local[-1]), local - local[0]

"""Privacy units: which examples belong to one person (user-level DP, issue 43).

With ``data.privacy_unit: user`` the guarantee is about everything one person contributed: the
sampler draws *users* (each independently with probability q = expected users per step / U), a
drawn user contributes at most k of its examples (a fresh uniformly random subset each step when it
has more: chosen from the secret sampling stream, never from the data), and the engine clips the
sum of a user's contributed gradients as one vector. This module holds the first two pieces: the
grouping of examples by user (``UserIndex``) and the sampler (``UserPoissonSampler``), whose batches
keep each user's examples consecutive (``UnitBatch.offsets``) so that a chunk never splits a user.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from dpscale.data.formats import DatasetError
from dpscale.data.splits import keyed_hashes
from dpscale.rng import DPRandom, require_dprandom


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
        examples = np.argsort(inverse, kind="stable").astype(np.int64)  # grouped, ascending within a user
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
        digest = hashlib.sha256(f"{self.ids.dtype.kind}:{len(self.examples)}:{self.num_users}".encode())
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
            raise ValueError(f"user ids must be integers or strings, got a {ids.dtype} array: {_WHY_TYPED}")
        if ids.dtype.kind == "U":
            for i, value in enumerate(ids.tolist()):  # (np.char.find cannot look for a NUL: it strips it too)
                _check_string_id(i, value)
        return ids
    values = raw.tolist() if isinstance(raw, np.ndarray) else list(raw)
    _check_shape(raw if isinstance(raw, np.ndarray) else np.empty(len(values)))  # an object array's own shape
    return _id_array_of(values)


_WHY_TYPED = "a float, a bool or ids of two types can merge two people (2**53 + 1 == 2**53 as floats, True == 1, 1 and '1')"


def _check_shape(ids: np.ndarray) -> None:
    """Refuse anything but one id per example (a non-empty 1-d array)."""
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"user ids must be one id per example (a 1-d array), got shape {ids.shape}")


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
            raise ValueError(f"user ids: example {i}'s id {values[i]!r} does not fit 64 bits beside the others: give the ids as strings")
        ids = np.array(values, dtype=np.uint64 if high >= 2**63 else np.int64)
    back = ids.tolist()
    if back != values:  # what numpy changed would merge people or rename one
        i = next(j for j, (a, b) in enumerate(zip(back, values)) if a != b)
        raise ValueError(f"user ids: example {i}'s id {values[i]!r} becomes {back[i]!r} in an array: give ids that survive it")
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
        raise ValueError(f"user ids: example {offset + int(np.flatnonzero(np.isnan(ids))[0])} has no user id (NaN)")
    if ids.dtype.kind == "O" and any(i is None or (isinstance(i, float) and i != i) for i in ids):
        j, value = next((j, i) for j, i in enumerate(ids) if i is None or i != i)
        raise ValueError(f"user ids: example {offset + j} has no user id ({'None' if value is None else 'NaN'})")
    if ids.dtype.kind in "UO" and (ids == "").any():
        raise ValueError(f"user ids: example {offset + int(np.flatnonzero(ids == '')[0])} has an empty user id")


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
        ids = np.load(path, allow_pickle=False) if path.suffix == ".npy" else _stripped_lines(path.read_text())
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
        raise DatasetError(f"{what} holds {ids.shape} ids but the training set has {examples} examples: give one per example")
    try:
        return user_id_array(ids)
    except ValueError as err:
        raise DatasetError(f"{what}: {err}") from err


@dataclass(frozen=True)
class UnitBatch:
    """One step's examples, grouped by privacy unit.

    Attributes:
        indices: (n,) int64 example indices; each unit's examples consecutive.
        offsets: (m + 1,) int64: unit j of this batch holds ``indices[offsets[j]:offsets[j + 1]]``.
    """

    indices: torch.Tensor
    offsets: torch.Tensor

    @property
    def num_units(self) -> int:
        """Units (users) drawn at this step."""
        return len(self.offsets) - 1


class UserPoissonSampler:
    """Independent Bernoulli(q) inclusion of each of U users per step, at most k examples each.

    A drawn user with more than k examples contributes a uniformly random subset of k, drawn anew at
    every step from this sampler's (secret) generator: which of its examples are used depends on no
    other user and on nothing in the data but the user's own count.

    With ``bands`` = b > 1 (BandMF) users are sampled cyclically: each user's group is a keyed hash
    of its id under ``partition_seed`` (``user_groups``: independent of every other user, so adding
    or removing a person moves nobody else), and step t draws only group t mod b, each member with
    probability p = b * q.

    With ``max_batch_size`` = M (truncated Poisson sampling of users, b = 1 only) a step that draws
    more than M users keeps a uniformly random M of them, chosen from the same secret generator:
    what dp_accounting's ``TruncatedSubsampledGaussianDpEvent(U, q, M, sigma)`` assumes, with the
    users as its units (as ``dpscale.data.sampling.PoissonSampler`` caps examples).

    Args:
        users: the grouping of the N examples by user.
        sample_rate: q in (0, 1], per user (p = b * q must also be <= 1).
        max_examples_per_user: k >= 1.
        generator: the sampling RNG; its state (with the step) is the sampler's whole state.
        bands: b >= 1; partition_seed: the groups' key (needed when b > 1); start_step: the next step.
        max_batch_size: M >= 1, the most users a step trains on (None: uncapped).
    """

    def __init__(
        self, users: UserIndex, sample_rate: float, max_examples_per_user: int, generator: DPRandom, *,
        bands: int = 1, partition_seed: int | None = None, start_step: int = 0, max_batch_size: int | None = None,
    ) -> None:  # fmt: skip
        if not 0.0 < sample_rate <= 1.0 or not sample_rate * bands <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1/bands], got {sample_rate} with bands={bands}")
        if isinstance(max_examples_per_user, bool) or int(max_examples_per_user) != max_examples_per_user or max_examples_per_user < 1:
            raise ValueError(f"max_examples_per_user must be an integer >= 1, got {max_examples_per_user!r}")
        if bands > 1 and partition_seed is None:
            raise ValueError(f"bands={bands} (cyclic Poisson sampling of users) needs a partition_seed")
        _check_user_cap(max_batch_size, bands)
        self.max_batch_size = None if max_batch_size is None else int(max_batch_size)
        self.users, self.sample_rate, self.bands = users, sample_rate, int(bands)
        self.max_examples_per_user = int(max_examples_per_user)
        self.generator = require_dprandom(generator, "user-level Poisson sampling")
        self.step = int(start_step)
        self._digest = users.digest()
        self._set_partition(partition_seed)

    def _set_partition(self, partition_seed: int | None) -> None:
        self.partition_seed = partition_seed
        if self.bands == 1:
            self._members: tuple[np.ndarray, ...] = (np.arange(self.users.num_users),)
            return
        group = user_groups(self.users.ids, self.bands, partition_seed)
        self._members = tuple(np.flatnonzero(group == g) for g in range(self.bands))

    def sample_units(self) -> UnitBatch:
        """The next step's drawn users and their contributed examples (possibly none)."""
        members = self._members[self.step % self.bands]
        # float64 uniforms, as for examples (PoissonSampler): no rounding of a small q upwards
        drawn = self._capped(members[self.generator.uniform(len(members)).numpy() < self.sample_rate * self.bands])
        self.step += 1
        sizes = self.users.sizes[drawn]
        keep = np.minimum(sizes, self.max_examples_per_user)
        # every example of every drawn user, with its user's rank in this batch
        rank = np.repeat(np.arange(len(drawn)), sizes)
        flat = np.repeat(self.users.offsets[drawn] - np.cumsum(sizes) + sizes, sizes) + np.arange(int(sizes.sum()))
        chosen = self._k_smallest_keys(rank, sizes, keep)
        rank, examples = rank[chosen], self.users.examples[flat[chosen]]
        order = np.lexsort((examples, rank))  # users in drawn order, each one's examples ascending
        offsets = np.concatenate([[0], np.cumsum(keep)]).astype(np.int64)
        return UnitBatch(torch.from_numpy(examples[order]), torch.from_numpy(offsets))

    def _capped(self, drawn: np.ndarray) -> np.ndarray:
        """``drawn`` (ascending users), or with more than M of them a uniformly random M-subset, still
        ascending: the first M of a permutation from the secret generator (drawn only when cut, so an
        uncapped run's stream is unchanged)."""
        if self.max_batch_size is None or len(drawn) <= self.max_batch_size:
            return drawn
        kept = self.generator.permutation(len(drawn))[: self.max_batch_size].numpy()
        return drawn[np.sort(kept)]

    def _k_smallest_keys(self, rank: np.ndarray, sizes: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """A boolean mask over the drawn users' examples: all of a user with at most k, else the k
        whose fresh uniform keys are smallest (a uniform k-subset), keys drawn only for such users."""
        mask = np.ones(len(rank), dtype=bool)
        over = (sizes > keep)[rank]
        if not over.any():
            return mask
        keys = self.generator.uniform(int(over.sum())).numpy()
        position = np.flatnonzero(over)
        order = position[np.lexsort((keys, rank[position]))]  # each user's examples by key
        first = np.searchsorted(rank[order], rank[order], side="left")  # where each user's run starts
        mask[order] = (np.arange(len(order)) - first) < keep[rank[order]]
        return mask

    def sample(self) -> torch.Tensor:
        """Indices (int64, 1-D) of the next step's contributed examples, each user's consecutive."""
        return self.sample_units().indices

    def state_dict(self) -> dict[str, Any]:
        return {"unit": "user", "generator": self.generator.state_dict(), "step": self.step,
                "bands": self.bands, "partition_seed": self.partition_seed, "users": self._digest,
                "max_batch_size": self.max_batch_size}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where the sampler that wrote ``state`` stood, with its groups.

        Raises:
            ValueError: a state of an example-level sampler, of another number of bands or batch cap
                (a state without a cap was written uncapped), or of another grouping of the examples
                into users.
        """
        if state.get("unit") != "user":
            raise ValueError("this sampler state samples examples, not users: it cannot continue a user-level run")
        if state.get("users") != self._digest:
            raise ValueError(
                "the user ids are not the ones this run was sampled with (another grouping of the examples into "
                "people): each part of the run would protect another person; continue with the same ids"
            )
        if int(state["bands"]) != self.bands:
            raise ValueError(f"this sampler state was written with bands={state['bands']}, not {self.bands}")
        if state.get("max_batch_size") != self.max_batch_size:
            raise ValueError(
                f"this sampler state was written with a cap of {state.get('max_batch_size')} users a step, not "
                f"{self.max_batch_size}: the run's steps would be sampled two ways that one epsilon does not describe"
                + (" (a run begun before dpscale applied the user-level cap drew every user its plan capped: start it anew)"
                   if "max_batch_size" not in state else "")
            )  # fmt: skip
        self.generator.load_state_dict(state["generator"])
        self.step = int(state["step"])
        if state["partition_seed"] != self.partition_seed:  # the run's groups win (b-separation)
            self._set_partition(state["partition_seed"])


def _check_user_cap(max_batch_size: int | None, bands: int) -> None:
    """Refuse a cap that is not an integer >= 1, or one with cyclic sampling (b > 1), which no
    accountant composes with a cap (the plan refuses it too: ``sampling_plan.check_sampling_settings``)."""
    if max_batch_size is None:
        return
    if isinstance(max_batch_size, bool) or int(max_batch_size) != max_batch_size or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an integer >= 1 (users a step), got {max_batch_size!r}")
    if bands > 1:
        raise ValueError(f"a batch cap truncates Poisson batches of users; cyclic sampling (bands={bands}) takes none")


def user_groups(ids: np.ndarray, bands: int, partition_seed: int | None) -> np.ndarray:
    """Each user's BandMF group: a keyed BLAKE2b hash of its id under the secret ``partition_seed``,
    scaled to 0..b-1. A function of the seed and the user's own id only: adding or removing a user
    moves no other user to another group (docs/correlated_noise.md).

    Args:
        ids: (U,) user ids (integers or strings).
        bands: b >= 1.
        partition_seed: the key (an integer of up to 512 bits).

    Returns:
        (U,) int64 groups.
    """
    if partition_seed is None:
        raise ValueError("user groups need a partition_seed")
    seed = int(partition_seed)
    key = seed.to_bytes(max(1, (seed.bit_length() + 7) // 8), "little")
    values = keyed_hashes(np.asarray(ids), key)
    # floor(v * b / 2^64) exactly: (v >> 32) * b + ((v & (2^32 - 1)) * b >> 32), then >> 32 (b < 2^31)
    high, low = values >> np.uint64(32), values & np.uint64(0xFFFFFFFF)
    b = np.uint64(bands)
    return ((high * b + ((low * b) >> np.uint64(32))) >> np.uint64(32)).astype(np.int64)


def user_sampler(
    plan: Any, users: UserIndex | None, generator: DPRandom, *, world_size: int, partition_seed: int | None,
    start_step: int,
) -> UserPoissonSampler:  # fmt: skip
    """The sampler of a user-level plan (``DPPlan.make_sampler``).

    Raises:
        ValueError: no user index, one of another number of users than the plan's N, or several processes.
    """
    if users is None:
        raise ValueError("a user-level plan samples users: give the user ids (data.privacy_unit=user needs them)")
    if users.num_users != plan.dataset_size:
        raise ValueError(f"the plan counts N={plan.dataset_size} users but the data holds {users.num_users}")
    if world_size > 1:
        raise ValueError("data.privacy_unit=user runs in one process (users are not sharded across ranks yet)")
    return UserPoissonSampler(
        users, plan.sample_rate, plan.max_examples_per_user, generator, bands=plan.bands,
        partition_seed=partition_seed, start_step=start_step, max_batch_size=plan.max_batch_size,
    )  # fmt: skip


def user_slices(offsets: torch.Tensor, per_chunk: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(first row, end row, local offsets) of each chunk of ``per_chunk`` consecutive users."""
    offsets = offsets.cpu()
    users = len(offsets) - 1
    for first in range(0, users, per_chunk):
        local = offsets[first : min(users, first + per_chunk) + 1]
        yield int(local[0]), int(local[-1]), local - local[0]

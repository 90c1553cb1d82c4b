"""``users.csv``: each image's person in an image folder, read as spreadsheets write it (issue 62).

A header with a path and a user column (and optionally ``label``, then checked against the image's
class folder), one row per training image, paths relative to the folder. Accepted: a UTF-8
byte-order mark (and UTF-16 with one, Excel's "Unicode text"), ``,``, ``;`` or tab between fields, spaces around names and values, any case, one
alias of a column (``USER_COLUMNS``: ``patient_id``, ``subject`` ...) when exactly one is present,
and Windows' ``\\`` between folders. Refused, each with its line: a row naming no image of the
listing (a missing file, a ``.dcm``; a path that differs from a listed one only in case names it),
an image named twice (both lines and both users), an empty user. Said, not refused: ids that differ
only in case, spaces or leading zeros (``PATIENT-003`` and ``patient-003``, ``7`` and ``007``),
which count as different people.
"""

from __future__ import annotations

import csv
import io
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .formats import IMAGE_EXTENSIONS, DatasetError, is_image_file

USERS_MANIFEST = "users.csv"
# the columns: the canonical name, then aliases accepted when exactly one is present (compared
# lower-cased, with spaces, '-' and '_' removed)
PATH_COLUMNS = ("path", "file", "filename", "filepath", "image", "imagepath")
USER_COLUMNS = (
    "user",
    "userid",
    "patient",
    "patientid",
    "person",
    "personid",
    "subject",
    "subjectid",
)
NAMED_IDS = 3  # a note names this many look-alike pairs, then counts the rest


@dataclass(frozen=True)
class UsersManifest:
    """What ``users.csv`` says of a folder's images.

    Attributes:
        train: each training file's user, in listing order.
        test: the user of each official test file a row names (by resolved path; others absent).
        look_alikes: pairs of distinct ids equal but for case, spaces or leading zeros.
    """

    train: np.ndarray
    test: dict[Path, str]
    look_alikes: tuple[tuple[str, str], ...]


def read_users_manifest(
    root: Path,
    files: tuple[Path, ...],
    labels: np.ndarray,
    classes: list[str],
    *,
    test_files: tuple[Path, ...] = (),
) -> np.ndarray | None:
    """Each training file's user from ``root/users.csv`` (None without the file): ``read_manifest``'s ``train``."""
    manifest = read_manifest(root, files, labels, classes, test_files=test_files)
    return None if manifest is None else manifest.train


def read_manifest(
    root: Path,
    files: tuple[Path, ...],
    labels: np.ndarray,
    classes: list[str],
    *,
    test_files: tuple[Path, ...] = (),
) -> UsersManifest | None:
    """What ``root/users.csv`` says of the listed images (None without the file).

    Args:
        root: the folder; files, labels, classes: its training images as listed.
        test_files: the official test split's images: a row may name one (it trains on nothing).

    Raises:
        DatasetError: a file that is not UTF-8 text, no path or user column (or two candidates for
            one), a row naming no listed image (with its line number), a training file the
            manifest does not name, an image named twice, an empty user, or a ``label`` that is not
            the file's class folder.
    """
    manifest = root / USERS_MANIFEST
    if not manifest.is_file():
        return None
    _refuse_one_file_listed_twice(manifest, files)
    header, rows = _manifest_rows(manifest)
    columns = _manifest_columns(manifest, header)
    class_of = {f.resolve(): classes[int(y)] for f, y in zip(files, labels)}
    listed = {**{f.resolve(): f for f in test_files}, **{f.resolve(): f for f in files}}
    user_of: dict[Path, tuple[int, str]] = {}
    for line, row in rows:
        name, user, label = (
            row[c].strip() if c is not None and c < len(row) else "" for c in columns
        )
        path = _listed_path(manifest, line, root, name, listed)
        if path in user_of:
            first, first_user = user_of[path]
            raise DatasetError(
                f"{manifest} line {line}: {name} is named twice (line {first} names the same image, "
                f"{listed[path]}, with user {first_user!r}; this line with {user!r}): one row per image"
            )
        if not user:
            raise DatasetError(f"{manifest} line {line}: {name} has an empty user")
        # numpy drops a trailing NUL: 'p1\x00' would be 'p1'
        if any(ord(c) < 32 or ord(c) == 127 for c in user):
            raise DatasetError(
                f"{manifest} line {line}: the user {user!r} holds a control character (a NUL pads some "
                "database exports): remove it"
            )
        user_of[path] = (line, user)
        if label and path in class_of and label != class_of[path]:
            raise DatasetError(
                f"{manifest} line {line}: label {label!r} but {name} is in class folder {class_of[path]!r}"
            )
    missing = [f for f in files if f.resolve() not in user_of]
    if missing:
        raise DatasetError(
            f"{manifest} names no user for {len(missing)} training image(s), e.g. {missing[0]}"
        )
    train = np.array([user_of[f.resolve()][1] for f in files])
    test = {p: user_of[p][1] for p in (f.resolve() for f in test_files) if p in user_of}
    return UsersManifest(train, test, look_alike_ids(user for _, user in user_of.values()))


def _refuse_one_file_listed_twice(manifest: Path, files: tuple[Path, ...]) -> None:
    """Refuse two training images that are one file (a link to another listed image): a row naming
    one would give both its user, and the image would train twice (under two labels, perhaps)."""
    seen: dict[Path, Path] = {}
    for f in files:
        first = seen.setdefault(f.resolve(), f)
        if first != f:
            raise DatasetError(
                f"{manifest}: {f} and {first} are one file (a link): remove one of them"
            )


def _listed_path(
    manifest: Path, line: int, root: Path, name: str, listed: dict[Path, Path]
) -> Path:
    """The resolved path of the listed image a row names (``\\`` read as ``/`` when that names one).

    Raises:
        DatasetError: the row names no listed image, with why (and the listed path it differs
            from only in case, if any).
    """
    try:
        path = (root / name).resolve()
        if path not in listed and "\\" in name:  # a Windows export: folders separated by '\'
            path = (root / name.replace("\\", "/")).resolve()
    # a NUL in the path, a link loop, a name too long
    except (OSError, RuntimeError, ValueError) as err:
        raise DatasetError(f"{manifest} line {line}: {name!r} names no file ({err})") from err
    if path in listed:
        return path
    raise DatasetError(f"{manifest} line {line}: {_not_listed(root, name, listed)}")


def _not_listed(root: Path, name: str, listed: dict[Path, Path]) -> str:
    """Why a users.csv row's path names no listed image."""
    path = root / name.replace("\\", "/")
    if not name or not path.exists():
        wanted = name.replace("\\", "/").lower()
        near = next(
            (f for f in listed.values() if f.relative_to(root).as_posix().lower() == wanted), None
        )
        hint = (
            f" (did you mean {near.relative_to(root).as_posix()}? paths are case-sensitive)"
            if near
            else ""
        )
        return f"{name or '(an empty path)'} does not exist in {root}{hint}"
    if not is_image_file(path):
        return f"{name} is not an image dpscale reads ({', '.join(sorted(IMAGE_EXTENSIONS))}): convert it, or remove the row"
    return f"{name} is not in a class folder of the training images ({root}/<class>/ or {root}/train/<class>/)"


def look_alike_ids(ids: object) -> tuple[tuple[str, str], ...]:
    """Pairs of distinct ids equal once Unicode's compatibility form is taken (an 'é' composed or
    decomposed) and case, surrounding spaces and leading zeros of each number are dropped
    ("PATIENT-003" and "patient-3"): spreadsheets merged from two exports write one
    person so, and each spelling counts as its own person. Each pair: the first two spellings met.

    Args:
        ids: an iterable of string ids.

    Returns:
        the pairs, in the order their second spelling was met.
    """
    seen: dict[str, str] = {}
    pairs: dict[str, tuple[str, str]] = {}
    for raw in ids:  # type: ignore[attr-defined]
        user = str(raw)
        key = re.sub(r"(?<!\d)0+(?=\d)", "", unicodedata.normalize("NFKC", user).strip().casefold())
        first = seen.setdefault(key, user)
        if first != user and key not in pairs:
            pairs[key] = (first, user)
    return tuple(pairs.values())


def look_alikes_note(pairs: tuple[tuple[str, str], ...]) -> str | None:
    """The listing's line about look-alike ids (None without any)."""
    if not pairs:
        return None
    named = ", ".join(f"{a!r} and {b!r}" for a, b in pairs[:NAMED_IDS])
    more = f" and {len(pairs) - NAMED_IDS:,} more" if len(pairs) > NAMED_IDS else ""
    return (
        f"{USERS_MANIFEST}: {len(pairs):,} id(s) differ from another only in case or leading zeros ({named}{more}): "
        "each spelling counts as its own person; if one person, write the ids alike"
    )


def _manifest_rows(manifest: Path) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """users.csv's header and its non-blank rows with their line numbers: UTF-8 with or without a
    byte-order mark, fields separated by whichever of ``,``, ``;`` or tab the header uses most."""
    raw = manifest.read_bytes()
    # Excel's "Unicode text" is UTF-16 with its byte-order mark: read it too
    encoding = "utf-16" if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else "utf-8-sig"
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError as e:
        raise DatasetError(
            f"{manifest} is not UTF-8 text ({e.reason} at byte {e.start}): save it as CSV UTF-8"
        ) from e
    first = next((line for line in text.splitlines() if line.strip()), "")
    delimiter = max((",", ";", "\t"), key=first.count)
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    try:
        records = [(reader.line_num, row) for row in reader if any(field.strip() for field in row)]
    except csv.Error as err:  # e.g. a field over the csv module's limit (128 kB)
        raise DatasetError(f"{manifest} line {reader.line_num}: {err}") from err
    if not records:
        raise DatasetError(
            f"{manifest} is empty: it needs a header with path and user columns, then one row per image"
        )
    return records[0][1], records[1:]


def _column_key(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name.lower())


def _manifest_columns(manifest: Path, header: list[str]) -> tuple[int, int, int | None]:
    """The indices of users.csv's path, user and (optional) label columns: names compared without
    case, spaces, '-' or '_', each of path and user found by exactly one of its accepted names."""
    keys = [_column_key(name) for name in header]
    expected = (
        f"expected a path column ({', '.join(PATH_COLUMNS)}), a user column ({', '.join(USER_COLUMNS)}) and "
        "optionally label; case, spaces and '_' do not matter"
    )
    found = []
    for aliases in (PATH_COLUMNS, USER_COLUMNS):
        hits = [i for i, key in enumerate(keys) if key in aliases]
        if len(hits) > 1:
            both = " and ".join(repr(header[i].strip()) for i in hits)
            raise DatasetError(
                f"{manifest}: both {both} could name the {aliases[0]}: keep one ({expected})"
            )
        if not hits:
            columns = ", ".join(repr(name.strip()) for name in header)
            raise DatasetError(f"{manifest}: found columns {columns}; {expected}")
        found.append(hits[0])
    label = keys.index("label") if "label" in keys else None
    return found[0], found[1], label

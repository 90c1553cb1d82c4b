"""Atomic, private, checksummed file writes and training checkpoints (below every layer:
config, features and train use it).

A checkpoint is only ever replaced by a complete new one: we write to a temporary file
in the same directory, fsync it, then ``os.replace`` it over the old one (atomic on
POSIX), so an interrupted write leaves the previous checkpoint intact. Every file is created
owner-only (0600): a run directory holds what the guarantee does not cover (train losses, RNG
states). Torch files end with a SHA-256 of what precedes it, so a damaged one is refused by name
instead of loading flipped bytes as weights (and ``torch.load`` still reads them as they are).
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from dpscale._version import __version__
from dpscale.checkpoint_format import CHECKPOINT_FORMAT, MIGRATED_FORMATS, migrate
from dpscale.errors import UserError

CHECKPOINT_NAME = "checkpoint.pt"
PREVIOUS_CHECKPOINT_NAME = "checkpoint.prev.pt"  # the one before, kept to fall back on
PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700
# A torch file we write ends with this line: torch.save's bytes, then "\nDPSCALE-SHA256:<64 hex>\n"
# (torch.load and zip readers ignore bytes after the archive, so the file stays a plain torch file).
CHECKSUM_MARK = b"\nDPSCALE-SHA256:"
CHECKSUM_TRAILER_BYTES = len(CHECKSUM_MARK) + 64 + 1
# in the payload: a file that has it but no intact trailer is damaged
CHECKSUMMED_KEY = "sha256_trailer"
# The dpscale version that wrote a file (torch files, summary.json): a reader of an older version
# can name the release that reads a newer format.
VERSION_KEY = "dpscale_version"


class DamagedFileError(UserError, ValueError):
    """A file's bytes do not match the checksum written with it (or it cannot be parsed)."""


class ForeignFileError(UserError, ValueError):
    """A readable file that is not the kind of dpscale file asked for (another program's, or
    another dpscale file kind or format)."""


def cache_path(name: str) -> Path:
    """Where dpscale caches ``name`` on this machine: ``$DPSCALE_CACHE_DIR/name`` if set, else
    ``$XDG_CACHE_HOME/dpscale/name`` (``~/.cache`` if unset)."""
    if os.environ.get("DPSCALE_CACHE_DIR"):
        return Path(os.environ["DPSCALE_CACHE_DIR"]).expanduser() / name
    return (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
        / "dpscale"
        / name
    )


def make_private_dir(path: Path) -> bool:
    """Create ``path`` (and its parents) if missing; the directory itself owner-only.

    Returns:
        True when this call created ``path`` (so a failed start may remove it again).
    """
    path = Path(path)
    if path.is_dir():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=PRIVATE_DIR_MODE)
    except FileExistsError:  # made meanwhile by another process: not ours to remove
        return False
    return True


def atomic_write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` (mode 0600) so readers see either the old or the new file,
    never a partial one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_temporary(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_create_bytes(path: Path, data: bytes) -> bool:
    """Create ``path`` with ``data`` unless it exists: complete or absent, never empty (a full
    disk leaves nothing behind), and of two processes creating it at once exactly one wins.

    Returns:
        False when ``path`` already existed (nothing written).
    """
    tmp = _write_temporary(Path(path), data)
    try:
        os.link(tmp, path)  # fails if path exists: an atomic "create complete file"
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


def _write_temporary(path: Path, data: bytes | memoryview) -> Path:
    """A complete, fsynced, owner-only copy of ``data`` next to ``path``; removed on failure."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            _write_all(f, data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def _write_all(f: Any, data: bytes | memoryview) -> None:
    """The one place bytes reach the disk (tests make it fail as a full disk would)."""
    f.write(data)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def append_private_text(path: Path, text: str) -> None:
    """Append ``text`` to ``path`` (created owner-only) and flush it to the OS."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE_FILE_MODE)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()


def save_torch_file(
    path: Path, state: dict[str, Any], file_format: int, keep_previous: str | None = None
) -> None:
    """Serialise ``state`` (tensors, dicts, numbers) with ``torch.save``, tagged with
    ``file_format`` and this dpscale's version, checksummed (a SHA-256 trailer), and write it atomically.

    Args:
        keep_previous: a file name in the same directory: the file being replaced is kept
            under it (replacing the one kept before), so a damaged newest file can be fallen back on.
    """
    path = Path(path)
    buffer = io.BytesIO()
    # The version last: a state loaded from an older file and saved again is this version's file.
    torch.save(
        {"format": file_format, CHECKSUMMED_KEY: True, **state, VERSION_KEY: __version__}, buffer
    )
    # getbuffer(), not getvalue(): no second in-memory copy of what may be gigabytes.
    digest = hashlib.sha256(buffer.getbuffer()).hexdigest().encode()
    buffer.write(CHECKSUM_MARK + digest + b"\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_temporary(path, buffer.getbuffer())
    try:
        if keep_previous is not None and path.is_file():
            _keep_as(path, path.with_name(keep_previous))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _keep_as(path: Path, previous: Path) -> None:
    """Make ``previous`` a copy of ``path`` (a hard link, not a rename: ``path`` exists at
    every moment, whatever is interrupted)."""
    link = previous.with_name(f".{previous.name}.link")
    link.unlink(missing_ok=True)
    os.link(path, link)
    try:
        os.replace(link, previous)
    except BaseException:
        link.unlink(missing_ok=True)
        raise


def load_torch_file(
    path: Path, file_format: int, what: str, older: tuple[int, ...] = ()
) -> dict[str, Any]:
    """Load a file written by ``save_torch_file`` with ``file_format`` (or one of the ``older``
    formats, for the caller to migrate), checking its checksum.

    Raises:
        FileNotFoundError: no file at ``path``.
        DamagedFileError: the bytes do not match their checksum, or cannot be parsed.
        ForeignFileError: a readable file of another kind; every message names the path and ``what``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no {what} at {path}")
    damaged = f"{what} {path} is damaged: its bytes do not match its SHA-256 checksum"
    with path.open("rb") as f:  # one open file: checked and loaded are the same bytes
        checked = _check_trailer(f)
        if checked is False:
            raise DamagedFileError(damaged)
        f.seek(0)
        try:
            # weights_only: a file from elsewhere must not be able to run code on load.
            state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises several types for corrupt files
            raise DamagedFileError(
                f"{what} {path} is unreadable ({type(err).__name__}: {err})"
            ) from err
    if not isinstance(state, dict) or state.get("format") not in (file_format, *older):
        raise ForeignFileError(_unreadable_format(path, what, state, file_format))
    if state.pop(CHECKSUMMED_KEY, False) and checked is None:  # written with a trailer that is gone
        raise DamagedFileError(damaged)
    return state


def _unreadable_format(path: Path, what: str, state: Any, file_format: int) -> str:
    """Why a loaded file is refused: written by a newer dpscale (naming its version where it
    was recorded), or not a dpscale ``what`` at all (another program's, or an unknown format).

    Args:
        path: the file.
        what: the kind of file asked for ("checkpoint", "feature cache").
        state: what ``torch.load`` returned.
        file_format: the newest format of ``what`` this code reads.

    Returns:
        the one-line message.
    """
    found = state.get("format") if isinstance(state, dict) else None
    if isinstance(found, int) and not isinstance(found, bool) and found > file_format:
        version = state.get(VERSION_KEY)
        writer = (
            f"version {version}, format {found}" if isinstance(version, str) else f"format {found}"
        )
        return (
            f"{path}: {what} written by a newer dpscale ({writer}); this is dpscale {__version__} "
            f"reading {what} format {file_format} or older: upgrade dpscale"
        )
    return f"{path} is not a dpscale {what} (format {file_format})"


def _check_trailer(f: Any) -> bool | None:
    """True: the file ends with a checksum trailer its bytes match; False: they do not match;
    None: no trailer (a file written before checksums)."""
    size = f.seek(0, os.SEEK_END)
    if size < CHECKSUM_TRAILER_BYTES:
        return None
    f.seek(size - CHECKSUM_TRAILER_BYTES)
    trailer = f.read()
    if not trailer.startswith(CHECKSUM_MARK):
        return None
    f.seek(0)
    digest, left = hashlib.sha256(), size - CHECKSUM_TRAILER_BYTES
    while left > 0:
        chunk = f.read(min(left, 1 << 24))
        if not chunk:
            return False
        digest.update(chunk)
        left -= len(chunk)
    return trailer[len(CHECKSUM_MARK) : -1] == digest.hexdigest().encode()


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write a training checkpoint atomically, keeping the one it replaces as ``checkpoint.prev.pt``."""
    save_torch_file(path, state, CHECKPOINT_FORMAT, keep_previous=PREVIOUS_CHECKPOINT_NAME)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint written by ``save_checkpoint``, in the current layout (``migrate``).

    Raises:
        FileNotFoundError / DamagedFileError / ForeignFileError: with the path and what is wrong.
    """
    return migrate(load_torch_file(path, CHECKPOINT_FORMAT, "checkpoint", older=MIGRATED_FORMATS))

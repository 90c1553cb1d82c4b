"""Atomic file writes and training checkpoints (below every layer: config, features and train use it).

A checkpoint is only ever replaced by a complete new one: we write to a temporary file
in the same directory, fsync it, then ``os.replace`` it over the old one (atomic on
POSIX), so an interrupted write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_NAME = "checkpoint.pt"
CHECKPOINT_FORMAT = 1


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see either the old or the new file, never a partial one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def save_torch_file(path: Path, state: dict[str, Any], file_format: int) -> None:
    """Serialise ``state`` (tensors, dicts, numbers) with ``torch.save``, tagged with
    ``file_format``, and write it atomically."""
    buffer = io.BytesIO()
    torch.save({"format": file_format, **state}, buffer)
    # getbuffer(), not getvalue(): no second in-memory copy of what may be gigabytes.
    atomic_write_bytes(path, buffer.getbuffer())


def load_torch_file(path: Path, file_format: int, what: str) -> dict[str, Any]:
    """Load a file written by ``save_torch_file`` with ``file_format``.

    Raises:
        FileNotFoundError / ValueError: naming the path and ``what`` it should have been.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no {what} at {path}")
    try:
        # weights_only: a file from elsewhere must not be able to run code on load.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for corrupt files
        raise ValueError(f"{what} {path} is unreadable ({type(err).__name__}: {err})") from err
    if not isinstance(state, dict) or state.get("format") != file_format:
        raise ValueError(f"{path} is not a dpscale {what} (format {file_format})")
    return state


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write a training checkpoint atomically."""
    save_torch_file(path, state, CHECKPOINT_FORMAT)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint written by ``save_checkpoint``.

    Raises:
        FileNotFoundError / ValueError: with the path and what is wrong.
    """
    return load_torch_file(path, CHECKPOINT_FORMAT, "checkpoint")

"""Writing a run directory: its lock, starting a run in it, checking a resume's config edits.

The directory's file names and its readers (config, checkpoints, summary, metrics) are
:mod:`dpscale.runs`'s. Every file is owner-only: the directory holds what the guarantee does not cover.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from dpscale._io import atomic_create_bytes, make_private_dir
from dpscale.config import Config, config_yaml, flat_config, parse_override
from dpscale.errors import ConfigError
from dpscale.runs import (
    CONFIG_NAME,
    LOCK_NAME,
    PREVIOUS_CHECKPOINT_NAME,
    UNSTARTED_RUN_FILES,
    holds_checkpoint,
)

try:  # POSIX; elsewhere a run directory is not locked (see RunLock)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "NewRun",
    "RunDirBusy",
    "RunLock",
    "check_config_edits",
    "config_changes",
    "default_out_dir",
    "open_new_run",
]


class RunDirBusy(ConfigError):
    """Another live process holds the run directory's lock."""


def default_out_dir(config: Config) -> str:
    """runs/<model>-<data>-<date-time>, with a suffix if that directory already exists."""
    base = f"runs/{config.model.name}-{config.data.name}-{datetime.now():%Y%m%d-%H%M%S}"
    candidate, n = base, 1
    while Path(candidate).exists():
        n += 1
        candidate = f"{base}-{n}"
    return candidate


def taken_message(run_dir: Path) -> str:
    return f"{run_dir} already holds a run; continue it with `dpscale train --resume {run_dir}` or choose another run.out_dir"


class RunLock:
    """The exclusive lock of one run directory, held by the process that trains in it.

    An advisory ``flock`` on ``.dpscale.lock``: the OS drops it when its process dies (even by
    SIGKILL), so a lock file left by a killed run never blocks the next one; the file names the
    holder (pid, host, start time) for the message a second process gets.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None
        self.stale_holder: str | None = None  # the holder named by a lock file whose process died

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or raise ``RunDirBusy`` naming the process that holds it."""
        if self._fd is not None or fcntl is None:
            return
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as err:
                holder = _named_holder(fd)
                os.close(fd)
                raise RunDirBusy(
                    f"{self.run_dir} is in use by another dpscale process ({holder}); wait for it to finish, or "
                    "stop it (Ctrl-C writes a checkpoint) and resume"
                ) from err
            if _same_file(fd, self.path):
                break
            # the holder released (and removed) the file between our open and flock: again
            os.close(fd)
        self.stale_holder = _read_holder(fd) or None
        _write_holder(fd)
        self._fd = fd
        _remove_temporaries(self.run_dir)

    def release(self) -> None:
        """Give the lock up and remove its file (nothing left behind after a clean exit)."""
        if self._fd is None:
            return
        # Removed while still held: a process that opened the old file sees the inode change and retries.
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


def _remove_temporaries(run_dir: Path) -> None:
    """Remove the half-written temporaries of a process killed mid-write (only the lock's
    holder writes in a run directory, so none of them is being written now)."""
    for path in run_dir.glob(".*.tmp"):
        path.unlink(missing_ok=True)
    (run_dir / f".{PREVIOUS_CHECKPOINT_NAME}.link").unlink(missing_ok=True)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _named_holder(fd: int, wait_s: float = 1.0) -> str:
    """The holder's name from a lock file held by another process. It writes its name right
    after taking the lock, so a process that lost the race by microseconds waits up to
    ``wait_s`` seconds for it instead of naming nobody."""
    deadline = time.monotonic() + wait_s
    while not (holder := _read_holder(fd)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return holder or "its holder has not written its name yet"


def _write_holder(fd: int) -> None:
    text = (
        f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"
    )
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode(), 0)
    except OSError:  # a full disk: the lock holds without its note
        pass


@dataclass
class NewRun:
    """A run directory being started: locked, and how to undo the start if it fails.

    Attributes:
        lock: held from ``open_new_run`` until the run ends.
        created: this start created the directory (a failed start removes it again).
        cleared: files of a run that stopped before its first checkpoint, removed to start again.
    """

    run_dir: Path
    lock: RunLock
    created: bool
    cleared: list[str] = field(default_factory=list)

    def claim(self, config: Config) -> None:
        """Write ``config`` as the run's config.yaml: complete or not at all (a full disk leaves
        no empty file), and only where no other run's is."""
        text = config_yaml(config).encode("utf-8")
        try:
            created = atomic_create_bytes(self.run_dir / CONFIG_NAME, text)
        except OSError as err:
            raise OSError(
                f"cannot write the run directory {self.run_dir}: {err.strerror or err}"
            ) from err
        if not created:
            raise ConfigError(taken_message(self.run_dir))

    def abandon(self) -> None:
        """Undo a start that failed before training: release the lock; remove the directory if
        this start created it and left it empty."""
        self.lock.release()
        if self.created:
            try:
                self.run_dir.rmdir()
            except OSError:  # not empty: leave whatever is there
                pass


def open_new_run(run_dir: str | Path) -> NewRun:
    """Create (owner-only) and lock ``run_dir`` for a new run.

    A directory left by a run that stopped before its first checkpoint (its config and metrics,
    no steps kept) is cleared: nothing of it can be continued.

    Raises:
        RunDirBusy: another process trains in it. ConfigError: it holds a checkpointed run.
    """
    run_dir = Path(run_dir)
    created = make_private_dir(run_dir)
    lock = RunLock(run_dir)
    start = NewRun(run_dir, lock, created)
    try:
        lock.acquire()
        if holds_checkpoint(run_dir):
            raise ConfigError(taken_message(run_dir))
        for name in UNSTARTED_RUN_FILES:
            if (run_dir / name).exists():
                (run_dir / name).unlink()
                start.cleared.append(name)
    except BaseException:
        start.abandon()
        raise
    return start


def config_changes(saved: dict[str, Any], config: Config) -> dict[str, tuple[Any, Any]]:
    """Every setting of ``config`` that differs from the ``saved`` resolved config, as
    {dotted key: (saved value, new value)} (``run.out_dir`` aside: a run directory may move)."""
    before, after = flat_config(saved), flat_config(config.to_dict())
    # a setting added since the checkpoint was written (dp.mechanism, ...) had its default then
    defaults = flat_config(Config().to_dict())
    before.update({k: defaults[k] for k in set(after) - set(before) if k in defaults})
    changes = {
        k: (before.get(k), after.get(k))
        for k in sorted(set(before) | set(after))
        if before.get(k) != after.get(k)
    }
    changes.pop("run.out_dir", None)
    return changes


def check_config_edits(
    run_dir: Path, saved: dict[str, Any] | None, config: Config, overrides: Sequence[str], step: int
) -> dict[str, tuple[Any, Any]]:
    """The changes ``overrides`` (``--set`` on resume) make to the checkpoint's config.

    Raises:
        ConfigError: config.yaml was edited since the checkpoint in a setting no override names
            (a resume continues the run as configured unless a change is asked for explicitly).
    """
    if saved is None:  # a checkpoint from before configs were recorded in it: edits cannot be seen
        return {}
    changes = config_changes(saved, config)
    asked = {".".join(parse_override(text)[0]) for text in overrides}
    edited = {k: v for k, v in changes.items() if k not in asked}
    if edited:
        listed = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in edited.items())
        sets = " ".join(f"--set {k}={_yaml_value(new)}" for k, (_, new) in edited.items())
        raise ConfigError(
            f"{run_dir / CONFIG_NAME} was edited after the checkpoint at step {step} ({listed}); a resume continues "
            f"the run as configured: restore the file, or ask for the change with `dpscale train --resume {run_dir} "
            f"{sets}` (recorded in the run)"
        )
    return changes


def _yaml_value(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()

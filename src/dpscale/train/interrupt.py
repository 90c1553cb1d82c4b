"""Ctrl-C and SIGTERM (preemption) during training, honoured between steps."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any


def resume_hint(step: int, run_dir: Path) -> str:
    """What an interrupted run prints (also with the report off): how the user gets their run back."""
    return f"interrupted after step {step}; resume with: dpscale train --resume {run_dir}"


class DeferredInterrupt:
    """Turns Ctrl-C and SIGTERM (preemption) into a request honoured between steps, so the
    checkpoint written on interrupt is never taken halfway through a step (e.g. after the
    update but before the accountant saw it). A second signal interrupts immediately."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "DeferredInterrupt":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)

"""What the tuner's test modules share (test_autotune, test_autotune_choice, test_autotune_runs):
a small convolutional model, and the disk cache written and read as it is. Import it as
``from autotune_helpers import ...`` (pytest puts ``tests/`` on the path)."""

from __future__ import annotations

from torch import nn

from dpscale.privacy.clipping import autotune, autotune_timing


def convs() -> nn.Module:
    """Four 3x3 convolutions (stride 2, dilated, grouped) on 3 x 9 x 9 inputs, then a head."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.Tanh(),
        nn.Conv2d(8, 6, 3, padding=2, dilation=2),
        nn.Tanh(),
        nn.Conv2d(6, 6, 3, groups=3, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(6 * 5 * 5, 10),
    )


def cache_as_written(monkeypatch) -> None:
    """The disk cache written and read as it is: no timing judged under load (this shared machine's
    may be, and then not written) and no cached choice checked against its timing, on its first
    chunk or later (the small layers here time too noisily to); tests/test_autotune_cache.py
    covers both with a fake clock."""
    monkeypatch.setattr(
        autotune_timing, "load_verdict", lambda samples, thread: autotune_timing.IDLE
    )
    monkeypatch.setattr(
        autotune.MethodTuner, "_cache_check", lambda self, choice, candidates, device, rows: ""
    )
    monkeypatch.setattr(autotune, "CHECK_OFF", float("inf"))

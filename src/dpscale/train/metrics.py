"""Evaluation and the run's append-only metrics log."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from dpscale._io import append_private_text, atomic_write_text


def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000
) -> tuple[float, float]:
    """Accuracy (fraction in [0, 1]) and mean cross-entropy of ``model`` on (x, y)."""
    batches = (
        (x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, x.shape[0], batch_size)
    )
    return evaluate_batches(model, batches, x.device)


@torch.no_grad()
def evaluate_batches(
    model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> tuple[float, float]:
    """Accuracy (fraction in [0, 1]) and mean cross-entropy of ``model`` over (x, y) batches on ``device``."""
    was_training = model.training
    model.eval()
    # correct, loss sum, count: read once at the end
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for x, target in batches:
        logits = model(x)
        loss = F.cross_entropy(logits, target, reduction="sum").double()
        count = torch.full((), float(len(target)), dtype=torch.float64, device=device)
        totals += torch.stack([(logits.argmax(1) == target).sum().double(), loss, count])
    model.train(was_training)
    correct, loss_sum, n = totals.tolist()
    return int(correct) / max(1, n), loss_sum / max(1, n)


def json_safe(value: Any) -> Any:
    """inf/nan -> None so every file we write is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class MetricsLog:
    """``metrics.jsonl``: one JSON object per evaluation, flushed immediately."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def append(self, record: dict[str, Any]) -> None:
        append_private_text(self.path, json.dumps(json_safe(record)) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop records logged after ``step`` (written after the checkpoint a resume starts from)."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short by a crash mid-write
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]


@torch.no_grad()
def evaluate_augtest(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    kind: str,
    views: int,
    generator: torch.Generator,
    value_range: tuple[float, float],
    batch_size: int = 1000,
    padding: int = 4,
) -> float:
    """AugTest accuracy: each test image is classified by a majority vote over ``views``
    augmented copies of it (TAN Appendix C; ``padding``: crop-flip's and crop's largest shift,
    px); a fraction in [0, 1]."""
    from dpscale.data.augment import augment_views, majority_vote

    was_training = model.training
    model.eval()
    correct = 0
    step = max(1, batch_size // views)
    for start in range(0, x.shape[0], step):
        batch = augment_views(
            x[start : start + step],
            kind,
            views,
            generator,
            value_range=value_range,
            padding=padding,
        )
        logits = model(batch.reshape(-1, *batch.shape[2:])).reshape(batch.shape[0], views, -1)
        correct += int((majority_vote(logits) == y[start : start + step]).sum())
    model.train(was_training)
    return correct / max(1, x.shape[0])

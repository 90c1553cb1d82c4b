"""The preset record shared by the paper modules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Preset:
    """Attributes:
    name: what follows ``preset:``.
    description: one line: data, model and the paper setting it reproduces.
    source: paper, table and the paper's reported result.
    values: config sections (data, features, model, dp, optim, train) as plain values.
    """

    name: str
    description: str
    source: str
    values: dict[str, Any]

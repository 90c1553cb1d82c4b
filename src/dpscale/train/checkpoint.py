"""Training checkpoints: the atomic file writes live in :mod:`dpscale._io` (every layer uses them)."""

from dpscale._io import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_NAME,
    atomic_write_bytes,
    atomic_write_text,
    load_checkpoint,
    load_torch_file,
    save_checkpoint,
    save_torch_file,
)

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_NAME",
    "atomic_write_bytes",
    "atomic_write_text",
    "load_checkpoint",
    "load_torch_file",
    "save_checkpoint",
    "save_torch_file",
]

"""Dataset loading: in-memory image-classification datasets with fixed train/test splits."""

# Imported on first use (PEP 562): ``dpscale account``/``--help`` then never pay for torch.
from __future__ import annotations

import importlib
from typing import Any

_MODULE_OF = {
    "DATASET_NAMES": "datasets",
    "DatasetError": "datasets",
    "DatasetInfo": "datasets",
    "ImageDataset": "datasets",
    "PoissonSampler": "sampling",
    "SAMPLING_MODES": "sampling",
    "SHUFFLE_CAVEAT": "sampling",
    "ShuffleSampler": "sampling",
    "dataset_fingerprint": "datasets",
    "load_cifar": "datasets",
    "load_dataset": "datasets",
    "load_idx": "datasets",
    "load_image_folder": "datasets",
    "load_mnist_5k": "datasets",
    "load_npz": "datasets",
    "make_sampler": "sampling",
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

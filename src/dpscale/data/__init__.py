"""Dataset loading: in-memory image-classification datasets with fixed train/test splits."""

# Imported on first use (PEP 562): ``dpscale account``/``--help`` then never pay for torch.
from __future__ import annotations

from dpscale._lazy import lazy_dir, lazy_getattr

_MODULE_OF = {
    "DATASET_NAMES": "datasets",
    "DatasetError": "datasets",
    "DatasetInfo": "image_dataset",
    "ImageDataset": "image_dataset",
    "dataset_fingerprint": "datasets",
    "load_cifar": "datasets",
    "load_dataset": "datasets",
    "load_idx": "datasets",
    "load_image_folder": "datasets",
    "load_mnist_5k": "datasets",
    "load_npz": "datasets",
}

__all__ = sorted(_MODULE_OF)


# moved to privacy/sampling/ (issue 64): served with a DeprecationWarning for one release
_MOVED = {
    **dict.fromkeys(
        ("PoissonSampler", "ShuffleSampler", "make_sampler"), "dpscale.privacy.sampling.samplers"
    ),
    **dict.fromkeys(("SAMPLING_MODES", "SHUFFLE_CAVEAT"), "dpscale.privacy.sampling.modes"),
}
__getattr__ = lazy_getattr(__name__, _MODULE_OF, _MOVED)
__dir__ = lazy_dir(_MODULE_OF)

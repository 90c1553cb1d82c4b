"""Dataset loading: in-memory image-classification datasets with fixed train/test splits."""

from .datasets import (
    DATASET_NAMES,
    DatasetError,
    DatasetInfo,
    ImageDataset,
    load_cifar,
    load_dataset,
    load_idx,
    load_image_folder,
    load_mnist_5k,
    dataset_fingerprint,
    load_npz,
)
from .sampling import SAMPLING_MODES, SHUFFLE_CAVEAT, PoissonSampler, ShuffleSampler, make_sampler

__all__ = [
    "DATASET_NAMES",
    "DatasetError",
    "DatasetInfo",
    "ImageDataset",
    "load_cifar",
    "load_dataset",
    "load_idx",
    "load_image_folder",
    "load_mnist_5k",
    "load_npz",
    "dataset_fingerprint",
    "SAMPLING_MODES",
    "SHUFFLE_CAVEAT",
    "PoissonSampler",
    "ShuffleSampler",
    "make_sampler",
]

"""Tramer & Boneh 2021, "Differentially private learning needs better features", Table 13.

The hyper-parameters that gave the best accuracy at (epsilon = 3, delta = 1e-5) for each dataset
and model. Shared by all (their Table 12): clipping norm C = 0.1, SGD with momentum 0.9, Poisson
sampling, sigma calibrated so the budget is spent after T epochs, learning rate = base x B / 512.
Data Normalization uses the paper's (C1, C2) per dataset and sigma_norm; its privacy cost is
composed with DP-SGD. The accountant is RDP, as in the paper (PLD would calibrate less noise).

ScatterNet presets read pixels in [0, 1] (``data.normalize: false``): the paper's (C1, C2)
bounds are on that scale (they sit at the medians of the per-example channel-mean norms there).
"""

from __future__ import annotations

from typing import NamedTuple

from dpscale.presets.base import Preset

DATASETS = {  # key: (data.name, paper's Data Norm (C1, C2), end-to-end CNN)
    "mnist": ("mnist", (0.2, 0.05), "papernot-cnn"),
    "fmnist": ("fashion-mnist", (0.3, 0.15), "papernot-cnn"),
    "cifar10": ("cifar10", (1.0, 1.5), "tramer-cifar-cnn"),
}


class Row(NamedTuple):
    """One column of Table 13, with the paper's accuracies at epsilon = 3 for reference: Table 1
    (best of the search, batches by random shuffling) and Table 19 (the same hyper-parameters
    re-run with Poisson sampling, as these presets do; linear and CNN models only)."""

    dataset: str
    model: str  # scatter-linear | scatter-cnn | cnn
    batch_size: int
    base_lr: float
    epochs: int
    groups: int | None  # GroupNorm groups G, or None
    norm_noise: float | None  # Data Norm sigma_norm, or None
    paper_accuracy: float  # Tramer Table 1 / Table 19 shuffle column, percent (mean of five runs)
    poisson_accuracy: float | None  # Tramer Table 19, Poisson sampling, percent


TABLE_13 = [
    Row("mnist", "scatter-linear", 4096, 1.0, 40, None, 8.0, 98.7, 98.6),
    Row("mnist", "scatter-cnn", 1024, 0.5, 25, None, 8.0, 98.7, None),
    Row("mnist", "cnn", 512, 0.5, 40, None, None, 98.1, 98.0),
    Row("fmnist", "scatter-linear", 8192, 1.0, 40, 27, None, 89.7, 89.6),
    Row("fmnist", "scatter-cnn", 2048, 1.0, 40, 27, None, 89.0, None),
    Row("fmnist", "cnn", 2048, 1.0, 40, None, None, 86.0, 86.1),
    Row("cifar10", "scatter-linear", 8192, 0.25, 60, None, 8.0, 67.0, 66.8),
    Row("cifar10", "scatter-cnn", 8192, 0.25, 60, None, 8.0, 69.3, None),
    Row("cifar10", "cnn", 1024, 0.5, 30, None, None, 59.2, 59.0),
]


def _values(row: Row) -> dict:
    data_name, (c1, c2), cnn = DATASETS[row.dataset]
    scatter = row.model != "cnn"
    values: dict = {
        "data": {"name": data_name, "root": None, "normalize": not scatter},
        "model": {"name": row.model if scatter else cnn, "activation": "tanh"},
        "dp": {
            "epsilon": 3.0,
            "delta": 1.0e-5,
            "noise_multiplier": None,
            "max_grad_norm": 0.1,
            "batch_size": row.batch_size,
            "sampling": "poisson",
            "accountant": "rdp",
        },
        "optim": {"name": "sgd", "lr": row.base_lr * row.batch_size / 512, "momentum": 0.9},
        "train": {
            "epochs": row.epochs,
            "eval_every_epochs": 1,  # epsilon and accuracy per epoch: the curve of Tramer Figure 1
            "max_physical_batch_size": 2048 if row.model == "scatter-linear" else 512,
        },
    }
    if scatter:
        features: dict = {
            "extractor": "scatternet",
            "scatter_j": 2,
            "scatter_angles": 8,
            "scatter_order": 2,
        }
        if row.groups is not None:
            features.update(normalize="groupnorm", groups=row.groups)
        else:
            features.update(normalize="datanorm", norm_clip=[c1, c2], norm_noise=row.norm_noise)
        # config section order
        values = {"data": values.pop("data"), "features": features, **values}
    return values


def _describe(row: Row) -> tuple[str, str]:
    model = {
        "scatter-linear": "ScatterNet + linear",
        "scatter-cnn": "ScatterNet + CNN",
        "cnn": "end-to-end CNN",
    }[row.model]
    norm = (
        f", GroupNorm G={row.groups}"
        if row.groups
        else (f", private Data Norm sigma_norm={row.norm_noise:g}" if row.norm_noise else "")
    )
    description = f"{DATASETS[row.dataset][0]}, {model}{norm}, epsilon=3"
    source = (
        f"Tramer & Boneh 2021, Table 13: B={row.batch_size}, base lr {row.base_lr:g} (x B/512), "
        f"{row.epochs} epochs, C=0.1, momentum 0.9; paper accuracy at epsilon=3: {row.paper_accuracy}% "
        "(shuffled batches)"
        + (
            f", {row.poisson_accuracy}% with Poisson sampling (Table 19)"
            if row.poisson_accuracy
            else ""
        )
    )
    return description, source


TRAMER_PRESETS = [
    Preset(f"tramer-{row.dataset}-{row.model}", *_describe(row), _values(row)) for row in TABLE_13
]

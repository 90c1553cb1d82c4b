"""Transfer presets: Papernot et al. Section 4.1 (CIFAR-100 sources -> private CIFAR-10, all but
the last layer frozen) and Tramer & Boneh Section 5.2 (a DP linear probe on public features).

Source presets are non-private and meant for ``dpscale pretrain``; the private targets start
from a source run given with ``--set model.init=RUN_DIR`` (or ``features.extractor=checkpoint:RUN_DIR``):
the placeholder ``RUN_DIR`` makes a run that was not given one stop with a clear error.
"""

from __future__ import annotations

from typing import Any

from dpscale.presets.base import Preset

RUN_DIR = "RUN_DIR"  # placeholder: the user's source run directory

_SOURCE_TEXT = (
    "Papernot et al. 2021, Section 4.1 and Appendix B ('Section 4.1 (CIFAR100)' column): Table 2 CNN, ReLU, "
    "non-private, B=64, 150 epochs, Adam lr 0.001. Not in the paper: which classes (here seeded by "
    "data.subset_seed=0), how meta-classes are grouped (dpscale's seeded even grouping), Adam betas, augmentation. "
    "Run with `dpscale pretrain preset:{name} --set data.root=DIR`; then papernot-cifar10-transfer from it."
)


def _source(**subset: Any) -> dict[str, Any]:
    return {
        "data": {"name": "cifar100", "root": None, "subset_seed": 0, **subset},
        "model": {"name": "papernot-cifar-cnn", "activation": "relu"},
        "dp": {"epsilon": None, "noise_multiplier": 0.0, "max_grad_norm": None, "batch_size": 64},
        "optim": {"name": "adam", "lr": 1.0e-3},
        "train": {"epochs": 150, "max_physical_batch_size": 64},
    }


def _source_preset(name: str, variant: str, description: str, **subset: Any) -> Preset:
    return Preset(
        name,
        f"CIFAR-100 source '{variant}' for Papernot's transfer (NOT PRIVATE): {description}",
        _SOURCE_TEXT.format(name=name),
        _source(**subset),
    )


PAPERNOT_SOURCES = [
    _source_preset(
        "papernot-cifar100-source-min-rand-10",
        "Min-rand-10",
        "10 random classes, 5,000 images",
        random_classes=10,
    ),
    _source_preset(
        "papernot-cifar100-source-half-rand-50",
        "Half-rand-50",
        "50 random classes in 10 evenly sized meta-classes, 25,000 images",
        random_classes=50,
        meta_classes=10,
    ),
    _source_preset("papernot-cifar100-source-max-100", "Max-100", "all 100 classes, 50,000 images"),
]

PAPERNOT_TRANSFER = Preset(
    "papernot-cifar10-transfer",
    "CIFAR-10 from a CIFAR-100 source run, all but the logits frozen, sigma=15, B=5000, 400 epochs (Papernot Table 3)",
    "Papernot et al. 2021, Section 4.1, Table 3 and Appendix B ('Section 4.1 (CIFAR10)'): Table 2 CNN, ReLU, all but "
    "the last layer frozen (freeze_groups=7 of 8), DP-SGD lr 0.8, C=1, sigma=15, B=5000, 400 epochs, delta 1e-5. "
    "Table 3: Max-100 source 57.0/66.2/68.4/69.7/71.0% (average of 10) after 10/50/100/200/400 epochs at the paper's "
    "epsilon 0.32/0.73/1.04/1.48/2.12; dpscale's RDP gives 0.25/0.58/0.85/1.23/1.80 for the same numbers (a tighter "
    "RDP-to-DP conversion); evaluations every 10 epochs report each column. Not in the paper: momentum (none), "
    "re-initialising the head (done: the source has other classes), the sampling (Poisson). Start from a source "
    "run: --set model.init=RUN_DIR (a papernot-cifar100-source-* pretraining); the guarantee assumes its data public.",
    {
        "data": {"name": "cifar10", "root": None},
        "model": {
            "name": "papernot-cifar-cnn",
            "activation": "relu",
            "init": RUN_DIR,
            "reset_head": True,
            "freeze_groups": 7,
        },
        "dp": {
            "epsilon": None,
            "delta": 1.0e-5,
            "noise_multiplier": 15.0,
            "max_grad_norm": 1.0,
            "batch_size": 5000,
            "sampling": "poisson",
            "accountant": "rdp",
        },
        "optim": {"name": "sgd", "lr": 0.8, "momentum": 0.0},
        "train": {"epochs": 400, "max_physical_batch_size": 1000, "eval_every_epochs": 10},
    },
)

TRAMER_LINEAR_PROBE = Preset(
    "tramer-cifar10-linear-probe",
    "CIFAR-10, DP linear probe on a public model's features (--set features.extractor=checkpoint:RUN_DIR), epsilon=2",
    "Tramer & Boneh 2021, Section 5.2 and Table 17 (best for SimCLRv2): B=1024, lr 2 x B/512, 40 epochs, C=0.1, "
    "momentum 0.9, features not normalised; the paper reports 92.7% (SimCLRv2, ImageNet) and 80.0% (ResNeXt-29, "
    "CIFAR-100; B=2048, lr 8) at epsilon 2, delta 1e-5. Those public models are not loadable here: the extractor is "
    "a dpscale run on public data (e.g. a papernot-cifar100-source-* pretraining), whose penultimate features are "
    "probed. Not in the paper: sigma (calibrated), the sampling (Poisson here; the paper shuffled).",
    {
        "data": {"name": "cifar10", "root": None, "normalize": True},
        "features": {"extractor": f"checkpoint:{RUN_DIR}", "normalize": "none"},
        "model": {"name": "linear", "activation": "tanh"},
        "dp": {
            "epsilon": 2.0,
            "delta": 1.0e-5,
            "noise_multiplier": None,
            "max_grad_norm": 0.1,
            "batch_size": 1024,
            "sampling": "poisson",
            "accountant": "rdp",
        },
        "optim": {"name": "sgd", "lr": 4.0, "momentum": 0.9},
        "train": {"epochs": 40, "max_physical_batch_size": 2048},
    },
)

TRANSFER_PRESETS = [*PAPERNOT_SOURCES, PAPERNOT_TRANSFER, TRAMER_LINEAR_PROBE]

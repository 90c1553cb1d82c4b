"""Papernot et al. 2021, "Tempered sigmoid activations for deep learning with DP" (Making the shoe fit)."""

from __future__ import annotations

from dpscale.presets.base import Preset

PAPERNOT_PRESETS = [
    Preset(
        "papernot-mnist-tanh",
        "MNIST, Papernot Table 1 CNN (k=16 filters), tanh, DP-SGD with a given sigma",
        "Papernot et al. 2021, Appendix B, 'Section 3.2' column: B=256, 40 epochs, SGD lr 0.15, C=1.0, "
        "sigma=1.1; epsilon 2.93 (RDP) at delta 1e-5 on the 60,000 MNIST images. On a smaller set the "
        "same sigma spends more (q = B/N is larger); the run reports what it spent.",
        {
            "data": {"name": "mnist", "root": None},
            "model": {"name": "papernot-cnn", "activation": "tanh", "kwargs": {"filters": [16, 16]}},
            "dp": {
                "epsilon": None,  # sigma is given, not calibrated
                "delta": 1.0e-5,
                "noise_multiplier": 1.1,
                "max_grad_norm": 1.0,
                "batch_size": 256,
                "sampling": "poisson",
                "accountant": "rdp",  # what the paper reports
            },
            "optim": {"name": "sgd", "lr": 0.15, "momentum": 0.0},
            "train": {"epochs": 40, "max_physical_batch_size": 256},
        },
    )
]

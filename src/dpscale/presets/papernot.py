"""Papernot et al. 2021, "Tempered sigmoid activations for deep learning with DP" (Making the shoe fit)."""

from __future__ import annotations

from dpscale.presets.base import Preset

PAPERNOT_PRESETS = [
    Preset(
        "papernot-mnist-tanh",
        "MNIST, Papernot Table 1 CNN (k=16 filters), tanh, DP-SGD with a given sigma",
        "Papernot et al. 2021, Appendix B, 'Section 3.2' column: B=256, 40 epochs, SGD lr 0.15, C=1.0, "
        "sigma=1.1; the paper reports epsilon 2.93 (RDP) at delta 1e-5 on the 60,000 MNIST images, while "
        "dpscale's RDP accountant gives 2.09 for the same numbers (a tighter RDP-to-DP conversion than the "
        "paper's). On a smaller set the same sigma spends more (q = B/N is larger); the run reports what it spent.",
        {
            "data": {"name": "mnist", "root": None},
            "model": {
                "name": "papernot-cnn",
                "activation": "tanh",
                "kwargs": {"filters": [16, 16]},
            },
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
    ),
    Preset(
        "papernot-fmnist-tanh",
        "Fashion-MNIST, Papernot Table 1 CNN (k=16 filters), tanh, DP-SGD, sigma=1.1 (paper: 86.1% at epsilon 2.7)",
        "Papernot et al. 2021, Appendix B ('Section 5.1/5.2' columns: Table 1 architecture with k=16, tanh, B=256, "
        "40 epochs, C=1.0, sigma=1.1) and Table 5 (Fashion-MNIST, DP-SGD at B=256: lr 0.332, 86.1%; the Section "
        "3.2 column used lr 0.15 for 85.5%); epsilon 2.7 at delta 1e-5 as the paper reports it. dpscale's RDP "
        "accountant gives 2.09 for the same numbers (N=60,000): the paper used the older RDP-to-DP conversion. "
        "Not in the paper: momentum (none here), the sampling scheme (Poisson here).",
        {
            "data": {"name": "fashion-mnist", "root": None},
            "model": {
                "name": "papernot-cnn",
                "activation": "tanh",
                "kwargs": {"filters": [16, 16]},
            },
            "dp": {
                "epsilon": None,  # sigma is given, not calibrated
                "delta": 1.0e-5,
                "noise_multiplier": 1.1,
                "max_grad_norm": 1.0,
                "batch_size": 256,
                "sampling": "poisson",
                "accountant": "rdp",
            },
            "optim": {"name": "sgd", "lr": 0.332, "momentum": 0.0},
            "train": {"epochs": 40, "max_physical_batch_size": 256},
        },
    ),
    Preset(
        "papernot-cifar10-tanh",
        "CIFAR-10, Papernot Table 6 all-convolutional net, tanh, DP-Adam, sigma=0.5 (epsilon ~26: weak privacy)",
        "Papernot et al. 2021, Appendix B 'Section 4.2' column: Table 6 architecture (2,334,730 parameters), tanh, "
        "B=500, C=1.0, sigma=0.5, DP-Adam lr 1e-4; Section 4.2 reports 37% at epoch 33 with random initialisation "
        "(the epoch count is 'see Figure 4'; 33 is the epoch the text quotes). The paper gives no epsilon or delta "
        "for this run; at delta 1e-5 dpscale's RDP gives epsilon ~26 for 33 epochs on N=50,000, so it is a "
        "reproduction of the paper's setting, not a strongly private recipe. Adam betas/eps: dpscale's defaults "
        "(not in the paper). The paper's 72% at epsilon 2.1 is a ReLU transfer run (Table 3), not this preset.",
        {
            "data": {"name": "cifar10", "root": None},
            "model": {"name": "papernot-allconv", "activation": "tanh"},
            "dp": {
                "epsilon": None,
                "delta": 1.0e-5,
                "noise_multiplier": 0.5,
                "max_grad_norm": 1.0,
                "batch_size": 500,
                "sampling": "poisson",
                "accountant": "rdp",
            },
            "optim": {"name": "adam", "lr": 1.0e-4},
            "train": {"epochs": 33, "max_physical_batch_size": 500},
        },
    ),
]

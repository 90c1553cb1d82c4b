"""Fast screen of ScatterNet feature choices for a DP-SGD linear head on Fashion-MNIST (issue 28).

A second, independent DP-SGD for logistic regression only: the per-example gradient of a linear
model is the outer product (softmax - onehot) x features, so its norm is a product of two norms
and a whole run takes 20-90 s on 2 cores. It was used to screen feature transforms, ScatterNet
padding, J, L, schedules, a pixel path, clipping, losses, weight decay and centring before confirming the promising ones with ``dpscale sweep`` (the
library's path; docs/results.md). Poisson sampling, clip C, noise sigma*C on the clipped sum,
division by the expected batch B, SGD momentum 0.9, sigma calibrated with dpscale's PLD accountant;
Tramer & Boneh's preset otherwise (B 8192, lr 16, 40 epochs, GroupNorm). Validation split: dpscale's
10,000 held out of the 60,000 train images. Not covered by any guarantee: a tuning tool.

Usage (each argument is one run, as Python keyword arguments of ``run``):
    python benchmarks/fmnist_feature_screen.py "" "pad=2" "pad=2,seed=1" "transform='log'" "L=12,G=13" "pad=2,center=True"
"""

from __future__ import annotations

import functools
import math
import sys
import time

import torch
import torch.nn.functional as F

from dpscale.data.datasets import load_dataset
from dpscale.features.scatternet import ScatterNet
from dpscale.privacy.accounting.calibrate import calibrate_noise_multiplier

DATA_ROOT = "../shared/data/fashion-mnist"
_RAW: dict[tuple, torch.Tensor] = {}


@functools.cache
def validation_data():  # loaded once for all the runs of one invocation
    return load_dataset("fashion-mnist", DATA_ROOT)


def scatter(images: torch.Tensor, split: str, J: int, L: int, pad: int, order: int = 2) -> torch.Tensor:
    """ScatterNet coefficients of ``images`` (memoised per split and parameters)."""
    key = (split, J, L, pad, order)
    if key not in _RAW:
        net = ScatterNet(tuple(images.shape[1:]), J=J, L=L, pad=pad, max_order=order)
        with torch.no_grad():
            _RAW[key] = torch.cat([net(images[i : i + 2000]) for i in range(0, len(images), 2000)])
    return _RAW[key]


def design(
    raw: torch.Tensor, transform: str, groups: int, images: torch.Tensor | None = None, center: torch.Tensor | None = None
) -> torch.Tensor:
    """Transformed, GroupNorm-ed, flattened features (minus ``center``) with a constant 1 column for the bias.

    With ``images``, the per-image standardised pixels are appended (a linear path on the pixels).
    """
    if transform == "log":
        raw = torch.log(raw + 1e-2)
    elif transform == "sqrt":
        raw = raw.clamp_min(0).sqrt()
    x = F.group_norm(raw, groups, eps=1e-5).flatten(1)
    if center is not None:
        x = x - center
    if images is not None:
        x = torch.cat([x, F.group_norm(images, 1, eps=1e-5).flatten(1)], 1)
    return torch.cat([x, torch.ones(len(x), 1)], 1)


def run(
    transform: str = "none", G: int = 27, B: int = 8192, lr_base: float = 1.0, epochs: int = 40,
    C: float = 0.1, seed: int = 0, eps: float = 3.0, J: int = 2, L: int = 8, pad: int = 0,
    schedule: str = "const", nesterov: bool = False, pixels: bool = False, flip_test: bool = False, order: int = 2,
    center: bool = False, wd: float = 0.0, tau: float = 1.0,
) -> tuple[float, int, float]:  # fmt: skip
    """One DP-SGD run; returns (sigma, steps, validation accuracy in [0, 1]).

    ``center`` subtracts the training features' exact mean after GroupNorm (a screening shortcut:
    the library's ``features.center`` releases it privately); ``wd`` is weight decay; ``tau < 1``
    drops the gradient of examples whose true-class probability is already above tau.
    """
    data = validation_data()
    gen = torch.Generator().manual_seed(seed)
    mean = design(scatter(data.x_train, "train", J, L, pad, order), transform, G)[:, :-1].mean(0) if center else None
    x = design(scatter(data.x_train, "train", J, L, pad, order), transform, G, data.x_train if pixels else None, mean)
    onehot, norms = F.one_hot(data.y_train, 10).float(), x.norm(dim=1)
    n = len(x)
    q, steps = B / n, int(epochs * n / B)
    sigma = calibrate_noise_multiplier(target_epsilon=eps, delta=1e-5, sample_rate=q, steps=steps, kind="pld")
    weights, momentum, lr = torch.zeros(10, x.shape[1]), torch.zeros(10, x.shape[1]), lr_base * B / 512
    for t in range(steps):
        batch = (torch.rand(n, generator=gen) < q).nonzero().squeeze(1)
        probs = torch.softmax(x[batch] @ weights.T, -1)
        err = probs - onehot[batch]
        if tau < 1:
            err = err * ((probs * onehot[batch]).sum(1, keepdim=True) < tau)
        scale = (C / (err.norm(dim=1) * norms[batch]).clamp_min(1e-12)).clamp(max=1.0)  # per-example clip
        grad = ((err * scale[:, None]).T @ x[batch] + sigma * C * torch.randn(weights.shape, generator=gen)) / B
        step_lr = lr * (0.5 * (1 + math.cos(math.pi * t / steps)) if schedule == "cos" else 1.0)
        momentum = 0.9 * momentum + grad + wd * weights
        weights -= step_lr * (grad + 0.9 * momentum if nesterov else momentum)
    xv = design(scatter(data.x_test, "test", J, L, pad, order), transform, G, data.x_test if pixels else None, mean)
    logits = xv @ weights.T
    if flip_test:  # AugTest: the mean of the logits of each validation image and its mirror image
        flipped = data.x_test.flip(-1)
        flipped_x = design(scatter(flipped, "test-flipped", J, L, pad, order), transform, G, flipped if pixels else None, mean)
        logits = logits + flipped_x @ weights.T
    return sigma, steps, (logits.argmax(-1) == data.y_test).float().mean().item()


if __name__ == "__main__":
    torch.set_num_threads(2)
    for spec in sys.argv[1:]:
        start = time.time()
        sigma, steps, accuracy = run(**eval(f"dict({spec})"))  # noqa: S307 - a research script's own arguments
        seconds = time.time() - start
        print(f"{spec or '(preset)':40s} sigma {sigma:.3f} steps {steps} validation {accuracy:.2%} ({seconds:.0f} s)", flush=True)

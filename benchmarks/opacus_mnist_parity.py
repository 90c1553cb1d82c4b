"""Parity with Opacus on its own MNIST example: same model, settings, data, accountant and seeds.

Opacus' ``examples/mnist.py`` (SampleConvNet: conv 16@8x8/2 + maxpool, conv 32@4x4/2 + maxpool,
fc 32, fc 10; ReLU; SGD lr 0.1 without momentum; batch 64 with Poisson sampling, sigma 1.0, C 1.0,
10 epochs, delta 1e-5; inputs normalised with MNIST's mean and std) is run through Opacus and
through ``dpscale.make_private`` on ../shared/data/mnist-10k (8,000 train / 2,000 test). Per seed
both libraries start from the same initial weights; the order in which they run alternates between
seeds so that drifting machine load does not favour one. Both use the RDP accountant, so both
report the same epsilon for the same (q, sigma, steps).

Time per epoch is the thread-CPU time of the training loop (one torch thread), which a loaded
machine inflates less than wall time; the wall time is printed beside it.

Usage:
    python benchmarks/opacus_mnist_parity.py --seeds 10 [--epochs 10] [--data ../shared/data/mnist-10k]

Prints one row per (seed, library), then a summary: mean and sample std of the test accuracy, the
difference of means with its standard error (Welch), and the median time per epoch.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import dpscale
from dpscale.data.datasets import load_idx

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # Opacus' example normalises with these
BATCH_SIZE, LR, SIGMA, MAX_GRAD_NORM, DELTA = 64, 0.1, 1.0, 1.0, 1e-5


class SampleConvNet(nn.Module):
    """Opacus' example model, layer for layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, 1)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2, 1)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy in [0, 1]."""
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(xb).argmax(1) == yb).sum()) for xb, yb in zip(x.split(1024), y.split(1024)))
    return correct / len(y)


def run_opacus(seed: int, epochs: int, data: tuple) -> dict:
    """Opacus' example loop (Poisson loader, mean loss, optimizer.step per batch)."""
    from opacus import PrivacyEngine

    x, y, xt, yt = data
    torch.manual_seed(seed)
    model = SampleConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH_SIZE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus warns about secure_mode and the full backward hook
        engine = PrivacyEngine(accountant="rdp")
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader,
            noise_multiplier=SIGMA, max_grad_norm=MAX_GRAD_NORM,
        )  # fmt: skip
    criterion = nn.CrossEntropyLoss()
    cpu, wall = [], []
    for _ in range(epochs):
        model.train()
        c0, w0 = time.thread_time(), time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for xb, yb in loader:
                optimizer.zero_grad()
                criterion(model(xb), yb).backward()
                optimizer.step()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    return {"acc": accuracy(model, xt, yt), "eps": engine.get_epsilon(DELTA), "cpu": cpu, "wall": wall}


def run_dpscale(seed: int, epochs: int, data: tuple) -> dict:
    """The same run through ``dpscale.make_private``, looping over epochs as docs/own-loop.md shows."""
    x, y, xt, yt = data
    torch.manual_seed(seed)
    model = SampleConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0)
    mechanism = dpscale.make_private(
        model, optimizer, dataset_size=len(x), batch_size=BATCH_SIZE, max_grad_norm=MAX_GRAD_NORM,
        noise_multiplier=SIGMA, delta=DELTA, epochs=epochs, accountant="rdp", seed=seed,
    )  # fmt: skip
    steps_per_epoch = mechanism.remaining_steps() // epochs
    cpu, wall = [], []
    batches = mechanism.batches()
    for _ in range(epochs):
        model.train()
        c0, w0 = time.thread_time(), time.perf_counter()
        for _, indices in zip(range(steps_per_epoch), batches):
            mechanism.step(x[indices], y[indices])
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    return {"acc": accuracy(model, xt, yt), "eps": mechanism.epsilon(DELTA), "cpu": cpu, "wall": wall}


def summarise(rows: dict[str, list[dict]]) -> None:
    """Print mean/std accuracy per library, the Welch difference and the median epoch times."""
    print("\nlibrary   mean acc %   std (seeds)   median CPU s/epoch   median wall s/epoch   epsilon")
    for lib, runs in rows.items():
        accs = [100 * r["acc"] for r in runs]
        cpu = statistics.median(t for r in runs for t in r["cpu"])
        wall = statistics.median(t for r in runs for t in r["wall"])
        std = statistics.stdev(accs) if len(accs) > 1 else float("nan")
        print(f"{lib:8s}  {statistics.mean(accs):10.2f}  {std:12.2f}  {cpu:19.2f}  {wall:20.2f}  {runs[0]['eps']:8.3f}")
    a, b = ([100 * r["acc"] for r in rows[k]] for k in ("dpscale", "opacus"))
    if len(a) > 1:
        se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
        diff = statistics.mean(a) - statistics.mean(b)
        print(f"dpscale - opacus: {diff:+.2f} points, standard error {se:.2f} (t = {diff / se:+.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/mnist-10k")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ds = load_idx(args.data)
    norm = lambda t: (t - MNIST_MEAN) / MNIST_STD  # noqa: E731
    data = (norm(ds.x_train), ds.y_train, norm(ds.x_test), ds.y_test)
    print(f"MNIST-10k: {len(data[0])} train / {len(data[2])} test; B={BATCH_SIZE}, sigma={SIGMA}, C={MAX_GRAD_NORM}, "
          f"lr={LR}, {args.epochs} epochs; torch {torch.__version__}, 1 thread")  # fmt: skip
    rows: dict[str, list[dict]] = {"dpscale": [], "opacus": []}
    runners = {"dpscale": run_dpscale, "opacus": run_opacus}
    for seed in range(args.seeds):
        order = ("opacus", "dpscale") if seed % 2 == 0 else ("dpscale", "opacus")
        for lib in order:
            r = runners[lib](seed, args.epochs, data)
            rows[lib].append(r)
            print(f"seed {seed:2d}  {lib:8s}  acc {100 * r['acc']:6.2f}%  eps {r['eps']:.3f}  "
                  f"CPU {statistics.median(r['cpu']):.2f} s/epoch  wall {statistics.median(r['wall']):.2f} s/epoch", flush=True)  # fmt: skip
    summarise(rows)


if __name__ == "__main__":
    main()

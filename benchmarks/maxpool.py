"""dpscale's MaxPool2d (channels-last forward, NCHW backward) against nn.MaxPool2d on the zoo's
pooling shapes, in one process, interleaved, median of repeats:

    python benchmarks/maxpool.py [--repeats 15]

Prints a markdown table: forward+backward and no-grad forward ms of each, and the speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

from dpscale.layers import MaxPool2d

# (input shape, kernel, stride, padding): papernot-cnn at B=512 and 256, tramer-cifar-cnn at
# B=128, a ResNet stem at 32 px (B=32) and 224 px (B=8)
SHAPES = [
    ((512, 16, 13, 13), 2, 1, 0), ((512, 32, 5, 5), 2, 1, 0), ((256, 16, 13, 13), 2, 1, 0),
    ((128, 32, 32, 32), 2, 2, 0), ((128, 64, 16, 16), 2, 2, 0), ((128, 128, 8, 8), 2, 2, 0),
    ((32, 64, 16, 16), 3, 2, 1), ((8, 64, 112, 112), 3, 2, 1),
]  # fmt: skip


def _median_ms(calls: dict, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in calls}
    for i in range(repeats + 3):
        for key, call in calls.items() if i % 2 else reversed(list(calls.items())):
            start = time.perf_counter()
            call()
            if i >= 3:
                times[key].append(1000 * (time.perf_counter() - start))
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    print("| input | k/s/p | torch f+b ms | ours f+b ms | speed-up | torch eval ms | ours eval ms | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, k, s, p in SHAPES:
        x = torch.randn(shape, requires_grad=True)
        layers = {"torch": nn.MaxPool2d(k, s, p), "ours": MaxPool2d(k, s, p)}
        grad = torch.randn_like(layers["torch"](x))

        def train(m: nn.Module) -> None:
            m(x).backward(grad)

        def infer(m: nn.Module) -> None:
            with torch.no_grad():
                m(x)

        fb = _median_ms({n: (lambda m=m: train(m)) for n, m in layers.items()}, args.repeats)
        ev = _median_ms({n: (lambda m=m: infer(m)) for n, m in layers.items()}, args.repeats)
        print(
            f"| {tuple(shape)} | {k}/{s}/{p} | {fb['torch']:.2f} | {fb['ours']:.2f} | {fb['torch'] / fb['ours']:.2f}x "
            f"| {ev['torch']:.2f} | {ev['ours']:.2f} | {ev['torch'] / ev['ours']:.2f}x |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

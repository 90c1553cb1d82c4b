"""LoRA's fused down-projection against two separate layers (issue 29).

``dpscale.layers.LoRADownConv2d`` computes A x and the frozen W x + b in one convolution with the
weight [A; W]. This script times a private step (make_private, bk through ``engine=auto``) of
full fine-tuning, of LoRA as it is, and of LoRA with A and W run as two layers (the adapter's
forward before the fusion, patched in per instance), in one process, interleaved, median of
repeats, and each one's peak extra memory (as ``dpscale bench step-time``).

Usage:
    python benchmarks/lora_fusion.py [--models papernot-cnn,resnet18-gn] [--rank 8] [--repeats 31]
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch
from torch import nn

from dpscale.bench import step_time
from dpscale.models.peft import LoRAConv2d, LoRALinear, apply_peft
from dpscale.train.private import make_private
from dpscale.train.step import physical_chunks


def _two_layers(adapter: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The adapter's forward before the fusion: W x + b and A x as two calls."""
    return adapter.base(x) + adapter.lora_b(adapter.lora_a(x)) * adapter.scale


def _unfuse(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, (LoRAConv2d, LoRALinear)):
            module.forward = types.MethodType(_two_layers, module)
            plain = nn.Conv2d.forward if isinstance(module, LoRAConv2d) else nn.Linear.forward
            module.lora_a.forward = types.MethodType(plain, module.lora_a)


def _step(name: str, x: torch.Tensor, y: torch.Tensor, peft: str, rank: int, fused: bool):
    model = step_time._fresh_model(name, x.device)
    apply_peft(model, peft, rank=rank)
    if not fused:
        _unfuse(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    batch = x.shape[0]
    mechanism = make_private(
        model, optimizer, dataset_size=100 * batch, batch_size=batch, max_grad_norm=1.0, noise_multiplier=1.0,
        delta=1e-5, steps=10**5, accountant="rdp", engine="auto", seed=0,
    )  # fmt: skip
    indices = torch.arange(batch)
    return lambda: mechanism.step_drawn_chunks(physical_chunks(x, y, indices, batch))


def measure(name: str, rank: int, repeats: int) -> list[tuple[str, float, float]]:
    """(variant, median ms, peak MB) for full fine-tuning, LoRA fused and LoRA as two layers."""
    batch = step_time.DEFAULT_BATCH.get(name, 64)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *step_time._input_shape(name, torch.device("cpu")), generator=generator)
    y = torch.randint(0, 10, (batch,), generator=generator)
    steps = {
        "full fine-tuning": _step(name, x, y, "none", rank, True),
        "LoRA, fused": _step(name, x, y, "lora", rank, True),
        "LoRA, two layers": _step(name, x, y, "lora", rank, False),
    }
    for step in steps.values():
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):  # interleaved
        for variant, step in steps.items():
            start = time.perf_counter()
            step()
            times[variant].append(time.perf_counter() - start)
    cpu = torch.device("cpu")
    return [
        (v, 1000 * statistics.median(times[v]), step_time._peak_memory_mb(step_time.TimedStep(s, lambda: None), cpu))
        for v, s in steps.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="papernot-cnn,resnet18-gn")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| model | variant | median ms | x full | x two layers | peak MB |\n|---|---|---|---|---|---|")
    for name in args.models.split(","):
        rows = measure(name, args.rank, args.repeats)
        full, two = rows[0][1], rows[2][1]
        for variant, ms, peak in rows:
            print(f"| {name} | {variant} | {ms:.1f} | {ms / full:.2f} | {ms / two:.2f} | {peak:.1f} |", flush=True)


if __name__ == "__main__":
    main()

"""Relative error of every engine in bf16 / fp16 against a float64 per-example loop.

    python benchmarks/precision_error.py [--examples 8] [--models papernot-cnn,tramer-cifar-cnn,wrn16-4,vit-tiny]

Float32 weights; each engine under ``train.precision`` bf16 and fp16 (loss scale 1024) against a
float64 copy of the model, one backward per example, no autocast. Prints a markdown table of the
largest relative error of the per-example norms and of the clipped sum (relative to its norm).
"""

from __future__ import annotations

import argparse

import torch

from dpscale.models import build_model, default_input_shape
from dpscale.privacy.clipping.engines import make_engine
from dpscale.privacy.clipping.per_example import trainable_params
from dpscale.privacy.clipping.precision import make_precision
from dpscale.privacy.clipping.reference import float64_reference


def errors(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, engine: str, precision: str, clip: float) -> tuple[float, float]:
    """(largest relative norm error, relative error of the clipped sum) of one engine."""
    reference = float64_reference(model, (x, y), clip)  # a float64 copy, one backward per example
    want, want_norms = reference.clipped_sum, reference.norms
    run, _ = make_engine(engine, clip, model, precision=make_precision(precision))
    got, norms = run.per_example_clipped_sum(model, trainable_params(model), (x, y))
    norm_error = float(((norms.double() - want_norms).abs() / want_norms).max())
    diff = torch.sqrt(sum((got[n].double() - want[n]).square().sum() for n in want))
    return norm_error, float(diff / torch.sqrt(sum(w.square().sum() for w in want.values())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=8)
    parser.add_argument("--clip", type=float, default=0.1)
    parser.add_argument("--models", default="papernot-cnn,tramer-cifar-cnn,wrn16-4,vit-tiny")
    args = parser.parse_args(argv)
    print("| model | engine | bf16 norms | bf16 clipped sum | fp16 norms | fp16 clipped sum |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        torch.manual_seed(0)
        shape = default_input_shape(name)
        model = build_model(name, 10, shape).eval()
        x, y = torch.randn(args.examples, *shape), torch.randint(0, 10, (args.examples,))
        for engine in ("bk", "ghost", "vmap"):
            cells = [f"{e:.1e}" for precision in ("bf16", "fp16") for e in errors(model, x, y, engine, precision, args.clip)]
            print(f"| {name} | {engine} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

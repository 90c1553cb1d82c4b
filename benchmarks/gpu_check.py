"""A first GPU check, ready for the day a CUDA machine is lent (the full suite is issue 44's).

On a CUDA device, with TF32 off, for every registered model at its small input size:

1. each engine's per-example norms and clipped sum on the GPU in float32 against the float64
   per-example loop on the CPU (same weights, same examples): the relative error of the clipped sum
   (||engine - ref|| / ||ref||) and of the norms;
2. the clip bound on the GPU: every example's own released contribution (a batch of one, inputs
   scaled so that every gradient is clipped), its norm computed in float64, must be <= C with no
   tolerance (docs/precision.md derives the margin for the CPU's kernels; cuDNN's are not covered
   by that derivation, so this is measured).

Prints one markdown table (and writes it to --out, when given). The step-time table at GPU batch
sizes and an end-to-end run are separate commands (``dpscale bench step-time --device cuda``,
``dpscale train``); ``--device cpu`` runs the same checks on the CPU.

Usage:
    python benchmarks/gpu_check.py [--device cuda] [--models a,b] [--batch 8] [--out report.md]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from dpscale.models import build_model, default_input_shape, list_models
from dpscale.privacy import make_engine
from dpscale.privacy.engines import supported_engines
from dpscale.privacy.per_example import trainable_params
from dpscale.privacy.reference import float64_reference

SMALL_INPUT = {"resnet18-gn": (3, 32, 32), "resnet50-gn": (3, 32, 32), "nf-resnet50": (3, 32, 32),
               "vit-tiny": (3, 32, 32), "vit-small": (3, 32, 32)}  # fmt: skip
CLIP = 1.0


def _relative(got: dict, ref: dict) -> float:
    """||got - ref|| / ||ref|| over all parameters, in float64 on the CPU."""
    num = sum(float((got[k].double().cpu() - ref[k].double().cpu()).square().sum()) for k in ref)
    den = sum(float(ref[k].double().cpu().square().sum()) for k in ref)
    return (num / max(den, 1e-300)) ** 0.5


def check_model(name: str, device: torch.device, batch: int) -> list[str]:
    """Rows of the report for one model: one per engine."""
    torch.manual_seed(0)
    shape = SMALL_INPUT.get(name, default_input_shape(name))
    cpu_model = build_model(name, 10, shape)
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
    ref = float64_reference(cpu_model, (x, y), CLIP)
    model = cpu_model.to(device)
    params = trainable_params(model)
    xd, yd = x.to(device), y.to(device)
    rows = []
    for engine_name in supported_engines(model):
        engine, _ = make_engine(engine_name, CLIP, model)
        t0 = time.perf_counter()
        clipped, norms = engine.per_example_clipped_sum(model, params, (xd, yd))
        if device.type == "cuda":
            torch.cuda.synchronize()
        ms = 1e3 * (time.perf_counter() - t0)
        sum_err = _relative(clipped, ref.clipped_sum)
        norm_err = float(((norms.double().cpu() - ref.norms) / ref.norms).abs().max())
        worst = _worst_single_example_norm(engine, model, params, 50.0 * xd, yd)
        verdict = "ok" if worst <= CLIP and sum_err < 1e-3 else "FAIL"
        rows.append(f"| {name} | {engine_name} | {sum_err:.2e} | {norm_err:.2e} | {worst:.9f} | {ms:.1f} | {verdict} |")
        print(rows[-1], flush=True)
    return rows


def _worst_single_example_norm(engine, model, params, x: torch.Tensor, y: torch.Tensor) -> float:
    """The largest float64 norm of one example's released (clipped) gradient, over the examples."""
    worst = 0.0
    for i in range(len(x)):
        clipped, _ = engine.per_example_clipped_sum(model, params, (x[i : i + 1], y[i : i + 1]))
        worst = max(worst, sum(float(g.double().square().sum()) for g in clipped.values()) ** 0.5)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default=",".join(list_models()))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    header = [
        f"GPU check on {where}, torch {torch.__version__}, TF32 off, float32 engines vs the float64 CPU loop, "
        f"C = {CLIP}, {args.batch} examples per model",
        "",
        "| model | engine | clipped sum rel. error | max norm rel. error | max one-example released norm | ms (first call) | |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(header), flush=True)
    rows = []
    for name in args.models.split(","):
        try:
            rows += check_model(name, device, args.batch)
        except Exception as err:  # a model that fails must not hide the others' rows
            rows.append(f"| {name} | - | error: {type(err).__name__}: {str(err)[:120]} | | | | FAIL |")
            print(rows[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(header + rows) + "\n")


if __name__ == "__main__":
    main()

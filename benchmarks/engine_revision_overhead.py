"""Engine time against an earlier revision's ghost/bk engine, in one process, interleaved.

The route checks (parameter-level support, the outside-use monitor on the first call, in-place
version checks) must not slow the step down. This loads ``src/dpscale/privacy/clipping/ghost/engine.py`` as it
was at ``--baseline`` (default: the commit before they landed) next to the current one and times
one clipped-sum call of each on the step-time benchmark's models and batch sizes:

    python benchmarks/engine_revision_overhead.py --repeats 15 [--baseline REV] [--device cuda]

Prints a markdown table: median ms per call of both and their ratio (current / baseline); then
the per-step noise draw for each model's parameters from the 128-bit ``DPRandom`` (PCG64DXSM,
host) against the 32-bit-seeded ``torch.randn`` it replaced.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dpscale.bench.step_time import DEFAULT_BATCH, _input_shape
from dpscale.models import build_model
from dpscale.privacy.clipping.ghost.engine import GhostEngine
from dpscale.privacy.clipping.per_example import trainable_params

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "4c7b181"  # the last commit before the route checks


def load_baseline_engine(revision: str) -> type:
    """GhostEngine as it was at ``revision`` (imported under another module name)."""
    source = subprocess.run(
        ["git", "show", f"{revision}:src/dpscale/privacy/clipping/ghost/engine.py"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_ghost.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_ghost", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_ghost"] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module.GhostEngine


def _timed(call, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start)


def measure(name: str, batch: int, baseline: type, repeats: int, device: torch.device) -> tuple[float, float]:
    """(baseline median ms, current median ms) of one bk clipped-sum call."""
    torch.manual_seed(0)
    model = build_model(name, 10, _input_shape(name, device)).to(device)
    x = torch.randn(batch, *_input_shape(name, device), device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    params = trainable_params(model)
    engines = {"baseline": baseline(1.0, mode="bk"), "current": GhostEngine(1.0, mode="bk")}
    times: dict[str, list[float]] = {k: [] for k in engines}
    for i in range(repeats + 2):  # two warm-up rounds, then interleaved repeats
        order = list(engines.items()) if i % 2 else list(engines.items())[::-1]  # ABBA: no order bias
        for key, engine in order:
            ms = _timed(lambda: engine.clipped_sum_and_losses(model, params, (x, y)), device)
            if i >= 2:
                times[key].append(ms)
    return statistics.median(times["baseline"]), statistics.median(times["current"])


def measure_noise(name: str, repeats: int, device: torch.device) -> tuple[int, float, float]:
    """(parameters, torch.randn median ms, DPRandom median ms) of one step's noise draw."""
    from dpscale.privacy.noise.gaussian import add_gaussian_noise
    from dpscale.rng import DPRandom

    model = build_model(name, 10, _input_shape(name, device)).to(device)
    grads = {n: torch.zeros_like(p) for n, p in trainable_params(model).items()}
    torch_generator, dprandom = torch.Generator(device=device).manual_seed(0), DPRandom(0)

    def torch_noise() -> None:  # what add_gaussian_noise drew before DPRandom
        for g in grads.values():
            g + torch.randn(g.shape, generator=torch_generator, device=device)

    times: dict[str, list[float]] = {"torch": [], "dprandom": []}
    for i in range(repeats + 2):
        times["torch"].append(_timed(torch_noise, device))
        times["dprandom"].append(_timed(lambda: add_gaussian_noise(grads, 1.0, dprandom), device))
    count = sum(g.numel() for g in grads.values())
    return count, statistics.median(times["torch"][2:]), statistics.median(times["dprandom"][2:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=BASELINE, help="git revision of the baseline engine")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", default=",".join(DEFAULT_BATCH))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    baseline = load_baseline_engine(args.baseline)
    print(f"| model | batch | baseline {args.baseline} ms | current ms | current / baseline |")
    print("|---|---|---|---|---|")
    for name in args.models.split(","):
        old, new = measure(name, DEFAULT_BATCH.get(name, 32), baseline, args.repeats, device)
        print(f"| {name} | {DEFAULT_BATCH.get(name, 32)} | {old:.1f} | {new:.1f} | {new / old:.3f} |", flush=True)
    print("\n| model | parameters | noise torch.randn ms | noise DPRandom ms | ratio |")
    print("|---|---|---|---|---|")
    for name in args.models.split(","):
        count, torch_ms, dprandom_ms = measure_noise(name, args.repeats, device)
        print(f"| {name} | {count:,} | {torch_ms:.1f} | {dprandom_ms:.1f} | {dprandom_ms / torch_ms:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

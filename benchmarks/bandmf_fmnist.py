"""DP-SGD vs BandMF (amplified banded matrix factorization) on Fashion-MNIST: the table of
docs/correlated_noise.md.

Two recipes (Tramer & Boneh's presets, with dpscale's own held-out 10,000-image validation split
of the 60,000 training images): the end-to-end tanh CNN (``tramer-fmnist-cnn``, 10 epochs to fit
this CPU) and ScatterNet + linear (``tramer-fmnist-scatter-linear``, 40 epochs), at epsilon 1, 3
and 8, each with DP-SGD, BandMF with ``dp.bands=auto`` and BandMF with a fixed b, three seeds.
Every run is a separate ``dpscale train`` process, so its peak resident memory is its own.

    python benchmarks/bandmf_fmnist.py --data ../shared/data/fashion-mnist --out /tmp/bandmf-fmnist \
        [--recipes cnn,scatter-linear] [--epsilons 1,3,8] [--seeds 0,1,2] [--fixed-bands 4] [--threads 1]

Prints one line per run as it finishes, then the markdown table (mean and spread of the three
seeds). When ``dp.bands=auto`` picks b = 1 the run is DP-SGD's bit for bit (tested:
tests/test_bandmf_training.py), so its DP-SGD runs are reported for it and not trained twice.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RECIPES = {
    "cnn": ("preset:tramer-fmnist-cnn", ["train.epochs=10"]),
    "scatter-linear": ("preset:tramer-fmnist-scatter-linear", []),
    # more, smaller steps (1953 at B=1024, lr scaled as the preset scales it: base 1.0 x B/512): where
    # BandMF's predicted gain is larger (auto's table: 0.905x DP-SGD's error x sigma at epsilon 3)
    "scatter-linear-b1024": ("preset:tramer-fmnist-scatter-linear", ["dp.batch_size=1024", "optim.lr=2.0"]),
}


def mechanisms(fixed_bands: int) -> dict[str, list[str]]:
    """The three mechanisms compared, as config overrides."""
    return {
        "dpsgd": [],
        "bandmf-auto": ["dp.mechanism=bandmf", "dp.bands=auto"],
        f"bandmf-b{fixed_bands}": ["dp.mechanism=bandmf", f"dp.bands={fixed_bands}"],
    }


def train(preset: str, overrides: list[str], out: Path) -> dict:
    """One ``dpscale train`` process; its summary with wall time (s) and peak RSS (MB) added."""
    argv = [sys.executable, "-m", "dpscale", "train", preset, "--quiet"]
    for item in [*overrides, f"run.out_dir={out}"]:
        argv += ["--set", item]
    start = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {child.stderr.read()[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {**summary, "command_wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024}


def auto_bands(preset: str, overrides: list[str], out: Path) -> int:
    """The b that dp.bands=auto picks for this config (its plan only: nothing is trained)."""
    from dpscale.config import load_config
    from dpscale.train.inputs import plan_for, plan_inputs

    config = load_config(preset, [*overrides, f"run.out_dir={out}"])
    return plan_for(config, plan_inputs(config)).bands


def row(recipe: str, epsilon: float, mechanism: str, runs: list[dict]) -> str:
    """One table row: mean and spread (max - min) over the seeds."""
    accuracy = [100 * r["test_accuracy"] for r in runs]
    bands = runs[0]["bandmf"]["bands"] if runs[0].get("bandmf") else 1
    spread = max(accuracy) - min(accuracy)
    return (
        f"| {recipe} | {epsilon:g} | {mechanism} | {bands} | {runs[0]['noise_multiplier']:.3f} | "
        f"{', '.join(f'{a:.2f}' for a in accuracy)} | **{statistics.mean(accuracy):.2f}** | {spread:.2f} | "
        f"{max(r['epsilon'] for r in runs):.3f} | {statistics.mean(r['wall_time_s'] for r in runs):.0f} | "
        f"{max(r['peak_rss_mb'] for r in runs):.0f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/fashion-mnist")
    parser.add_argument("--out", default="/tmp/bandmf-fmnist")
    parser.add_argument("--recipes", default="scatter-linear,cnn")
    parser.add_argument("--epsilons", default="1,3,8")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--fixed-bands", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="run.threads of every run")
    parser.add_argument("--table-only", action="store_true", help="print the table of the runs already in --out")
    args = parser.parse_args()
    out = Path(args.out)
    results = table_from(out, args) if args.table_only else run_all(out, args)
    print("\n| recipe | epsilon | mechanism | b | sigma | accuracy per seed (%) | mean | spread | epsilon spent "
          "| training s | peak RSS MB |\n|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for (recipe, epsilon, mechanism), runs in results.items():
        print(row(recipe, epsilon, mechanism, runs))
    return 0


def table_from(out: Path, args: argparse.Namespace) -> dict[tuple, list[dict]]:
    """The runs already written to ``out`` (one JSON per run), grouped as ``run_all`` groups them;
    an auto whose runs are missing stands for DP-SGD's (auto picked b = 1)."""
    results: dict[tuple, list[dict]] = {}
    for recipe in args.recipes.split(","):
        for epsilon in map(float, args.epsilons.split(",")):
            for mechanism in mechanisms(args.fixed_bands):
                files = [out / f"{recipe}-eps{epsilon:g}-{mechanism}-s{seed}.json" for seed in args.seeds.split(",")]
                runs = [json.loads(f.read_text()) for f in files if f.exists()]
                if runs:
                    results[(recipe, epsilon, mechanism)] = runs
                elif mechanism == "bandmf-auto" and (recipe, epsilon, "dpsgd") in results:
                    results[(recipe, epsilon, mechanism)] = results[(recipe, epsilon, "dpsgd")]
    return results


def run_all(out: Path, args: argparse.Namespace) -> dict[tuple, list[dict]]:
    """Train every (recipe, epsilon, mechanism, seed) in turn, printing a line per run."""
    results: dict[tuple, list[dict]] = {}
    for recipe in args.recipes.split(","):
        preset, recipe_overrides = RECIPES[recipe]
        for epsilon in map(float, args.epsilons.split(",")):
            for mechanism, mech_overrides in mechanisms(args.fixed_bands).items():
                overrides = [f"data.root={args.data}", f"dp.epsilon={epsilon}", f"run.threads={args.threads}",
                             *recipe_overrides, *mech_overrides]  # fmt: skip
                if mechanism == "bandmf-auto" and auto_bands(preset, overrides, out / "plan") == 1:
                    results[(recipe, epsilon, mechanism)] = results[(recipe, epsilon, "dpsgd")]
                    print(f"{recipe} eps={epsilon:g} {mechanism}: auto picks b=1, DP-SGD's runs", flush=True)
                    continue
                runs = []
                for seed in map(int, args.seeds.split(",")):
                    name = f"{recipe}-eps{epsilon:g}-{mechanism}-s{seed}"
                    summary = train(preset, [*overrides, f"run.seed={seed}"], out / name)
                    (out / f"{name}.json").write_text(json.dumps(summary))
                    runs.append(summary)
                    print(f"{name}: {100 * summary['test_accuracy']:.2f}% eps={summary['epsilon']:.3f} "
                          f"{summary['wall_time_s']:.0f}s {summary['peak_rss_mb']:.0f}MB", flush=True)  # fmt: skip
                results[(recipe, epsilon, mechanism)] = runs
    return results


if __name__ == "__main__":
    raise SystemExit(main())

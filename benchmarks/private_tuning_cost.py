"""Epsilon of releasing the best of K runs of a finished recipe, K random (Papernot & Steinke 2022).

The cost a hyper-parameter search would have had if it had been run privately
(``dpscale sweep --private-tuning``): dp_accounting's RepeatAndSelect bound on the run's
accounting history, for K logarithmic, geometric and Poisson with mean M (issue 28, docs/results.md).

Usage:
    python benchmarks/private_tuning_cost.py RUN_DIR [--delta 1e-5] [--means 1,3,10,30]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dpscale.features.source_run import read_source_run
from dpscale.privacy.accounting.tuning import parse_tuning_distribution, tuned_epsilon
from dpscale.tune.private_tuning import compute_history_epsilon


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--means", default="1,3,10,30")
    args = parser.parse_args()
    history = read_source_run(str(args.run_dir)).history  # every release and DP-SGD step it accounted
    means = [float(m) for m in args.means.split(",")]
    for segment in history:
        print(f"{segment.label}: q={segment.sample_rate:.5g} sigma={segment.noise_multiplier:.5g} steps={segment.steps}")
    print(f"one run alone: epsilon {compute_history_epsilon(history, args.delta):.3f} (RDP) at delta={args.delta:g}; "
          "the best of K runs, K with mean M:")
    print("| K's distribution | " + " | ".join(f"M = {m:g}" for m in means) + " |")
    print("|---|" + "---|" * len(means))
    for name in ("logarithmic", "geometric", "poisson"):
        values = [tuned_epsilon(history, args.delta, parse_tuning_distribution(f"{name}:{m:g}")) for m in means]
        print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in values) + " |")


if __name__ == "__main__":
    main()

"""What the clip margin costs in accuracy: the default run (``dpscale train`` with no config:
papernot-cnn on the embedded MNIST sample, epsilon 3) with the margin and with it set to zero,
same seeds, same noise draws; prints a table of test accuracies.

    python benchmarks/clip_margin_accuracy.py [--seeds 0 1 2] [--set section.key=value ...]
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from dpscale.config import load_config
from dpscale.privacy.clipping import bounds as clipping
from dpscale.train.loop import Trainer


def run(seed: int, margin: bool, overrides: list[str], out: Path) -> float:
    """Test accuracy (%) of one seeded default run, with or without the clip margin."""
    exact = clipping.clip_margin
    if not margin:
        clipping.clip_margin = lambda dtype: 0.0
    try:
        config = load_config(None, [f"run.seed={seed}", *overrides])
        config = replace(config, run=replace(config.run, out_dir=str(out / f"{seed}-{margin}")))
        summary = Trainer.create(config, progress=False, report=False).run()
    finally:
        clipping.clip_margin = exact
    return 100 * summary["test_accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", action="append", default=[], help="config overrides, as for dpscale train")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"margin m = {clipping.clip_margin(torch.float32):.4g} (float32)")
    print("| seed | with margin (%) | without (%) | difference (points) |\n|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            on, off = run(seed, True, args.set, Path(tmp)), run(seed, False, args.set, Path(tmp))
            print(f"| {seed} | {on:.2f} | {off:.2f} | {on - off:+.2f} |", flush=True)


if __name__ == "__main__":
    main()

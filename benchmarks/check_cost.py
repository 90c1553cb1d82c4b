"""What the privacy checks cost a 40-epoch preset: the start-up self-check and batch-independence
check, plus the independence check on the first training chunk, against the run's training time
(median step time of steps 2..12, times the preset's steps).

    python benchmarks/check_cost.py [--data ../shared/data/fashion-mnist] [--presets a,b]

Prints a markdown table. The step time is measured on the preset's own model, batch and chunk
size; the whole run is not trained (40 epochs take hours on a CPU), so "run" is an estimate:
median step x steps (evaluation and data loading left out, which makes the share an upper bound).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from dpscale.config import load_config
from dpscale.train.loop import Trainer
from dpscale.train.guards import independence_check

PRESETS = "papernot-fmnist-tanh,tramer-fmnist-cnn"


def measure(preset: str, root: str, out: Path) -> dict[str, float]:
    """Seconds of each check and of a median step for ``preset`` on the data in ``root``."""
    config = load_config(f"preset:{preset}", [f"data.root={root}", f"run.out_dir={out / preset}", "run.seed=0"])
    started = time.perf_counter()
    trainer = Trainer.create(config, progress=False)
    build_s = time.perf_counter() - started
    setup_check = trainer.self_check.seconds + trainer.self_check.independence.seconds
    chunk = config.train.max_physical_batch_size
    x, y = trainer.data.x_train[:chunk], trainer.data.y_train[:chunk]
    started = time.perf_counter()
    independence_check(trainer.engine, trainer.model, (x, y))
    first_chunk = time.perf_counter() - started
    trainer.mechanism.first_chunk_check = None  # measured above: the steps below are plain steps
    times = []
    for _ in range(12):
        started = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - started)
    step = statistics.median(times[1:])
    return {"steps": trainer.total_steps, "step_s": step, "setup_check_s": setup_check,
            "first_chunk_s": first_chunk, "build_s": build_s}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/fashion-mnist")
    parser.add_argument("--presets", default=PRESETS)
    args = parser.parse_args()
    print("| preset | steps | median step (s) | set-up checks (s) | first-chunk check (s) | run estimate (s) | checks / run |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as out:
        for preset in args.presets.split(","):
            m = measure(preset, args.data, Path(out))
            run = m["steps"] * m["step_s"]
            checks = m["setup_check_s"] + m["first_chunk_s"]
            print(f"| {preset} | {m['steps']} | {m['step_s']:.3f} | {m['setup_check_s']:.2f} | "
                  f"{m['first_chunk_s']:.2f} | {run:.0f} | {100 * checks / run:.2f}% |")  # fmt: skip


if __name__ == "__main__":
    main()

"""Throughput of data-parallel DP-SGD: P torchrun processes vs one process (docs/distributed.md).

    python benchmarks/distributed_scaling.py [--batch-sizes 256,1024] [--steps 100] [--repeats 3]
        [--layouts 1x1,1x2,2x1] [--device cpu] [--model papernot-cnn]

A layout PxT is P processes with T torch threads each. Every job trains the same private run on
the embedded MNIST sample (N = 4000) and reports ms per logical step from its summary.json
(training time plus one final evaluation of 1000 test images and one RDP epsilon; process
start-up excluded). Jobs are interleaved over the repeats and the median is reported, as the
machine is noisy. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dpscale.train.distributed import launch_command


def run_job(processes: int, threads: int, batch_size: int, steps: int, device: str, model: str, out: Path) -> float:
    """ms per logical step of one job."""
    args = [
        "train", "--quiet",
        "--set", f"model.name={model}", "--set", f"dp.batch_size={batch_size}", "--set", "dp.epsilon=3", "--set", "dp.accountant=rdp",
        "--set", f"train.steps={steps}", "--set", "train.eval_every_epochs=1000",
        "--set", "train.max_physical_batch_size=256", "--set", "run.seed=0",
        "--set", f"run.threads={threads}", "--set", f"run.device={device}", "--set", f"run.out_dir={out}",
    ]
    cmd, env = launch_command(processes, args, threads)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return 1000.0 * summary["wall_time_s"] / summary["steps"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="256,1024")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", default="1x1,1x2,2x1", help="PxT: P processes with T threads each")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="papernot-cnn")
    args = parser.parse_args(argv)
    layouts = [tuple(int(v) for v in item.split("x")) for item in args.layouts.split(",")]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    times: dict[tuple, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for batch in batches:
                for processes, threads in layouts:  # interleaved: drift hits every layout alike
                    out = Path(tmp) / f"r{repeat}-b{batch}-p{processes}x{threads}"
                    ms = run_job(processes, threads, batch, args.steps, args.device, args.model, out)
                    times.setdefault((batch, processes, threads), []).append(ms)
                    print(f"  B={batch} {processes}x{threads}: {ms:.1f} ms/step", file=sys.stderr)
    base_layout = layouts[0]
    print(f"| B | processes x threads | ms / step (median of {args.repeats}) | examples / s | speed-up vs {base_layout[0]}x{base_layout[1]} |")
    print("|---|---|---|---|---|")
    for batch in batches:
        base = statistics.median(times[(batch, *base_layout)])
        for processes, threads in layouts:
            ms = statistics.median(times[(batch, processes, threads)])
            print(f"| {batch} | {processes}x{threads} | {ms:.1f} | {1000 * batch / ms:,.0f} | {base / ms:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Wall time of ``dpscale account`` (one process per call, imports included), issue 30.

Each case runs ``--repeats`` times as a fresh ``python -m dpscale account ... --json``; the table
gives the median wall time (s) and the epsilon and sigma it answered. ``--src DIR`` also times
another checkout's ``src`` (e.g. a ``git worktree`` of an older commit) with the same interpreter,
interleaved with this one, and warns if the two answer differently.

Usage:
    python benchmarks/account_time.py [--repeats 5] [--src /tmp/old/src]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# (label, flags): MNIST-scale, Kurakin/TAN ImageNet-scale, and calibrations up to 72k steps
CASES = [
    ("MNIST B=256 sigma=1 60 epochs, pld", "--dataset-size 60000 --batch-size 256 --noise 1.0 --epochs 60 --delta 1e-5"),
    ("MNIST B=256 sigma=1.1 60 epochs, rdp", "--dataset-size 60000 --batch-size 256 --noise 1.1 --epochs 60 --delta 1e-5 --accountant rdp"),
    ("TAN ImageNet B=32768 sigma=2.5 18k steps, pld", "--dataset-size 1281167 --batch-size 32768 --noise 2.5 --steps 18000 --delta 7.8e-7"),
    ("Kurakin ImageNet B=65536 sigma=3 70 epochs, pld", "--dataset-size 1281167 --batch-size 65536 --noise 3 --epochs 70 --delta 1e-6"),
    ("Kurakin ImageNet B=1024 sigma=0.28 10 epochs, pld", "--dataset-size 1281167 --batch-size 1024 --noise 0.28 --epochs 10 --delta 1e-6"),
    ("calibrate eps=8, B=32768, 18k steps, pld", "--dataset-size 1281167 --batch-size 32768 --target-epsilon 8 --steps 18000 --delta 7.8e-7"),
    ("calibrate eps=8, B=1024, 72k steps, pld", "--dataset-size 1281167 --batch-size 1024 --target-epsilon 8 --steps 72000 --delta 7.8e-7"),
    ("calibrate eps=8, B=1024, 72k steps, rdp", "--dataset-size 1281167 --batch-size 1024 --target-epsilon 8 --steps 72000 --delta 7.8e-7 --accountant rdp"),
]


def run_once(flags: str, env: dict[str, str]) -> tuple[float, dict]:
    """Wall time (s) of one fresh process, and its answer."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "dpscale", "account", *flags.split(), "--json"],
                          capture_output=True, text=True, check=True, env=env)  # fmt: skip
    return time.perf_counter() - start, json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--src", help="another checkout's src directory: timed too, interleaved, as 'other'")
    args = parser.parse_args()
    variants = {"this": dict(os.environ)}
    if args.src:
        variants["other"] = {**os.environ, "PYTHONPATH": args.src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    head = " | ".join(f"{v} median s" for v in variants)
    print(f"| case | {head} | epsilon | sigma |\n|---|{'---|' * len(variants)}---|---|")
    for label, flags in CASES:
        times: dict[str, list[float]] = {v: [] for v in variants}
        answers = {}
        for _ in range(args.repeats):  # interleaved: the machine's drift hits both alike
            for name, env in variants.items():
                seconds, answers[name] = run_once(flags, env)
                times[name].append(seconds)
        if len({(a["epsilon"], a["noise_multiplier"]) for a in answers.values()}) != 1:
            print(f"WARNING: {label}: the variants answer differently: {answers}", file=sys.stderr)
        cells = " | ".join(f"{statistics.median(t):.2f}" for t in times.values())
        answer = answers["this"]
        print(f"| {label} | {cells} | {answer['epsilon']:.4f} | {answer['noise_multiplier']:.4f} |", flush=True)


if __name__ == "__main__":
    main()

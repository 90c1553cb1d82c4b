"""Where a Trainer step's host time and host syncs go: the preset dpscale-fmnist-cnn on a device.

    python benchmarks/trainer_host_profile.py --data-root FASHION_MNIST [--device cuda] [--steps 40]

Prints (1) on CUDA, the GPU idle fraction and host syncs per step over 20 steps with each sync's
site (``dpscale.bench.gpu_suite``'s profiled window, as the device suite's section 5) and the
stack of the first sync at each site, (2) steps/s unprofiled, (3) a cProfile of ``--steps`` steps,
sorted by own time and by cumulative time. Session 16 ran it on an H200 (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
import traceback

import torch

from dpscale.bench import gpu_suite
from dpscale.config import load_config
from dpscale.train.loop import Trainer


def trainer(device: str, data_root: str, out_dir: str, extra: list[str]) -> Trainer:
    overrides = [f"run.device={device}", f"run.out_dir={out_dir}", "run.seed=0", f"data.root={data_root}", *extra]
    return Trainer.create(load_config("preset:dpscale-fmnist-cnn", overrides), progress=False, report=False)


def sync_report(run: Trainer) -> None:
    stacks: dict[str, str] = {}
    site_of = gpu_suite.sync_site

    def keeping_stacks(filename: str, lineno: int, stack: list) -> str:
        site = site_of(filename, lineno, stack)
        stacks.setdefault(site, "".join(traceback.format_list(stack[-9:])))
        return site

    gpu_suite.sync_site = keeping_stacks
    try:
        idle, per_step, sites = gpu_suite._profiled_window(run, run.step + 20, torch.device("cuda"))
    finally:
        gpu_suite.sync_site = site_of
    print(f"GPU idle fraction {idle:.2f}, host syncs per step {per_step:.1f}: {sites}")
    for site, stack in stacks.items():
        print(f"--- first sync at {site}:\n{stack}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out-dir", default="/tmp/dpscale-host-profile")
    parser.add_argument("--set", action="append", default=[], help="more config overrides, e.g. train.max_physical_batch_size=4096")
    args = parser.parse_args()
    run = trainer(args.device, args.data_root, args.out_dir, args.set)
    run.run(max_steps=5)  # warm-up: kernels, the clip methods' tuning
    if args.device == "cuda":
        sync_report(run)
    wait = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    wait()
    started, first = time.perf_counter(), run.step
    run.run(max_steps=run.step + args.steps)
    wait()
    print(f"unprofiled: {(run.step - first) / (time.perf_counter() - started):.1f} steps/s (checkpoint at the end included)")
    profiler = cProfile.Profile()
    profiler.enable()
    run.run(max_steps=run.step + args.steps)
    wait()
    profiler.disable()
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(40)
        print(text.getvalue())


if __name__ == "__main__":
    main()

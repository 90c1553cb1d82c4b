"""Peak host memory of a streamed run on a folder larger than that bound (issue 15's check):

    python benchmarks/stream_memory.py --folder /tmp/jpeg30k [--images 30000] [--size 160] [--set KEY=VALUE ...]

Writes ``--images`` JPEGs (``--size`` px, 10 classes, smooth content + texture, quality 90) into
``--folder`` unless it already holds them, then runs ``dpscale train`` on it with
``data.loader=stream`` for one epoch in a subprocess, sampling the memory of the whole process tree (trainer +
loader workers) every 0.2 s. Prints the decoded size of the set, the peak PSS of the tree (shared
pages counted once), the peak of the RSS summed over it, and the trainer's own peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = 10


def _write(args: tuple[Path, int, int]) -> None:
    folder, start, size = args
    rng = np.random.default_rng(start)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    for i in range(start, start + 500):
        label = i % CLASSES
        phase, freq = rng.uniform(0, 6.28, 3), rng.uniform(0.02, 0.1, 3) * (1 + label / CLASSES)
        smooth = np.stack([127 + 90 * np.sin(freq[c] * (xx + (c + 1) * yy) + phase[c]) for c in range(3)], axis=-1)
        pixels = np.clip(smooth + rng.normal(0, 10, (size, size, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"class{label}" / f"{i:06d}.jpg", quality=90)


def generate(folder: Path, images: int, size: int) -> None:
    for c in range(CLASSES):
        (folder / f"class{c}").mkdir(parents=True, exist_ok=True)
    if sum(1 for _ in folder.rglob("*.jpg")) >= images:
        return
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(_write, [(folder, start, size) for start in range(0, images, 500)]))


def _pss(pid: int) -> int:
    """Proportional set size (bytes): shared pages (torch's libraries in forked workers) split
    between the processes that share them, so a tree's sum counts each page once."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tree_rss(pid: int) -> tuple[int, int, int]:
    """(PSS of ``pid`` and all its descendants, RSS of them, RSS of ``pid``) in bytes, from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(stat[1]), []).append(int(entry))
            rss[int(entry)] = int(stat[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total = pss = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        pss += _pss(p)
        todo += children.get(p, [])
    return pss, total, rss.get(pid, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--images", type=int, default=30000)
    parser.add_argument("--size", type=int, default=160)
    parser.add_argument("--out", default="/tmp/stream-memory-run")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    generate(args.folder, args.images, args.size)
    print(f"folder ready in {time.perf_counter() - started:.0f} s; decoded uint8 size "
          f"{args.images * 3 * args.size**2 / 2**30:.2f} GiB (float32: {4 * args.images * 3 * args.size**2 / 2**30:.2f} GiB)")  # fmt: skip
    overrides = [
        "data.name=imagefolder", f"data.root={args.folder}", "data.loader=stream", "model.name=papernot-cnn",
        "dp.epsilon=null", "dp.noise_multiplier=1.0", "dp.max_grad_norm=1.0", "dp.batch_size=256",
        "train.epochs=1", "train.max_physical_batch_size=128", f"run.out_dir={args.out}", *args.set,
    ]  # fmt: skip
    command = [sys.executable, "-m", "dpscale", "train", "--quiet", *sum((["--set", o] for o in overrides), [])]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak_pss = peak_tree = peak_main = 0
    while process.poll() is None:
        pss, tree, own = _tree_rss(process.pid)
        peak_pss, peak_tree, peak_main = max(peak_pss, pss), max(peak_tree, tree), max(peak_main, own)
        time.sleep(0.2)
    output = process.stdout.read()
    print(output[-1500:])
    summary = json.loads((Path(args.out) / "summary.json").read_text()) if process.returncode == 0 else {}
    print(f"peak memory: process tree PSS {peak_pss / 2**30:.2f} GiB (RSS summed {peak_tree / 2**30:.2f} GiB, "
          f"counting shared pages once per process), trainer alone RSS {peak_main / 2**30:.2f} GiB; "
          f"wall {summary.get('wall_time_s', float('nan')):.0f} s training, data wait {summary.get('data_wait_s')} s")  # fmt: skip
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())

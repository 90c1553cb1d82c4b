"""Peak host memory of a streamed run on a folder larger than that bound (issues 15 and 62):

    python benchmarks/stream_memory.py --folder /tmp/jpeg30k [--images 30000] [--size 160]
        [--model linear --batch-size 1024 --chunk 512] [--source REV ...] [--memory default,keep,release]
        [--loader stream|memory] [--set KEY=VALUE ...]

Writes ``--images`` JPEGs (``--size`` px, 10 classes, smooth content + texture, quality 90) into
``--folder`` unless it already holds them, then runs ``dpscale train`` on it with
``data.loader=stream`` (``--loader memory``: decoded into one tensor first, for comparison) for
one epoch in a subprocess, once per source and memory setting (a setting named twice runs twice):
``--source`` is ``worktree`` (this checkout's src/) or a git revision (its src/ exported with
``git archive`` and put first on PYTHONPATH), ``--memory`` the ``DPSCALE_CPU_MEMORY`` value
(``default``: unset). Each run's memory is sampled every 0.2 s over the whole process tree
(trainer + loader workers). Prints a table: the largest RSS of any one process as the kernel
counted it (what ``/usr/bin/time -v`` prints as "Maximum resident set size"), the trainer's own
sampled peak RSS, the peak PSS of the tree (shared pages counted once), the training time and
the time spent waiting for data. MB are 2^20 bytes (``/usr/bin/time``'s kB / 1024).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
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


def _source_path(source: str, scratch: Path) -> str:
    """The src/ directory to run: this checkout's, or a revision's exported into ``scratch``."""
    repo = Path(__file__).resolve().parent.parent
    if source == "worktree":
        return str(repo / "src")
    target = scratch / source
    target.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", source, "src"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return str(target / "src")


def _measure(command: list[str], env: dict[str, str]) -> tuple[int, int, int, int, int]:
    """Run ``command``; (exit code, its largest single-process max RSS as the kernel counted it,
    the trainer's sampled peak RSS, the tree's sampled peak PSS, peak RSS summed), bytes."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak_pss = peak_tree = peak_main = 0
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)  # its own rusage: one run's, not the session's
        if pid:
            break
        pss, tree, own = _tree_rss(process.pid)
        peak_pss, peak_tree, peak_main = max(peak_pss, pss), max(peak_tree, tree), max(peak_main, own)
        time.sleep(0.2)
    process.returncode = os.waitstatus_to_exitcode(status)
    output = process.stdout.read() if process.stdout else ""
    if process.returncode:
        print(output[-1500:])
    return process.returncode, usage.ru_maxrss * 1024, peak_main, peak_pss, peak_tree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--images", type=int, default=30000)
    parser.add_argument("--size", type=int, default=160)
    parser.add_argument("--model", default="papernot-cnn")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=128, help="train.max_physical_batch_size")
    parser.add_argument("--source", action="append", default=[], help="worktree (default) or a git revision; repeatable")
    parser.add_argument("--memory", default="default", help="DPSCALE_CPU_MEMORY values, comma-separated (default: unset)")
    parser.add_argument("--out", default="/tmp/stream-memory-run")
    parser.add_argument("--loader", choices=("stream", "memory"), default="stream", help="data.loader")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    generate(args.folder, args.images, args.size)
    print(f"folder ready in {time.perf_counter() - started:.0f} s; decoded uint8 size "
          f"{args.images * 3 * args.size**2 / 2**30:.2f} GiB (float32: {4 * args.images * 3 * args.size**2 / 2**30:.2f} GiB)")  # fmt: skip
    overrides = [
        "data.name=imagefolder", f"data.root={args.folder}", f"data.loader={args.loader}", f"model.name={args.model}",
        "dp.epsilon=null", "dp.noise_multiplier=1.0", "dp.max_grad_norm=1.0", f"dp.batch_size={args.batch_size}",
        "train.epochs=1", f"train.max_physical_batch_size={args.chunk}", *args.set,
    ]  # fmt: skip
    print(
        f"command: DPSCALE_CPU_MEMORY=... PYTHONPATH=SOURCE/src python -m dpscale train --quiet {' '.join('--set ' + o for o in overrides)} --set run.out_dir=..."
    )
    print(f"machine: {os.cpu_count()} cores, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the start\n")
    print(
        "| source | DPSCALE_CPU_MEMORY | max RSS, one process (time -v) | trainer's peak RSS | tree's peak PSS | training s | data wait s |"
    )
    print("|---|---|---|---|---|---|---|")
    failed = 0
    with tempfile.TemporaryDirectory() as scratch:
        for source in args.source or ["worktree"]:
            path = _source_path(source, Path(scratch))
            for memory in args.memory.split(","):
                env = {k: v for k, v in os.environ.items() if k != "DPSCALE_CPU_MEMORY"} | {"PYTHONPATH": path}
                env |= {} if memory == "default" else {"DPSCALE_CPU_MEMORY": memory}
                out = Path(args.out) / f"{source}-{memory}"
                shutil.rmtree(out, ignore_errors=True)  # dpscale refuses a directory holding a run
                sets = sum((["--set", o] for o in [*overrides, f"run.out_dir={out}"]), [])
                code, maxrss, trainer, pss, _ = _measure([sys.executable, "-m", "dpscale", "train", "--quiet", *sets], env)
                summary = json.loads((out / "summary.json").read_text()) if code == 0 else {}
                failed += code != 0
                wait = summary.get("data_wait_s")  # None in memory: nothing streamed
                print(f"| {source} | {memory} | {maxrss / 2**20:.0f} MB | {trainer / 2**20:.0f} MB | {pss / 2**20:.0f} MB | "
                      f"{summary.get('wall_time_s', float('nan')):.0f} | {'-' if wait is None else f'{wait:.1f}'} |", flush=True)  # fmt: skip
    print(f"\nload average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

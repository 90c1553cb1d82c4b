"""The worked example of docs/privacy-units.md: Fashion-MNIST grouped into synthetic users.

The 60,000 Fashion-MNIST training images are grouped into users of s images (a seeded random
grouping: each user holds s unrelated images), for s in ``--sizes``. For each s the script trains
``--preset`` twice at epsilon = ``--epsilon`` (delta 1e-5):

- at the EXAMPLE unit (today's guarantee: one image), and reads what that guarantee promises a
  person with s images by group privacy (``dpscale.privacy.accounting.group_privacy.best_group_bound``);
- at the USER unit (``data.privacy_unit=user``, ``dp.max_examples_per_user=s``), with the same
  expected number of images per step (B = 8192 / s users) and the same number of steps.

Both see the same held-out split (about 10,000 images by whole users: the side file names the users) and
the same seed. It prints a Markdown table: test accuracy, the run's epsilon, and the group-privacy
(epsilon, delta) of the example-level run for a person with s images.

Usage (about 1.5 min per run on 2 cores; ``--seeds 0,1`` doubles it)::

    python benchmarks/privacy_units_fmnist.py --data ../shared/data/fashion-mnist --out /tmp/units
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte")
GROUPING_SEED = 0


def grouped_data(source: Path, out: Path, size: int, examples: int = 60_000) -> Path:
    """A data directory with links to ``source``'s IDX files and a side file grouping the images
    into users of ``size`` (a seeded random grouping)."""
    folder = out / f"data-users-of-{size}"
    folder.mkdir(parents=True, exist_ok=True)
    for stem in IDX_FILES:
        found = [p for p in (source / stem, source / f"{stem}.gz") if p.is_file()]
        if not found:
            sys.exit(f"{source} holds no {stem}[.gz]")
        link = folder / found[0].name
        if not link.exists():
            link.symlink_to(found[0].resolve())
    order = np.random.default_rng(GROUPING_SEED).permutation(examples)
    user = np.empty(examples, dtype=np.int64)
    user[order] = np.arange(examples) // size  # consecutive images of the permutation form a user
    (folder / "train-user-ids.txt").write_text("\n".join(map(str, user)) + "\n")
    return folder


def train(preset: str, data: Path, run_dir: Path, seed: int, extra: list[str]) -> dict:
    """One run of ``dpscale train``; its summary.json (reused when the run is already done)."""
    summary = run_dir / "summary.json"
    if not summary.exists():
        command = [sys.executable, "-m", "dpscale", "train", preset, "--quiet", "--set", f"data.root={data}",
                   "--set", f"run.out_dir={run_dir}", "--set", f"run.seed={seed}", "--set", "run.threads=2"]
        for setting in extra:
            command += ["--set", setting]
        print("$", " ".join(command), file=sys.stderr, flush=True)
        subprocess.run(command, check=True)
    return json.loads(summary.read_text())


def group_bound(summary: dict, size: int) -> str:
    """The example-level run's guarantee for a person with ``size`` images (group privacy), as
    ``dpscale account --group-size`` prints it: the best (k eps', delta_k) meeting the run's delta,
    else the direct (k eps, delta_k)."""
    command = [sys.executable, "-m", "dpscale", "account", "--dataset-size", str(summary["dataset_size"]),
               "--batch-size", f"{summary['batch_size']}", "--noise", f"{summary['noise_multiplier']!r}",
               "--steps", str(summary["steps"]), "--delta", f"{summary['delta']}", "--accountant", summary["accountant"],
               "--group-size", str(size), "--json"]
    group = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)["group_privacy"]
    if group["epsilon"] is not None:
        return f"{group['epsilon']:.3g} at delta {group['delta']:.2g}"
    return f"none at delta {summary['delta']:g} (directly: {group['direct_epsilon']:.3g} at delta {group['direct_delta']:.2g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/fashion-mnist"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/privacy-units"))
    parser.add_argument("--preset", default="preset:tramer-fmnist-scatter-linear")
    parser.add_argument("--sizes", default="1,4,16")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--images-per-step", type=int, default=8192)
    args = parser.parse_args()
    rows = ["| images per user s | users U | example unit: accuracy | its guarantee for a person with s images "
            "(group privacy) | user unit: B users, k | user unit: accuracy | user-level epsilon |",
            "|---|---|---|---|---|---|---|"]
    for size in (int(s) for s in args.sizes.split(",")):
        data = grouped_data(args.data, args.out, size)
        common = [f"dp.epsilon={args.epsilon}", "dp.delta=1e-5"]
        by_unit: dict[str, list[dict]] = {"example": [], "user": []}
        users_per_step = args.images_per_step / size
        for seed in (int(s) for s in args.seeds.split(",")):
            by_unit["example"].append(train(args.preset, data, args.out / f"example-s{size}-seed{seed}", seed, common))
            user = common + ["data.privacy_unit=user", f"dp.max_examples_per_user={size}",
                             f"dp.batch_size={users_per_step:g}", "train.epochs=null",
                             f"train.steps={by_unit['example'][-1]['steps']}"]
            by_unit["user"].append(train(args.preset, data, args.out / f"user-s{size}-seed{seed}", seed, user))
        accuracy = {unit: [100 * s["test_accuracy"] for s in runs] for unit, runs in by_unit.items()}
        shown = {unit: f"{np.mean(a):.2f}" + (f" +- {np.std(a):.2f}" if len(a) > 1 else "") for unit, a in accuracy.items()}
        first_user = by_unit["user"][0]
        rows.append(
            f"| {size} | {first_user['dataset_size']} | {shown['example']} (epsilon {by_unit['example'][0]['epsilon']:.3f}) | "
            f"{group_bound(by_unit['example'][0], size)} | {users_per_step:g}, {size} | {shown['user']} | "
            f"{first_user['epsilon']:.3f} |"
        )
    print("\n".join(rows))


if __name__ == "__main__":
    main()

"""Write a synthetic hospital collection: 16-bit greyscale PNG scans in class folders, several per
patient, and the ``users.csv`` that names each scan's patient (docs/privacy-units.md, "A hospital's
scans"):

    python scripts/hospital_scans.py --out /tmp/scans --patients 1500

Each patient has one diagnosis (``normal`` or ``finding``, half each) and a geometric number of
scans on 1, 2, ... (mean ``--mean-scans``; a long tail: some patients have 10 or more). A scan is the patient's
own smooth "anatomy" (so one patient's scans are alike, as a real person's are), a per-scan gain and
noise, and for ``finding`` patients a faint opacity in a lower zone of the left or right half. Pixel
values span about 2,000..50,000 of 65,535 (12-bit detectors stored in 16-bit PNGs look like this).
Nothing here is real data; the point is a folder with the hospital's shape to run the docs on.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("finding", "normal")


def patient_scans(mean_scans: float, patients: int, rng: np.random.Generator) -> np.ndarray:
    """How many scans each patient has: geometric on 1, 2, ... (numpy's), mean ``mean_scans`` (>= 1)."""
    if mean_scans <= 1:
        return np.ones(patients, dtype=np.int64)
    return rng.geometric(1.0 / mean_scans, patients).astype(np.int64)


def anatomy(size: int, rng: np.random.Generator) -> np.ndarray:
    """A patient's smooth background in [0, 1]: a few broad Gaussian blobs over a vertical gradient."""
    yy, xx = np.mgrid[0:size, 0:size] / size
    field = 0.3 + 0.3 * yy
    for _ in range(4):
        cy, cx, width = rng.uniform(0.2, 0.8), rng.uniform(0.2, 0.8), rng.uniform(0.1, 0.3)
        field += rng.uniform(-0.15, 0.15) * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * width**2))
    return field


def opacity(size: int, side: int, strength: float) -> np.ndarray:
    """A finding: a faint bright patch in the lower zone of the left (0) or right (1) half."""
    yy, xx = np.mgrid[0:size, 0:size] / size
    cx = 0.3 if side == 0 else 0.7
    return strength * np.exp(-((yy - 0.68) ** 2 + (xx - cx) ** 2) / (2 * 0.12**2))


def scan(base: np.ndarray, finding: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One 16-bit scan of a patient: its anatomy and finding, a gain, and sensor noise."""
    gain = rng.uniform(0.85, 1.15)
    x = gain * (base + finding) + rng.normal(0, 0.04, base.shape)
    return np.clip(2000 + 48000 * x, 0, 65535).astype(np.uint16)


def write_collection(out: Path, patients: int, mean_scans: float, size: int, seed: int) -> tuple[int, int]:
    """Write the class folders and ``users.csv`` under ``out``.

    Args:
        out: the folder (created); patients: how many; mean_scans: the mean scans per patient;
        size: the square side of each scan in pixels; seed: the generator's seed.

    Returns:
        (scans written, the most scans of one patient).
    """
    rng = np.random.default_rng(seed)
    counts = patient_scans(mean_scans, patients, rng)
    for c in CLASSES:
        (out / c).mkdir(parents=True, exist_ok=True)
    rows = []
    for p, n in enumerate(counts):
        label = CLASSES[p % 2]
        strength = rng.uniform(0.08, 0.2) if label == "finding" else 0.0
        base, patch = anatomy(size, rng), opacity(size, int(rng.integers(2)), strength)
        for s in range(n):
            name = f"{label}/p{p:05d}-{s:02d}.png"
            Image.fromarray(scan(base, patch, rng)).save(out / name)  # uint16 -> mode I;16
            rows.append((name, f"patient-{p:05d}"))
    with (out / "users.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(("path", "user"))
        writer.writerows(rows)
    return len(rows), int(counts.max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (class folders and users.csv)")
    parser.add_argument("--patients", type=int, default=1500)
    parser.add_argument("--mean-scans", type=float, default=3.0, help="mean scans per patient")
    parser.add_argument("--size", type=int, default=32, help="scan side in pixels")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    scans, most = write_collection(args.out, args.patients, args.mean_scans, args.size, args.seed)
    print(f"wrote {scans} scans of {args.patients} patients (at most {most} each) and users.csv to {args.out}")


if __name__ == "__main__":
    main()

"""JPEG decoding per core: Pillow (full and reduced-scale "draft" decoding), simplejpeg and
OpenCV where they import, for the two things a loader worker does:

  * ``resize``: decode + resize to S x S (what ``dpscale data prepare`` and a streamed folder
    with ``data.image_size=S`` do per image);
  * ``rrc``: decode + RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3) + flip to 224 x 224.

    python benchmarks/decode.py [--folder DIR | --generate N] [--size 256] [--repeats 3]

With ``--generate N`` it writes N ImageNet-like JPEGs (500 x 375, smooth content + texture,
quality 90; ~40-80 KB) to a temporary folder. One process, one thread: images per second per core.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image


def generate(folder: Path, count: int, seed: int = 0) -> list[Path]:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    yy, xx = np.mgrid[0:375, 0:500].astype(np.float32)
    paths = []
    for i in range(count):
        phase = rng.uniform(0, 6.28, 3)
        freq = rng.uniform(0.005, 0.05, 3)
        smooth = np.stack([127 + 100 * np.sin(freq[c] * (xx + yy * (c + 1)) + phase[c]) for c in range(3)], axis=-1)
        texture = rng.normal(0, 12, (375, 500, 3))
        pixels = np.clip(smooth + texture, 0, 255).astype(np.uint8)
        path = folder / f"img{i:05d}.jpg"
        Image.fromarray(pixels).save(path, quality=90)
        paths.append(path)
    return paths


def _rrc_box(width: int, height: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        w, h = int(round((target * ratio) ** 0.5)), int(round((target / ratio) ** 0.5))
        if 0 < w <= width and 0 < h <= height:
            left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    side = min(width, height)
    return (width - side) // 2, (height - side) // 2, (width + side) // 2, (height + side) // 2


def pil_decode(data: bytes, draft: int | None) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    if draft:  # libjpeg decodes at 1/2, 1/4 or 1/8 scale, never below the requested size
        img.draft("RGB", (draft, draft))
    return img.convert("RGB")


def decoders(size: int) -> dict:
    """name -> function(bytes) -> HWC uint8 array of at least ``size`` on the short side where possible."""
    out = {
        "pillow": lambda b: np.asarray(pil_decode(b, None)),
        "pillow-draft": lambda b: np.asarray(pil_decode(b, size)),
    }
    try:
        import simplejpeg

        out["simplejpeg"] = lambda b: simplejpeg.decode_jpeg(b, colorspace="RGB")
        out["simplejpeg-scaled"] = lambda b: simplejpeg.decode_jpeg(b, colorspace="RGB", min_height=size, min_width=size)
    except ImportError:
        pass
    try:
        import cv2

        cv2.setNumThreads(1)
        out["opencv"] = lambda b: cv2.cvtColor(cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    except ImportError:
        pass
    return out


def task(decode, kind: str, size: int, rng: np.random.Generator):
    def run(data: bytes) -> np.ndarray:
        img = Image.fromarray(decode(data))
        if kind == "resize":
            return np.asarray(img.resize((size, size), Image.Resampling.BILINEAR))
        box = _rrc_box(*img.size, rng)
        out = img.resize((224, 224), Image.Resampling.BILINEAR, box=box)
        return np.asarray(out.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else out)

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path)
    parser.add_argument("--generate", type=int, default=300)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    paths = sorted(args.folder.rglob("*.[jJ][pP]*[gG]")) if args.folder else generate(Path(tempfile.mkdtemp()), args.generate)
    blobs = [p.read_bytes() for p in paths]  # from the page cache: decoding, not disk, is measured
    print(f"{len(blobs)} JPEGs, mean {np.mean([len(b) for b in blobs]) / 1024:.0f} KB; one process, one thread\n")
    print("| decoder | decode + resize to S | decode + RRC + flip to 224 |")
    print("|---|---|---|")
    for name, decode in decoders(args.size).items():
        rates = []
        for kind in ("resize", "rrc"):
            run = task(decode, kind, args.size, np.random.default_rng(0))
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                for b in blobs:
                    run(b)
                times.append(time.perf_counter() - start)
            rates.append(len(blobs) / statistics.median(times))
        print(f"| {name} | {rates[0]:.0f} img/s | {rates[1]:.0f} img/s |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

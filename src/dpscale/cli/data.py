"""``dpscale data prepare`` and ``dpscale data verify``: prepared shards from the command line."""

from __future__ import annotations

import argparse
import sys
import time


def _worker_count(text: str) -> int:
    """argparse type of --workers: an integer >= 0 (-3 was accepted and reported as '-3 workers')."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _cmd_prepare(args: argparse.Namespace) -> int:
    # imported here: registering the parser must not load torch
    from dpscale.data.folder import list_image_folder
    from dpscale.data.shards import prepare_shards
    from dpscale.data.stream import default_workers

    from tqdm import tqdm

    workers = args.workers if args.workers is not None else default_workers()
    start = time.perf_counter()
    listing = list_image_folder(
        args.src,
        image_size=args.size,
        val_labels=args.val_labels,
        skip_corrupt=args.skip_corrupt,
        workers=workers,
    )
    for reason in listing.skipped:
        print(f"skipped: {reason}", file=sys.stderr)
    # files left out, colour files, the manifest's people: as `dpscale train` says them
    for note in listing.notes:
        print(note, file=sys.stderr)
    total = len(listing.train_files) + len(listing.test_files)
    with tqdm(total=total, unit="img", file=sys.stderr, disable=args.quiet, desc="prepare") as bar:
        manifest = prepare_shards(
            listing, args.dest, args.size, workers=workers, progress=bar.update
        )
    seconds = time.perf_counter() - start
    channels = 1 if listing.mode == "L" else 3
    print(
        f"wrote {len(listing.train_files)} training and {len(listing.test_files)} test images "
        f"({channels}x{args.size}x{args.size} {listing.dtype}, {len(listing.classes)} classes, test split: {listing.test_split}; "
        f"{len(listing.skipped)} skipped) to {manifest.parent} in {seconds:.1f} s ({total / seconds:.0f} images/s, "
        f"{workers} worker{'' if workers == 1 else 's'})"
    )
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from dpscale.data.shards import open_shards

    manifest, train, test = open_shards(args.dest, verify=True)
    shape = "x".join(str(d) for d in manifest["image_shape"])
    print(
        f"{args.dest}: OK ({len(train)} training and {len(test)} test images, {shape}, every SHA-256 matches)"
    )
    return 0


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``dpscale data {prepare,verify}``."""
    data = sub.add_parser(
        "data", help="prepare an image folder as memory-mapped shards, or verify prepared shards"
    )
    commands = data.add_subparsers(dest="data_command", required=True)
    prepare = commands.add_parser(
        "prepare",
        help="decode an image folder once into fixed-size shards (uint8; float32 for 16-bit images; train with data.name=shards)",
    )
    prepare.add_argument(
        "src", help="image folder (root/train/<class>/*, optional root/test or root/val)"
    )
    prepare.add_argument("dest", help="new directory for the shards and manifest.json")
    prepare.add_argument(
        "--size", type=int, required=True, help="square side in pixels (bilinear resize)"
    )
    prepare.add_argument(
        "--workers", type=_worker_count, help="decoding processes (default: all cores but one)"
    )
    prepare.add_argument(
        "--val-labels", metavar="FILE", help="label file of a flat root/val folder"
    )
    prepare.add_argument(
        "--skip-corrupt",
        action="store_true",
        help="leave out unreadable images (listed) instead of failing",
    )
    prepare.add_argument("--quiet", action="store_true", help="no progress bar")
    prepare.set_defaults(func=_cmd_prepare)
    verify = commands.add_parser(
        "verify", help="check a prepared set's manifest, shapes and every checksum"
    )
    verify.add_argument("dest")
    verify.set_defaults(func=_cmd_verify)

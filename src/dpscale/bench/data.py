"""``dpscale bench data``: images per second from disk to device-ready tensors, by worker count,
and the share of a private training step spent waiting for data.

For each source (an image folder, prepared shards) and each worker count, a ``StreamFeed``
(the trainer's own loader: Poisson batches split into chunks, read by DataLoader workers,
converted to float on the device) delivers ``--steps`` logical batches of expected size
``--batch-size``; the first is not timed (workers starting). With ``--model`` every chunk also goes
through the DP engine's clipped sum, and the table gives the fraction of the step's time the
training process waited for a chunk.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from dpscale.privacy.sampling.samplers import PoissonSampler
from dpscale.data.stream import StreamFeed, default_workers, open_stream
from dpscale.rng import DPRandom


def _worker_counts(text: str | None) -> list[int]:
    if text:
        return [int(w) for w in text.split(",")]
    return sorted({0, 1, default_workers()})


def _engine_step(
    name: str | None, input_shape: tuple[int, int, int], classes: int, device: torch.device
):
    """A function(chunk) doing the engine's clipped sum on ``name``'s model (None: no model)."""
    if name is None:
        return None
    from dpscale.models import build_model
    from dpscale.privacy.clipping.engines import make_engine
    from dpscale.privacy.clipping.per_example import trainable_params

    model = build_model(name, classes, input_shape).to(device)
    (engine, _), params = make_engine("auto", 1.0, model), trainable_params(model)
    return lambda chunk: engine.clipped_sum_and_losses(model, params, chunk)


def measure(
    data, workers: int, args: argparse.Namespace, device: torch.device, step_fn
) -> dict[str, float]:
    """One source at one worker count: images/s after the first step, and the waiting share."""
    rate = min(1.0, args.batch_size / len(data.train))
    feed = StreamFeed(
        data,
        PoissonSampler(len(data.train), rate, DPRandom(0)),
        chunk_size=args.chunk,
        start_step=0,
        total_steps=args.steps + 1,
        device=device,
        workers=workers,
        prefetch=args.prefetch,
    )
    for step in range(args.steps + 1):
        if step == 1:  # the first step started the workers: not timed
            feed.wait_s, feed.examples, start = 0.0, 0, time.perf_counter()
        for chunk in feed.chunks(step):
            if step_fn is not None:
                step_fn(chunk)
        if device.type == "cuda":
            torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    feed.close(args.steps + 1)
    return {
        "images_per_s": feed.examples / seconds,
        "wait_fraction": feed.wait_s / seconds,
        "seconds": seconds,
    }


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    sources = [("imagefolder", args.folder), ("shards", args.shards)]
    sources = [(kind, root) for kind, root in sources if root]
    if not sources:
        print("dpscale bench data: give --folder DIR and/or --shards DIR", file=sys.stderr)
        return 2
    print("# Data-loading benchmark\n")
    print(f"- command: `dpscale bench data {' '.join(args.argv)}`")
    print(
        f"- device: {device}; batch {args.batch_size} (Poisson), chunks of {args.chunk}, {args.steps} timed steps, "
        f"prefetch {args.prefetch}; model: {args.model or 'none (loading only)'}\n"
    )
    print("| source | workers | images/s | waiting for data | timed s |")
    print("|---|---|---|---|---|")
    for kind, root in sources:
        data = open_stream(
            kind,
            root,
            image_size=args.image_size if kind == "imagefolder" else None,
            normalize=True,
        )
        step_fn = _engine_step(args.model, data.info.input_shape, data.info.num_classes, device)
        for workers in _worker_counts(args.workers):
            row = measure(data, workers, args, device, step_fn)
            print(
                f"| {kind} {root} | {workers} | {row['images_per_s']:.0f} | {100 * row['wait_fraction']:.1f}% | "
                f"{row['seconds']:.1f} |",
                flush=True,
            )
    return 0

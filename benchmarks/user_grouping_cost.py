"""What clipping per user costs against clipping per example (issue 43), engine level.

The same B examples, on papernot-cnn, through the bk engine: once per example, once as B/k users of
k examples each laid out by ``padded_units`` (views=k, ``user_sum_loss``). Thread-CPU time with one
torch thread, the two interleaved, median of the repeats; users of exactly k examples, so no
padding rows (a user with fewer examples pays for k rows).

Usage:
    python benchmarks/user_grouping_cost.py [--batch 256] [--k 1,4,8] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dpscale.models import build_model
from dpscale.privacy import make_engine
from dpscale.privacy.clipping.per_example import padded_units, trainable_params, user_sum_loss


def _timed(run) -> float:
    start = time.thread_time()
    run()
    return 1e3 * (time.thread_time() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="papernot-cnn")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--k", default="1,4,8")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(args.model, 10, (1, 28, 28))
    params = trainable_params(model)
    x, y = torch.randn(args.batch, 1, 28, 28), torch.randint(0, 10, (args.batch,))
    print(f"{args.model}, B = {args.batch} examples, bk, one torch thread, thread-CPU ms (median of {args.repeats})")
    print("| users of k | per example ms | per user ms | x per example |\n|---|---|---|---|")
    per_example, _ = make_engine("bk", 1.0, model)
    for k in (int(v) for v in args.k.split(",")):
        offsets = torch.arange(0, args.batch + 1, k)
        users = padded_units((x, y, offsets), k)
        per_user, _ = make_engine("bk", 1.0, model, views=k, loss_fn=user_sum_loss(k))
        runs = {"example": lambda: per_example.per_example_clipped_sum(model, params, (x, y)),
                "user": lambda: per_user.per_example_clipped_sum(model, params, users)}  # fmt: skip
        times: dict[str, list[float]] = {"example": [], "user": []}
        for _ in range(3):
            for run in runs.values():
                run()
        for _ in range(args.repeats):
            for name, run in runs.items():
                times[name].append(_timed(run))
        a, b = statistics.median(times["example"]), statistics.median(times["user"])
        print(f"| {k} | {a:.1f} | {b:.1f} | {b / a:.3f} |")


if __name__ == "__main__":
    main()

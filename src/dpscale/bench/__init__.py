"""Benchmarks (``dpscale bench ...`` or ``python -m dpscale.bench ...``)."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from dpscale.choices import BENCH_CLOCKS, BENCH_METHODS, MECHANISMS, PEFT_METHODS, PRECISIONS


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``bench`` and its sub-commands on a subparsers object."""
    bench = sub.add_parser("bench", help="benchmarks (step-time, ops, end-to-end, data)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    _add_step_time_parser(kinds)
    _add_end_to_end_parser(kinds)
    _add_ops_parser(kinds)
    _add_gpu_suite_parser(kinds)
    data = kinds.add_parser(
        "data",
        help="images/s from disk to device by worker count; share of a step waiting for data",
    )
    add_data_arguments(data)
    data.set_defaults(func=_run_data)


def _add_step_time_parser(kinds: argparse._SubParsersAction) -> None:
    """``bench step-time``: what is timed and how, then the twin rows, then where the table goes."""
    step = kinds.add_parser(
        "step-time", help="ms per DP-SGD step per engine vs non-private, and Opacus"
    )
    step.add_argument("--models", default="papernot-cnn,tramer-cifar-cnn")
    step.add_argument(
        "--engines",
        default="",
        help="comma list; default: all (nonprivate, dpscale-*, opacus-*); a -kK suffix (dpscale-auto-k4, "
        "nonprivate-k4) trains on K crop-flip views per example (augmentation multiplicity)",
    )
    step.add_argument("--repeats", type=int, default=10)
    step.add_argument("--warmup", type=int, default=3)
    step.add_argument("--device", default="cpu")
    step.add_argument(
        "--precision",
        default="fp32",
        choices=PRECISIONS,
        help="forward/backward precision of every row (docs/precision.md)",
    )
    step.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="for every model (default: a per-model size, larger on cuda)",
    )
    step.add_argument("--threads", type=int, default=None)
    step.add_argument(
        "--clock",
        choices=BENCH_CLOCKS,
        default="wall",
        help="wall: synchronised wall clock; thread: this thread's CPU time with one torch thread "
        "(CPU only: what a loaded shared machine does not inflate)",
    )
    _add_step_time_twins(step)
    step.add_argument("--json", action="store_true", help="print rows as JSON instead of the table")
    step.add_argument(
        "--write",
        metavar="PATH",
        help="also write the markdown table here (e.g. docs/benchmarks.md)",
    )
    step.set_defaults(func=_run_step_time)


def _add_step_time_twins(step: argparse.ArgumentParser) -> None:
    """``bench step-time``'s twin rows after each dpscale engine: BandMF, PEFT, user-level, compiled."""
    step.add_argument(
        "--mechanism",
        choices=MECHANISMS,
        default="dpsgd",
        help="bandmf: time a BandMF twin (-bandmfB) next to each dpscale engine (its extra cost)",
    )
    step.add_argument("--bands", type=int, default=8, help="b of the BandMF rows (default 8)")
    step.add_argument(
        "--peft",
        choices=[m for m in PEFT_METHODS if m != "none"],
        default=None,
        help="also time a parameter-efficient twin (-lora, -bitfit, -last_groups) of each dpscale engine "
        "row: the same model with only the adapters (and the logits layer) trained",
    )
    step.add_argument("--lora-rank", type=int, default=8, help="r of the LoRA rows (default 8)")
    step.add_argument(
        "--user-rows",
        type=int,
        default=None,
        metavar="K",
        help="also time a user-level twin (-userK) of each dpscale engine row: the same B images as B/K "
        "users of K images, each user's summed gradient clipped as one (data.privacy_unit=user)",
    )
    step.add_argument(
        "--compile",
        action="store_true",
        help="also time a compiled twin (-compiled) of each dpscale engine row: make_private(compile=True), the vmap "
        "engine's clipped step as one torch.compile graph, compiled before the warm-up (engines it refuses are skipped)",
    )


def _add_end_to_end_parser(kinds: argparse._SubParsersAction) -> None:
    """``bench end-to-end``: a preset's whole run, dpscale vs Opacus."""
    whole = kinds.add_parser(
        "end-to-end", help="a preset's whole training run, dpscale vs the same recipe in Opacus"
    )
    whole.add_argument(
        "config",
        nargs="?",
        default=None,
        help="YAML file or preset:<name> (default: the default config)",
    )
    whole.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override (repeatable)",
    )
    whole.add_argument("--libraries", default="dpscale,opacus", help="comma list: dpscale, opacus")
    whole.add_argument("--device", default=None, help="run.device for both (default: the config's)")
    whole.add_argument(
        "--out", default=None, help="directory for the runs (default: runs/bench-end-to-end-<time>)"
    )
    whole.add_argument(
        "--json", action="store_true", help="print rows as JSON instead of the table"
    )
    whole.add_argument("--write", metavar="PATH", help="also write the markdown table here")
    whole.set_defaults(func=_run_end_to_end)


def _add_ops_parser(kinds: argparse._SubParsersAction) -> None:
    """``bench ops``: the operators one step launches."""
    ops = kinds.add_parser(
        "ops",
        help="ATen operators one optimizer step launches per engine vs non-private, and Opacus",
    )
    ops.add_argument(
        "--models",
        default=None,
        help="comma list (default: papernot-cnn, tramer-cifar-cnn, wrn16-4, resnet18-gn)",
    )
    ops.add_argument(
        "--engines",
        default=None,
        help="comma list, step-time's names (default: nonprivate, dpscale-auto, opacus-ew)",
    )
    ops.add_argument("--batch-size", type=int, default=4, help="for every model (default 4)")
    ops.add_argument("--warmup", type=int, default=2, help="steps run before the counted one")
    ops.add_argument(
        "--device", default="cpu", help="cpu (one torch thread) or cuda: host launches either way"
    )
    ops.add_argument(
        "--methods",
        choices=BENCH_METHODS,
        default="shape-rule",
        help="per-layer methods: the shape rule (deterministic, default) or this machine's tuner and its cache",
    )
    ops.add_argument(
        "--top",
        type=int,
        default=0,
        metavar="N",
        help="also list each row's N most launched operators",
    )
    ops.add_argument(
        "--by-function",
        type=int,
        default=0,
        metavar="N",
        help="also list the N dpscale functions that launched most",
    )
    ops.add_argument(
        "--json",
        action="store_true",
        help="print rows as JSON (every operator's count) instead of the table",
    )
    ops.add_argument("--write", metavar="PATH", help="also write the markdown table here")
    ops.set_defaults(func=_run_ops)


def _add_gpu_suite_parser(kinds: argparse._SubParsersAction) -> None:
    """``bench gpu-suite``: the device acceptance suite."""
    suite = kinds.add_parser(
        "gpu-suite",
        help="the device acceptance suite: engines vs the float64 loop, 16-bit clip "
        "bounds, make_private on the device = on the CPU, step time, the training loop; one markdown report",
    )
    suite.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    suite.add_argument(
        "--models", default=None, help="comma list (default: every registered model; --quick: two)"
    )
    suite.add_argument("--batch", type=int, default=8, help="examples per model in the checks")
    suite.add_argument(
        "--quick", action="store_true", help="tiny sizes: the CPU form the test suite runs"
    )
    suite.add_argument("--out", default=None, metavar="PATH", help="also write the report here")
    suite.add_argument(
        "--data-root",
        default=None,
        metavar="DIR",
        help="Fashion-MNIST: section 5 trains the whole dpscale-fmnist-cnn preset on it",
    )
    suite.set_defaults(func=_run_gpu_suite)


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``bench data`` (here, not in bench/data.py: registering them must not load torch)."""
    parser.add_argument("--folder", help="an image folder (data.name=imagefolder layout)")
    parser.add_argument("--shards", help="a directory written by `dpscale data prepare`")
    parser.add_argument(
        "--image-size", type=int, default=224, help="folders: resize to this square size"
    )
    parser.add_argument(
        "--workers", help="comma list of worker counts (default: 0, 1, all cores but one)"
    )
    parser.add_argument("--batch-size", type=int, default=512, help="expected logical batch size")
    parser.add_argument("--chunk", type=int, default=128, help="examples per physical chunk")
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed logical batches")
    parser.add_argument("--model", help="also run the DP engine on every chunk (e.g. resnet18-gn)")
    parser.add_argument("--device", default="cpu")


def _run_gpu_suite(args: argparse.Namespace) -> int:
    from dpscale.bench.gpu_suite import main

    return main(args)


def _run_step_time(args: argparse.Namespace) -> int:
    from dpscale.bench.step_time_command import main

    return main(args)


def _run_data(args: argparse.Namespace) -> int:
    from dpscale.bench.data import main

    return main(args)


def _run_ops(args: argparse.Namespace) -> int:
    from dpscale.bench.ops import main

    return main(args)


def _run_end_to_end(args: argparse.Namespace) -> int:
    from dpscale.bench.end_to_end import main

    return main(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpscale.bench")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(["bench", *argv])
    args.argv = argv[1:]
    return args.func(args)

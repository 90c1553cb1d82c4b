"""``dpscale sweep`` (a grid of runs, optionally tuned privately) and ``dpscale tune clip-lr``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from dpscale.cli.args import float_list, int_list, refusals_as_config_errors, time_stamp
from dpscale.errors import ConfigError


def _default_out(prefix: str, config: str | None) -> Path:
    """sweeps/<prefix><config name>-<time>."""
    return Path(
        f"sweeps/{prefix}{Path(config or 'default').stem.replace('preset:', '')}-{time_stamp()}"
    )


# ----------------------------------------------------------------------- sweep
def _cmd_sweep(args: argparse.Namespace) -> int:
    from dpscale.tune.private_tuning import TUNER_PRIVATE
    from dpscale.tune.sweep import TABLE_NAME, Sweep, SweepSpec, parse_grid

    if not args.grid:
        raise ConfigError("give at least one --grid KEY=V1,V2,...")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            "run `dpscale sweep` as one process; to train each point on P processes, run the points with torchrun ... -m dpscale train"
        )
    spec = SweepSpec(
        args.config,
        tuple(args.set),
        tuple(parse_grid(g) for g in args.grid),
        args.metric,
        True if args.minimize else None,
        args.private_tuning,
    )
    out = Path(args.out) if args.out else _default_out("", args.config)
    sweep = Sweep(out, spec, progress=not args.quiet, on_point=_print_point)
    sweep.prepare()
    if spec.private_tuning:
        assert sweep.tuning is not None  # prepare() reads it from spec.private_tuning
        print(
            f"sweep: private tuning, {sweep.tuning.describe()}: {len(sweep.drawn_points)} trials drawn from {len(spec.points())} "
            f"points, in {out} (rerun the same command to resume). {TUNER_PRIVATE}",
            file=sys.stderr,
        )
    else:
        print(
            f"sweep: {len(spec.points())} points in {out} (rerun the same command to resume)",
            file=sys.stderr,
        )
    try:
        results = sweep.run()
    except KeyboardInterrupt:
        print(
            f"sweep interrupted; rerun the same command (with --out {out}) to resume it",
            file=sys.stderr,
        )
        raise
    if spec.private_tuning:
        _print_release(sweep, out, results)
    else:
        print((out / TABLE_NAME).read_text())
    failed = [r for r in results if r.status != "done"]
    return 1 if failed else 0


def _print_release(sweep: Any, out: Path, results: list) -> None:
    """Private tuning: the tuner's table (it reveals K) on stderr, and on stdout only the line
    that may be published."""
    from dpscale.tune.private_tuning import RELEASED_DIR, release_statement
    from dpscale.tune.sweep import TABLE_NAME

    print((out / TABLE_NAME).read_text(), file=sys.stderr)
    release = sweep.release(results)
    print(release_statement(release))
    print(f"released: {out / RELEASED_DIR}")
    for note in release["guarantee_caveats"] or []:
        print(f"WARNING: {note}")


def _print_point(result: Any) -> None:
    """One finished sweep point, on stderr."""
    if result.status != "done":
        print(f"  failed: {result.error}", file=sys.stderr)
        return
    s = result.summary
    print(
        f"  test_accuracy={100 * s['test_accuracy']:.2f}% {s['privacy_status']} -> {result.run_dir}",
        file=sys.stderr,
    )


# -------------------------------------------------------------- tune clip-lr
def _cmd_tune_clip_lr(args: argparse.Namespace) -> int:
    from dpscale.tune.clip_lr import clip_lr_report, run_clip_lr

    if args.private_tuning:
        raise ConfigError(
            "--private-tuning cannot cover clip-lr: its first stage trains at sigma=0 on the data (Kurakin et al.), "
            "which no tuning bound makes private. Tune C and the lr together with `dpscale sweep --private-tuning "
            "DIST --grid dp.max_grad_norm=... --grid optim.lr=...` at the target sigma, or run clip-lr on public data"
        )
    out = Path(args.out) if args.out else _default_out("clip-lr-", args.config)
    # The sweeps record a failed point instead of raising; what escapes is the choice's refusal
    # (no unclipped run, no clip norm within the tolerance, no lr run finished).
    with refusals_as_config_errors():
        result = run_clip_lr(
            args.config,
            args.set,
            out,
            args.clip_norms,
            args.lrs,
            args.lr_factors,
            args.tolerance,
            args.seeds or (),
            args.metric,
            progress=not args.quiet,
            on_point=_print_point,
        )
    if args.json:
        print(json.dumps(result.as_json()))
        return 0
    print(clip_lr_report(result))
    print(f"wrote {out / 'clip_lr.json'} and {out / 'clip_lr.md'}")
    for note in result.guarantee_caveats:
        print(f"WARNING: {note}")
    return 0


# ---------------------------------------------------------------------- parser
def add_sweep_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``sweep``."""
    sweep = sub.add_parser(
        "sweep", help="run a grid of configs through the trainer (resumable), table by metric"
    )
    sweep.add_argument("config", nargs="?", help="YAML config or preset:NAME")
    sweep.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...")
    sweep.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="applied to every point"
    )
    sweep.add_argument(
        "--out", metavar="DIR", help="sweep directory (default sweeps/<config>-<time>)"
    )
    sweep.add_argument("--metric", default="test_accuracy", help="summary key to sort by")
    sweep.add_argument(
        "--minimize", action="store_true", help="sort ascending (default only for *loss*)"
    )
    sweep.add_argument(
        "--private-tuning",
        metavar="DIST",
        help="run K random grid points, K ~ DIST (poisson:MEAN, geometric:MEAN, logarithmic:MEAN, negbin:ETA:MEAN), "
        "and release the best in OUT/released/ with the tuning's privacy cost composed (Papernot & Steinke 2022); "
        "K must stay secret",
    )
    sweep.add_argument("--quiet", action="store_true")
    sweep.set_defaults(func=_cmd_sweep)


def add_tune_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``tune`` and ``tune clip-lr``."""
    tune = sub.add_parser(
        "tune", help="tuning procedures (clip-lr: Kurakin et al. 2022, Section 3.3)"
    )
    tune_sub = tune.add_subparsers(dest="tune_command", required=True)
    clip = tune_sub.add_parser(
        "clip-lr", help="clip-norm sweep at sigma=0, then lr sweep at the target sigma"
    )
    clip.add_argument(
        "config", nargs="?", help="YAML config or preset:NAME (its optim.lr is alpha_pub)"
    )
    clip.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    clip.add_argument("--out", metavar="DIR")
    clip.add_argument(
        "--clip-norms", type=float_list, default=(0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
    )
    lrs = clip.add_mutually_exclusive_group()
    lrs.add_argument("--lrs", type=float_list, help="learning rates for stage 3")
    lrs.add_argument(
        "--lr-factors",
        type=float_list,
        default=(0.5, 1.0, 2.0, 4.0, 8.0),
        help="stage 3 lrs as multiples of alpha_pub",
    )
    clip.add_argument(
        "--tolerance", type=float, default=0.01, help="accepted drop from the unclipped metric"
    )
    clip.add_argument(
        "--seeds", type=int_list, help="average each value over these run.seed values"
    )
    clip.add_argument("--metric", default="test_accuracy")
    clip.add_argument("--quiet", action="store_true")
    clip.add_argument("--json", action="store_true")
    clip.add_argument(
        "--private-tuning", metavar="DIST", help="refused, with the reason: stage 1 is not private"
    )
    clip.set_defaults(func=_cmd_tune_clip_lr)

"""``dpscale plot`` and ``dpscale export``: what a run hands on (curves, and its model with the guarantee attached)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dpscale.choices import EXPORT_FORMATS
from dpscale.errors import ConfigError


def _cmd_plot(args: argparse.Namespace) -> int:
    from dpscale.plots import plot_runs

    out = args.out or str(Path(args.run_dirs[0]) / "plots")
    plot_runs(_runs_to_plot(args.run_dirs), out, on_written=print)
    return 0


def _runs_to_plot(paths: list[str]) -> list[Path]:
    """The run directories named, each folder of runs (a sweep, runs/) replaced by its runs that
    have evaluated (one stderr line for each one left out: a sweep may still be going).

    Args:
        paths: the command line's RUN_DIR arguments.

    Returns:
        the run directories to overlay, in the order named (a folder's runs by name).

    Raises:
        ConfigError: a path that is neither a run directory nor a folder of runs with an evaluation.
    """
    from dpscale.runs import CONFIG_NAME, find_run_dirs, is_run_dir, read_metrics

    run_dirs: list[Path] = []
    for path in paths:
        if is_run_dir(path):  # named by the user: plot_runs refuses it if it has not evaluated yet
            run_dirs.append(Path(path))
            continue
        found = find_run_dirs(path)
        if not found:
            raise ConfigError(
                f"{path} is not a dpscale run directory (no {CONFIG_NAME}) nor a folder of runs"
            )
        evaluated = [run_dir for run_dir in found if read_metrics(run_dir)]
        for run_dir in sorted(set(found) - set(evaluated)):
            print(f"{run_dir}: no evaluation yet, left out", file=sys.stderr)
        if not evaluated:
            raise ConfigError(
                f"{path}: none of its {len(found)} runs has evaluated yet: nothing to plot"
            )
        run_dirs += evaluated
    return run_dirs


def _cmd_export(args: argparse.Namespace) -> int:
    from dpscale.export import export_run
    from dpscale.export_card import partial_note

    # export_run refuses what is no finished run (none, no checkpoint yet, still training, stopped early)
    exported = export_run(
        args.run_dir, args.format, args.out, args.ema, allow_partial=args.allow_partial
    )
    privacy = exported.metadata["privacy"]
    print(
        f"{exported.path} ({args.format}, test accuracy {100 * exported.metadata['test_accuracy']:.2f}%, "
        f"{privacy['privacy_status']})"
    )
    partial = partial_note(exported.metadata)
    if partial:
        print(partial)
    print(exported.card)
    return 0


def add_outputs_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``plot`` and ``export``."""
    plot = sub.add_parser(
        "plot", help="PNG curves of runs: accuracy, loss, epsilon vs steps; epsilon vs delta"
    )
    plot.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="one or more run directories, or folders of runs (a sweep, runs/): overlaid",
    )
    plot.add_argument("--out", help="folder for the PNGs (default: the first RUN_DIR's plots/)")
    plot.set_defaults(func=_cmd_plot)
    export = sub.add_parser(
        "export",
        help="the run's model as a file with its privacy statement, plus its card FILE.card.md",
    )
    export.add_argument("run_dir", metavar="RUN_DIR")
    export.add_argument("--format", choices=EXPORT_FORMATS, default="safetensors")
    export.add_argument(
        "--ema", action="store_true", help="the EMA weights (runs with train.ema_decay)"
    )
    export.add_argument("--out", help="the file to write (default: RUN_DIR/export/model.<suffix>)")
    export.add_argument(
        "--allow-partial",
        action="store_true",
        help="export a run still training or stopped before its planned steps (its newest "
        "checkpoint; the card says 'partial: step S of T')",
    )
    export.set_defaults(func=_cmd_export)

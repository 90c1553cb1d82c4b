"""``dpscale plot`` and ``dpscale export``: what a run hands on (curves, and its model with the guarantee attached)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dpscale.choices import EXPORT_FORMATS
from dpscale.errors import ConfigError


def _cmd_plot(args: argparse.Namespace) -> int:
    from dpscale.plots import plot_runs
    from dpscale.runs import is_run_dir

    for run_dir in args.run_dirs:
        if not is_run_dir(run_dir):
            raise ConfigError(f"{run_dir} is not a dpscale run directory (no config.yaml)")
    out = args.out or str(Path(args.run_dirs[0]) / "plots")
    for path in plot_runs(args.run_dirs, out):
        print(path)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from dpscale.export import export_run
    from dpscale.runs import holds_checkpoint, is_run_dir

    if not is_run_dir(args.run_dir) or not holds_checkpoint(args.run_dir):
        raise ConfigError(f"{args.run_dir} is not a dpscale run directory with a checkpoint")
    exported = export_run(args.run_dir, args.format, args.out, args.ema)
    privacy = exported.metadata["privacy"]
    print(f"{exported.path} ({args.format}, test accuracy {100 * exported.metadata['test_accuracy']:.2f}%, "
          f"{privacy['privacy_status']})")  # fmt: skip
    print(exported.card)
    return 0


def add_outputs_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``plot`` and ``export``."""
    plot = sub.add_parser("plot", help="PNG curves of runs: accuracy, loss, epsilon vs steps; epsilon vs delta")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="one or more run directories (overlaid)")
    plot.add_argument("--out", help="folder for the PNGs (default: RUN_DIR/plots of the first run)")
    plot.set_defaults(func=_cmd_plot)
    export = sub.add_parser("export", help="the run's model as a file with its privacy statement, plus MODEL_CARD.md")
    export.add_argument("run_dir", metavar="RUN_DIR")
    export.add_argument("--format", choices=EXPORT_FORMATS, default="safetensors")
    export.add_argument("--ema", action="store_true", help="the EMA weights (runs with train.ema_decay)")
    export.add_argument("--out", help="the file to write (default: RUN_DIR/export/model.<suffix>)")
    export.set_defaults(func=_cmd_export)

"""``dpscale tan fit``: the TAN batch scaling law (accuracy vs log B) fitted on a sweep of simulations."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from dpscale.cli.args import refusals_as_config_errors
from dpscale.errors import ConfigError
from dpscale.tune import TUNING_CAVEAT


def add_fit_parser(tan_sub: argparse._SubParsersAction) -> None:
    """Register ``tan fit``.

    Args:
        tan_sub: the sub-commands of ``dpscale tan``.
    """
    fit = tan_sub.add_parser(
        "fit", help="fit the batch scaling law (accuracy vs log B) on a sweep of simulations"
    )
    fit.add_argument(
        "sweep_dirs",
        nargs="+",
        metavar="SWEEP_DIR",
        help="one or more sweeps (their runs are pooled)",
    )
    fit.add_argument(
        "--out", metavar="DIR", help="where tan_fit.json/.png go (default: the first SWEEP_DIR)"
    )
    fit.add_argument("--metric", default="test_accuracy")
    fit.add_argument("--confidence", type=float, default=0.95)
    fit.add_argument(
        "--where",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="use only these sweep points",
    )
    fit.add_argument(
        "--reference",
        action="append",
        default=[],
        metavar="RUN_DIR",
        help="a finished run at B_ref to compare the prediction with",
    )
    fit.add_argument(
        "--reference-batch-size", type=float, help="B_ref (default: from the simulations)"
    )
    fit.add_argument("--plot", metavar="PNG", help="default: SWEEP_DIR/tan_fit.png")
    fit.add_argument("--no-plot", action="store_true")
    fit.add_argument("--json", action="store_true")
    fit.set_defaults(func=_cmd_tan_fit)


def _cmd_tan_fit(args: argparse.Namespace) -> int:
    from dpscale._io import atomic_write_text
    from dpscale.train.metrics import json_safe
    from dpscale.tune.scaling import fit_sweep
    from dpscale.tune.sweep import read_results

    sweep_dir = Path(args.out or args.sweep_dirs[0])  # where tan_fit.json/.png go
    where = _where(args.where)
    references = [_finished_run(run_dir) for run_dir in args.reference]
    records = [record for directory in args.sweep_dirs for record in read_results(directory)]
    with refusals_as_config_errors():  # too few runs, or runs that do not share one setting
        result = fit_sweep(
            records, args.metric, args.confidence, where, references, args.reference_batch_size
        )
    sweep_dir.mkdir(parents=True, exist_ok=True)
    out_json = sweep_dir / "tan_fit.json"
    report = json_safe({**result.as_json(), "tuning_caveat": TUNING_CAVEAT})
    atomic_write_text(out_json, json.dumps(report, indent=2) + "\n")
    plot_path = None
    if not args.no_plot:
        from dpscale.tune.plot import plot_scaling_fit

        plot_path = plot_scaling_fit(result, args.plot or sweep_dir / "tan_fit.png")
    if args.json:
        print(json.dumps(report))
        return 0
    _print_fit(result, out_json, plot_path)
    return 0


def _where(items: list[str]) -> dict[str, Any]:
    """``--where KEY=VALUE`` flags -> {key: value as the sweep table shows it}."""
    from dpscale.tune.sweep import display_value

    where = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--where needs KEY=VALUE, got {item!r}")
        where[key.strip()] = display_value(value)
    return where


def _finished_run(run_dir: str) -> tuple[str, dict[str, Any]]:
    """(``run_dir``, its summary) for ``--reference``."""
    from dpscale.runs import SUMMARY_NAME, read_summary

    summary = read_summary(run_dir)
    if summary is None:
        raise ConfigError(f"--reference {run_dir}: no {SUMMARY_NAME} (is the run finished?)")
    return str(run_dir), summary


def _print_fit(result: Any, out_json: Path, plot_path: Path | None) -> None:
    fit, pred = result.fit, result.prediction
    pct = lambda v: f"{100 * v:.2f}" if "accuracy" in result.metric else f"{v:.4g}"  # noqa: E731
    unit = " points" if "accuracy" in result.metric else ""
    print(
        f"TAN batch scaling law on {fit.points} runs at {fit.distinct_batch_sizes} batch sizes "
        f"(S={result.steps}, eta_step=q/sigma={result.eta_step:.5g}):"
    )
    print(f"  {result.metric} = {pct(fit.intercept)} + ({pct(fit.slope)}{unit}) x log2(B)")
    if math.isfinite(fit.residual_std):
        lo, hi = fit.slope_interval
        print(
            f"  slope per doubling of B: {pct(fit.slope)}{unit}, {100 * fit.confidence:g}% CI [{pct(lo)}, {pct(hi)}], "
            f"residual std {pct(fit.residual_std)}"
        )
    else:
        print("  (two points: no residual degrees of freedom, no confidence interval)")
    ci, pi = pred.confidence_interval, pred.prediction_interval
    ref_eps = (
        f", epsilon={result.reference_epsilon:.4g}" if result.reference_epsilon is not None else ""
    )
    print(
        f"  prediction at B_ref={result.reference_batch_size:g} (sigma={result.reference_noise_multiplier:.4g}{ref_eps}): {pct(pred.value)}"
    )
    if math.isfinite(fit.residual_std):
        print(
            f"    {100 * fit.confidence:g}% CI for the mean [{pct(ci[0])}, {pct(ci[1])}]; for one run [{pct(pi[0])}, {pct(pi[1])}]"
        )
    if result.reference_points:
        measured = result.measured_reference
        inside = pi[0] <= measured <= pi[1] if math.isfinite(fit.residual_std) else None
        where = (
            ""
            if inside is None
            else (
                " (inside the prediction interval)"
                if inside
                else " (OUTSIDE the prediction interval)"
            )
        )
        print(
            f"  measured at B_ref ({len(result.reference_points)} run(s)): {pct(measured)}; "
            f"error measured - predicted = {pct(result.error)}{unit}{where}"
        )
    print(f"wrote {out_json}" + (f" and {plot_path}" if plot_path else ""))
    print(
        f"NOTE: {TUNING_CAVEAT}. The simulated runs carry no privacy guarantee at the reference epsilon."
    )

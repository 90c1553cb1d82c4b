"""``dpscale tan ...``, ``dpscale sweep`` and ``dpscale tune clip-lr``: thin wrappers that parse,
call ``dpscale.tune`` and print."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from dpscale.config import ConfigError
from dpscale.tune import TUNING_CAVEAT

if TYPE_CHECKING:  # the commands import the library lazily, so that --help stays fast
    from dpscale.config import Config
    from dpscale.privacy.accountant import AccountingSegment
    from dpscale.privacy.plan import ExtractorPrivacy


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def _ints(text: str) -> tuple[int, ...]:
    values = _floats(text)
    if any(v != int(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return tuple(int(v) for v in values)


def number_arg(text: str) -> int | float:
    """argparse type: an int when the text is one (batch sizes print as 256, not 256.0), else a float."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _check_privacy_args(n: int, b: float, sigma: float, steps: int, delta: float) -> None:
    if n < 1 or not 0 < b <= n:
        raise ConfigError(f"need 0 < --batch-size <= --dataset-size, got {b} and {n}")
    if not sigma > 0:
        raise ConfigError(f"--noise must be > 0, got {sigma}")
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    if not 0 < delta < 1:
        raise ConfigError(f"--delta must be in (0, 1), got {delta}")


def _stamp() -> str:
    return f"{datetime.now():%Y%m%d-%H%M%S}"


# ------------------------------------------------------------------ tan simulate
def _cmd_tan_simulate(args: argparse.Namespace) -> int:
    from dpscale.train.run import run_training
    from dpscale.config import load_config

    overrides = [*args.set, f"dp.simulated_batch_size={args.batch_size}"]
    config = load_config(args.config, overrides)
    if not args.batch_size < config.dp.batch_size:
        raise ConfigError(
            f"--batch-size {args.batch_size} must be smaller than the reference run's dp.batch_size={config.dp.batch_size}"
        )
    if args.dry_run:
        return _print_simulation_plan(config)
    if config.run.out_dir is None:
        from dpscale.train.distributed import init_distributed
        from dpscale.train.rundir import default_out_dir

        out = init_distributed(config.run.device).broadcast_object(f"{default_out_dir(config)}-tan-b{args.batch_size}")
        config = replace(config, run=replace(config.run, out_dir=out))
    return run_training(config, max_steps=args.max_steps, quiet=args.quiet)


def _plan_inputs(config: Config, private: bool) -> tuple[tuple[AccountingSegment, ...], ExtractorPrivacy | None]:
    """(releases, extractor case) that the trainer would compose for ``config``: a checkpoint
    extractor's run on the same data, then the feature normalisation's releases."""
    from dpscale.features.pipeline import extractor_privacy, feature_releases
    from dpscale.train.loop import training_fingerprint

    extractor, releases = extractor_privacy(
        config.features, lambda normalize: training_fingerprint(config, normalize), private
    )
    return releases + feature_releases(config.features), extractor


def _print_simulation_plan(config) -> int:
    from dpscale.data import load_dataset
    from dpscale.privacy.plan import steps_for
    from dpscale.train.plan_config import plan_from_config

    n = load_dataset(config.data.name, config.data.root, image_size=config.data.image_size).info.num_train
    steps = steps_for(config.train.epochs, config.train.steps, n, config.dp.batch_size)
    releases, extractor = _plan_inputs(config, private=True)  # a simulation's reference is private
    plan = plan_from_config(config.dp, n, steps, releases, seeded=config.run.seed is not None, extractor=extractor)
    sim = plan.simulation
    print(f"reference run:  B={sim.batch_size:g}, sigma={sim.noise_multiplier:.6g}, S={steps}, "
          f"epsilon={sim.epsilon:.4f} at delta={plan.delta:g} ({plan.accountant})")
    print(f"simulated run:  B={plan.batch_size:g}, sigma={plan.noise_multiplier:.6g}, S={steps} "
          f"(q/sigma={plan.sample_rate / plan.noise_multiplier:.6g}, eps_TAN={plan.eps_tan:.4f}), "
          f"{sim.compute_fraction:.3g}x the reference's compute")
    for note in plan.caveats():
        print(f"WARNING: {note}")
    return 0


# ----------------------------------------------------------------------- sweep
def _cmd_sweep(args: argparse.Namespace) -> int:
    from dpscale.tune.private_tuning import TUNER_PRIVATE
    from dpscale.tune.sweep import TABLE_NAME, Sweep, SweepSpec, parse_grid

    if not args.grid:
        raise ConfigError("give at least one --grid KEY=V1,V2,...")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("run `dpscale sweep` as one process; to train each point on P processes, run the points "
                          "with torchrun ... -m dpscale train")
    spec = SweepSpec(
        args.config, tuple(args.set), tuple(parse_grid(g) for g in args.grid), args.metric,
        True if args.minimize else None, args.private_tuning,
    )
    out = Path(args.out or f"sweeps/{Path(args.config or 'default').stem.replace('preset:', '')}-{_stamp()}")
    sweep = Sweep(out, spec, progress=not args.quiet, on_point=_print_point)
    sweep.prepare()
    if spec.private_tuning:
        print(f"sweep: private tuning, {sweep.tuning.describe()}: {len(sweep._points)} trials drawn from {len(spec.points())} "
              f"points, in {out} (rerun the same command to resume). {TUNER_PRIVATE}", file=sys.stderr)  # fmt: skip
    else:
        print(f"sweep: {len(spec.points())} points in {out} (rerun the same command to resume)", file=sys.stderr)
    try:
        results = sweep.run()
    except KeyboardInterrupt:
        print(f"sweep interrupted; rerun the same command (with --out {out}) to resume it", file=sys.stderr)
        raise
    if spec.private_tuning:
        _print_release(sweep, out, results)
    else:
        print((out / TABLE_NAME).read_text())
    failed = [r for r in results if r.status != "done"]
    return 1 if failed else 0


def _print_release(sweep, out: Path, results) -> None:
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


def _print_point(result) -> None:
    if result.status != "done":
        print(f"  failed: {result.error}", file=sys.stderr)
        return
    s = result.summary
    print(f"  test_accuracy={100 * s['test_accuracy']:.2f}% {s['privacy_status']} -> {result.run_dir}", file=sys.stderr)


# --------------------------------------------------------------------- tan fit
def _cmd_tan_fit(args: argparse.Namespace) -> int:
    from dpscale.tune.scaling import fit_sweep
    from dpscale.tune.sweep import display_value, read_results

    sweep_dir = Path(args.out or args.sweep_dirs[0])  # where tan_fit.json/.png go
    where = {}
    for item in args.where:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--where needs KEY=VALUE, got {item!r}")
        where[key.strip()] = display_value(value)
    references = []
    for run_dir in args.reference:
        path = Path(run_dir) / "summary.json"
        if not path.is_file():
            raise ConfigError(f"--reference {run_dir}: no summary.json (is the run finished?)")
        references.append((str(run_dir), json.loads(path.read_text())))
    records = [record for directory in args.sweep_dirs for record in read_results(directory)]
    result = fit_sweep(
        records, args.metric, args.confidence, where, references, args.reference_batch_size
    )
    sweep_dir.mkdir(parents=True, exist_ok=True)
    out_json = sweep_dir / "tan_fit.json"
    from dpscale.train.checkpoint import atomic_write_text
    from dpscale.train.metrics import json_safe

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


def _print_fit(result, out_json: Path, plot_path: Path | None) -> None:
    fit, pred = result.fit, result.prediction
    pct = lambda v: f"{100 * v:.2f}" if "accuracy" in result.metric else f"{v:.4g}"  # noqa: E731
    unit = " points" if "accuracy" in result.metric else ""
    print(f"TAN batch scaling law on {fit.points} runs at {fit.distinct_batch_sizes} batch sizes "
          f"(S={result.steps}, eta_step=q/sigma={result.eta_step:.5g}):")
    print(f"  {result.metric} = {pct(fit.intercept)} + ({pct(fit.slope)}{unit}) x log2(B)")
    if math.isfinite(fit.residual_std):
        lo, hi = fit.slope_interval
        print(f"  slope per doubling of B: {pct(fit.slope)}{unit}, {100 * fit.confidence:g}% CI [{pct(lo)}, {pct(hi)}], "
              f"residual std {pct(fit.residual_std)}")
    else:
        print("  (two points: no residual degrees of freedom, no confidence interval)")
    ci, pi = pred.confidence_interval, pred.prediction_interval
    ref_eps = f", epsilon={result.reference_epsilon:.4g}" if result.reference_epsilon is not None else ""
    print(f"  prediction at B_ref={result.reference_batch_size:g} (sigma={result.reference_noise_multiplier:.4g}"
          f"{ref_eps}): {pct(pred.value)}")
    if math.isfinite(fit.residual_std):
        print(f"    {100 * fit.confidence:g}% CI for the mean [{pct(ci[0])}, {pct(ci[1])}]; "
              f"for one run [{pct(pi[0])}, {pct(pi[1])}]")
    if result.reference_points:
        measured = result.measured_reference
        inside = pi[0] <= measured <= pi[1] if math.isfinite(fit.residual_std) else None
        where = "" if inside is None else (" (inside the prediction interval)" if inside else " (OUTSIDE the prediction interval)")
        print(f"  measured at B_ref ({len(result.reference_points)} run(s)): {pct(measured)}; "
              f"error measured - predicted = {pct(result.error)}{unit}{where}")
    print(f"wrote {out_json}" + (f" and {plot_path}" if plot_path else ""))
    print(f"NOTE: {TUNING_CAVEAT}. The simulated runs carry no privacy guarantee at the reference epsilon.")


# ------------------------------------------------------------ privacy-search
def _cmd_tan_privacy_search(args: argparse.Namespace) -> int:
    from dpscale.tune.tables import privacy_search_table

    _check_privacy_args(args.dataset_size, args.batch_size, args.noise, args.steps, args.delta)
    rows = privacy_search_table(
        args.dataset_size, args.batch_size, args.noise, args.steps, args.delta, args.accountant, args.steps_factors
    )
    written, skipped = _write_pair_configs(args, rows) if args.config else ({}, {})
    if args.json:
        print(json.dumps([
            {
                "batch_size": r.batch_size, "steps": r.steps, "noise_multiplier": r.noise_multiplier,
                "epsilon": r.epsilon, "eps_tan": r.eps_tan, "lr_scale": r.lr_scale,
                **({"config": written.get(r.steps)} if args.config else {}),
            }
            for r in rows
        ]))
        return 0
    print(f"(B, S) pairs at sigma={args.noise:g} and constant eta (TAN Section 4.3), N={args.dataset_size}, "
          f"delta={args.delta:g}, {args.accountant} accountant:")
    print(f"{'S':>9} {'B':>11} {'epsilon':>9} {'eps_TAN':>9} {'lr scale':>9}" + ("  lr" if args.lr else ""))
    for r in rows:
        lr = f"  {args.lr * r.lr_scale:.4g}" if args.lr else ""
        print(f"{r.steps:>9} {r.batch_size:>11.2f} {r.epsilon:>9.4f} {r.eps_tan:>9.4f} {r.lr_scale:>9.4g}{lr}")
    print("B is the expected batch size of Poisson sampling; a fractional B keeps eta exact. "
          "TAN scales the learning rate inversely to S.")
    for r in rows:
        if not args.config:
            lr = f" --set optim.lr={args.lr * r.lr_scale:.6g}" if args.lr else ""
            print(f"  S={r.steps}: --set dp.batch_size={r.batch_size:.10g} --set train.steps={r.steps} "
                  f"--set dp.noise_multiplier={r.noise_multiplier:g}{lr}")
        elif r.steps in written:
            print(f"  S={r.steps}: {written[r.steps]}")
        else:
            print(f"  S={r.steps}: no config written: {skipped[r.steps]}")
    if args.noise < 2:
        print("WARNING: sigma < 2: beyond the privacy wall the accountant's epsilon differs from pair to pair")
    return 0


def _write_pair_configs(args: argparse.Namespace, rows) -> tuple[dict[int, str], dict[int, str]]:
    """One YAML per pair that the trainer would accept (budget, releases, sampling).

    Returns:
        ({steps: path written}, {steps: why no config was written}).
    """
    from dpscale.config import load_config, save_config, validate
    from dpscale.data import load_dataset
    from dpscale.train.plan_config import plan_from_config

    base = load_config(args.config, args.set)
    n = load_dataset(base.data.name, base.data.root, image_size=base.data.image_size).info.num_train
    mismatch = {
        "--dataset-size": (args.dataset_size, n),
        "--delta": (args.delta, base.dp.delta),
        "--accountant": (args.accountant, base.dp.accountant),
    }
    wrong = [f"{flag} {given} but the config has {have}" for flag, (given, have) in mismatch.items() if given != have]
    if wrong:
        raise ConfigError("--config must describe the same run: " + "; ".join(wrong))
    releases, _ = _plan_inputs(base, private=True)  # every pair has sigma > 0
    out = Path(args.out or f"tan-search-{_stamp()}")
    out.mkdir(parents=True, exist_ok=True)
    written, skipped = {}, {}
    for r in rows:
        config = replace(
            base,
            dp=replace(base.dp, batch_size=r.batch_size, noise_multiplier=r.noise_multiplier, simulated_batch_size=None),
            train=replace(base.train, steps=r.steps, epochs=None),
            optim=replace(base.optim, lr=base.optim.lr * r.lr_scale),
            run=replace(base.run, out_dir=None),
        )
        try:  # exactly the checks the trainer makes: a written config is one that runs
            validate(config)
            plan_from_config(config.dp, n, r.steps, releases)
        except ConfigError as err:
            skipped[r.steps] = str(err)
            continue
        path = out / f"pair-S{r.steps}.yaml"
        save_config(config, path)
        written[r.steps] = str(path)
    return written, skipped


# ------------------------------------------------------------------------ wall
def _cmd_tan_wall(args: argparse.Namespace) -> int:
    from dpscale.privacy.tan import eta_for_eps_tan, privacy_wall_warning, tan_eta
    from dpscale.tune.tables import DEFAULT_WALL_SIGMAS, wall_table

    if not 0 < args.delta < 1:
        raise ConfigError(f"--delta must be in (0, 1), got {args.delta}")
    reference = (args.dataset_size, args.batch_size, args.noise)
    if any(v is not None for v in reference):
        if any(v is None for v in reference) or args.steps is None or len(args.steps) != 1:
            raise ConfigError("a reference run needs --dataset-size, --batch-size, --noise and one --steps")
        _check_privacy_args(args.dataset_size, args.batch_size, args.noise, args.steps[0], args.delta)
        eta = tan_eta(args.batch_size / args.dataset_size, args.noise, args.steps[0])
    else:
        eta = eta_for_eps_tan(args.epsilon_tan, args.delta)
    steps_list = args.steps or (1000, 10000, 100000)
    rows = wall_table(eta, tuple(steps_list), args.delta, args.accountant, args.sigmas or DEFAULT_WALL_SIGMAS)
    plot_path = None
    if not args.no_plot:
        from dpscale.tune.plot import plot_wall

        plot_path = plot_wall(rows, args.plot)
    if args.json:
        print(json.dumps([
            {"noise_multiplier": r.noise_multiplier, "steps": r.steps, "sample_rate": r.sample_rate,
             "epsilon": r.epsilon, "eps_tan": r.eps_tan, "ratio": r.ratio}
            for r in rows
        ]))
        return 0
    print(f"epsilon vs sigma at constant eta={eta:.5g} (eps_TAN={rows[0].eps_tan if rows else float('nan'):.4f}), "
          f"delta={args.delta:g}, {args.accountant} accountant; q = sqrt(2) sigma eta / sqrt(S):")
    print(f"{'S':>8} {'sigma':>7} {'q':>10} {'epsilon':>10} {'eps/eps_TAN':>12}")
    for r in rows:
        flag = "  <- wall" if privacy_wall_warning(r.epsilon, r.noise_multiplier, r.eps_tan) else ""
        print(f"{r.steps:>8} {r.noise_multiplier:>7.3g} {r.sample_rate:>10.4g} {r.epsilon:>10.4f} {r.ratio:>12.3f}{flag}")
    if plot_path:
        print(f"wrote {plot_path}")
    return 0


# ------------------------------------------------------------------- data-size
def _cmd_tan_data_size(args: argparse.Namespace) -> int:
    from dpscale.tune.tables import data_size_table

    _check_privacy_args(args.dataset_size, args.batch_size, args.noise, args.steps, args.delta)
    rows = data_size_table(
        args.dataset_size, args.batch_size, args.noise, args.steps, args.delta, args.factors,
        args.accountant, scale_delta=not args.keep_delta,
    )
    if args.json:
        print(json.dumps([r.__dict__ for r in rows]))
        return 0
    how = "delta fixed" if args.keep_delta else "delta divided by the factor, as TAN does"
    print(f"N multiplied by a factor at fixed B={args.batch_size:g}, sigma={args.noise:g}, S={args.steps} "
          f"({how}; {args.accountant} accountant; TAN Table 5):")
    print(f"{'factor':>7} {'N':>10} {'q':>9} {'delta':>9} {'epsilon':>9} {'eps_TAN':>9} {'N*eta':>9}")
    for r in rows:
        print(f"{r.factor:>7.3g} {r.dataset_size:>10} {r.sample_rate:>9.4g} {r.delta:>9.3g} {r.epsilon:>9.4f} "
              f"{r.eps_tan:>9.4f} {r.global_snr:>9.4g}")
    print("N*eta (the global signal-to-noise ratio) is constant: TAN expects the same information extracted, "
          "richer with more data, at a smaller epsilon.")
    return 0


# -------------------------------------------------------------- tune clip-lr
def _cmd_tune_clip_lr(args: argparse.Namespace) -> int:
    from dpscale.tune.clip_lr import clip_lr_report, run_clip_lr

    if args.private_tuning:
        raise ConfigError(
            "--private-tuning cannot cover clip-lr: its first stage trains at sigma=0 on the data (Kurakin et al.), "
            "which no tuning bound makes private. Tune C and the lr together with `dpscale sweep --private-tuning "
            "DIST --grid dp.max_grad_norm=... --grid optim.lr=...` at the target sigma, or run clip-lr on public data"
        )
    out = Path(args.out or f"sweeps/clip-lr-{Path(args.config or 'default').stem.replace('preset:', '')}-{_stamp()}")
    result = run_clip_lr(
        args.config, args.set, out, args.clip_norms, args.lrs, args.lr_factors, args.tolerance,
        args.seeds or (), args.metric, progress=not args.quiet, on_point=_print_point,
    )
    if args.json:
        print(json.dumps(result.as_json()))
    else:
        print(clip_lr_report(result))
        print(f"wrote {out / 'clip_lr.json'} and {out / 'clip_lr.md'}")
        for note in result.guarantee_caveats:
            print(f"WARNING: {note}")
    return 0


# ---------------------------------------------------------------------- parser
def _privacy_args(p: argparse.ArgumentParser, steps_required: bool = True) -> None:
    p.add_argument("--dataset-size", type=int, required=True, help="N")
    p.add_argument("--batch-size", type=number_arg, required=True, help="expected batch size B (q = B/N)")
    p.add_argument("--noise", type=float, required=True, help="noise multiplier sigma")
    p.add_argument("--steps", type=int, required=steps_required, help="steps S")
    p.add_argument("--delta", type=float, default=1e-5)


def add_tune_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``tan``, ``sweep`` and ``tune`` on the top-level subparsers."""
    tan = sub.add_parser("tan", help="TAN tools: simulate, fit, privacy-search, wall, data-size (Sander et al. 2023)")
    tan_sub = tan.add_subparsers(dest="tan_command", required=True)

    sim = tan_sub.add_parser("simulate", help="train the cheap TAN simulation of a config at a smaller batch size")
    sim.add_argument("config", nargs="?", help="YAML config or preset:NAME: the reference run")
    sim.add_argument("--batch-size", type=number_arg, required=True, help="simulated batch size B (< the config's)")
    sim.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sim.add_argument("--dry-run", action="store_true", help="print the reference and simulated plans only")
    sim.add_argument("--max-steps", type=int, metavar="N")
    sim.add_argument("--quiet", action="store_true")
    sim.set_defaults(func=_cmd_tan_simulate)

    fit = tan_sub.add_parser("fit", help="fit the batch scaling law (accuracy vs log B) on a sweep of simulations")
    fit.add_argument("sweep_dirs", nargs="+", metavar="SWEEP_DIR", help="one or more sweeps (their runs are pooled)")
    fit.add_argument("--out", metavar="DIR", help="where tan_fit.json/.png go (default: the first SWEEP_DIR)")
    fit.add_argument("--metric", default="test_accuracy")
    fit.add_argument("--confidence", type=float, default=0.95)
    fit.add_argument("--where", action="append", default=[], metavar="KEY=VALUE", help="use only these sweep points")
    fit.add_argument("--reference", action="append", default=[], metavar="RUN_DIR",
                     help="a finished run at B_ref to compare the prediction with")
    fit.add_argument("--reference-batch-size", type=float, help="B_ref (default: from the simulations)")
    fit.add_argument("--plot", metavar="PNG", help="default: SWEEP_DIR/tan_fit.png")
    fit.add_argument("--no-plot", action="store_true")
    fit.add_argument("--json", action="store_true")
    fit.set_defaults(func=_cmd_tan_fit)

    search = tan_sub.add_parser("privacy-search", help="(B, S) pairs at fixed sigma and TAN, with their epsilon")
    _privacy_args(search)
    search.add_argument("--accountant", choices=["pld", "rdp"], default="pld")
    search.add_argument("--steps-factors", type=_floats, default=(0.25, 0.5, 1.0, 2.0, 4.0), metavar="M1,M2,...")
    search.add_argument("--lr", type=float, help="the reference learning rate (prints each pair's)")
    search.add_argument("--config", help="write a ready config per pair from this one (YAML or preset:NAME)")
    search.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="with --config")
    search.add_argument("--out", help="directory for the pair configs (default tan-search-<time>)")
    search.add_argument("--json", action="store_true")
    search.set_defaults(func=_cmd_tan_privacy_search)

    wall = tan_sub.add_parser("wall", help="epsilon vs sigma at constant eta: the privacy wall (TAN Figure 2)")
    wall.add_argument("--epsilon-tan", type=float, default=3.0, help="choose eta so that eps_TAN is this")
    wall.add_argument("--dataset-size", type=int, help="or take eta from a reference run: N")
    wall.add_argument("--batch-size", type=number_arg, help="reference B")
    wall.add_argument("--noise", type=float, help="reference sigma")
    wall.add_argument("--steps", type=_ints, metavar="S1,S2,...", help="curves for these S (default 1000,10000,100000)")
    wall.add_argument("--sigmas", type=_floats, default=None, metavar="SIGMA1,...")
    wall.add_argument("--delta", type=float, default=1e-5)
    wall.add_argument("--accountant", choices=["pld", "rdp"], default="rdp",
                      help="rdp (as TAN Figure 2; PLD is slow far below the wall)")
    wall.add_argument("--plot", default="tan_wall.png", metavar="PNG")
    wall.add_argument("--no-plot", action="store_true")
    wall.add_argument("--json", action="store_true")
    wall.set_defaults(func=_cmd_tan_wall)

    data = tan_sub.add_parser("data-size", help="how epsilon changes when N grows by a factor (TAN Table 5)")
    _privacy_args(data)
    data.add_argument("--factors", type=_floats, default=(0.5, 1.0, 2.0, 4.0, 10.0), metavar="F1,F2,...")
    data.add_argument("--keep-delta", action="store_true", help="keep delta (TAN divides it by the factor)")
    data.add_argument("--accountant", choices=["pld", "rdp"], default="pld")
    data.add_argument("--json", action="store_true")
    data.set_defaults(func=_cmd_tan_data_size)

    sweep = sub.add_parser("sweep", help="run a grid of configs through the trainer (resumable), table by metric")
    sweep.add_argument("config", nargs="?", help="YAML config or preset:NAME")
    sweep.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...")
    sweep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="applied to every point")
    sweep.add_argument("--out", metavar="DIR", help="sweep directory (default sweeps/<config>-<time>)")
    sweep.add_argument("--metric", default="test_accuracy", help="summary key to sort by")
    sweep.add_argument("--minimize", action="store_true", help="sort ascending (default only for *loss*)")
    sweep.add_argument(
        "--private-tuning", metavar="DIST",
        help="run K random grid points, K ~ DIST (poisson:MEAN, geometric:MEAN, logarithmic:MEAN, negbin:ETA:MEAN), "
        "and release the best in OUT/released/ with the tuning's privacy cost composed (Papernot & Steinke 2022); "
        "K must stay secret",
    )  # fmt: skip
    sweep.add_argument("--quiet", action="store_true")
    sweep.set_defaults(func=_cmd_sweep)

    tune = sub.add_parser("tune", help="tuning procedures (clip-lr: Kurakin et al. 2022, Section 3.3)")
    tune_sub = tune.add_subparsers(dest="tune_command", required=True)
    clip = tune_sub.add_parser("clip-lr", help="clip-norm sweep at sigma=0, then lr sweep at the target sigma")
    clip.add_argument("config", nargs="?", help="YAML config or preset:NAME (its optim.lr is alpha_pub)")
    clip.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    clip.add_argument("--out", metavar="DIR")
    clip.add_argument("--clip-norms", type=_floats, default=(0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0))
    lrs = clip.add_mutually_exclusive_group()
    lrs.add_argument("--lrs", type=_floats, help="learning rates for stage 3")
    lrs.add_argument("--lr-factors", type=_floats, default=(0.5, 1.0, 2.0, 4.0, 8.0),
                     help="stage 3 lrs as multiples of alpha_pub")
    clip.add_argument("--tolerance", type=float, default=0.01, help="accepted drop from the unclipped metric")
    clip.add_argument("--seeds", type=_ints, help="average each value over these run.seed values")
    clip.add_argument("--metric", default="test_accuracy")
    clip.add_argument("--quiet", action="store_true")
    clip.add_argument("--json", action="store_true")
    clip.add_argument("--private-tuning", metavar="DIST", help="refused, with the reason: stage 1 is not private")
    clip.set_defaults(func=_cmd_tune_clip_lr)

"""``dpscale tan simulate|fit|privacy-search|wall|data-size``: the TAN tools (Sander et al. 2023).

``tan fit`` lives in ``cli/tan_fit.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpscale.choices import ACCOUNTANT_KINDS
from dpscale.cli.args import (
    float_list,
    number_arg,
    positive_float_list,
    positive_int_list,
    refusals_as_config_errors,
    time_stamp,
)
from dpscale.cli.tan_fit import add_fit_parser
from dpscale.errors import ConfigError

if TYPE_CHECKING:  # the commands import the library lazily, so that --help stays fast
    from dpscale.config import Config


def _check_privacy_args(n: int, b: float, sigma: float, steps: int, delta: float) -> None:
    if n < 1 or not 0 < b <= n:
        raise ConfigError(f"need 0 < --batch-size <= --dataset-size, got {b} and {n}")
    if not sigma > 0:
        raise ConfigError(f"--noise must be > 0, got {sigma}")
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    if not 0 < delta < 1:
        raise ConfigError(f"--delta must be in (0, 1), got {delta}")


# ------------------------------------------------------------------ tan simulate
def _cmd_tan_simulate(args: argparse.Namespace) -> int:
    from dpscale.config import load_config
    from dpscale.train.run import run_training

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

        out = init_distributed(config.run.device).broadcast_object(
            f"{default_out_dir(config)}-tan-b{args.batch_size}"
        )
        config = replace(config, run=replace(config.run, out_dir=out))
    return run_training(config, max_steps=args.max_steps, quiet=args.quiet)


def _log(line: str) -> None:
    """A notice from opening the data (e.g. files data.skip_corrupt left out), on stderr."""
    print(line, file=sys.stderr)


def _print_simulation_plan(config: Config) -> int:
    """The plans the Trainer would build for the reference run and its simulation, without training."""
    from dpscale.train.inputs import plan_for, plan_inputs

    # N, steps and releases exactly as the Trainer finds them
    inputs = plan_inputs(config, log=_log)
    plan, steps = plan_for(config, inputs), inputs.steps
    sim = plan.simulation
    # _cmd_tan_simulate set dp.simulated_batch_size below dp.batch_size: the plan is a TAN simulation's
    assert sim is not None
    print(
        f"reference run:  B={sim.batch_size:g}, sigma={sim.noise_multiplier:.6g}, S={steps}, "
        f"epsilon={sim.epsilon:.4f} at delta={plan.delta:g} ({plan.accountant})"
    )
    print(
        f"simulated run:  B={plan.batch_size:g}, sigma={plan.noise_multiplier:.6g}, S={steps} "
        f"(q/sigma={plan.sample_rate / plan.noise_multiplier:.6g}, eps_TAN={plan.eps_tan:.4f}), "
        f"{sim.compute_fraction:.3g}x the reference's compute"
    )
    for note in plan.caveats():
        print(f"WARNING: {note}")
    return 0


# ------------------------------------------------------------ privacy-search
def _cmd_tan_privacy_search(args: argparse.Namespace) -> int:
    from dpscale.tune.tables import privacy_search_table

    _check_privacy_args(args.dataset_size, args.batch_size, args.noise, args.steps, args.delta)
    with refusals_as_config_errors():  # e.g. a delta the PLD accountant cannot resolve
        rows = privacy_search_table(
            args.dataset_size,
            args.batch_size,
            args.noise,
            args.steps,
            args.delta,
            args.accountant,
            args.steps_factors,
        )
    written, skipped = _write_pair_configs(args, rows) if args.config else ({}, {})
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "batch_size": r.batch_size,
                        "steps": r.steps,
                        "noise_multiplier": r.noise_multiplier,
                        "epsilon": r.epsilon,
                        "eps_tan": r.eps_tan,
                        "lr_scale": r.lr_scale,
                        **({"config": written.get(r.steps)} if args.config else {}),
                    }
                    for r in rows
                ]
            )
        )
        return 0
    _print_pairs(args, rows, written, skipped)
    return 0


def _print_pairs(
    args: argparse.Namespace, rows: list, written: dict[int, str], skipped: dict[int, str]
) -> None:
    print(
        f"(B, S) pairs at sigma={args.noise:g} and constant eta (TAN Section 4.3), N={args.dataset_size}, "
        f"delta={args.delta:g}, {args.accountant} accountant:"
    )
    print(
        f"{'S':>9} {'B':>11} {'epsilon':>9} {'eps_TAN':>9} {'lr scale':>9}"
        + ("  lr" if args.lr else "")
    )
    for r in rows:
        lr = f"  {args.lr * r.lr_scale:.4g}" if args.lr else ""
        print(
            f"{r.steps:>9} {r.batch_size:>11.2f} {r.epsilon:>9.4f} {r.eps_tan:>9.4f} {r.lr_scale:>9.4g}{lr}"
        )
    print(
        "B is the expected batch size of Poisson sampling; a fractional B keeps eta exact. TAN scales the learning rate inversely to S."
    )
    for r in rows:
        if not args.config:
            lr = f" --set optim.lr={args.lr * r.lr_scale:.6g}" if args.lr else ""
            print(
                f"  S={r.steps}: --set dp.batch_size={r.batch_size:.10g} --set train.steps={r.steps} "
                f"--set dp.noise_multiplier={r.noise_multiplier:g}{lr}"
            )
        elif r.steps in written:
            print(f"  S={r.steps}: {written[r.steps]}")
        else:
            print(f"  S={r.steps}: no config written: {skipped[r.steps]}")
    if args.noise < 2:
        print(
            "WARNING: sigma < 2: beyond the privacy wall the accountant's epsilon differs from pair to pair"
        )


def _write_pair_configs(
    args: argparse.Namespace, rows: list
) -> tuple[dict[int, str], dict[int, str]]:
    """One YAML per pair that the trainer would accept (budget, releases, sampling).

    Returns:
        ({steps: path written}, {steps: why no config was written}).
    """
    from dpscale.config import load_config, save_config, validate
    from dpscale.train.inputs import inputs_for, plan_for, plan_inputs

    base = load_config(args.config, args.set)
    if base.dp.mechanism != "dpsgd":
        raise ConfigError(
            f"tan privacy-search trades DP-SGD's (B, sigma, S) at equal eps_TAN; {args.config} has "
            f"dp.mechanism={base.dp.mechanism}, whose amplified accounting (ceil(S/b) compositions at b*q) changes "
            "with b: search with dp.mechanism=dpsgd, then set dp.mechanism=bandmf on the pair you pick"
        )
    # Every pair trains on the base's data with sigma = --noise: the same N and source runs as this.
    inputs = plan_inputs(replace(base, dp=replace(base.dp, noise_multiplier=args.noise)), log=_log)
    _check_same_run(args, base, inputs.dataset_size)
    out = Path(args.out or f"tan-search-{time_stamp()}")
    out.mkdir(parents=True, exist_ok=True)
    written, skipped = {}, {}
    for r in rows:
        config = _pair_config(base, r)
        try:  # exactly the checks the trainer makes: a written config is one that runs
            validate(config)
            plan_for(config, inputs_for(config, inputs.dataset_size, inputs.sources))
        except ConfigError as err:
            skipped[r.steps] = str(err)
            continue
        path = out / f"pair-S{r.steps}.yaml"
        save_config(config, path)
        written[r.steps] = str(path)
    return written, skipped


def _check_same_run(args: argparse.Namespace, base: Config, dataset_size: int) -> None:
    """Refuse a --config whose N, delta or accountant differ from the flags the pairs were computed with."""
    mismatch = {
        "--dataset-size": (args.dataset_size, dataset_size),
        "--delta": (args.delta, base.dp.delta),
        "--accountant": (args.accountant, base.dp.accountant),
    }
    wrong = [
        f"{flag} {given} but the config has {have}"
        for flag, (given, have) in mismatch.items()
        if given != have
    ]
    if wrong:
        raise ConfigError("--config must describe the same run: " + "; ".join(wrong))


def _pair_config(base: Config, row: Any) -> Config:
    """``base`` at one (B, S) pair: its sigma, steps and scaled learning rate, a fresh out_dir."""
    return replace(
        base,
        dp=replace(
            base.dp,
            batch_size=_whole(row.batch_size),
            noise_multiplier=row.noise_multiplier,
            simulated_batch_size=None,
        ),
        train=replace(base.train, steps=row.steps, epochs=None),
        optim=replace(base.optim, lr=base.optim.lr * row.lr_scale),
        run=replace(base.run, out_dir=None),
    )


def _whole(batch_size: float) -> int | float:
    """A batch size as the config spells it: an int when whole (fixed-size and shuffled batches need one)."""
    return int(batch_size) if float(batch_size).is_integer() else batch_size


# ------------------------------------------------------------------------ wall
def _cmd_tan_wall(args: argparse.Namespace) -> int:
    from dpscale.tune.tables import DEFAULT_WALL_SIGMAS, wall_table

    if not 0 < args.delta < 1:
        raise ConfigError(f"--delta must be in (0, 1), got {args.delta}")
    eta = _wall_eta(args)
    with refusals_as_config_errors():  # e.g. a delta the PLD accountant cannot resolve
        rows = wall_table(
            eta,
            tuple(args.steps or (1000, 10000, 100000)),
            args.delta,
            args.accountant,
            args.sigmas or DEFAULT_WALL_SIGMAS,
        )
    plot_path = None
    if not args.no_plot:
        from dpscale.tune.plot import plot_wall

        plot_path = plot_wall(rows, args.plot)
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "noise_multiplier": r.noise_multiplier,
                        "steps": r.steps,
                        "sample_rate": r.sample_rate,
                        "epsilon": r.epsilon,
                        "eps_tan": r.eps_tan,
                        "ratio": r.ratio,
                    }
                    for r in rows
                ]
            )
        )
        return 0
    _print_wall(args, eta, rows, plot_path)
    return 0


def _wall_eta(args: argparse.Namespace) -> float:
    """eta of the curves: from the reference run, when one is given, else from --epsilon-tan."""
    from dpscale.privacy.accounting.tan import eta_for_eps_tan, tan_eta

    reference = (args.dataset_size, args.batch_size, args.noise)
    if all(v is None for v in reference):
        with refusals_as_config_errors():  # an eps_TAN that no eta gives
            return eta_for_eps_tan(args.epsilon_tan, args.delta)
    if any(v is None for v in reference) or args.steps is None or len(args.steps) != 1:
        raise ConfigError(
            "a reference run needs --dataset-size, --batch-size, --noise and one --steps"
        )
    _check_privacy_args(args.dataset_size, args.batch_size, args.noise, args.steps[0], args.delta)
    return tan_eta(args.batch_size / args.dataset_size, args.noise, args.steps[0])


def _print_wall(args: argparse.Namespace, eta: float, rows: list, plot_path: Path | None) -> None:
    from dpscale.privacy.accounting.tan import privacy_wall_warning

    print(
        f"epsilon vs sigma at constant eta={eta:.5g} (eps_TAN={rows[0].eps_tan if rows else float('nan'):.4f}), "
        f"delta={args.delta:g}, {args.accountant} accountant; q = sqrt(2) sigma eta / sqrt(S):"
    )
    print(f"{'S':>8} {'sigma':>7} {'q':>10} {'epsilon':>10} {'eps/eps_TAN':>12}")
    for r in rows:
        flag = "  <- wall" if privacy_wall_warning(r.epsilon, r.noise_multiplier, r.eps_tan) else ""
        print(
            f"{r.steps:>8} {r.noise_multiplier:>7.3g} {r.sample_rate:>10.4g} {r.epsilon:>10.4f} {r.ratio:>12.3f}{flag}"
        )
    if plot_path:
        print(f"wrote {plot_path}")


# ------------------------------------------------------------------- data-size
def _cmd_tan_data_size(args: argparse.Namespace) -> int:
    from dpscale.tune.tables import data_size_table

    _check_privacy_args(args.dataset_size, args.batch_size, args.noise, args.steps, args.delta)
    with refusals_as_config_errors():  # a factor <= 0, or a delta / factor outside (0, 1)
        rows = data_size_table(
            args.dataset_size,
            args.batch_size,
            args.noise,
            args.steps,
            args.delta,
            args.factors,
            args.accountant,
            scale_delta=not args.keep_delta,
        )
    if args.json:
        print(json.dumps([r.__dict__ for r in rows]))
        return 0
    how = "delta fixed" if args.keep_delta else "delta divided by the factor, as TAN does"
    print(
        f"N multiplied by a factor at fixed B={args.batch_size:g}, sigma={args.noise:g}, S={args.steps} "
        f"({how}; {args.accountant} accountant; TAN Table 5):"
    )
    print(
        f"{'factor':>7} {'N':>10} {'q':>9} {'delta':>9} {'epsilon':>9} {'eps_TAN':>9} {'N*eta':>9}"
    )
    for r in rows:
        print(
            f"{r.factor:>7.3g} {r.dataset_size:>10} {r.sample_rate:>9.4g} {r.delta:>9.3g} {r.epsilon:>9.4f} "
            f"{r.eps_tan:>9.4f} {r.global_snr:>9.4g}"
        )
    print(
        "N*eta (the global signal-to-noise ratio) is constant: TAN expects the same information extracted, "
        "richer with more data, at a smaller epsilon."
    )
    return 0


# ---------------------------------------------------------------------- parser
def add_tan_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``tan`` and its sub-commands."""
    tan = sub.add_parser(
        "tan", help="TAN tools: simulate, fit, privacy-search, wall, data-size (Sander et al. 2023)"
    )
    tan_sub = tan.add_subparsers(dest="tan_command", required=True)
    _add_simulate_parser(tan_sub)
    add_fit_parser(tan_sub)
    _add_privacy_search_parser(tan_sub)
    _add_wall_parser(tan_sub)
    _add_data_size_parser(tan_sub)


def _privacy_args(p: argparse.ArgumentParser, steps_required: bool = True) -> None:
    p.add_argument("--dataset-size", type=int, required=True, help="N")
    p.add_argument(
        "--batch-size", type=number_arg, required=True, help="expected batch size B (q = B/N)"
    )
    p.add_argument("--noise", type=float, required=True, help="noise multiplier sigma")
    p.add_argument("--steps", type=int, required=steps_required, help="steps S")
    p.add_argument("--delta", type=float, default=1e-5)


def _add_simulate_parser(tan_sub: argparse._SubParsersAction) -> None:
    sim = tan_sub.add_parser(
        "simulate", help="train the cheap TAN simulation of a config at a smaller batch size"
    )
    sim.add_argument("config", nargs="?", help="YAML config or preset:NAME: the reference run")
    sim.add_argument(
        "--batch-size",
        type=number_arg,
        required=True,
        help="simulated batch size B (< the config's)",
    )
    sim.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sim.add_argument(
        "--dry-run", action="store_true", help="print the reference and simulated plans only"
    )
    sim.add_argument("--max-steps", type=int, metavar="N")
    sim.add_argument("--quiet", action="store_true")
    sim.set_defaults(func=_cmd_tan_simulate)


def _add_privacy_search_parser(tan_sub: argparse._SubParsersAction) -> None:
    search = tan_sub.add_parser(
        "privacy-search", help="(B, S) pairs at fixed sigma and TAN, with their epsilon"
    )
    _privacy_args(search)
    search.add_argument("--accountant", choices=ACCOUNTANT_KINDS, default="pld")
    search.add_argument(
        "--steps-factors", type=float_list, default=(0.25, 0.5, 1.0, 2.0, 4.0), metavar="M1,M2,..."
    )
    search.add_argument("--lr", type=float, help="the reference learning rate (prints each pair's)")
    search.add_argument(
        "--config", help="write a ready config per pair from this one (YAML or preset:NAME)"
    )
    search.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="with --config"
    )
    search.add_argument("--out", help="directory for the pair configs (default tan-search-<time>)")
    search.add_argument("--json", action="store_true")
    search.set_defaults(func=_cmd_tan_privacy_search)


def _add_wall_parser(tan_sub: argparse._SubParsersAction) -> None:
    wall = tan_sub.add_parser(
        "wall", help="epsilon vs sigma at constant eta: the privacy wall (TAN Figure 2)"
    )
    wall.add_argument(
        "--epsilon-tan", type=float, default=3.0, help="choose eta so that eps_TAN is this"
    )
    wall.add_argument("--dataset-size", type=int, help="or take eta from a reference run: N")
    wall.add_argument("--batch-size", type=number_arg, help="reference B")
    wall.add_argument("--noise", type=float, help="reference sigma")
    wall.add_argument(
        "--steps",
        type=positive_int_list,
        metavar="S1,S2,...",
        help="curves for these S (default 1000,10000,100000)",
    )
    wall.add_argument("--sigmas", type=positive_float_list, default=None, metavar="SIGMA1,...")
    wall.add_argument("--delta", type=float, default=1e-5)
    wall.add_argument(
        "--accountant",
        choices=ACCOUNTANT_KINDS,
        default="rdp",
        help="rdp (as TAN Figure 2; PLD is slow far below the wall)",
    )
    wall.add_argument("--plot", default="tan_wall.png", metavar="PNG")
    wall.add_argument("--no-plot", action="store_true")
    wall.add_argument("--json", action="store_true")
    wall.set_defaults(func=_cmd_tan_wall)


def _add_data_size_parser(tan_sub: argparse._SubParsersAction) -> None:
    data = tan_sub.add_parser(
        "data-size", help="how epsilon changes when N grows by a factor (TAN Table 5)"
    )
    _privacy_args(data)
    data.add_argument(
        "--factors", type=float_list, default=(0.5, 1.0, 2.0, 4.0, 10.0), metavar="F1,F2,..."
    )
    data.add_argument(
        "--keep-delta", action="store_true", help="keep delta (TAN divides it by the factor)"
    )
    data.add_argument("--accountant", choices=ACCOUNTANT_KINDS, default="pld")
    data.add_argument("--json", action="store_true")
    data.set_defaults(func=_cmd_tan_data_size)

"""The ``dpscale`` command line: train, eval, account, models.

Kept thin: every command parses arguments, calls the library and prints.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Sequence

from dpscale.config import ConfigError


def _cmd_train(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from dpscale.config import load_config
    from dpscale.train.loop import Trainer
    from dpscale.train.rundir import default_out_dir
    from dpscale.train.run import run_training, train_and_report

    if args.resume:
        if args.config:
            raise ConfigError("--resume continues a run as configured in its config.yaml; do not pass a config "
                              "(change a setting explicitly with --set, recorded in the run)")  # fmt: skip
        trainer = Trainer.resume(args.resume, progress=not args.quiet, overrides=args.set, report=True)
        return train_and_report(trainer, args.max_steps)
    config = load_config(args.config, args.set)
    if config.run.out_dir is None:
        from dpscale.train.distributed import init_distributed

        # under torchrun every process must use rank 0's directory name (it has the time in it)
        out_dir = init_distributed(config.run.device).broadcast_object(default_out_dir(config))
        config = replace(config, run=replace(config.run, out_dir=out_dir))
    return run_training(config, args.max_steps, args.quiet)


PRETRAIN_OVERRIDES = ("dp.epsilon=null", "dp.noise_multiplier=0", "dp.max_grad_norm=null")


def _cmd_pretrain(args: argparse.Namespace) -> int:
    """Non-private training on public data: ``dpscale train`` with no noise and no clipping."""
    overrides = [o for o in args.set if o.split("=", 1)[0].strip() not in ("dp.epsilon", "dp.noise_multiplier", "dp.max_grad_norm")]
    if len(overrides) != len(args.set):
        raise ConfigError("dpscale pretrain trains without privacy: do not set dp.epsilon, dp.noise_multiplier or dp.max_grad_norm")
    args.set = [*overrides, *PRETRAIN_OVERRIDES]
    args.resume = None
    print("dpscale pretrain: NOT PRIVATE (for public data; start private runs from it with model.init=RUN_DIR)", file=sys.stderr)
    return _cmd_train(args)


def _cmd_audit(args: argparse.Namespace) -> int:
    """Train with canaries and print what the one-run audit measured (JSON: the last line)."""
    from dataclasses import replace

    from dpscale.audit.run import run_audit
    from dpscale.config import load_config
    from dpscale.train.rundir import default_out_dir

    config = load_config(args.config, args.set)
    if config.run.out_dir is None:
        config = replace(config, run=replace(config.run, out_dir=f"{default_out_dir(config)}-audit"))
    rules = [_guess_rule(args.guesses)] if args.guesses else None
    result = run_audit(
        config, kind=args.kind, canaries=args.canaries, confidence=args.confidence, rules=rules,
        audit_seed=args.audit_seed, progress=not args.quiet, plot=not args.no_plot,
    )  # fmt: skip
    if args.json:
        print(json.dumps(result.as_json()))
        return 0
    print(f"audit ({result.kind} canaries): {result.canaries} canaries, {result.included} included (N counts them)")
    print(f"  guesses: {result.guesses} ({result.guess_in} in, {result.guess_out} out), {result.correct} right; "
          f"best of {result.rules_tried} rules, union-bounded")  # fmt: skip
    print(f"  eps_lower_bound = {result.eps_lower_bound:.4f} at {100 * result.confidence:g}% confidence; "
          f"claimed epsilon = {result.epsilon:.4f} at delta = {result.delta:g} (this audit can show at most "
          f"{result.eps_ceiling:.3g})")  # fmt: skip
    print(f"  {result.verdict}")
    print(f"  run_dir={result.run_dir}" + (f" plot={result.plot}" if result.plot else ""))
    return 0


def _guess_rule(text: str) -> tuple[int, int]:
    try:
        k_in, k_out = (int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--guesses takes K_IN,K_OUT (two integers, e.g. 100,0), got {text!r}") from None
    return k_in, k_out


def _cmd_eval(args: argparse.Namespace) -> int:
    from dpscale.train.loop import Trainer
    from dpscale.train.rundir import SUMMARY_NAME

    trainer = Trainer.load(args.run_dir)
    from dpscale.train.metrics import json_safe

    accuracy, loss = trainer.evaluate_model(trainer.model)  # in memory or streamed, as the run trained
    result = {
        "run_dir": str(args.run_dir),
        "step": trainer.step,
        "total_steps": trainer.total_steps,
        "complete": (Path(args.run_dir) / SUMMARY_NAME).exists() and trainer.step == trainer.total_steps,
        "test_accuracy": accuracy,
        "test_loss": loss,
        **trainer.extra_evaluations(),  # EMA model and AugTest accuracies, when configured
        "epsilon": trainer.epsilon(),
        "delta": trainer.plan.delta,
        "accountant": trainer.plan.accountant,
        **({"reference_epsilon": trainer.plan.reference_epsilon(trainer.step)} if trainer.plan.simulation else {}),
        "guarantee_caveats": trainer.plan.caveats(),
        "extractor_privacy": trainer.plan.extractor.case if trainer.plan.extractor else None,
    }
    if args.json:
        print(json.dumps(json_safe(result)))
    else:
        status = trainer.plan.status(result["epsilon"], result.get("reference_epsilon"))
        print(
            f"{args.run_dir}: step {trainer.step}/{trainer.total_steps}, test accuracy {100 * accuracy:.2f}%, "
            f"test loss {loss:.4f}, {status}"
        )
        extractor = trainer.plan.extractor
        if extractor is not None and extractor.caveat() is None:  # the other cases are caveats, below
            print(f"epsilon includes the extractor's run: {extractor.describe()}")
        for note in result["guarantee_caveats"]:
            print(f"WARNING: {note}")
    return 0


def _cmd_account(args: argparse.Namespace) -> int:
    from dpscale.privacy import calibrate_noise_multiplier, calibrate_steps, compute_epsilon
    from dpscale.privacy.plan import steps_for
    from dpscale.privacy.tan import PRIVACY_WALL_SIGMA, eps_tan, privacy_wall_warning

    n, b = args.dataset_size, args.batch_size
    if n < 1 or not 1 <= b <= n:
        raise ConfigError(f"need 1 <= --batch-size <= --dataset-size, got {b} and {n}")
    if not 0 < args.delta < 1:
        raise ConfigError(f"--delta must be in (0, 1), got {args.delta}")
    q = b / n
    have_length = args.steps is not None or args.epochs is not None
    if args.noise is None and args.target_epsilon is None:
        raise ConfigError("give --noise (to compute epsilon) or --target-epsilon (to calibrate the noise)")
    if args.epochs is not None and not (args.epochs > 0 and math.isfinite(args.epochs)):
        raise ConfigError(f"--epochs must be a positive number, got {args.epochs}")
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    if args.target_epsilon is not None and not (args.target_epsilon > 0 and math.isfinite(args.target_epsilon)):
        raise ConfigError(f"--target-epsilon must be a positive number, got {args.target_epsilon}")
    if args.noise is not None and args.noise <= 0:
        raise ConfigError(f"--noise must be > 0, got {args.noise}")
    releases = ()
    if args.data_norm_noise is not None:
        from dpscale.features.normalize import data_norm_release

        if not args.data_norm_noise > 0:
            raise ConfigError(f"--data-norm-noise must be > 0, got {args.data_norm_noise}")
        releases = (data_norm_release(args.data_norm_noise),)

    if args.noise is not None and args.target_epsilon is not None and have_length:
        raise ConfigError(
            "give two of --noise, --target-epsilon and --epochs/--steps: the third is computed from them"
        )
    if args.noise is not None and args.target_epsilon is not None and not have_length:
        solved = "steps"
        sigma = args.noise
        steps = calibrate_steps(
            target_epsilon=args.target_epsilon, delta=args.delta, sample_rate=q, noise_multiplier=sigma,
            kind=args.accountant, releases=releases,
        )  # fmt: skip
        if steps == 0:
            raise ConfigError(f"not even one step fits in epsilon={args.target_epsilon} with noise {sigma}")
    elif not have_length:
        raise ConfigError("give --epochs or --steps")
    else:
        steps = steps_for(args.epochs, args.steps, n, b)
        if args.noise is not None:
            solved, sigma = "epsilon", args.noise
        else:
            solved = "noise_multiplier"
            try:
                sigma = calibrate_noise_multiplier(
                    target_epsilon=args.target_epsilon, delta=args.delta, sample_rate=q, steps=steps,
                    kind=args.accountant, releases=releases,
                )  # fmt: skip
            except ValueError as err:
                raise ConfigError(str(err)) from None
    mechanism = {"sample_rate": q, "noise_multiplier": sigma, "steps": steps, "delta": args.delta, "kind": args.accountant}
    epsilon = compute_epsilon(**mechanism, releases=releases)
    tan = eps_tan(q, sigma, steps, args.delta)
    wall_warning = None
    if sigma < PRIVACY_WALL_SIGMA:  # compare the DP-SGD steps alone with eps_TAN
        alone = epsilon if not releases else compute_epsilon(**mechanism)
        wall_warning = privacy_wall_warning(alone, sigma, tan)
    result = {
        "epsilon": epsilon,
        "delta": args.delta,
        "noise_multiplier": sigma,
        "steps": steps,
        "epochs": steps * q,
        "sample_rate": q,
        "dataset_size": n,
        "batch_size": b,
        "accountant": args.accountant,
        "eps_tan": tan,
        "solved_for": solved,
        "target_epsilon": args.target_epsilon,
        "sampling": "poisson",
        "data_norm_noise": args.data_norm_noise,
        "wall_warning": wall_warning,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"DP-SGD with Poisson sampling q = {b}/{n} = {q:.6g}, noise multiplier sigma = {sigma:.6g}, "
        f"{steps} steps ({steps * q:.4g} epochs)"
    )
    with_norm = f", composed with private Data Normalization (sigma_norm = {args.data_norm_noise:g})" if releases else ""
    print(f"  epsilon = {epsilon:.4f} at delta = {args.delta:g}  [{args.accountant} accountant]{with_norm}")
    wall = "" if sigma >= PRIVACY_WALL_SIGMA else "  (sigma < 2: beyond the privacy wall, eps_TAN is optimistic)"
    alone = " (DP-SGD steps alone)" if releases else ""
    print(f"  eps_TAN = {tan:.4f}{alone}  [Sander et al. 2023, eq. 4]{wall}")
    if wall_warning:
        print(f"WARNING: {wall_warning}")
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from dpscale.models import build_model, count_parameters, default_input_shape, list_models
    from dpscale.privacy.engines import supported_engines

    rows = []
    for name in list_models():
        shape = default_input_shape(name)
        model = build_model(name, 10, shape)
        rows.append({"name": name, "params": count_parameters(model), "input_shape": list(shape), "engines": supported_engines(model)})
    if args.json:
        print(json.dumps(rows))
    else:
        for row in rows:
            shape = "x".join(map(str, row["input_shape"]))
            print(f"{row['name']:<26} {row['params']:>10,} params  input {shape:<8} engines: {', '.join(row['engines'])}")
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    import yaml

    from dpscale.presets import get_preset, list_presets

    if args.name:
        try:
            preset = get_preset(args.name)
        except KeyError as err:
            raise ConfigError(err.args[0]) from None
        if args.json:
            print(json.dumps({"name": preset.name, "description": preset.description, "source": preset.source, "values": preset.values}))
            return 0
        source = "\n".join(f"# {line}" for line in _wrap(preset.source))
        print(f"# preset:{preset.name}: {preset.description}\n{source}")
        print(f"#   dpscale train preset:{preset.name} --set data.root=DIR")
        print(yaml.safe_dump(preset.values, sort_keys=False).rstrip())
        return 0
    presets = list_presets()
    if args.json:
        print(json.dumps([{"name": p.name, "description": p.description, "source": p.source} for p in presets]))
        return 0
    for preset in presets:
        width = max(len(p.name) for p in presets) + 1
        print(f"{preset.name:<{width}} {preset.description}")
    print("\nrun one with: dpscale train preset:NAME --set data.root=DIR   (dpscale presets NAME shows it as YAML)")
    return 0


def _wrap(text: str, width: int = 96) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width)


def build_parser() -> argparse.ArgumentParser:
    from dpscale.bench import add_bench_parser
    from dpscale.data.command import add_data_parser
    from dpscale.audit import AUDIT_KINDS, DEFAULT_CANARIES, DEFAULT_CONFIDENCE
    from dpscale.tune.cli import add_tune_parsers, number_arg

    parser = argparse.ArgumentParser(prog="dpscale", description="Differentially private training of image classifiers")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model with DP-SGD (default: embedded MNIST sample)")
    train.add_argument("config", nargs="?", help="YAML config file, or preset:NAME (see `dpscale presets`)")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override, e.g. dp.epsilon=3 (with --resume: a change to the run, recorded in it)")  # fmt: skip
    train.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its newest intact checkpoint")
    train.add_argument("--max-steps", type=int, metavar="N", help="stop at global step N with a checkpoint")
    train.add_argument("--quiet", action="store_true", help="no progress bar (evaluations, warnings and results still print)")
    train.set_defaults(func=_cmd_train)

    pre = sub.add_parser("pretrain", help="non-private training on public data, for model.init of private runs")
    pre.add_argument("config", nargs="?", help="YAML config file, or preset:NAME")
    pre.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. data.name=cifar100")
    pre.add_argument("--max-steps", type=int, metavar="N", help="stop at global step N with a checkpoint")
    pre.add_argument("--quiet", action="store_true", help="no progress bar")
    pre.set_defaults(func=_cmd_pretrain)

    audit = sub.add_parser("audit", help="measure a lower bound on the epsilon of one training run with canaries")
    audit.add_argument("config", nargs="?", help="YAML config file, or preset:NAME (default: the embedded MNIST run)")
    audit.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, as for train")
    audit.add_argument("--canaries", type=int, default=DEFAULT_CANARIES, metavar="M", help="canaries, each included with probability 1/2")
    audit.add_argument("--kind", choices=AUDIT_KINDS, default="gradient", help="gradient: white-box Dirac canaries; input: mislabelled images")
    audit.add_argument("--confidence", type=float, default=DEFAULT_CONFIDENCE, help="of the lower bound")
    audit.add_argument("--guesses", metavar="K_IN,K_OUT", help="one guessing rule (default: the best of several, union-bounded)")
    audit.add_argument("--audit-seed", type=int, help="seed of membership and canaries (default: run.seed, else fresh)")
    audit.add_argument("--no-plot", action="store_true", help="skip the score histogram PNG")
    audit.add_argument("--quiet", action="store_true", help="no progress bar")
    audit.add_argument("--json", action="store_true", help="print the result as one JSON object (the last line)")
    audit.set_defaults(func=_cmd_audit)

    ev = sub.add_parser("eval", help="re-evaluate a run's checkpoint on its test set")
    ev.add_argument("run_dir")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(func=_cmd_eval)

    acc = sub.add_parser("account", help="epsilon for DP-SGD parameters, or the noise for a target epsilon")
    acc.add_argument("--dataset-size", type=int, required=True, help="N")
    acc.add_argument("--batch-size", type=number_arg, required=True, help="expected batch size B (q = B/N)")
    acc.add_argument("--noise", type=float, help="noise multiplier sigma")
    length = acc.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=float)
    length.add_argument("--steps", type=int)
    acc.add_argument("--delta", type=float, default=1e-5)
    acc.add_argument("--accountant", choices=["pld", "rdp"], default="pld")
    acc.add_argument("--target-epsilon", type=float, help="calibrate sigma (or steps, given --noise) to this")
    acc.add_argument(
        "--data-norm-noise", type=float, metavar="SIGMA_NORM",
        help="compose with private Data Normalization (two Gaussian sums, Tramer Algorithm 2) at this noise",
    )
    acc.add_argument("--json", action="store_true")
    acc.set_defaults(func=_cmd_account)

    add_bench_parser(sub)
    add_tune_parsers(sub)
    add_data_parser(sub)

    presets = sub.add_parser("presets", help="list the paper presets, or print one as YAML")
    presets.add_argument("name", nargs="?", help="a preset to print as a YAML config")
    presets.add_argument("--json", action="store_true")
    presets.set_defaults(func=_cmd_presets)

    models = sub.add_parser("models", help="list the registered models")
    models.add_argument("--json", action="store_true")
    models.set_defaults(func=_cmd_models)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv[2:]  # for `bench`: the flags, echoed in the report
    try:
        code = args.func(args)
        _leave_process_group()
        return code
    except (ConfigError, ValueError, OSError, RuntimeError, MemoryError) as err:
        # No goodbye to the other ranks here: a failure may be this rank's alone, and waiting for
        # ranks blocked in another collective would hang; torchrun stops them.
        if os.environ.get("DPSCALE_DEBUG"):
            raise
        print(f"dpscale {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _leave_process_group()  # every rank stopped at the same step (see Trainer.run)
        return 130


def _one_line(err: BaseException) -> str:
    """The error's message on one line (its type's name when it has none, as MemoryError may)."""
    text = " ".join(str(err).split())
    if isinstance(err, MemoryError):
        return f"out of memory ({text or 'MemoryError'}); DPSCALE_DEBUG=1 shows where"
    return text or type(err).__name__


def _leave_process_group() -> None:
    """End a torchrun job's process group cleanly, after every rank got here (a no-op for a
    single process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # Wait for every rank first: a rank that tears its group down while another still
        # receives the last broadcast can abort the job (gloo: "terminate called ...").
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

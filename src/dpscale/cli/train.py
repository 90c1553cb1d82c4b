"""``dpscale train`` (and ``--resume``), ``dpscale pretrain`` and ``dpscale eval``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dpscale.errors import ConfigError

PRETRAIN_OVERRIDES = ("dp.epsilon=null", "dp.noise_multiplier=0", "dp.max_grad_norm=null")


def _cmd_train(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from dpscale.config import load_config
    from dpscale.train.loop import Trainer
    from dpscale.train.rundir import default_out_dir
    from dpscale.train.run import run_training, train_and_report

    if args.resume:
        if args.config:
            raise ConfigError(
                "--resume continues a run as configured in its config.yaml; do not pass a config "
                "(change a setting explicitly with --set, recorded in the run)"
            )
        trainer = Trainer.resume(
            args.resume, progress=not args.quiet, overrides=args.set, report=True
        )
        return train_and_report(trainer, args.max_steps)
    config = load_config(args.config, args.set)
    if config.run.out_dir is None:
        from dpscale.train.distributed import init_distributed

        # under torchrun every process must use rank 0's directory name (it has the time in it)
        out_dir = init_distributed(config.run.device).broadcast_object(default_out_dir(config))
        config = replace(config, run=replace(config.run, out_dir=out_dir))
    return run_training(config, args.max_steps, args.quiet)


def _cmd_pretrain(args: argparse.Namespace) -> int:
    """Non-private training on public data: ``dpscale train`` with no noise and no clipping."""
    privacy_keys = tuple(o.split("=", 1)[0] for o in PRETRAIN_OVERRIDES)
    overrides = [o for o in args.set if o.split("=", 1)[0].strip() not in privacy_keys]
    if len(overrides) != len(args.set):
        raise ConfigError(
            "dpscale pretrain trains without privacy: do not set dp.epsilon, dp.noise_multiplier or dp.max_grad_norm"
        )
    args.set = [*overrides, *PRETRAIN_OVERRIDES]
    args.resume = None
    print(
        "dpscale pretrain: NOT PRIVATE (for public data; start private runs from it with model.init=RUN_DIR)",
        file=sys.stderr,
    )
    return _cmd_train(args)


def _cmd_eval(args: argparse.Namespace) -> int:
    from dpscale.runs import SUMMARY_NAME
    from dpscale.train.loop import Trainer
    from dpscale.train.metrics import json_safe

    trainer = Trainer.load(args.run_dir)
    # in memory or streamed, as the run trained
    accuracy, loss = trainer.evaluate_model(trainer.model)
    plan = trainer.plan
    result = {
        "run_dir": str(args.run_dir),
        "step": trainer.step,
        "total_steps": trainer.total_steps,
        "complete": (Path(args.run_dir) / SUMMARY_NAME).exists()
        and trainer.step == trainer.total_steps,
        "test_accuracy": accuracy,
        "test_loss": loss,
        **trainer.extra_evaluations(),  # EMA model and AugTest accuracies, when configured
        "epsilon": trainer.epsilon(),
        "delta": plan.delta,
        "accountant": plan.accountant,
        **({"reference_epsilon": plan.reference_epsilon(trainer.step)} if plan.simulation else {}),
        "guarantee_caveats": plan.caveats(),
        "extractor_privacy": plan.extractor.case if plan.extractor else None,
    }
    if args.json:
        print(json.dumps(json_safe(result)))
        return 0
    status = plan.status(result["epsilon"], result.get("reference_epsilon"))
    print(
        f"{args.run_dir}: step {trainer.step}/{trainer.total_steps}, test accuracy {100 * accuracy:.2f}%, test loss {loss:.4f}, {status}"
    )
    # the other cases are caveats, below
    if plan.extractor is not None and plan.extractor.caveat() is None:
        print(f"epsilon includes the extractor's run: {plan.extractor.describe()}")
    for note in result["guarantee_caveats"]:
        print(f"WARNING: {note}")
    return 0


def add_train_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``train`` and ``pretrain``."""
    train = sub.add_parser(
        "train", help="train a model with DP-SGD (default: embedded MNIST sample)"
    )
    train.add_argument(
        "config", nargs="?", help="YAML config file, or preset:NAME (see `dpscale presets`)"
    )
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override, e.g. dp.epsilon=3 (with --resume: a change to the run, recorded in it)",
    )
    train.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue an interrupted run from its newest intact checkpoint",
    )
    train.add_argument(
        "--max-steps", type=int, metavar="N", help="stop at global step N with a checkpoint"
    )
    train.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar (evaluations, warnings and results still print)",
    )
    train.set_defaults(func=_cmd_train)

    pre = sub.add_parser(
        "pretrain", help="non-private training on public data, for model.init of private runs"
    )
    pre.add_argument("config", nargs="?", help="YAML config file, or preset:NAME")
    pre.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override, e.g. data.name=cifar100",
    )
    pre.add_argument(
        "--max-steps", type=int, metavar="N", help="stop at global step N with a checkpoint"
    )
    pre.add_argument("--quiet", action="store_true", help="no progress bar")
    pre.set_defaults(func=_cmd_pretrain)


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``eval``."""
    ev = sub.add_parser("eval", help="re-evaluate a run's checkpoint on its test set")
    ev.add_argument("run_dir")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(func=_cmd_eval)

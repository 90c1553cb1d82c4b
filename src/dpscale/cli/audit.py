"""``dpscale audit``: train with canaries and measure a lower bound on epsilon."""

from __future__ import annotations

import argparse
import json

from dpscale.errors import ConfigError


def _cmd_audit(args: argparse.Namespace) -> int:
    """Train with canaries and print what the one-run audit measured (JSON: the last line)."""
    from dataclasses import replace

    from dpscale.audit.run import run_audit
    from dpscale.config import load_config
    from dpscale.train.rundir import default_out_dir

    config = load_config(args.config, args.set)
    if config.run.out_dir is None:
        config = replace(
            config, run=replace(config.run, out_dir=f"{default_out_dir(config)}-audit")
        )
    rules = [_guess_rule(args.guesses)] if args.guesses else None
    result = run_audit(
        config,
        kind=args.kind,
        canaries=args.canaries,
        confidence=args.confidence,
        rules=rules,
        audit_seed=args.audit_seed,
        progress=not args.quiet,
        plot=not args.no_plot,
    )
    if args.json:
        print(json.dumps(result.as_json()))
        return 0
    print(
        f"audit ({result.kind} canaries): {result.canaries} canaries, {result.included} included (N counts them)"
    )
    print(
        f"  guesses: {result.guesses} ({result.guess_in} in, {result.guess_out} out), {result.correct} right; "
        f"best of {result.rules_tried} rules, union-bounded"
    )
    print(
        f"  eps_lower_bound = {result.eps_lower_bound:.4f} at {100 * result.confidence:g}% confidence; "
        f"claimed epsilon = {result.epsilon:.4f} at delta = {result.delta:g} (this audit can show at most "
        f"{result.eps_ceiling:.3g})"
    )
    print(f"  {result.verdict}")
    print(f"  run_dir={result.run_dir}" + (f" plot={result.plot}" if result.plot else ""))
    return 0


def _guess_rule(text: str) -> tuple[int, int]:
    """``--guesses K_IN,K_OUT`` -> (K_IN, K_OUT)."""
    try:
        k_in, k_out = (int(part) for part in text.split(","))
    except ValueError as err:
        raise ConfigError(
            f"--guesses takes K_IN,K_OUT (two integers, e.g. 100,0), got {text!r}"
        ) from err
    return k_in, k_out


def add_audit_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``audit``."""
    from dpscale.audit import AUDIT_KINDS, DEFAULT_CANARIES, DEFAULT_CONFIDENCE

    audit = sub.add_parser(
        "audit", help="measure a lower bound on the epsilon of one training run with canaries"
    )
    audit.add_argument(
        "config",
        nargs="?",
        help="YAML config file, or preset:NAME (default: the embedded MNIST run)",
    )
    audit.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override, as for train"
    )
    audit.add_argument(
        "--canaries",
        type=int,
        default=DEFAULT_CANARIES,
        metavar="M",
        help="canaries, each included with probability 1/2",
    )
    audit.add_argument(
        "--kind",
        choices=AUDIT_KINDS,
        default="gradient",
        help="gradient: white-box Dirac canaries; input: mislabelled images",
    )
    audit.add_argument(
        "--confidence", type=float, default=DEFAULT_CONFIDENCE, help="of the lower bound"
    )
    audit.add_argument(
        "--guesses",
        metavar="K_IN,K_OUT",
        help="one guessing rule (default: the best of several, union-bounded)",
    )
    audit.add_argument(
        "--audit-seed",
        type=int,
        help="seed of membership and canaries (default: run.seed, else fresh)",
    )
    audit.add_argument("--no-plot", action="store_true", help="skip the score histogram PNG")
    audit.add_argument("--quiet", action="store_true", help="no progress bar")
    audit.add_argument(
        "--json", action="store_true", help="print the result as one JSON object (the last line)"
    )
    audit.set_defaults(func=_cmd_audit)

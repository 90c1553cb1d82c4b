"""``dpscale bench step-time``: the rows its flags ask for (twins after each dpscale engine), the threads, the table written."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch

from dpscale.bench.engine_names import with_bandmf_rows, with_twin_rows
from dpscale.bench.step_time import ALL_ENGINES, markdown_table, run_step_time
from dpscale.errors import ConfigError


def main(args: argparse.Namespace) -> int:
    """Run ``dpscale bench step-time``: the rows its flags ask for, timed, as a Markdown table (or JSON).

    Args:
        args: the parsed flags (``dpscale.bench.add_bench_parser``'s step-time ones, and ``argv``).

    Returns:
        The exit code, 0.
    """
    models = [m for m in args.models.split(",") if m]
    engines = [e for e in args.engines.split(",") if e] if args.engines else list(ALL_ENGINES)
    if args.mechanism == "bandmf":
        engines = with_bandmf_rows(engines, args.bands)
    if args.peft:
        engines = with_twin_rows(engines, args.peft)
    if args.user_rows:
        engines = with_twin_rows(engines, f"user{args.user_rows}")
    if getattr(args, "compile", False):  # last: "-compiled" ends a name (compiled_of)
        engines = with_twin_rows(engines, "compiled")
    _set_threads(args)
    load_before = _load_average()
    rows = run_step_time(
        models,
        engines,
        repeats=args.repeats,
        warmup=args.warmup,
        device=args.device,
        precision=args.precision,
        batch_size=args.batch_size,
        lora_rank=args.lora_rank,
        clock=args.clock,
    )
    load = (load_before, _load_average())
    if args.json:
        print(
            json.dumps(
                [
                    {k: v for k, v in asdict(r).items() if k not in ("repeats", "resolved")}
                    for r in rows
                ]
            )
        )
    command = "dpscale bench step-time " + " ".join(args.argv)
    table = markdown_table(rows, command.strip(), args.device, args.precision, args.clock, load)
    if not args.json:
        print(table)
    if args.write:
        Path(args.write).parent.mkdir(parents=True, exist_ok=True)
        Path(args.write).write_text(table)
    return 0


def _set_threads(args: argparse.Namespace) -> None:
    """--threads; --clock thread times one torch thread (the other threads' CPU time would not count)."""
    if args.clock == "thread":
        if args.device != "cpu":
            raise ConfigError("--clock thread measures CPU time: use it with --device cpu")
        if args.threads not in (None, 1):
            raise ConfigError(
                "--clock thread times one torch thread: leave --threads out or set it to 1"
            )
        torch.set_num_threads(1)
    elif args.threads:
        torch.set_num_threads(args.threads)


def _load_average() -> float:
    """The 1-minute load average (nan where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return float("nan")

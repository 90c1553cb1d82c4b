"""End-to-end benchmark: a whole training run of a preset, dpscale against the same recipe in Opacus.

    dpscale bench end-to-end preset:tramer-fmnist-cnn --set data.root=../shared/data/fashion-mnist

Both sides train the same model from the same initial weights on the same (prepared, extracted,
normalised) data for the same number of steps, with Poisson sampling at the plan's rate, the
plan's noise multiplier and clip norm, the config's optimizer and learning-rate schedule, and
evaluate on the same test set. dpscale's row is ``dpscale train`` itself (``Trainer.create`` +
``run``: data, self-check, training, evaluations, checkpoint, summary). Opacus' row starts from
the same prepared data (the time ``Trainer.create`` took to prepare it is added to its whole
time, so both wholes include data preparation) and runs ``PrivacyEngine.make_private`` with
``BatchMemoryManager`` at ``train.max_physical_batch_size``, then one evaluation at the end.

Runs one after the other (not interleaved: each is minutes long); rerun to see the spread.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class EndToEndRow:
    """One library's run. Times in seconds; epsilon at the plan's delta by that library's accountant."""

    library: str
    whole_s: float
    training_s: float
    steps: int
    test_accuracy: float
    epsilon: float
    accountant: str


def run_dpscale(config, log: Callable[[str], None]) -> EndToEndRow:
    """``dpscale train`` on ``config``, timed from the start to the summary."""
    from dpscale.train import Trainer

    started = time.perf_counter()
    trainer = Trainer.create(config, progress=False)
    summary = trainer.run()
    whole = time.perf_counter() - started
    assert summary is not None  # run() without max_steps trains to the end, then gives the summary
    log(f"dpscale: {whole:.1f} s, test accuracy {summary['test_accuracy']:.4f}")
    return EndToEndRow(
        "dpscale",
        whole,
        trainer.progress.wall_time_s,
        trainer.step,
        summary["test_accuracy"],
        summary["epsilon"],
        trainer.plan.run_accountant,
    )


def run_opacus(config, log: Callable[[str], None]) -> EndToEndRow:
    """The same recipe with Opacus (hooks mode, Poisson sampling, BatchMemoryManager)."""
    from dpscale.train import Trainer

    started = time.perf_counter()
    base = Trainer.create(
        replace(config, train=replace(config.train, self_check=False)), progress=False
    )
    # data, features, model init: what dpscale's run also does
    prepared = time.perf_counter() - started
    trained_at = time.perf_counter()
    model, accuracy, epsilon = _opacus_train(base, config)
    training = time.perf_counter() - trained_at
    log(f"opacus: {prepared + training:.1f} s, test accuracy {accuracy:.4f}")
    return EndToEndRow(
        "opacus", prepared + training, training, base.total_steps, accuracy, epsilon, "rdp (opacus)"
    )


def _opacus_train(base, config) -> tuple[torch.nn.Module, float, float]:
    import warnings

    from opacus import PrivacyEngine
    from opacus.utils.batch_memory_manager import BatchMemoryManager
    from torch.utils.data import DataLoader, TensorDataset

    from dpscale.train.metrics import evaluate
    from dpscale.train.optim import build_optimizer, build_scheduler

    plan, data = base.plan, base.data
    model = copy.deepcopy(base.model)  # the same initial weights
    optimizer = build_optimizer(config.optim, [p for p in model.parameters() if p.requires_grad])
    loader = DataLoader(
        TensorDataset(data.x_train, data.y_train), batch_size=max(1, round(plan.batch_size))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="rdp")
        model, optimizer, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=plan.noise_multiplier,
            max_grad_norm=plan.max_grad_norm,
            poisson_sampling=True,
        )
        scheduler = build_scheduler(config.optim, optimizer, base.total_steps)
        steps = 0
        while steps < base.total_steps:
            with BatchMemoryManager(
                data_loader=loader,
                max_physical_batch_size=base.physical_batch_size,
                optimizer=optimizer,
            ) as physical:
                for x, y in physical:
                    F.cross_entropy(model(x), y).backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    if not optimizer._is_last_step_skipped:  # a logical step ended
                        scheduler.step()
                        steps += 1
                        if steps == base.total_steps:
                            break
    accuracy, _ = evaluate(model, data.x_test, data.y_test, config.train.eval_batch_size)
    return model, accuracy, engine.get_epsilon(plan.delta)


def markdown(rows: list[EndToEndRow], command: str, device: str) -> str:
    from dpscale.bench.step_time import _cpu_name

    machine = torch.cuda.get_device_name() if device.startswith("cuda") else _cpu_name()
    lines = [
        "# End-to-end benchmark",
        "",
        f"- command: `{command}`",
        f"- machine: {machine}, {torch.get_num_threads()} torch threads, torch {torch.__version__}; date {time.strftime('%Y-%m-%d')}",
        "",
        "| library | whole s | training s | steps | test accuracy | epsilon | accountant |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.library} | {r.whole_s:.1f} | {r.training_s:.1f} | {r.steps} | {100 * r.test_accuracy:.2f}% | "
            f"{r.epsilon:.3f} | {r.accountant} |"
        )
    return "\n".join(lines) + "\n"


def main(args) -> int:
    from dpscale.config import load_config
    from dpscale.train.metrics import json_safe

    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    config = load_config(args.config, args.set)
    if args.device:
        config = replace(config, run=replace(config.run, device=args.device))
    out = Path(args.out or f"runs/bench-end-to-end-{time.strftime('%Y%m%d-%H%M%S')}")
    config = replace(config, run=replace(config.run, out_dir=str(out / "dpscale")))
    rows = []
    for library in args.libraries.split(","):
        if library == "dpscale":
            rows.append(run_dpscale(config, log))
        elif library == "opacus":
            if config.augment.multiplicity > 1 or config.train.ema_decay:
                log(
                    "skip opacus: the recipe uses augmentation multiplicity or EMA, which Opacus does not offer"
                )
                continue
            try:
                rows.append(
                    run_opacus(
                        replace(config, run=replace(config.run, out_dir=str(out / "opacus-data"))),
                        log,
                    )
                )
            except ImportError:
                log("skip opacus: not installed (pip install -c constraints.txt '.[bench]')")
        else:
            raise SystemExit(f"unknown library {library!r}; choose dpscale and/or opacus")
    text = markdown(rows, "dpscale bench end-to-end " + " ".join(args.argv), config.run.device)
    print(json.dumps([json_safe(asdict(r)) for r in rows]) if args.json else text)
    if args.write:
        Path(args.write).parent.mkdir(parents=True, exist_ok=True)
        Path(args.write).write_text(text)
    return 0

"""Starting a run and reporting its result: shared by ``dpscale train``, ``dpscale tan simulate``
and the tuning commands (kept out of the CLI module so the commands do not import each other)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when a run starts (the commands import this module without torch)
    from dpscale.config import Config
    from dpscale.train.loop import Trainer


def run_training(config: Config, max_steps: int | None = None, quiet: bool = False) -> int:
    """Start the run ``config`` describes (run.out_dir set), train, print the result line
    (``quiet``: no progress bar; the evaluations, warnings and result are still printed)."""
    from dpscale.train.loop import Trainer

    return train_and_report(Trainer.create(config, progress=not quiet, report=True), max_steps)


def train_and_report(trainer: Trainer, max_steps: int | None) -> int:
    """Train ``trainer`` (until ``max_steps``), print the result line (rank 0); exit status 0."""
    summary = trainer.run(max_steps=max_steps)
    if not trainer.dist.is_main:
        return 0  # rank 0 reports for the job
    if summary is None:
        print(
            f"stopped at step {trainer.step}/{trainer.total_steps}; continue with: dpscale train --resume {trainer.run_dir}"
        )
        return 0
    # each warning once: after the result unless the run printed them when it started
    print(result_line(summary, trainer.run_dir, warnings=not trainer.warnings_shown))
    return 0


def result_line(summary: dict[str, Any], run_dir: Path, warnings: bool = True) -> str:
    """The one-line result of a finished run, followed (``warnings``) by every caveat of its guarantee."""
    accuracy = f"test_accuracy={100 * summary['test_accuracy']:.2f}%"
    notes = (
        summary["guarantee_caveats"]
        + summary.get("privacy_warnings", [])
        + [summary.get("training_set")]
        if warnings
        else []
    )
    notes = "".join(f"\nWARNING: {n}" for n in notes if n)
    odds = f"\n{summary['odds']} [from {summary['odds_from']}]" if summary.get("odds") else ""
    return f"{accuracy} {summary['privacy_status']} steps={summary['steps']} run_dir={run_dir}{odds}{notes}"

"""TensorBoard event files of a run (``run.tensorboard``, on by default where the package imports).

The run directory's ``tensorboard/`` folder gets, through torch's ``SummaryWriter``:

- every ``STEP_SCALARS_EVERY`` steps: the step's mean train loss, clipped fraction, mean
  per-example gradient norm (before clipping), learning rate and step time (ms), and for a
  streamed run the time the step waited for data (s, this session);
- at every evaluation: test accuracy and loss (EMA and AugTest accuracies when configured),
  epsilon spent at the run's delta, the train loss since the last evaluation, and C for
  adaptive clipping;
- once per session: the config (YAML) and the privacy statement (plan, meaning, caveats) as text.

The train loss, clipped fraction and gradient norms are computed on private examples without
noise: like metrics.jsonl they are not covered by the guarantee (the privacy text says so, with
``GUARANTEE_SCOPE``); keep the run directory private. Step scalars are read every
``STEP_SCALARS_EVERY`` steps only, because reading them waits for the
device (one host sync). Epsilon is logged at evaluations, where the run computes it anyway.
A resumed run purges the events after the checkpoint's step, so a curve never shows steps twice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpscale._io import PRIVATE_FILE_MODE, make_private_dir
from dpscale.config import config_yaml
from dpscale.privacy.plan.caveat_texts import GUARANTEE_SCOPE
from dpscale.runs import TENSORBOARD_NAME
from dpscale.train.build import Log, Run
from dpscale.train.report import privacy_statement, training_set_note
from dpscale.train.step import StepStats

STEP_SCALARS_EVERY = 10

# metrics.jsonl key -> TensorBoard tag, for the evaluation records
EVALUATION_TAGS = {
    "test_accuracy": "test/accuracy",
    "test_loss": "test/loss",
    "test_accuracy_ema": "test/accuracy_ema",
    "test_accuracy_augtest": "test/accuracy_augtest",
    "epsilon": "privacy/epsilon",
    "train_loss": "train/loss_since_last_evaluation",
    "clip_norm": "privacy/clip_norm",
}


def tensorboard_available() -> bool:
    """True when torch's SummaryWriter imports (the ``tensorboard`` package is installed)."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


class RunBoard:
    """The event-file writer of one training session.

    Args:
        run_dir: the run directory (events go to ``run_dir/tensorboard``).
        start_step: the step the session starts at; events at or after it from an earlier
            session (one that ran past its last checkpoint, or an unstarted run's) are purged.
    """

    def __init__(self, run_dir: Path, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        folder = Path(run_dir) / TENSORBOARD_NAME
        make_private_dir(folder)  # owner-only, as the rest of the run directory
        self.writer = SummaryWriter(str(folder), purge_step=start_step)
        for path in folder.iterdir():  # the writer opened its event file with the umask's mode
            if path.is_file():
                path.chmod(PRIVATE_FILE_MODE)

    def start(self, built: Run, step: int, privacy_warnings: list[str]) -> None:
        """The config and the privacy statement (with the run's ``privacy_warnings``) as text, at
        the session's first step ``step``."""
        plan = built.plan
        statement = privacy_statement(plan, privacy_warnings, training_set_note(built))
        if plan.is_private:
            statement.append(GUARANTEE_SCOPE)
        self.writer.add_text("config", _code(config_yaml(built.config)), step)
        self.writer.add_text("privacy", _code("\n".join(statement)), step)

    def after_step(
        self, step: int, stats: StepStats, lr: float, step_ms: float, data_wait_s: float | None
    ) -> None:
        """The step scalars of step ``step``, every ``STEP_SCALARS_EVERY`` steps (else nothing).

        Args:
            step: the steps taken; stats: the last step's statistics; lr: its learning rate.
            step_ms: the step's wall time (ms; on a GPU, the time to enqueue it).
            data_wait_s: streaming: time this session waited for data so far (s); None in memory.
        """
        if step % STEP_SCALARS_EVERY:
            return
        values = stats.as_dict()
        if values["examples"]:
            self.writer.add_scalar("train/loss", values["loss_sum"] / values["examples"], step)
        self.writer.add_scalar("train/clipped_fraction", values["clipped_fraction"], step)
        self.writer.add_scalar("train/mean_grad_norm", values["mean_grad_norm"], step)
        self.writer.add_scalar("train/lr", lr, step)
        self.writer.add_scalar("time/step_ms", step_ms, step)
        if data_wait_s is not None:
            self.writer.add_scalar("time/data_wait_s", data_wait_s, step)

    def evaluation(self, record: dict[str, Any]) -> None:
        """An evaluation record's scalars (a metrics.jsonl line)."""
        for key, tag in EVALUATION_TAGS.items():
            value = record.get(key)
            if isinstance(value, (int, float)):
                self.writer.add_scalar(tag, value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _code(text: str) -> str:
    """Text shown verbatim (TensorBoard renders text as Markdown)."""
    return "\n".join("    " + line for line in text.splitlines())


def open_board(
    built: Run, run_dir: Path | None, step: int, privacy_warnings: list[str], log: Log
) -> RunBoard | None:
    """The writer of a session starting at ``step`` in ``run_dir``, its text written: None when
    ``run.tensorboard`` is off, on ranks other than 0, or when tensorboard is not installed
    (said once with ``log``)."""
    if not built.config.run.tensorboard or run_dir is None or not built.dist.is_main:
        return None
    if not tensorboard_available():
        log("note: no TensorBoard events (pip install tensorboard, or set run.tensorboard=false)")
        return None
    board = RunBoard(run_dir, step)
    board.start(built, step, privacy_warnings)
    return board

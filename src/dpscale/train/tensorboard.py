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
from typing import TYPE_CHECKING, Any

from dpscale._io import PRIVATE_FILE_MODE, make_private_dir
from dpscale.config import config_yaml
from dpscale.privacy.plan import GUARANTEE_SCOPE
from dpscale.runs import TENSORBOARD_NAME

if TYPE_CHECKING:  # the loop imports this module: a type for checkers only, no import circle at run time
    from dpscale.train.loop import Trainer

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

    def start(self, trainer: Trainer) -> None:
        """The config and the privacy statement as text, at the session's first step."""
        plan = trainer.plan
        statement = [plan.describe(), plan.meaning(), *filter(None, [plan.planned_odds()])] + [
            f"WARNING: {n}" for n in plan.caveats() + trainer.privacy_warnings()
        ]
        if plan.is_private:
            statement.append(GUARANTEE_SCOPE)
        self.writer.add_text("config", _code(config_yaml(trainer.config)), trainer.step)
        self.writer.add_text("privacy", _code("\n".join(statement)), trainer.step)

    def after_step(self, trainer: Trainer, step_ms: float) -> None:
        """The step scalars of ``trainer``'s last step, every ``STEP_SCALARS_EVERY`` steps (else nothing).

        Args:
            step_ms: the step's wall time (ms; on a GPU, the time to enqueue it).
        """
        step = trainer.step
        if step % STEP_SCALARS_EVERY:
            return
        values = trainer.last_stats.as_dict()
        if values["examples"]:
            self.writer.add_scalar("train/loss", values["loss_sum"] / values["examples"], step)
        self.writer.add_scalar("train/clipped_fraction", values["clipped_fraction"], step)
        self.writer.add_scalar("train/mean_grad_norm", values["mean_grad_norm"], step)
        self.writer.add_scalar("train/lr", trainer.built.scheduler.get_last_lr()[0], step)
        self.writer.add_scalar("time/step_ms", step_ms, step)
        if trainer.built.streamed:
            feed = trainer.feed
            self.writer.add_scalar("time/data_wait_s", trainer.data_wait_s + (feed.wait_s if feed else 0.0), step)

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


def open_board(trainer: Trainer) -> RunBoard | None:
    """The session's writer: None when ``run.tensorboard`` is off, on ranks other than 0, or
    when tensorboard is not installed (said once in the report)."""
    if not trainer.config.run.tensorboard or trainer.run_dir is None or not trainer.dist.is_main:
        return None
    if not tensorboard_available():
        trainer.log("note: no TensorBoard events (pip install tensorboard, or set run.tensorboard=false)")
        return None
    board = RunBoard(trainer.run_dir, trainer.step)
    board.start(trainer)
    return board

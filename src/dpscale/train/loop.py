"""The DP-SGD training loop of a run built by ``build_run``: the steps, the evaluations and
checkpoints that are due, and Ctrl-C. Read ``Trainer.run`` top to bottom."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm import tqdm

from dpscale.config import Config, save_config
from dpscale.privacy.plan.dp_plan import DPPlan
from dpscale.runs import CONFIG_NAME, METRICS_NAME
import dpscale.train.report as report
import dpscale.train.session as session
import dpscale.train.state as run_state
from dpscale.train.batches import TrainBatches, continued_batches
from dpscale.train.build import Run, build_run
from dpscale.train.distributed import Distributed, init_distributed
from dpscale.train.hooks import RunHooks
from dpscale.train.interrupt import DeferredInterrupt, resume_hint
from dpscale.train.loss_window import EMPTY, LossWindow
from dpscale.train.mechanism import DPMechanism
from dpscale.train.metrics import MetricsLog
from dpscale.train.progress import Progress, epochs_done, evaluation_due
from dpscale.train.progress_bar import StepBar
from dpscale.train.rundir import RunLock
from dpscale.train.step import StepStats
from dpscale.train.tensorboard import RunBoard, open_board


class Trainer:
    """A DP-SGD run in a run directory. Build with ``Trainer.create``, ``resume`` or ``load``.

    Args:
        config: the resolved config (``run.out_dir`` set).
        progress: show a progress bar (to stderr).
        report: print the header, evaluations, warnings and result lines (to stderr); default: ``progress``.
        plan: a DP plan saved in a checkpoint (skips calibration; checked against config and data).
        feature_norm: a feature normaliser's state saved in a checkpoint (see ``build_run``).
        hooks: an audit's canaries and observer (``dpscale.audit``); None for a plain run.

    Attributes:
        built: everything the run trains with (``build_run``): data, plan, model, mechanism, ...
        progress: where the run stands (steps taken, wall time, ...); run_dir: the run directory.
        batches: this rank's training batches (``TrainBatches``); last_stats: the last step's statistics.
        window: the train loss since the last evaluation; checkpoints: those written (``RunCheckpoints``).
        lock: the run directory's lock, held from ``create``/``resume`` until ``run`` returns.
    """

    def __init__(
        self,
        config: Config,
        progress: bool = True,
        plan: DPPlan | None = None,
        feature_norm: dict[str, Any] | None = None,
        hooks: RunHooks | None = None,
        report: bool | None = None,
    ) -> None:
        self.lock: RunLock | None = None  # held by create/resume until run returns
        self.config, self.run_dir = config, session.run_dir_of(config)
        is_main = init_distributed(config.run.device).is_main  # only rank 0 prints and writes
        self.show_progress = progress and is_main
        self.report = (progress if report is None else report) and is_main
        self.built: Run = build_run(
            config,
            hooks or RunHooks(),
            log=self.log,
            progress=self.show_progress,
            saved_plan=plan,
            feature_norm=feature_norm,
        )
        # as built: an auto chunk size as its number
        self.config, self.batches = self.built.config, TrainBatches(self.built, 0)
        # AugTest's seed: the same test views at every evaluation
        self.progress = Progress(augtest_seed=self.built.seeds["augtest"])
        self.metrics = MetricsLog(self.run_dir / METRICS_NAME)
        self.last_stats: StepStats | None = None
        self.window = LossWindow(self.built.device)  # the train loss since the last evaluation
        self.checkpoints = run_state.RunCheckpoints(self.run_dir)
        self._privacy_warnings: list[str] | None = None  # computed on first use
        self.warnings_shown = False  # printed as this session's run starts (not again at its end)
        self.board: RunBoard | None = None  # TensorBoard events (run.tensorboard), while run runs

    # The parts the loop and its callers read most.
    plan = property(lambda self: self.built.plan, doc="The frozen DP plan.")
    model = property(lambda self: self.built.model, doc="The model being trained.")
    data = property(lambda self: self.built.data, doc="Training and test data.")
    total_steps = property(lambda self: self.built.total_steps, doc="S, the planned steps.")
    step = property(lambda self: self.progress.step, doc="Logical steps taken.")

    @property
    def mechanism(self) -> DPMechanism:
        """Sampler, noise, accountant."""
        return self.built.mechanism

    @property
    def dist(self) -> Distributed:
        """The process group."""
        return self.built.dist

    @classmethod
    def create(
        cls,
        config: Config,
        progress: bool = True,
        hooks: RunHooks | None = None,
        report: bool | None = None,
    ) -> "Trainer":
        """Start a new run in ``config.run.out_dir`` (``hooks``: an audit's canaries, see ``RunHooks``).

        Refuses a directory that holds a checkpointed run or that another process trains in; what a
        run that stopped before its first checkpoint left there is cleared. The directory stays
        locked until ``run`` returns; a start that fails leaves nothing behind.
        """
        claim = session.claim_new_run(config)
        with session.undone_on_failure(claim.abandon if claim is not None else None):
            trainer = cls(config, progress, hooks=hooks, report=report)
            if note := session.cleared_note(claim):
                trainer.log(note)
            # as built: an auto chunk size as its number
            session.write_claim(claim, trainer.config, trainer.dist)
        trainer.lock = claim.lock if claim is not None else None
        return trainer

    @classmethod
    def load(cls, run_dir: str | Path, progress: bool = False) -> "Trainer":
        """The run in ``run_dir`` at its checkpoint, read-only (nothing in the directory changes)."""
        config, state = session.read_saved_run(run_dir)
        plan, feature_norm = session.saved_parts(state)
        trainer = cls(config, progress, plan=plan, feature_norm=feature_norm)
        trainer.load_state(state)
        return trainer

    @classmethod
    def resume(
        cls,
        run_dir: str | Path,
        progress: bool = True,
        overrides: Sequence[str] = (),
        report: bool | None = None,
    ) -> "Trainer":
        """Continue the run in ``run_dir`` from its newest intact checkpoint, exactly where it stopped.

        Args:
            overrides: ``section.key=value`` changes asked for explicitly (``--set`` on resume),
                recorded in the run; config.yaml edited in any other setting is refused.

        The directory is locked (another process training in it is refused) until ``run`` returns.
        A run that stopped before its first checkpoint starts again from step 0; a damaged newest
        checkpoint is set aside for the previous one when that is intact.
        """
        opened = session.open_to_resume(Path(run_dir), overrides)
        with session.undone_on_failure(opened.lock.release):
            # (None, None) for a run that stopped before its first checkpoint: it starts again from step 0
            plan, norm = session.saved_parts(opened.latest.state)
            trainer = cls(opened.config, progress, plan=plan, feature_norm=norm, report=report)
            trainer.continue_from(opened, bool(overrides))
        trainer.lock = opened.lock if opened.held else None  # rank 0 holds it for the job
        return trainer

    def continue_from(self, opened: session.Resumption, overridden: bool) -> None:
        """``resume`` on the built Trainer: the checkpoint's state loaded, metrics.jsonl cut back
        to its step, the changes asked for recorded (in the checkpoint, config.yaml, the summary)."""
        latest, is_main = opened.latest, self.dist.is_main
        if latest.state is None:  # its note says it starts from step 0
            self.log(latest.note or "")
            if is_main:
                self.metrics.truncate_after(0)
                if overridden:
                    save_config(self.config, self.run_dir / CONFIG_NAME)
            return
        self.load_state(latest.state)
        if latest.note:
            self.announce(latest.note)
        self.checkpoints.damaged = latest.damaged
        if is_main:
            self.metrics.truncate_after(self.step)
        if opened.changes:  # saved now, so the next resume compares against the new values
            record, line = session.change_record(self.step, opened.changes)
            self.progress.config_changes.append(record)
            self.announce(line)
            self.save()
            if is_main:
                save_config(self.config, self.run_dir / CONFIG_NAME)

    def close(self) -> None:
        """Close the TensorBoard events, release the run directory's lock (``run`` does; safe twice)."""
        if self.board is not None:
            board, self.board = self.board, None
            board.close()
        if self.lock is not None:
            self.lock.release()

    def __del__(self) -> None:
        lock = getattr(self, "lock", None)
        with contextlib.suppress(Exception):  # interpreter exit: the OS drops the lock anyway
            if lock is not None:
                lock.release()

    def state(self) -> dict[str, Any]:
        """The checkpoint (``dpscale.checkpoint_format``); collective with P processes."""
        streams = self.batches.state(self.step)
        return run_state.training_state(
            self.built, self.progress, rank_streams=streams, window=self.window.as_dict()
        )

    def load_state(self, saved: dict[str, Any]) -> None:
        """Continue from a checkpoint's state (current layout: ``load_checkpoint`` migrates)."""
        self.progress, notes = run_state.restore(self.built, saved)
        self.window.load(saved["window"])
        for note in notes:
            self.log(note)
        self.batches = continued_batches(self.batches, self.built, saved, self.step, self.log)
        self.checkpoints.step = self.step

    def save(self) -> None:
        """Write the checkpoint (rank 0; collective with P processes, so every rank calls it).

        Raises:
            OSError: the checkpoint could not be written (e.g. a full disk), saying that the
                previous one is intact.
        """
        self.checkpoints.write(self.state(), self.step, self.dist.is_main)

    def run(self, max_steps: int | None = None) -> dict[str, Any] | None:
        """Train until the planned number of steps, or until global step ``max_steps``.

        Writes a checkpoint every ``train.checkpoint_every_minutes`` (and every
        ``train.checkpoint_every_steps``), at the end and when stopping early. Ctrl-C finishes
        the current step, writes a checkpoint and raises ``KeyboardInterrupt``.

        Returns:
            the summary dict when training is complete, else None.
        """
        stop = self.total_steps if max_steps is None else min(self.total_steps, max_steps)
        if self.lock is not None:
            self.lock.acquire()  # again, for a second call of run (the first released it)
        try:
            return self._run_locked(stop)
        finally:
            self.close()

    def _run_locked(self, stop: int) -> dict[str, Any] | None:
        """``run`` while holding the run directory's lock."""
        # the plan, what it means, and every caveat and warning (once per session)
        for line in report.header_lines(self.plan, self.built, self.privacy_warnings()):
            self.log(line)
        self.warnings_shown = self.report
        self.board = self.board or open_board(
            self.built, self.run_dir, self.step, self.privacy_warnings(), self.log
        )
        bar = StepBar(self.total_steps, self.step, self.show_progress, self.epsilon)
        interrupt = DeferredInterrupt()
        self.checkpoints.saved_at = time.perf_counter()
        interrupted = False
        try:
            with interrupt, self.built.precision.matmul_flags():
                while self.step < stop:
                    # With P processes a signal may reach one rank only: all stop at the same step.
                    if self.dist.any(interrupt.requested):
                        interrupted = True
                        break
                    self._step_evaluate_save(bar)
        finally:
            bar.close()
            self.progress.data_wait_s += self.batches.stop(self.step)
        if interrupted or (not self.dist.enabled and interrupt.requested):
            self.save()
            if self.dist.is_main:  # always printed (also with progress off)
                print(resume_hint(self.step, self.run_dir), file=sys.stderr)
            raise KeyboardInterrupt
        if self.step < self.total_steps:
            self.save()
            return None
        return self.finish()

    def _step_evaluate_save(self, bar: StepBar) -> None:
        """One step, then the evaluation and checkpoint that are due, then the progress bar."""
        train, started = self.config.train, time.perf_counter()
        stats = self.train_step()
        if line := report.new_clip_methods(self.built):
            self.log(line)
        if self.board is not None:
            waited = (
                self.progress.data_wait_s + self.batches.waited_s() if self.built.streamed else None
            )
            lr = self.built.scheduler.get_last_lr()[0]
            self.board.after_step(
                self.step, stats, lr, 1000 * (time.perf_counter() - started), waited
            )
        evaluated = evaluation_due(self.plan, train.eval_every_epochs, self.step, self.total_steps)
        if evaluated:
            self.progress.wall_time_s += time.perf_counter() - started
            started = time.perf_counter()
            record = self.evaluate_and_log()
            if record is not None:
                bar.epsilon = record["epsilon"]
                self.log(report.evaluation_line(record))
        if self.step == self.total_steps or self.checkpoints.due(train, self.step, self.dist):
            self.save()
        self.progress.wall_time_s += time.perf_counter() - started
        bar.after_step(stats, evaluated, self.epsilon)

    def train_step(self) -> StepStats:
        """Draw a logical batch, take one private step, account for it; its statistics returned."""
        reduce = self.dist.all_reduce_sum_ if self.dist.enabled else None
        chunks = self.batches.chunks(self.step)  # drawn by the mechanism, or read ahead by a stream
        # clip, noise once, / B, optimizer and scheduler step, account
        stats = self.mechanism.step_drawn_chunks(
            chunks, all_reduce_sum=reduce, add_noise=self.dist.adds_noise
        )
        if self.built.ema is not None:
            self.built.ema.update(self.model)
        self.progress.step += 1
        self.window.add(stats)
        self.last_stats = stats
        return stats

    def evaluate_and_log(self) -> dict[str, Any] | None:
        """Evaluate and append to metrics.jsonl (rank 0; other ranks only reset the window)."""
        record: dict[str, Any] | None = None
        if self.dist.is_main:
            record = report.evaluation_record(
                self.built, self.progress, self.window.as_dict(), self.log
            )
        self.window.load(EMPTY)
        if record is not None:
            self.metrics.append(record)
            if self.board is not None:
                self.board.evaluation(record)
        return record

    def evaluate_model(self, model: torch.nn.Module) -> tuple[float, float]:
        """Accuracy and mean loss of ``model`` on the test set."""
        return report.evaluate_model(self.built, model)

    def extra_evaluations(self) -> dict[str, float]:
        """EMA-model and AugTest accuracies, when configured."""
        return report.extra_evaluations(self.built, self.progress.augtest_seed)

    def epochs_done(self, step: int) -> float:
        """Epochs after ``step`` steps: step * B / N (an epoch is N / B expected-size batches)."""
        return epochs_done(self.plan, step)

    def epsilon(self) -> float:
        """Epsilon spent so far (inf for a non-private run)."""
        return self.mechanism.epsilon()

    def privacy_warnings(self) -> list[str]:
        """Advice about the privacy parameters (the privacy wall), computed once per run."""
        if self._privacy_warnings is None:
            self._privacy_warnings = report.privacy_advice(self.plan, self.config)
        return self._privacy_warnings

    def finish(self) -> dict[str, Any]:
        """Write ``summary.json`` for a completed run (rank 0) and return it (on every rank)."""
        summary = None
        if self.dist.is_main:
            last = self.metrics.read()[-1]
            summary = report.write_summary(
                self.built, self.progress, self.run_dir, last, self.privacy_warnings()
            )
        return self.dist.broadcast_object(summary)

    def log(self, message: str) -> None:
        """A line of the run's report (stderr; off with ``report=False``)."""
        if self.report:
            tqdm.write(message, file=sys.stderr)

    def announce(self, message: str) -> None:
        """A line the user must see even with the report off: how their run was continued."""
        if init_distributed(self.config.run.device).is_main:  # also before the run is built
            tqdm.write(message, file=sys.stderr)

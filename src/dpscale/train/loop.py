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
from dpscale.train.batches import TrainBatches, restarted_streams
from dpscale.train.build import Run, build_run
from dpscale.train.distributed import Distributed, init_distributed
from dpscale.train.hooks import RunHooks
from dpscale.train.interrupt import DeferredInterrupt
from dpscale.train.mechanism import DPMechanism
from dpscale.train.metrics import MetricsLog
from dpscale.train.progress import Progress, epochs_done, evaluation_due
from dpscale.train.rundir import RunLock
from dpscale.train.step import StepStats
from dpscale.train.tensorboard import RunBoard, open_board

# How often the progress bar's epsilon is recomputed between evaluations (PLD takes ~0.5 s).
EPSILON_REFRESH_S = 10.0


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
        self.lock: RunLock | None = None  # the run directory's, held by create/resume until run returns
        self.config, self.run_dir = config, session.run_dir_of(config)
        is_main = init_distributed(config.run.device).is_main  # only rank 0 prints and writes
        self.show_progress, self.report = progress and is_main, (progress if report is None else report) and is_main
        self.built: Run = build_run(
            config, hooks or RunHooks(), log=self.log, progress=self.show_progress, saved_plan=plan, feature_norm=feature_norm
        )
        self.config, self.batches = self.built.config, TrainBatches(self.built, 0)  # an auto chunk size: its number
        self.progress = Progress(augtest_seed=self.built.seeds["augtest"])  # test views: the same at every evaluation
        self.metrics = MetricsLog(self.run_dir / METRICS_NAME)
        self.last_stats: StepStats | None = None
        self.load_window({"loss_sum": 0.0, "examples": 0, "nonfinite_examples": 0})
        self._saved_at = time.perf_counter()  # when the checkpoint was last written (perf_counter s)
        self._privacy_warnings: list[str] | None = None  # computed on first use
        self.warnings_shown = False  # printed at the start of this session's run (so not again at its end)
        self.damaged_checkpoint: Path | None = None  # a damaged newest checkpoint, set aside at the next save
        self._checkpoint_step: int | None = None  # the step of the last checkpoint this process wrote or read
        self.board: RunBoard | None = None  # TensorBoard events (run.tensorboard), while ``run`` runs

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
    def create(cls, config: Config, progress: bool = True, hooks: RunHooks | None = None, report: bool | None = None) -> "Trainer":
        """Start a new run in ``config.run.out_dir`` (``hooks``: an audit's canaries, see ``RunHooks``).

        Refuses a directory that holds a checkpointed run or that another process trains in; what a
        run that stopped before its first checkpoint left there is cleared. The directory stays
        locked until ``run`` returns; a start that fails leaves nothing behind.
        """
        claim = session.claim_new_run(config)
        try:
            trainer = cls(config, progress, hooks=hooks, report=report)
            if note := session.cleared_note(claim):
                trainer.log(note)
            session.write_claim(claim, trainer.config, trainer.dist)  # as built: an auto chunk size as its number
        except BaseException:
            if claim is not None:
                claim.abandon()
            raise
        trainer.lock = claim.lock if claim is not None else None
        return trainer

    @classmethod
    def load(cls, run_dir: str | Path, progress: bool = False) -> "Trainer":
        """The run in ``run_dir`` at its checkpoint, read-only (nothing in the directory changes)."""
        config, state = session.read_saved_run(run_dir)
        trainer = cls(config, progress, plan=session.saved_plan(state), feature_norm=state.get("feature_norm"))
        trainer.load_state(state)
        return trainer

    @classmethod
    def resume(cls, run_dir: str | Path, progress: bool = True, overrides: Sequence[str] = (), report: bool | None = None) -> "Trainer":
        """Continue the run in ``run_dir`` from its newest intact checkpoint, exactly where it stopped.

        Args:
            overrides: ``section.key=value`` changes asked for explicitly (``--set`` on resume),
                recorded in the run; config.yaml edited in any other setting is refused.

        The directory is locked (another process training in it is refused) until ``run`` returns.
        A run that stopped before its first checkpoint starts again from step 0; a damaged newest
        checkpoint is set aside for the previous one when that is intact.
        """
        opened = session.open_to_resume(Path(run_dir), overrides)
        try:
            state = opened.latest.state
            if state is None:  # stopped before its first checkpoint: starts again from step 0
                trainer = cls(opened.config, progress, report=report)
            else:
                plan, feature_norm = session.saved_plan(state), state.get("feature_norm")
                trainer = cls(opened.config, progress, plan=plan, feature_norm=feature_norm, report=report)
            trainer.continue_from(opened, bool(overrides))
        except BaseException:
            opened.lock.release()
            raise
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
        self.damaged_checkpoint = latest.damaged
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
        with contextlib.suppress(Exception):  # at interpreter exit; the OS drops the lock with the process anyway
            if lock is not None:
                lock.release()

    def state(self) -> dict[str, Any]:
        """The checkpoint (``dpscale.checkpoint_format``); collective with P processes."""
        streams = self.batches.state(self.step)
        return run_state.training_state(self.built, self.progress, rank_streams=streams, window=self.window_as_dict())

    def load_state(self, saved: dict[str, Any]) -> None:
        """Continue from a checkpoint's state (current layout: ``load_checkpoint`` migrates)."""
        self.progress, notes = run_state.restore(self.built, saved)
        self.load_window(saved["window"])
        for note in notes:
            self.log(note)
        mine, restart_note = run_state.saved_rank_streams(saved, self.dist)
        if mine is None:  # fresh sampling, noise and augmentation streams, never the ones used before
            self.batches = restarted_streams(self.built, self.step)
            self.log(restart_note or "")
        else:
            self.batches.load_state(mine)
        self._checkpoint_step = self.step

    def save(self) -> None:
        """Write the checkpoint (rank 0; collective with P processes, so every rank calls it).

        Raises:
            OSError: the checkpoint could not be written (e.g. a full disk), saying that the
                previous one is intact.
        """
        saved = self.state()
        if self.dist.is_main:
            run_state.write_checkpoint(self.run_dir, saved, damaged=self.damaged_checkpoint, intact_step=self._checkpoint_step)
            self.damaged_checkpoint = None
        self._checkpoint_step = self.step
        self._saved_at = time.perf_counter()

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
        self._print_plan()
        self.board = self.board or open_board(self.built, self.run_dir, self.step, self.privacy_warnings(), self.log)
        bar = tqdm(
            total=self.total_steps, initial=self.step, disable=not self.show_progress, file=sys.stderr, desc="train",
            unit="step", dynamic_ncols=True,
        )  # fmt: skip
        self._bar_state = {"epsilon": self.epsilon() if self.step else 0.0, "reported_at": time.perf_counter()}
        interrupt = DeferredInterrupt()
        self._saved_at = time.perf_counter()
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
            # Always printed (also with progress off): this is how the user gets their run back.
            if self.dist.is_main:
                print(f"interrupted after step {self.step}; resume with: dpscale train --resume {self.run_dir}", file=sys.stderr)
            raise KeyboardInterrupt
        if self.step < self.total_steps:
            self.save()
            return None
        return self.finish()

    def _print_plan(self) -> None:
        """The plan, what it means, and every caveat and warning (once per session)."""
        for line in report.header_lines(self.plan, self.built, self.privacy_warnings()):
            self.log(line)
        self.warnings_shown = self.report

    def _step_evaluate_save(self, bar: Any) -> None:
        """One step, then the evaluation and checkpoint that are due, then the progress bar."""
        started = time.perf_counter()
        stats = self.train_step()
        if line := report.new_clip_methods(self.built):
            self.log(line)
        if self.board is not None:
            waited = self.progress.data_wait_s + self.batches.waited_s() if self.built.streamed else None
            lr = self.built.scheduler.get_last_lr()[0]
            self.board.after_step(self.step, stats, lr, 1000 * (time.perf_counter() - started), waited)
        evaluated = evaluation_due(self.plan, self.config.train.eval_every_epochs, self.step, self.total_steps)
        if evaluated:
            self.progress.wall_time_s += time.perf_counter() - started
            started = time.perf_counter()
            record = self.evaluate_and_log()
            if record is not None:
                self._bar_state["epsilon"] = record["epsilon"]
                self.log(
                    f"epoch {record['epoch']:.2f} step {self.step}: test accuracy "
                    f"{100 * record['test_accuracy']:.2f}%, epsilon {report.format_epsilon(record['epsilon'])}"
                )
        if self.step == self.total_steps or self._checkpoint_due():
            self.save()
        self.progress.wall_time_s += time.perf_counter() - started
        bar.update(1)
        # Reading the step's loss waits for the device: only when the bar is redrawn.
        bar_state = self._bar_state
        if self.show_progress and (evaluated or time.perf_counter() - bar_state["reported_at"] > EPSILON_REFRESH_S):
            bar_state["epsilon"], bar_state["reported_at"] = self.epsilon(), time.perf_counter()
            loss = stats.loss_sum / max(1, stats.examples)
            bar.set_postfix(loss=f"{loss:.3f}", eps=report.format_epsilon(bar_state["epsilon"]), refresh=False)

    def train_step(self) -> StepStats:
        """Draw a logical batch, take one private step, account for it; its statistics returned."""
        reduce = self.dist.all_reduce_sum_ if self.dist.enabled else None
        chunks = self.batches.chunks(self.step)  # drawn through the mechanism, or read ahead by a stream
        # clip, noise once, / B, optimizer and scheduler step, account
        stats = self.mechanism.step_drawn_chunks(chunks, all_reduce_sum=reduce, add_noise=self.dist.adds_noise)
        if self.built.ema is not None:
            self.built.ema.update(self.model)
        self.progress.step += 1
        # the window's order: loss sum, examples, non-finite examples (on the device: no host sync)
        self._window += stats.select("loss_sum", "examples", "nonfinite").to(self._window.device)
        self.last_stats = stats
        return stats

    def _checkpoint_due(self) -> bool:
        """Every ``train.checkpoint_every_steps`` steps, and once ``train.checkpoint_every_minutes``
        have passed since the last checkpoint (agreed by all ranks: saving is collective)."""
        train = self.config.train
        every = train.checkpoint_every_steps
        if every and self.step % every == 0:
            return True
        minutes = train.checkpoint_every_minutes
        if minutes is None:
            return False
        return self.dist.any(time.perf_counter() - self._saved_at >= 60.0 * minutes)

    def load_window(self, window: dict[str, Any]) -> None:
        """Set the train-loss window (loss sum, examples, non-finite examples since the last evaluation)."""
        self._window = run_state.window_tensor(window, self.built.device)

    def window_as_dict(self) -> dict[str, float | int]:
        loss_sum, examples, nonfinite = self._window.tolist()
        return {"loss_sum": loss_sum, "examples": int(examples), "nonfinite_examples": int(nonfinite)}

    def evaluate_and_log(self) -> dict[str, Any] | None:
        """Evaluate and append to metrics.jsonl (rank 0; other ranks only reset the window)."""
        record = report.evaluation_record(self.built, self.progress, self.window_as_dict(), self.log) if self.dist.is_main else None
        self.load_window({"loss_sum": 0.0, "examples": 0, "nonfinite_examples": 0})
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
            summary = report.write_summary(self.built, self.progress, self.run_dir, last, self.privacy_warnings())
        return self.dist.broadcast_object(summary)

    def log(self, message: str) -> None:
        """A line of the run's report (stderr; off with ``report=False``)."""
        if self.report:
            tqdm.write(message, file=sys.stderr)

    def announce(self, message: str) -> None:
        """A line the user must see even with the report off: how their run was continued."""
        if init_distributed(self.config.run.device).is_main:  # also before the run is built
            tqdm.write(message, file=sys.stderr)

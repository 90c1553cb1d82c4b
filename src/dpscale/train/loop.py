"""The DP-SGD training loop of a run built by ``build_run``: the steps, the evaluations and
checkpoints that are due, and Ctrl-C. Read ``Trainer.run`` top to bottom."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from tqdm import tqdm

from dpscale.config import Config
from dpscale.data.run_data import data_workers
from dpscale.data.stream import StreamFeed
from dpscale.privacy.plan import DPPlan
from dpscale.runs import DAMAGED_CHECKPOINT_NAME, METRICS_NAME
from dpscale._io import CHECKPOINT_NAME, save_checkpoint
import dpscale.train.report as report
import dpscale.train.session as session
import dpscale.train.state as run_state
from dpscale.train.build import Run, build_run
from dpscale.train.distributed import Distributed, init_distributed, rank_stream_seed
from dpscale.train.hooks import RunHooks
from dpscale.train.interrupt import DeferredInterrupt
from dpscale.train.mechanism import DPMechanism
from dpscale.train.metrics import MetricsLog
from dpscale.train.rundir import RunLock
from dpscale.train.step import physical_chunks
from dpscale.train.units import AugmentViews, chunk_size_for, streamed_chunks, user_step_chunks
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
        step: logical steps taken; run_dir: the run directory.
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
        self._lock: RunLock | None = None  # the run directory's, held by create/resume until run returns
        self.config = config
        self.run_dir = Path(config.run.out_dir) if config.run.out_dir is not None else None
        is_main = init_distributed(config.run.device).is_main  # only rank 0 prints and writes
        self.progress, self.report = progress and is_main, (progress if report is None else report) and is_main
        self.built: Run = build_run(
            config, hooks or RunHooks(), log=self.log, progress=self.progress, saved_plan=plan, feature_norm=feature_norm
        )
        self.start_rank_streams(0)
        self.augtest_seed = self.built.seeds["augtest"]  # test views: the same at every evaluation
        self.metrics = MetricsLog(self.run_dir / METRICS_NAME)
        self.step, self.wall_time_s = 0, 0.0
        self.load_window({"loss_sum": 0.0, "examples": 0, "nonfinite_examples": 0})
        self._saved_at = time.perf_counter()  # when the checkpoint was last written (perf_counter s)
        self._privacy_warnings: list[str] | None = None  # computed on first use
        self.warnings_shown = False  # printed at the start of this session's run (so not again at its end)
        self.config_changes: list[dict[str, Any]] = []  # asked for with --set on resume
        self.damaged_checkpoint: Path | None = None  # a damaged newest checkpoint, set aside at the next save
        self._checkpoint_step: int | None = None  # the step of the last checkpoint this process wrote or read
        self.data_wait_s = 0.0  # streaming: time this process waited for chunks (s), this session
        self.board: RunBoard | None = None  # TensorBoard events (run.tensorboard), while ``run`` runs

    # The parts the loop and its callers read most.
    plan = property(lambda self: self.built.plan, doc="The frozen DP plan.")
    model = property(lambda self: self.built.model, doc="The model being trained.")
    mechanism: DPMechanism = property(lambda self: self.built.mechanism, doc="Sampler, noise, accountant.")  # type: ignore[assignment]
    dist: Distributed = property(lambda self: self.built.dist, doc="The process group.")  # type: ignore[assignment]
    data = property(lambda self: self.built.data, doc="Training and test data.")
    total_steps = property(lambda self: self.built.total_steps, doc="S, the planned steps.")

    def start_rank_streams(self, start_step: int) -> None:
        """Fresh sampling and augmentation streams for this rank, for a job of P processes that
        starts (or restarts with a different P) at ``start_step``; at a restart, fresh noise too
        (see ``run_state.restore``). Augmentation's is a CPU torch generator (not privacy-relevant)."""
        rank, world, seeds = self.dist.rank, self.dist.world_size, self.built.seeds
        if start_step:
            self.mechanism.restart_streams(
                sampler_seed=rank_stream_seed(seeds["sampler"], rank, world, start_step),
                noise_seed=run_state.fresh_noise_seed(self, start_step),
            )  # fmt: skip
        self.feed: StreamFeed | None = None  # streaming: started at the first step
        augment_seed = rank_stream_seed(seeds["augment"], rank, world, start_step)
        self.augment_generator = torch.Generator().manual_seed(augment_seed % 2**64)  # torch takes 64 bits

    @classmethod
    def create(cls, config: Config, progress: bool = True, hooks: RunHooks | None = None, report: bool | None = None) -> "Trainer":
        """Start a new run in ``config.run.out_dir`` (``hooks``: an audit's canaries, see ``RunHooks``).

        Refuses a directory that holds a checkpointed run or that another process trains in; what a
        run that stopped before its first checkpoint left there is cleared. The directory stays
        locked until ``run`` returns; a start that fails leaves nothing behind.
        """
        return session.start(cls, config, progress, hooks, report)

    @classmethod
    def load(cls, run_dir: str | Path, progress: bool = False) -> "Trainer":
        """The run in ``run_dir`` at its checkpoint, read-only (nothing in the directory changes)."""
        return session.load(cls, run_dir, progress)

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
        return session.resume(cls, run_dir, progress, overrides, report)

    def hold(self, lock: RunLock | None) -> None:
        """Keep the run directory's ``lock`` until ``run`` returns (``close``)."""
        self._lock = lock

    def close(self) -> None:
        """Close the TensorBoard events, release the run directory's lock (``run`` does; safe twice)."""
        if self.board is not None:
            self.board, board = None, self.board
            board.close()
        if self._lock is not None:
            self._lock.release()

    def __del__(self) -> None:
        lock = getattr(self, "_lock", None)
        if lock is not None:
            try:
                lock.release()
            except Exception:  # at interpreter exit; the OS drops the lock with the process anyway
                pass

    def state(self) -> dict[str, Any]:
        """The checkpoint (``dpscale.checkpoint_format``); collective with P processes."""
        return run_state.training_state(self)

    def load_state(self, saved: dict[str, Any]) -> None:
        """Continue from a checkpoint's state (current layout: ``load_checkpoint`` migrates)."""
        run_state.restore(self, saved)
        self._checkpoint_step = self.step

    def sampler_state(self) -> dict[str, Any]:
        """The sampler's state before the next step's draw (a stream draws batches ahead)."""
        return self.feed.sampler_state(self.step) if self.feed is not None else self.mechanism.sampler.state_dict()

    def save(self) -> None:
        """Write the checkpoint (rank 0; collective with P processes, so every rank calls it).

        Raises:
            OSError: the checkpoint could not be written (e.g. a full disk), saying that the
                previous one is intact.
        """
        saved = self.state()
        if self.dist.is_main:
            path = self.run_dir / CHECKPOINT_NAME
            if self.damaged_checkpoint is not None:  # never keep a damaged file as the previous checkpoint
                os.replace(self.damaged_checkpoint, self.run_dir / DAMAGED_CHECKPOINT_NAME)
                self.damaged_checkpoint = None
            try:
                save_checkpoint(path, saved)
            except OSError as err:
                kept = (
                    "no earlier checkpoint"
                    if self._checkpoint_step is None
                    else f"the checkpoint of step {self._checkpoint_step} is intact"
                )
                raise OSError(f"cannot write {path} at step {self.step}: {err.strerror or err}; {kept}") from err
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
        if self._lock is not None:
            self._lock.acquire()  # again, for a second call of run (the first released it)
        try:
            return self._run_locked(stop)
        finally:
            self.close()

    def _run_locked(self, stop: int) -> dict[str, Any] | None:
        """``run`` while holding the run directory's lock."""
        self._print_plan()
        self.board = self.board or open_board(self)
        bar = tqdm(
            total=self.total_steps, initial=self.step, disable=not self.progress, file=sys.stderr, desc="train",
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
            self._stop_feed()
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
        self.log(self.plan.describe())
        self.log("\n".join(line for line in (self.plan.meaning(), self.plan.planned_odds()) if line))
        for note in self.plan.caveats() + self.privacy_warnings():
            self.log(f"WARNING: {note}")
        self.warnings_shown = self.report

    def _step_evaluate_save(self, bar: Any) -> None:
        """One step, then the evaluation and checkpoint that are due, then the progress bar."""
        started = time.perf_counter()
        self.train_step()
        report.log_new_clip_methods(self)
        if self.board is not None:
            self.board.after_step(self, 1000 * (time.perf_counter() - started))
        evaluated = self._eval_due()
        if evaluated:
            self.wall_time_s += time.perf_counter() - started
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
        self.wall_time_s += time.perf_counter() - started
        bar.update(1)
        # Reading the step's loss waits for the device: only when the bar is redrawn.
        bar_state = self._bar_state
        if self.progress and (evaluated or time.perf_counter() - bar_state["reported_at"] > EPSILON_REFRESH_S):
            bar_state["epsilon"], bar_state["reported_at"] = self.epsilon(), time.perf_counter()
            loss = self.last_stats.loss_sum / max(1, self.last_stats.examples)
            bar.set_postfix(loss=f"{loss:.3f}", eps=report.format_epsilon(bar_state["epsilon"]), refresh=False)

    def train_step(self) -> None:
        """Sample a logical batch, take one private step, account for it."""
        reduce = self.dist.all_reduce_sum_ if self.dist.enabled else None
        # clip, noise once, / B, optimizer and scheduler step, account
        stats = self.mechanism.step_drawn_chunks(self._train_chunks(), all_reduce_sum=reduce, add_noise=self.dist.adds_noise)
        if self.built.ema is not None:
            self.built.ema.update(self.model)
        self.step += 1
        # the window's order: loss sum, examples, non-finite examples (on the device: no host sync)
        self._window += stats.select("loss_sum", "examples", "nonfinite").to(self._window.device)
        self.last_stats = stats

    def _train_chunks(self) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        """The sampler's next batch as physical chunks on the device (K views per example; whole users' rows)."""
        data, device, augment = self.data, self.built.device, self.config.augment
        views = AugmentViews(augment.type, augment.multiplicity, self.augment_generator, self.built.value_range)
        plan, physical = self.mechanism.plan, self.config.train.max_physical_batch_size
        if plan.user_level and not self.built.streamed:
            return user_step_chunks(self.mechanism.sampler.sample_units(), data, plan, physical, views)
        chunk_size = chunk_size_for(plan, physical, augment.multiplicity)  # examples (users) per chunk
        if not self.built.streamed:
            indices = self.mechanism.sampler.sample()
            if device.type == "cuda":  # pinned, so the copy does not wait for the device's queue
                indices = indices.pin_memory().to(device, non_blocking=True)
            return views.chunks(physical_chunks(data.x_train, data.y_train, indices, chunk_size))
        if self.feed is None:
            self.feed = StreamFeed(
                data, self.mechanism.sampler, chunk_size=chunk_size, start_step=self.step, total_steps=self.total_steps,
                device=device, workers=data_workers(self.config), prefetch=self.config.data.prefetch,
            )  # fmt: skip
        return streamed_chunks(self.feed.chunks(self.step), plan, views)

    def _stop_feed(self) -> None:
        """Stop the stream's workers now (left to the garbage collector, each takes seconds to
        shut down) and put the sampler back before the next step's draw."""
        if self.feed is not None:
            self.data_wait_s += self.feed.wait_s
            self.feed.close(self.step)
            self.feed = None

    def _eval_due(self) -> bool:
        """True at the last step and whenever another ``train.eval_every_epochs`` has passed
        (epochs of the reference run for a TAN simulation, so both evaluate at the same steps)."""
        if self.step == self.total_steps:
            return True
        every = self.config.train.eval_every_epochs
        batch = self.plan.simulation.batch_size if self.plan.simulation else self.plan.batch_size
        period = lambda step: math.floor(step * batch / self.plan.dataset_size / every + 1e-9)  # noqa: E731
        return period(self.step) > period(self.step - 1)

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
        record = report.evaluation_record(self, self.window_as_dict()) if self.dist.is_main else None
        self.load_window({"loss_sum": 0.0, "examples": 0, "nonfinite_examples": 0})
        if record is not None:
            self.metrics.append(record)
            if self.board is not None:
                self.board.evaluation(record)
        return record

    def evaluate_model(self, model: torch.nn.Module) -> tuple[float, float]:
        """Accuracy and mean loss of ``model`` on the test set."""
        return report.evaluate_model(self, model)

    def extra_evaluations(self) -> dict[str, float]:
        """EMA-model and AugTest accuracies, when configured."""
        return report.extra_evaluations(self)

    def epochs_done(self, step: int) -> float:
        """Epochs after ``step`` steps: step * B / N (an epoch is N / B expected-size batches)."""
        return step * self.plan.batch_size / self.plan.dataset_size

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
        summary = report.write_summary(self) if self.dist.is_main else None
        return self.dist.broadcast_object(summary)

    def log(self, message: str) -> None:
        """A line of the run's report (stderr; off with ``report=False``)."""
        if self.report:
            tqdm.write(message, file=sys.stderr)

    def announce(self, message: str) -> None:
        """A line the user must see even with the report off: how their run was continued."""
        if init_distributed(self.config.run.device).is_main:  # also before the run is built
            tqdm.write(message, file=sys.stderr)

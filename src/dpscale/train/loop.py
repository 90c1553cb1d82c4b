"""The training run: set-up from a config, the DP-SGD loop, checkpoints, resume, summary."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar

import numpy as np
import torch
from tqdm import tqdm

from dpscale.config import Config, ConfigError, is_private_config, save_config
from dpscale.data import ImageDataset, dataset_fingerprint, load_dataset
from dpscale.data.subsets import random_classes, select as select_classes
from dpscale.data.stream import StreamedData, StreamFeed, default_workers, eval_batches, materialize, open_stream
from dpscale.features.extract import read_source_run
from dpscale.features.normalize import FeatureNormalizer
from dpscale.features.pipeline import (
    extract_run_features,
    extractor_privacy,
    feature_releases,
    fit_normalizer,
    normalize_dataset,
)
from dpscale.models import build_model, count_parameters, freeze_block_groups
from dpscale.models.init import init_from, init_privacy, meanvar_init, read_weights
from dpscale.privacy.accountant import AccountingSegment, PrivacyAccountant
from dpscale.privacy.per_example import PerExampleEngine, check_per_example_compatible
from dpscale.privacy.precision import make_precision
from dpscale.privacy.self_check import SELF_CHECK_EXAMPLES, SelfCheckResult, checked_engine
from dpscale.privacy.plan import GUARANTEE_SCOPE, DPPlan, SourceRunPrivacy, steps_for
from dpscale.train.plan_config import check_plan_against_config, plan_from_config
from dpscale.rng import DPRandom, noise_generator
from dpscale.train.checkpoint import CHECKPOINT_NAME, atomic_write_text, save_checkpoint
from dpscale.train.rundir import (  # noqa: F401 - the file names, re-exported for callers
    AUDIT_NAME,
    CONFIG_NAME,
    DAMAGED_CHECKPOINT_NAME,
    METRICS_NAME,
    SUMMARY_NAME,
    RunLock,
    check_config_edits,
    default_out_dir,
    holds_run,
    latest_checkpoint,
    open_new_run,
    read_run,
    read_run_config,
)
from dpscale.train.distributed import NOISE_RANK, Distributed, init_distributed, rank_stream_seed
from dpscale.train.ema import WeightEMA
from dpscale.train.metrics import MetricsLog, evaluate, evaluate_augtest, evaluate_batches, json_safe
from dpscale.train.optim import build_optimizer, build_scheduler
from dpscale.train.hooks import RunHooks
from dpscale.train.mechanism import DPMechanism, independence_check, run_seeds
from dpscale.train.step import augmented_chunks, physical_chunks

SEED_MODEL_RUN = "init-seed-run"  # label of a Mean-Var seed run's releases in this run's accountant
# How often the progress bar's epsilon is recomputed between evaluations (PLD takes ~0.5 s).
EPSILON_REFRESH_S = 10.0


class _DeferredInterrupt:
    """Turns Ctrl-C and SIGTERM (preemption) into a request honoured between steps, so the
    checkpoint written on interrupt is never taken halfway through a step (e.g. after the
    update but before the accountant saw it). A second signal interrupts immediately."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "_DeferredInterrupt":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


_seeds = run_seeds  # the run's seeds (one definition, with the mechanism)


FRESH_NOISE_ON_RESUME = (
    "run.seed is null: the noise continues from fresh OS entropy, so no two continuations of this checkpoint share "
    "noise (release one; releasing two continuations of one checkpoint composes both)"
)


def _torch_generator_streams(state: dict[str, Any]) -> bool:
    """True for a checkpoint written before DPRandom: its noise or sampler generator states are
    torch ByteTensors (32-bit-seeded mt19937), which a DPRandom cannot continue, and should not."""
    streams = state.get("rank_streams") or [{"sampler": state.get("sampler") or {}}]
    generators = [state.get("noise_generator"), *(s["sampler"].get("generator") for s in streams)]
    return any(isinstance(g, torch.Tensor) for g in generators)


def prepare_data(config: Config, device: torch.device, data: ImageDataset | None = None) -> ImageDataset:
    """The whole dataset in memory on ``device`` (data.loader=memory): loaded (unless ``data``
    is given, already decoded), class-selected and scaled as the config says."""
    cfg = config.data
    if data is None:
        data = load_dataset(
            cfg.name, cfg.root, image_size=cfg.image_size, val_labels=cfg.val_labels, skip_corrupt=cfg.skip_corrupt,
            workers=_workers(config),
        )
    if cfg.selects_classes:
        classes = cfg.classes
        if cfg.random_classes:
            classes = random_classes(data.info.num_classes, cfg.random_classes, cfg.subset_seed)
        data = select_classes(
            data, classes=classes, meta_classes=cfg.meta_classes, max_per_class=cfg.max_per_class, seed=cfg.subset_seed
        )
    x_train, x_test = data.x_train, data.x_test
    if config.data.normalize:  # data-independent constants: no privacy cost
        x_train, x_test = (x_train - 0.5) / 0.5, (x_test - 0.5) / 0.5
    return ImageDataset(
        x_train.to(device), data.y_train.to(device), x_test.to(device), data.y_test.to(device), data.info
    )


def _workers(config: Config) -> int:
    return default_workers() if config.data.workers is None else config.data.workers


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def open_training_data(config: Config, device: torch.device, log: Any = print) -> ImageDataset | StreamedData:
    """The run's data: in memory, or streamed from disk (data.loader; "auto" streams when the
    decoded float32 training and test sets would take more than a quarter of physical memory)."""
    cfg = config.data
    loader = cfg.loader
    if loader == "auto" and cfg.name in ("imagefolder", "shards") and cfg.root is not None:
        streamed = _open_stream(config)
        info = streamed.info
        decoded = 4 * (info.num_train + info.num_test) * int(np.prod(info.input_shape))
        memory = _physical_memory_bytes()
        if memory and decoded > memory / 4 and config.features.extractor is None and config.features.normalize == "none" and not config.eval.augtest:
            log(f"data.loader=auto: streaming {cfg.root} from disk (decoded it would take {decoded / 2**30:.1f} GiB of {memory / 2**30:.1f} GiB)")
            return streamed
        return prepare_data(config, device, materialize(streamed))  # decoded from the listing already made
    if loader == "stream":
        return _open_stream(config)
    return prepare_data(config, device)


def _open_stream(config: Config) -> StreamedData:
    cfg = config.data
    if cfg.root is None:
        raise ConfigError(f"data.loader=stream needs data.root (the image folder or prepared shards)")
    return open_stream(
        cfg.name, cfg.root, image_size=cfg.image_size, normalize=cfg.normalize, val_labels=cfg.val_labels,
        skip_corrupt=cfg.skip_corrupt, workers=_workers(config),
    )


def training_fingerprint(config: Config, normalize: bool | None = None) -> str:
    """``dataset_fingerprint`` of the training images a run with ``config`` prepares (on the CPU).

    Args:
        config: the run's config.
        normalize: the data.normalize to prepare them with (None: the config's own).

    Returns:
        The fingerprint, as checkpoints store it in ``data_fingerprint``.
    """
    if normalize is not None:
        config = replace(config, data=replace(config.data, normalize=normalize))
    return dataset_fingerprint(prepare_data(config, torch.device("cpu")))


class Trainer:
    """A DP-SGD run in a run directory. Build with ``Trainer.create`` or ``Trainer.resume``.

    Args:
        config: the resolved config (``run.out_dir`` set).
        progress: show a progress bar (to stderr).
        report: print the header, evaluations, warnings and result lines (to stderr); default: ``progress``.
        plan: a DP plan saved in a checkpoint (skips calibration; checked against config and data).
        feature_norm: a feature normaliser's state saved in a checkpoint (its private statistics
            are reused, never drawn again: a second draw would be a second release).
        hooks: an audit's canaries and observer (``dpscale.audit``); None for a plain run.
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
        self.config = config
        self.hooks = hooks or RunHooks()
        self._lock: RunLock | None = None  # the run directory's, held by create/resume until run returns
        self._setup_process(progress, progress if report is None else report)
        info = self._setup_data_and_plan(plan, feature_norm)
        self._setup_model(info, initial_weights=plan is None)  # a resumed run's weights come from its checkpoint
        self._setup_state()

    def _setup_process(self, progress: bool, report: bool) -> None:
        """Processes, device, run directory and the run's seeds."""
        config = self.config
        # Data parallel under torchrun (P processes), else a single process; only rank 0 prints and writes.
        self.dist: Distributed = init_distributed(config.run.device)
        if self.dist.enabled and config.dp.sampling != "poisson":
            raise ConfigError("distributed training needs dp.sampling=poisson (each rank samples its own shard)")
        self.progress = progress and self.dist.is_main
        self.report = report and self.dist.is_main
        if config.run.out_dir is None:
            raise ConfigError("run.out_dir must be set (the CLI picks runs/<model>-<data>-<time>)")
        self.run_dir = Path(config.run.out_dir)
        if config.run.threads:
            torch.set_num_threads(config.run.threads)
        device = config.run.device
        if self.dist.enabled and device == "cuda":
            device = f"cuda:{self.dist.local_rank}"  # one GPU per process
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"run.device={config.run.device} but this torch build has no usable CUDA device")
        self._seeds = self.dist.broadcast_object(_seeds(config.run.seed))  # fresh entropy: rank 0's, for all

    def _setup_data_and_plan(self, plan: DPPlan | None, feature_norm: dict[str, Any] | None) -> Any:
        """Data (in memory or streamed), features, the DP plan (new, or a checkpoint's checked)
        and the feature normaliser; returns the dataset info."""
        config = self.config
        images = open_training_data(config, self.device, self._log)
        self.streamed = isinstance(images, StreamedData)
        # of the images: features may differ in the last bit
        self.data_fingerprint = images.fingerprint if self.streamed else dataset_fingerprint(images)
        if images.info.skipped_files:
            self._log(
                f"data.skip_corrupt: left out {len(images.info.skipped_files)} unreadable file(s), e.g. "
                f"{images.info.skipped_files[0]}; N = {images.info.num_train} readable training images"
            )
        # Before extracting: a source run (checkpoint extractor, model.init) that cannot be composed is refused at once.
        private = is_private_config(config.dp)
        extractor, extractor_releases = extractor_privacy(config.features, self._fingerprint_as, private)
        init_run, init_releases = init_privacy(config.model, self._fingerprint_as, private)
        with self.dist.main_first():  # rank 0 fills the feature cache, the others read it
            features = extract_run_features(config.features, images, self.device, self.progress, self._log)
        del images
        if self.hooks.training_set is not None:  # an audit's canaries: before the plan, so N counts them
            features = self.hooks.training_set(features)
        n = features.info.num_train
        self.total_steps = steps_for(config.train.epochs, config.train.steps, n, config.dp.batch_size)
        loading = plan is not None  # from a checkpoint
        releases = extractor_releases + init_releases + feature_releases(config.features) + self._seed_model_releases()
        self.plan: DPPlan = self._resolve_plan(plan, n, releases, extractor, init_run)
        if loading and (feature_norm or {}).get("kind", "none") != config.features.normalize:
            raise ConfigError(
                f"the checkpoint's feature normalisation ({(feature_norm or {}).get('kind', 'none')}) is not "
                f"features.normalize={config.features.normalize} of its config; refusing to continue it"
            )
        self.feature_normalizer = self._feature_normalizer(features, feature_norm)
        self.data = normalize_dataset(features, self.feature_normalizer)
        return features.info

    def _seed_model_releases(self) -> tuple[AccountingSegment, ...]:
        """Mean-Var init releases statistics of its seed model, which trained on private data: that
        run's whole accounting history, composed into this run's plan (unless declared public)."""
        model = self.config.model
        if model.init_scaling != "meanvar" or model.init_seed_public:
            return ()
        source = read_source_run(model.init_seed_model)
        if not source.private:
            raise ConfigError(
                f"model.init_seed_model={model.init_seed_model} trained without privacy: its Mean-Var statistics would "
                "release its training data without a guarantee; use a private seed run, or set "
                "model.init_seed_public=true if its training data is public"
            )
        return tuple(replace(seg, label=f"{SEED_MODEL_RUN}:{seg.label}") for seg in source.history)

    def _feature_normalizer(self, features: Any, saved: dict[str, Any] | None) -> FeatureNormalizer:
        """A checkpoint's normaliser (its private statistics reused, never drawn again), or a new one."""
        if saved is not None:
            return FeatureNormalizer.from_state_dict(saved)
        # Data Normalization's noise: 128-bit seed, or the OS CSPRNG with dp.secure_noise
        generator = noise_generator(self._seeds["features"], self.config.dp.secure_noise)
        # a stream has features.normalize=none (config validation): nothing to fit
        normalizer = FeatureNormalizer() if self.streamed else fit_normalizer(self.config.features, features.x_train, self.plan, generator)
        if not self.dist.enabled:
            return normalizer
        # One release, whatever P: every rank uses rank 0's noisy statistics.
        return FeatureNormalizer.from_state_dict(self.dist.broadcast_object(normalizer.state_dict()))

    def _setup_model(self, info: Any, initial_weights: bool) -> None:
        """Model (seeded init or model.init, frozen groups), the checked engine, optimizer,
        scheduler and the DP mechanism."""
        config = self.config
        torch.manual_seed(self._seeds["init"])
        self.model = build_model(
            config.model.name, info.num_classes, info.input_shape, config.model.activation, **config.model.kwargs
        )
        self.init_report: dict[str, Any] | None = None
        if config.model.init and initial_weights:
            report = init_from(self.model, config.model.init, reset_head=config.model.reset_head)
            self.init_report = asdict(report)
            self._log(report.describe())
        if config.model.init_scaling == "meanvar" and initial_weights:
            counts = meanvar_init(
                self.model, read_weights(config.model.init_seed_model), torch.Generator().manual_seed(self._seeds["init"])
            )
            self.init_report = {"source": config.model.init_seed_model, "scaling": "meanvar", **counts}
            self._log(f"model.init_scaling=meanvar: {counts['scaled']} tensors drawn with the statistics of "
                      f"{config.model.init_seed_model} ({counts['kept']} kept at their default init)")  # fmt: skip
        self.model.to(self.device)
        check_per_example_compatible(self.model)
        if config.model.freeze_groups:
            freeze_block_groups(self.model, config.model.freeze_groups)
        self.dist.broadcast_module_(self.model)  # identical already (same seed); made certain
        self.precision = make_precision(config.train.precision, config.train.fp16_loss_scale)
        self.engine, self.self_check = self._checked_engine()
        if self.hooks.engine is not None:
            self.engine = self.hooks.engine(self.engine, self.model)
        self.optimizer = build_optimizer(config.optim, [p for p in self.model.parameters() if p.requires_grad])
        self.scheduler = build_scheduler(config.optim, self.optimizer, self.total_steps)
        # The DP mechanism keeps sampler, noise and accountant in step (the releases made above,
        # e.g. Data Normalization, recorded before any step). Only the noise rank (NOISE_RANK) draws
        # noise; its generator's state is the one checkpointed. Noise is drawn on the host, then
        # copied to the device: the same noise on CPU and CUDA.
        self.mechanism = DPMechanism(
            self.model, self.optimizer, self.plan, self.engine, scheduler=self.scheduler, noise_seed=self._seeds["noise"],
            sampler_seed=rank_stream_seed(self._seeds["sampler"], self.dist.rank, self.dist.world_size, 0),
            rank=self.dist.rank, world_size=self.dist.world_size,
            # in train mode, on the first real training chunk (the set-up check saw a few examples)
            first_chunk_check=independence_check if config.train.self_check and self.plan.is_private else None,
        )  # fmt: skip
        self.mechanism.observer = self.hooks.observe_gradient
        self._start_rank_streams(0)
        self.ema = WeightEMA(self.model, config.train.ema_decay) if config.train.ema_decay else None

    def _setup_state(self) -> None:
        """The loop's own state: step, clocks, metrics log, the train-loss window."""
        self.augtest_seed = self._seeds["augtest"]  # test views: the same at every evaluation
        self.metrics = MetricsLog(self.run_dir / METRICS_NAME)
        self.step = 0
        self.wall_time_s = 0.0
        self._reset_window()
        self._saved_at = time.perf_counter()  # when the checkpoint was last written (perf_counter s)
        self._privacy_warnings: list[str] | None = None  # computed on first use
        self.warnings_shown = False  # printed at the start of this session's run (so not again at its end)
        self.config_changes: list[dict[str, Any]] = []  # asked for with --set on resume
        self._damaged_checkpoint: Path | None = None  # a damaged newest checkpoint, set aside at the next save
        self._checkpoint_step: int | None = None  # the step of the last checkpoint this process wrote or read
        self.data_wait_s = 0.0  # streaming: time this process waited for chunks (s), this session

    def _resolve_plan(
        self,
        plan: DPPlan | None,
        dataset_size: int,
        releases: tuple[AccountingSegment, ...],
        extractor: SourceRunPrivacy | None,
        init_run: SourceRunPrivacy | None = None,
    ) -> DPPlan:
        """A new run's plan, or the checkpoint's ``plan`` checked against the config and data
        (a changed source run is refused: its releases differ).
        Either way with the labels the config determines (a fixed seed, the checkpoint
        extractor's and the model.init run's cases): they are no privacy parameters, and older
        checkpoints lack them."""
        dp, seeded = self.config.dp, self.config.run.seed is not None
        unchecked = not self.config.train.self_check
        if plan is None:
            plan = plan_from_config(dp, dataset_size, self.total_steps, releases, seeded=seeded, extractor=extractor)
        else:
            check_plan_against_config(plan, dp, dataset_size, self.total_steps, releases)
        return replace(
            plan, seeded=seeded, extractor=extractor, init_run=init_run, engine_unchecked=unchecked,
            secure_noise=dp.secure_noise,
        )

    def _fingerprint_as(self, normalize: bool) -> str:
        """This run's training-set fingerprint as prepared with data.normalize=``normalize`` (a
        checkpoint extractor's run may have used the other convention on the same images)."""
        if normalize == self.config.data.normalize:
            return self.data_fingerprint
        return training_fingerprint(self.config, normalize)

    def _checked_engine(self) -> tuple[PerExampleEngine, SelfCheckResult | None]:
        """The clipping engine, verified before the first step on the first few training
        examples (their K views drawn from a fixed generator: the run's streams are untouched)."""
        train, augment = self.config.train, self.config.augment
        k = min(SELF_CHECK_EXAMPLES, len(self.data.y_train))
        chunk = self.data.head(k, self.device) if self.streamed else (self.data.x_train[:k], self.data.y_train[:k])
        if augment.multiplicity > 1:
            views = augmented_chunks([chunk], augment.type, augment.multiplicity, torch.Generator().manual_seed(0), self.value_range)
            chunk = next(iter(views))
        try:
            engine, notices, result = checked_engine(
                train.engine, self.plan.max_grad_norm, self.model, chunk,
                # a non-private run claims no guarantee for the check to protect (and its unclipped,
                # cancelling gradient sums are where float32 reorderings look largest)
                views=augment.multiplicity, check=train.self_check and self.plan.is_private, precision=self.precision,
            )
        except ValueError as err:
            raise ConfigError(f"train.engine={train.engine}: {err}") from None
        checks = [result, result.independence] if result else []
        for note in notices + [check.describe() for check in checks if check is not None]:
            self._log(note)
        return engine, result

    @property
    def sampler(self) -> Any:
        return self.mechanism.sampler

    @sampler.setter
    def sampler(self, sampler: Any) -> None:
        self.mechanism.sampler = sampler

    @property
    def noise_generator(self) -> DPRandom:
        return self.mechanism.noise_generator

    @noise_generator.setter
    def noise_generator(self, generator: DPRandom) -> None:
        self.mechanism.noise_generator = generator

    @property
    def accountant(self) -> PrivacyAccountant:
        return self.mechanism.accountant

    def _start_rank_streams(self, start_step: int) -> None:
        """This rank's sampler and augmentation generators, fresh for a job of P processes that
        starts (or restarts with a different P) at ``start_step``. CPU generators: the same draws
        on any device. The sampler's is a 128-bit-seeded DPRandom (which examples join a batch
        is private); augmentation's a torch generator (not privacy-relevant)."""
        rank, world = self.dist.rank, self.dist.world_size
        sampler_seed = rank_stream_seed(self._seeds["sampler"], rank, world, start_step)
        self.sampler = self.plan.make_sampler(DPRandom(sampler_seed), rank, world)
        self._feed: StreamFeed | None = None  # streaming: started at the first step
        augment_seed = rank_stream_seed(self._seeds["augment"], rank, world, start_step)
        self.augment_generator = torch.Generator().manual_seed(augment_seed % 2**64)  # torch takes 64 bits

    # ----------------------------------------------------------------- set-up
    @classmethod
    def create(
        cls, config: Config, progress: bool = True, hooks: RunHooks | None = None, report: bool | None = None
    ) -> "Trainer":
        """Start a new run in ``config.run.out_dir`` (``hooks``: an audit's canaries, see ``RunHooks``).

        Refuses a directory that holds a checkpointed run or that another process trains in; what a
        run that stopped before its first checkpoint left there is cleared. The directory stays
        locked until ``run`` returns; a start that fails leaves nothing behind.
        """
        dist = init_distributed(config.run.device)
        start = _on_main(dist, lambda: open_new_run(config.run.out_dir))
        try:
            trainer = cls(config, progress, hooks=hooks, report=report)
            if start is not None and start.cleared:
                trainer._log(f"{trainer.run_dir} held a run that stopped before its first checkpoint: cleared its "
                             f"{', '.join(start.cleared)} and started again")  # fmt: skip
            _on_main(dist, lambda: start.claim(config))
        except BaseException:
            if start is not None:
                start.abandon()
            raise
        trainer._lock = start.lock if start is not None else None
        return trainer

    @classmethod
    def load(cls, run_dir: str | Path, progress: bool = False) -> "Trainer":
        """The run in ``run_dir`` at its checkpoint, read-only (nothing in the directory changes)."""
        _refuse_audit_run(run_dir)
        config, state = read_run(run_dir)
        check_config_edits(Path(run_dir), state.get("config"), config, (), int(state["step"]))
        trainer = cls(config, progress, plan=DPPlan(**state["plan"]), feature_norm=state.get("feature_norm"))
        trainer.load_state(state)
        return trainer

    @classmethod
    def resume(
        cls, run_dir: str | Path, progress: bool = True, overrides: Sequence[str] = (), report: bool | None = None
    ) -> "Trainer":
        """Continue the run in ``run_dir`` from its newest intact checkpoint, exactly where it stopped.

        Args:
            overrides: ``section.key=value`` changes asked for explicitly (``--set`` on resume),
                recorded in the run; config.yaml edited in any other setting is refused.

        The directory is locked (another process training in it is refused) until ``run`` returns.
        A run that stopped before its first checkpoint starts again from step 0; a damaged newest
        checkpoint is set aside for the previous one when that is intact.
        """
        run_dir = Path(run_dir)
        _refuse_audit_run(run_dir)
        config = read_run_config(run_dir, overrides)
        dist = init_distributed(config.run.device)
        lock = RunLock(run_dir)
        _on_main(dist, lock.acquire)
        try:
            trainer = cls._continue(run_dir, config, progress, overrides, report)
        except BaseException:
            lock.release()
            raise
        trainer._lock = lock if dist.is_main else None  # rank 0 holds it for the job
        return trainer

    @classmethod
    def _continue(
        cls, run_dir: Path, config: Config, progress: bool, overrides: Sequence[str], report: bool | None
    ) -> "Trainer":
        """``resume`` under the lock: the newest intact checkpoint loaded, config edits checked."""
        latest = latest_checkpoint(run_dir)
        if latest.state is None:
            trainer = cls(config, progress, report=report)
            trainer._log(latest.note)
            if trainer.dist.is_main:
                trainer.metrics.truncate_after(0)
                if overrides:
                    save_config(config, run_dir / CONFIG_NAME)
            return trainer
        state = latest.state
        changes = check_config_edits(run_dir, state.get("config"), config, overrides, int(state["step"]))
        trainer = cls(config, progress, plan=DPPlan(**state["plan"]), feature_norm=state.get("feature_norm"), report=report)
        trainer.load_state(state)
        if latest.note:
            trainer._announce(latest.note)
        trainer._damaged_checkpoint = latest.damaged
        if trainer.dist.is_main:
            trainer.metrics.truncate_after(trainer.step)
        if changes:
            trainer._record_config_changes(changes)
        return trainer

    def _record_config_changes(self, changes: dict[str, tuple[Any, Any]]) -> None:
        """Keep the changes asked for on resume in the run: in the checkpoint (written now, so
        the next resume compares against the new values), config.yaml and the summary."""
        record = {"step": self.step, "changes": {k: {"from": old, "to": new} for k, (old, new) in changes.items()}}
        self.config_changes.append(record)
        listed = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())
        self._announce(f"changed on resume at step {self.step} (recorded in the run): {listed}")
        self.save()
        if self.dist.is_main:
            save_config(self.config, self.run_dir / CONFIG_NAME)

    def close(self) -> None:
        """Release the run directory's lock (``run`` does when it returns; safe to call twice)."""
        if self._lock is not None:
            self._lock.release()

    def __del__(self) -> None:
        lock = getattr(self, "_lock", None)
        if lock is not None:
            try:
                lock.release()
            except Exception:  # at interpreter exit; the OS drops the lock with the process anyway
                pass

    # ------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        """The checkpoint. Collective with P processes: gathers every rank's sampling streams."""
        streams = self.dist.all_gather_object(
            {"sampler": self._sampler_state(), "augment_generator": self.augment_generator.get_state()}
        )
        return {
            "world_size": self.dist.world_size,
            "rank_streams": streams,  # [rank 0's, rank 1's, ...]
            "step": self.step,
            "wall_time_s": self.wall_time_s,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "accountant": self.accountant.state_dict(),
            # the noise rank's (rank 0); an unseeded run resumes with fresh noise, so nothing to keep
            "noise_generator": self.noise_generator.state_dict() if self.plan.seeded else None,
            "augtest_seed": self.augtest_seed,
            "ema": self.ema.state_dict() if self.ema else None,
            "window": self._window_as_dict(),
            "plan": asdict(self.plan),
            "data_fingerprint": self.data_fingerprint,
            "feature_norm": self.feature_normalizer.state_dict(),
            "model_init": self.init_report,
            "config": self.config.to_dict(),  # a resume refuses config.yaml edited since (unless --set)
            "config_changes": self.config_changes,
        }

    def _sampler_state(self) -> dict[str, Any]:
        """The sampler's state before the next step's draw (a stream draws batches ahead)."""
        return self._feed.sampler_state(self.step) if self._feed is not None else self.sampler.state_dict()

    def load_state(self, state: dict[str, Any]) -> None:
        saved = DPPlan(**state["plan"])
        # the plan's labels (PLAN_LABELS) come from the config (absent in older checkpoints)
        if not self.plan.same_numbers(saved):
            raise ConfigError("the checkpoint was written under a different DP plan; refusing to resume")
        if state["data_fingerprint"] != self.data_fingerprint:
            raise ConfigError(
                f"the training data at data.root={self.config.data.root!r} differs from the data this run "
                "was trained on; refusing to resume"
            )
        self.model.load_state_dict(state["model"])
        self.init_report = state.get("model_init")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.accountant.load_state_dict(state["accountant"])  # replaces, never adds
        legacy = _torch_generator_streams(state)
        if self.dist.rank == NOISE_RANK and not legacy and self.plan.seeded:
            self.noise_generator.load_state_dict(state["noise_generator"])
        elif not self.plan.seeded and self.plan.is_private:
            self._log(FRESH_NOISE_ON_RESUME)
        self._load_rank_streams(state, legacy)
        if "augtest_seed" in state:  # absent in checkpoints from before augmentation existed
            self.augtest_seed = int(state["augtest_seed"])
        if self.ema is not None:
            if state.get("ema") is None:
                raise ConfigError("train.ema_decay is set but the checkpoint has no EMA of the weights")
            self.ema.load_state_dict(state["ema"])
        window = state["window"]  # nonfinite_examples: absent in checkpoints from before mixed precision
        self._window = torch.tensor(
            [float(window["loss_sum"]), float(window["examples"]), float(window.get("nonfinite_examples", 0))],
            dtype=torch.float64, device=self.device,
        )
        self.step = int(state["step"])
        self._checkpoint_step = self.step
        self.config_changes = list(state.get("config_changes", []))
        self.mechanism.steps_taken = self.step
        self.wall_time_s = float(state["wall_time_s"])
        if self.plan.is_private and self.accountant.steps != self.step:
            raise ValueError(f"checkpoint is inconsistent: step {self.step} but {self.accountant.steps} accounted")
        if self.accountant.releases != self.plan.releases:
            raise ValueError("checkpoint is inconsistent: its accountant's releases differ from the DP plan's")

    def _load_rank_streams(self, state: dict[str, Any], legacy: bool = False) -> None:
        """Continue this rank's sampling streams; with a different number of processes than the
        checkpoint's, or ``legacy`` torch generator states (32-bit seeded, from before DPRandom),
        start fresh streams at the checkpoint's step (never replaying used ones)."""
        saved_world = int(state.get("world_size", 1))
        if legacy or saved_world != self.dist.world_size:
            step = int(state["step"])
            self._start_rank_streams(step)
            # Fresh noise too: had a run resumed from this checkpoint been abandoned, the same
            # noise on other batches would otherwise cancel out between the two.
            self.noise_generator = noise_generator(
                rank_stream_seed(self._seeds["noise"], NOISE_RANK, self.dist.world_size, step), self.plan.secure_noise
            )
            if legacy:  # _seeds is fresh OS entropy without run.seed, else derived from it (and the step here)
                self._log(
                    f"the checkpoint's noise and sampling generators are 32-bit-seeded torch states (written "
                    f"before the 128-bit DP RNG): continuing with fresh 128-bit streams from step {step} on"
                )
                return
            self._log(
                f"resuming a {saved_world}-process run with {self.dist.world_size} process(es): each rank "
                f"samples its shard from a fresh stream from step {state['step']} on"
            )
            return
        if "rank_streams" in state:
            mine = state["rank_streams"][self.dist.rank]
        else:  # a checkpoint from before distributed training: one process
            mine = {"sampler": state["sampler"], "augment_generator": state.get("augment_generator")}
        self._feed = None
        self.sampler.load_state_dict(mine["sampler"])
        if mine.get("augment_generator") is not None:
            self.augment_generator.set_state(mine["augment_generator"])

    def save(self) -> None:
        """Write the checkpoint (rank 0; collective with P processes, so every rank calls it).

        Raises:
            OSError: the checkpoint could not be written (e.g. a full disk), saying that the
                previous one is intact.
        """
        state = self.state()
        if self.dist.is_main:
            path = self.run_dir / CHECKPOINT_NAME
            if self._damaged_checkpoint is not None:  # never keep a damaged file as the previous checkpoint
                os.replace(self._damaged_checkpoint, self.run_dir / DAMAGED_CHECKPOINT_NAME)
                self._damaged_checkpoint = None
            try:
                save_checkpoint(path, state)
            except OSError as err:
                kept = "no earlier checkpoint" if self._checkpoint_step is None else f"the checkpoint of step {self._checkpoint_step} is intact"
                raise OSError(f"cannot write {path} at step {self.step}: {err.strerror or err}; {kept}") from err
        self._checkpoint_step = self.step
        self._saved_at = time.perf_counter()

    # ------------------------------------------------------------------- loop
    def epochs_done(self, step: int) -> float:
        """Epochs after ``step`` steps: step * B / N (an epoch is N / B expected-size batches)."""
        return step * self.plan.batch_size / self.plan.dataset_size

    def _eval_due(self) -> bool:
        """True at the last step and whenever another ``train.eval_every_epochs`` has passed
        (epochs of the reference run for a TAN simulation, so both evaluate at the same steps)."""
        if self.step == self.total_steps:
            return True
        every = self.config.train.eval_every_epochs
        batch = self.plan.simulation.batch_size if self.plan.simulation else self.plan.batch_size
        period = lambda step: math.floor(step * batch / self.plan.dataset_size / every + 1e-9)  # noqa: E731
        return period(self.step) > period(self.step - 1)

    def epsilon(self) -> float:
        """Epsilon spent so far (inf for a non-private run)."""
        return self.accountant.epsilon(self.plan.delta) if self.plan.is_private else math.inf

    def _log(self, message: str) -> None:
        """A line of the run's report (stderr; off with ``report=False``)."""
        if self.report:
            tqdm.write(message, file=sys.stderr)

    def _announce(self, message: str) -> None:
        """A line the user must see even with the report off: how their run was continued."""
        if self.dist.is_main:
            tqdm.write(message, file=sys.stderr)

    def train_step(self) -> None:
        """Sample a logical batch, take one private step, account for it."""
        augment = self.config.augment
        # With K views per example, a physical chunk holds max_physical_batch_size / K examples.
        chunks = self._train_chunks(max(1, self.config.train.max_physical_batch_size // augment.multiplicity))
        if augment.multiplicity > 1:
            chunks = augmented_chunks(chunks, augment.type, augment.multiplicity, self.augment_generator, self.value_range)
        stats = self.mechanism._step_chunks(  # clip, noise once, / B, optimizer and scheduler step, account
            chunks, all_reduce_sum=self.dist.all_reduce_sum_ if self.dist.enabled else None, add_noise=self.dist.adds_noise
        )
        if self.ema is not None:
            self.ema.update(self.model)
        self.step += 1
        self._window += stats.counts[[1, 0, 4]].to(self._window.device)  # on the device: no host sync
        self._last_stats = stats

    def _train_chunks(self, chunk_size: int) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        """This step's logical batch (drawn by the sampler) as physical chunks on the device."""
        if not self.streamed:
            indices = self.sampler.sample()
            if self.device.type == "cuda":  # pinned, so the copy does not wait for the device's queue
                indices = indices.pin_memory().to(self.device, non_blocking=True)
            return physical_chunks(self.data.x_train, self.data.y_train, indices, chunk_size)
        if self._feed is None:
            self._feed = StreamFeed(
                self.data, self.sampler, chunk_size=chunk_size, start_step=self.step, total_steps=self.total_steps,
                device=self.device, workers=_workers(self.config), prefetch=self.config.data.prefetch,
            )  # fmt: skip
        return self._feed.chunks(self.step)

    def _stop_feed(self) -> None:
        """Stop the stream's workers now (left to the garbage collector, each takes seconds to
        shut down) and put the sampler back before the next step's draw."""
        if self._feed is not None:
            self.data_wait_s += self._feed.wait_s
            self._feed.close(self.step)
            self._feed = None

    def evaluate_model(self, model: torch.nn.Module) -> tuple[float, float]:
        """Accuracy and mean loss of ``model`` on the test set (streamed from disk when training is)."""
        batch = self.config.train.eval_batch_size
        if self.streamed:  # host memory bounded by the training chunk, whatever eval_batch_size says
            batch = min(batch, self.config.train.max_physical_batch_size)
            return evaluate_batches(model, eval_batches(self.data, batch, self.device, _workers(self.config)), self.device)
        return evaluate(model, self.data.x_test, self.data.y_test, batch)

    def _reset_window(self) -> None:
        """Train loss sum and examples since the last evaluation (float64, on the device)."""
        self._window = torch.zeros(3, dtype=torch.float64, device=self.device)

    def _window_as_dict(self) -> dict[str, float | int]:
        loss_sum, examples, nonfinite = self._window.tolist()
        return {"loss_sum": loss_sum, "examples": int(examples), "nonfinite_examples": int(nonfinite)}

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

    def evaluate_and_log(self) -> dict[str, Any] | None:
        """Evaluate and append to metrics.jsonl (rank 0; other ranks only reset the window)."""
        if not self.dist.is_main:
            self._reset_window()
            return None
        accuracy, test_loss = self.evaluate_model(self.model)
        window = self._window_as_dict()
        record = {
            "epoch": self.epochs_done(self.step),
            "step": self.step,
            "train_loss": window["loss_sum"] / window["examples"] if window["examples"] else None,
            "test_accuracy": accuracy,
            "test_loss": test_loss,
            "epsilon": self.epsilon(),
            "delta": self.plan.delta,
            **({"reference_epsilon": self.plan.reference_epsilon(self.step)} if self.plan.simulation else {}),
            "lr": self.scheduler.get_last_lr()[0],
            "wall_time_s": self.wall_time_s,
        }
        if window["nonfinite_examples"]:  # they contributed zero; say so, it is a utility loss
            record["nonfinite_examples"] = window["nonfinite_examples"]
            self._log(
                f"WARNING: {window['nonfinite_examples']} examples since the last evaluation had non-finite gradients "
                "and contributed zero (fp16 overflow? lower train.fp16_loss_scale or use bf16)"
            )
        record.update(self.extra_evaluations())
        if self.plan.caveats():
            record["privacy_note"] = "; ".join(self.plan.caveats())
        self._reset_window()
        self.metrics.append(record)
        return record

    @property
    def value_range(self) -> tuple[float, float]:
        """Range of the input pixels (for colour augmentations)."""
        return (-1.0, 1.0) if self.config.data.normalize else (0.0, 1.0)

    def extra_evaluations(self) -> dict[str, float]:
        """EMA-model and AugTest accuracies, when configured (not the headline test_accuracy)."""
        out = {}
        if self.ema is not None:
            out["test_accuracy_ema"], out["test_loss_ema"] = self.evaluate_model(self.ema.model)
        if self.config.eval.augtest:  # in memory only (config validation)
            x, y, batch = self.data.x_test, self.data.y_test, self.config.train.eval_batch_size
            augment = self.config.augment
            generator = torch.Generator().manual_seed(self.augtest_seed)
            out["test_accuracy_augtest"] = evaluate_augtest(
                self.model, x, y, augment.type, augment.multiplicity, generator, self.value_range, batch
            )
        return out

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
        self._log(self.plan.describe())
        self._log(self.plan.meaning())
        for note in self.plan.caveats() + self.privacy_warnings():
            self._log(f"WARNING: {note}")
        self.warnings_shown = self.report
        bar = tqdm(
            total=self.total_steps, initial=self.step, disable=not self.progress, file=sys.stderr, desc="train",
            unit="step", dynamic_ncols=True,
        )  # fmt: skip
        self._bar_state = {"epsilon": self.epsilon() if self.step else 0.0, "reported_at": time.perf_counter()}
        interrupt = _DeferredInterrupt()
        self._saved_at = time.perf_counter()
        interrupted = False
        try:
            with interrupt, self.precision.matmul_flags():
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

    def _step_evaluate_save(self, bar: Any) -> None:
        """One step, then the evaluation and checkpoint that are due, then the progress bar."""
        started = time.perf_counter()
        self.train_step()
        evaluated = self._eval_due()
        if evaluated:
            self.wall_time_s += time.perf_counter() - started
            started = time.perf_counter()
            record = self.evaluate_and_log()
            if record is not None:
                self._bar_state["epsilon"] = record["epsilon"]
                self._log(
                    f"epoch {record['epoch']:.2f} step {self.step}: test accuracy "
                    f"{100 * record['test_accuracy']:.2f}%, epsilon {_fmt_eps(record['epsilon'])}"
                )
        if self.step == self.total_steps or self._checkpoint_due():
            self.save()
        self.wall_time_s += time.perf_counter() - started
        bar.update(1)
        # Reading the step's loss waits for the device: only when the bar is redrawn.
        state = self._bar_state
        if self.progress and (evaluated or time.perf_counter() - state["reported_at"] > EPSILON_REFRESH_S):
            state["epsilon"], state["reported_at"] = self.epsilon(), time.perf_counter()
            loss = self._last_stats.loss_sum / max(1, self._last_stats.batch_size)
            bar.set_postfix(loss=f"{loss:.3f}", eps=_fmt_eps(state["epsilon"]), refresh=False)

    def privacy_warnings(self) -> list[str]:
        """Advice about the privacy parameters (the privacy wall), computed once per run."""
        if self._privacy_warnings is None:
            warning = self.plan.wall_warning()
            self._privacy_warnings = [warning] if warning else []
            model = self.config.model  # model.init's source: in the plan's caveats (plan.init_run)
            if model.init_scaling == "meanvar" and model.init_seed_public:
                self._privacy_warnings.append(
                    f"model.init_seed_public: the Mean-Var statistics of {model.init_seed_model} are left out of "
                    "epsilon (its training data declared public)"
                )
        return self._privacy_warnings

    def finish(self) -> dict[str, Any]:
        """Write ``summary.json`` for a completed run (rank 0) and return it (on every rank)."""
        summary = self._summary() if self.dist.is_main else None
        return self.dist.broadcast_object(summary)

    def _privacy_summary(self) -> dict[str, Any]:
        """The summary's privacy fields: what was spent, by which plan, and what it does not cover."""
        plan = self.plan
        return {
            "epsilon": self.epsilon(),
            "delta": plan.delta,
            "target_epsilon": plan.target_epsilon,
            # a TAN simulation is no private model: its guarantee is not the one it reports
            "private": plan.is_private and plan.simulation is None,
            "noise_multiplier": plan.noise_multiplier,
            "noise_calibrated": plan.calibrated,
            "max_grad_norm": plan.max_grad_norm,
            "batch_size": plan.batch_size,
            "sample_rate": plan.sample_rate,
            "dataset_size": plan.dataset_size,
            "steps": self.step,
            "epochs": self.epochs_done(self.step),
            "sampling": plan.sampling,
            "accountant": plan.accountant,
            "eps_tan": plan.eps_tan,
            "epsilon_parts": self.accountant.epsilon_by_label(plan.delta) if plan.releases else None,
            "simulation": (
                {**asdict(plan.simulation), "own_epsilon_accountant": plan.run_accountant} if plan.simulation else None
            ),
            "reference_epsilon": plan.reference_epsilon(self.step) if plan.simulation else None,
            "privacy_warnings": self.privacy_warnings(),
            "features": self.config.features.extractor,
            "feature_normalization": self.feature_normalizer.kind,
            # composed / declared public / other data: how a checkpoint extractor's run enters epsilon
            "extractor_privacy": plan.extractor.case if plan.extractor else None,
            "guarantee_caveats": plan.caveats(),
            "guarantee_scope": GUARANTEE_SCOPE if plan.is_private else None,
            "seeded": self.config.run.seed is not None,
            "config_changes": self.config_changes,  # asked for with --set on resume, by step
        }

    def _summary(self) -> dict[str, Any]:
        last = self.metrics.read()[-1]
        plan = self.plan
        summary = {
            "test_accuracy": last["test_accuracy"],
            "test_loss": last["test_loss"],
            **{k: last[k] for k in ("test_accuracy_ema", "test_accuracy_augtest") if k in last},
            "augment_multiplicity": self.config.augment.multiplicity,
            **self._privacy_summary(),
            "dataset": self.data.info.name,
            "data_loader": "stream" if self.streamed else "memory",
            "skipped_files": len(self.data.info.skipped_files),
            # streaming, this session: time the step waited for the loader's chunks (s)
            "data_wait_s": self.data_wait_s if self.streamed else None,
            "model": self.config.model.name,
            "model_init": self.init_report,
            "trainable_params": count_parameters(self.model, trainable_only=True),
            "engine": self.engine.name,
            "precision": self.precision.name,
            "engine_self_check": self.self_check.as_json() if self.self_check else None,
            "world_size": self.dist.world_size,
            "noise_rank": NOISE_RANK if self.dist.enabled else None,
            "wall_time_s": self.wall_time_s,
        }
        summary["privacy_status"] = plan.status(summary["epsilon"], summary["reference_epsilon"])
        summary = json_safe(summary)
        atomic_write_text(self.run_dir / SUMMARY_NAME, json.dumps(summary, indent=2) + "\n")
        return summary


T = TypeVar("T")


def _on_main(dist: Distributed, action: Callable[[], T]) -> T | None:
    """``action()`` on rank 0, its failure raised on every rank (each would otherwise wait for
    the failed one); other ranks get None."""
    result, error = None, None
    if dist.is_main:
        try:
            result = action()
        except (ConfigError, OSError) as err:
            if not dist.enabled:
                raise
            error = str(err)
    error = dist.broadcast_object(error) if dist.enabled else error
    if error:
        raise ConfigError(error)
    return result


def _refuse_audit_run(run_dir: str | Path) -> None:
    if (Path(run_dir) / AUDIT_NAME).exists():
        raise ConfigError(
            f"{run_dir} is a `dpscale audit` run: its training set holds canaries its config does not describe, "
            "so it cannot be resumed or evaluated; run `dpscale audit` again"
        )


def _fmt_eps(epsilon: float) -> str:
    return "inf" if not math.isfinite(epsilon) else f"{epsilon:.3f}"

"""A training run built once from its config, like an execution plan: process and device, data,
the DP plan, model, checked engine, optimizer and the DP mechanism. ``build_run`` makes every
part in data-flow order; the Trainer (train/loop.py) only runs what it built."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from dpscale.cpu_memory import keep_freed_memory
from dpscale.config import Config
from dpscale.errors import ConfigError
from dpscale.data.run_data import open_training_data, training_fingerprint
from dpscale.data.stream import StreamedData
from dpscale.features.normalize import FeatureNormalizer
from dpscale.features.pipeline import extract_run_features, normalize_dataset
from dpscale.privacy.clipping.per_example import PerExampleEngine
from dpscale.privacy.plan.dp_plan import DPPlan
from dpscale.privacy.clipping.precision import Precision
from dpscale.privacy.clipping.self_check import SelfCheckResult
from dpscale.train.distributed import Distributed, init_distributed, rank_stream_seed
from dpscale.train.ema import WeightEMA, decay_not_reached_note
from dpscale.train.feature_normalizer import feature_normalizer
from dpscale.train.hooks import RunHooks
from dpscale.train.inputs import data_fingerprint, inputs_for, plan_for, privacy_units, source_runs
from dpscale.train.seeds import run_seeds
from dpscale.train.mechanism import DPMechanism
from dpscale.train.optim import build_optimizer, build_scheduler
from dpscale.train.run_engine import run_engine
from dpscale.train.run_model import run_model
from dpscale.train.step import fixed_rows
from dpscale.train.chunk_size import AUTO, run_chunk
from dpscale.train.units import chunk_size_for, run_users

Log = Callable[[str], Any]


@dataclass
class Run:
    """Everything a run trains with, built by ``build_run``.

    Attributes:
        dist: the process group (a single process by default); device: this rank's device.
        seeds: the run's seeds (``run_seeds``; fresh OS entropy without run.seed).
        data: the training and test data, features extracted and normalised (in memory or streamed).
        data_fingerprint: of the training images, as checkpoints record it.
        plan: the frozen DP plan; total_steps: its S.
        feature_normalizer: private Data Normalization's statistics (or the identity).
        model, init_report: the model and what initialised it (model.init / Mean-Var), if anything.
        precision, engine, self_check: the clipping engine, verified before the first step.
        optimizer, scheduler, mechanism: the DP mechanism owns sampler, noise and accountant.
        ema: an exponential moving average of the weights (train.ema_decay), or None.
    """

    config: Config
    dist: Distributed
    device: torch.device
    seeds: dict[str, int]
    data: Any
    data_fingerprint: str
    plan: DPPlan
    total_steps: int
    feature_normalizer: FeatureNormalizer
    model: nn.Module
    init_report: dict[str, Any] | None
    precision: Precision
    engine: PerExampleEngine
    self_check: SelfCheckResult | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    mechanism: DPMechanism
    ema: WeightEMA | None

    @property
    def streamed(self) -> bool:
        """The training data is streamed from disk (data.loader), not held in memory."""
        return isinstance(self.data, StreamedData)

    @property
    def value_range(self) -> tuple[float, float]:
        """Range of the input pixels (for colour augmentations)."""
        return (-1.0, 1.0) if self.config.data.normalize else (0.0, 1.0)

    @property
    def physical_batch_size(self) -> int:
        """train.max_physical_batch_size as the run uses it (``build_run`` resolves auto to its number)."""
        size = self.config.train.max_physical_batch_size
        if not isinstance(size, int):
            raise RuntimeError(
                f"train.max_physical_batch_size={size!r} was not resolved to a number"
            )
        return size


def build_run(
    config: Config,
    hooks: RunHooks,
    *,
    log: Log,
    progress: bool = False,
    saved_plan: DPPlan | None = None,
    feature_norm: dict[str, Any] | None = None,
) -> Run:
    """Build the run ``config`` describes.

    Args:
        config: the resolved config (``run.out_dir`` set).
        hooks: an audit's canaries and observer (``RunHooks()`` for a plain run).
        log: prints a line of the run's report.
        progress: show the feature extraction's progress bar.
        saved_plan: a checkpoint's DP plan (checked against the config and data, never
            recalibrated); its weights come from the checkpoint, so no initialisation is applied.
        feature_norm: a checkpoint's feature normaliser (its private statistics reused, never
            drawn again: a second draw would be a second release).
    """
    dist, device, seeds = open_process(config)
    features, fingerprint, data_notes, sources = _training_features(
        config, hooks, dist, device, log, progress
    )
    inputs = inputs_for(config, privacy_units(config, features), sources)
    # the model before the plan: BandMF's noise history is sized by its trainable parameters
    model, init_report, trainable = run_model(
        config, features.info, seeds, device, log, initial_weights=saved_plan is None
    )
    # dp.max_grad_norm_per=tensor: a bound for each tensor that trains (after PEFT and frozen groups)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    plan = plan_for(config, inputs, saved_plan, parameters=trainable, names=names)
    for note in data_notes:
        log(note)
    normalizer = feature_normalizer(
        config, features, plan, seeds, dist, feature_norm, loading=saved_plan is not None
    )
    data = normalize_dataset(features, normalizer)
    dist.broadcast_module_(model)  # identical already (same seed); made certain
    built = _with_mechanism(
        config,
        hooks,
        dist,
        device,
        seeds,
        data,
        fingerprint,
        plan,
        inputs.steps,
        normalizer,
        model,
        init_report,
        log,
    )
    built = _resolved_chunk(built, log)
    # examples a chunk
    chunk = chunk_size_for(built.plan, built.physical_batch_size, config.augment.multiplicity)
    built.mechanism.pad_rows = fixed_rows(
        built.plan, chunk, config.train.fixed_shapes, config.train.compile
    )
    return built


def _training_features(
    config: Config,
    hooks: RunHooks,
    dist: Distributed,
    device: torch.device,
    log: Log,
    progress: bool,
) -> tuple[Any, str, list[str], Any]:
    """The training data opened and extracted as features (an audit's canaries added), with the
    images' fingerprint, the data's notes (reported with the plan) and the source runs, checked
    before extracting."""
    # the labels line: reported with the plan, so a refusal before it stays one line
    data_notes: list[str] = []
    images = open_training_data(config, device, data_notes.append)
    # the DP step's large per-step tensors reuse freed pages (not a stream's: dpscale.cpu_memory)
    if device.type == "cpu":
        # logged with the engine's checks
        keep_freed_memory(streamed=isinstance(images, StreamedData))
    # files left out, colour files, people on each side of the split
    data_notes.extend(images.info.notes)
    fingerprint = data_fingerprint(images)
    if images.info.skipped_files:
        log(
            f"data.skip_corrupt: left out {len(images.info.skipped_files)} unreadable file(s), e.g. "
            f"{images.info.skipped_files[0]}; N = {images.info.num_train} readable training images"
        )

    # a source run may have used the other data.normalize
    def fingerprint_as(normalize: bool) -> str:
        return (
            fingerprint
            if normalize == config.data.normalize
            else training_fingerprint(config, normalize)
        )

    # Before extracting: a source run (checkpoint extractor, model.init) that cannot be composed is refused at once.
    sources = source_runs(config, fingerprint_as)
    with dist.main_first():  # rank 0 fills the feature cache, the others read it
        features = extract_run_features(
            config.features, images, device, progress and dist.is_main, log
        )
    del images
    if hooks.training_set is not None:  # an audit's canaries: before the plan, so N counts them
        features = hooks.training_set(features)
    return features, fingerprint, data_notes, sources


def _resolved_chunk(built: Run, log: Log) -> Run:
    """train.max_physical_batch_size=auto as the number it chose (the smallest of the ranks'), in the
    run's config: config.yaml and the checkpoint record it, so a resumed run takes the same chunks."""
    train = built.config.train
    if train.max_physical_batch_size != AUTO:
        return built
    views = built.config.augment.multiplicity
    choice = run_chunk(
        built.engine,
        built.model,
        built.plan,
        built.data,
        views,
        built.device,
        train.memory_budget_mb,
    )
    rows = min(built.dist.all_gather_object(choice.rows))
    log(
        choice.describe()
        + (f"; {rows} rows on every rank (the smallest rank's)" if rows != choice.rows else "")
    )
    built.config = replace(built.config, train=replace(train, max_physical_batch_size=rows))
    return built


def open_process(config: Config) -> tuple[Distributed, torch.device, dict[str, int]]:
    """The process group (data parallel under torchrun, else one process), this rank's device
    and the run's seeds (fresh entropy: rank 0's, for all)."""
    dist = init_distributed(config.run.device)
    if dist.enabled and config.data.privacy_unit == "user":
        raise ConfigError(
            "data.privacy_unit=user runs in one process (users are not sharded across ranks yet)"
        )
    if config.run.out_dir is None:
        raise ConfigError("run.out_dir must be set (the CLI picks runs/<model>-<data>-<time>)")
    if config.run.threads:
        torch.set_num_threads(config.run.threads)
    device = config.run.device
    if dist.enabled and device == "cuda":
        device = f"cuda:{dist.local_rank}"  # one GPU per process
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"run.device={config.run.device} but this torch build has no usable CUDA device"
        )
    return dist, torch.device(device), dist.broadcast_object(run_seeds(config.run.seed))


def _with_mechanism(
    config: Config,
    hooks: RunHooks,
    dist: Distributed,
    device: torch.device,
    seeds: dict[str, int],
    data: Any,
    fingerprint: str,
    plan: DPPlan,
    total_steps: int,
    normalizer: FeatureNormalizer,
    model: nn.Module,
    init_report: dict[str, Any] | None,
    log: Log,
) -> Run:
    """The checked engine, optimizer, scheduler and DP mechanism around ``model``."""
    precision, engine, self_check, first_chunk_check = run_engine(
        config, plan, model, data, device, distributed=dist.enabled, log=log
    )
    if hooks.engine is not None:
        engine = hooks.engine(engine, model)
    optimizer = build_optimizer(config.optim, [p for p in model.parameters() if p.requires_grad])
    scheduler = build_scheduler(config.optim, optimizer, total_steps)
    # The mechanism keeps sampler, noise and accountant in step (the releases made before any
    # step, e.g. Data Normalization, recorded first). Only the noise rank draws noise; noise is
    # drawn on the host, then copied to the device: the same noise on CPU and CUDA.
    mechanism = DPMechanism(
        model,
        optimizer,
        plan,
        engine,
        scheduler=scheduler,
        noise_seed=seeds["noise"],
        sampler_seed=rank_stream_seed(seeds["sampler"], dist.rank, dist.world_size, 0),
        partition_seed=seeds["partition"],  # one partition for every rank (BandMF's b groups)
        rank=dist.rank,
        world_size=dist.world_size,
        # in train mode, on the first real training chunk (the set-up check saw a few examples)
        first_chunk_check=first_chunk_check,
        users=run_users(plan, data),
        views=config.augment.multiplicity,
    )
    mechanism.observer = hooks.observe_gradient
    ema = _ema(model, config.train.ema_decay, total_steps, log)
    return Run(
        config=config,
        dist=dist,
        device=device,
        seeds=seeds,
        data=data,
        data_fingerprint=fingerprint,
        plan=plan,
        total_steps=total_steps,
        feature_normalizer=normalizer,
        model=model,
        init_report=init_report,
        precision=precision,
        engine=engine,
        self_check=self_check,
        optimizer=optimizer,
        scheduler=scheduler,
        mechanism=mechanism,
        ema=ema,
    )


def _ema(model: nn.Module, decay: float | None, total_steps: int, log: Log) -> WeightEMA | None:
    """The exponential moving average of the weights (train.ema_decay), or None; a note when its
    decay is not reached in ``total_steps``."""
    ema = WeightEMA(model, decay) if decay else None
    ema_note = decay_not_reached_note(ema.decay, total_steps) if ema else None
    if ema_note:
        log(f"note: {ema_note}")
    return ema

"""A training run built once from its config, like an execution plan: process and device, data,
the DP plan, model, checked engine, optimizer and the DP mechanism. ``build_run`` makes every
part in data-flow order; the Trainer (train/loop.py) only runs what it built."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from dpscale.cpu_memory import keep_freed_memory
from dpscale.config import Config
from dpscale.errors import ConfigError
from dpscale.data.run_data import open_training_data, training_fingerprint
from dpscale.data.stream import StreamedData
from dpscale.features.normalize import FeatureNormalizer
from dpscale.features.pipeline import extract_run_features, fit_normalizer, normalize_dataset
from dpscale.models import build_model, freeze_block_groups
from dpscale.models.peft import apply_peft
from dpscale.models.init import init_from, meanvar_init, read_weights
from dpscale.privacy.clipping.compiled import COMPILED_NOTE, compiled_choice, compiled_engine_name
from dpscale.privacy.clipping.per_example import (
    PerExampleEngine, check_per_example_compatible, ghost_per_user_notice, per_example_cross_entropy, user_engine_options,
)  # fmt: skip
from dpscale.privacy.plan.dp_plan import DPPlan
from dpscale.privacy.clipping.precision import Precision, make_precision
from dpscale.privacy.clipping.self_check import SELF_CHECK_EXAMPLES, SelfCheckResult, checked_engine
from dpscale.rng import noise_generator
from dpscale.train.distributed import Distributed, init_distributed, rank_stream_seed
from dpscale.train.ema import WeightEMA, decay_not_reached_note
from dpscale.train.hooks import RunHooks
from dpscale.train.inputs import data_fingerprint, inputs_for, plan_for, privacy_units, source_runs
from dpscale.train.seeds import run_seeds
from dpscale.train.mechanism import DPMechanism, FirstChunkCheck, independence_check
from dpscale.train.optim import build_optimizer, build_scheduler
from dpscale.train.step import AugmentViews, fixed_rows
from dpscale.train.chunk_size import AUTO, run_chunk
from dpscale.train.units import chunk_size_for, first_users_chunk, rows_per_user, run_users

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
            raise RuntimeError(f"train.max_physical_batch_size={size!r} was not resolved to a number")
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
    data_notes: list[str] = []  # the labels line: reported with the plan, so a refusal before it stays one line
    images = open_training_data(config, device, data_notes.append)
    if device.type == "cpu":  # the DP step's large per-step tensors reuse freed pages (not a stream's: dpscale.cpu_memory)
        keep_freed_memory(streamed=isinstance(images, StreamedData))  # logged with the engine's checks
    data_notes.extend(images.info.notes)  # files left out, colour files, people on each side of the split
    fingerprint = data_fingerprint(images)
    if images.info.skipped_files:
        log(f"data.skip_corrupt: left out {len(images.info.skipped_files)} unreadable file(s), e.g. "
            f"{images.info.skipped_files[0]}; N = {images.info.num_train} readable training images")  # fmt: skip

    def fingerprint_as(normalize: bool) -> str:  # a source run may have used the other data.normalize
        return fingerprint if normalize == config.data.normalize else training_fingerprint(config, normalize)

    # Before extracting: a source run (checkpoint extractor, model.init) that cannot be composed is refused at once.
    sources = source_runs(config, fingerprint_as)
    with dist.main_first():  # rank 0 fills the feature cache, the others read it
        features = extract_run_features(config.features, images, device, progress and dist.is_main, log)
    del images
    if hooks.training_set is not None:  # an audit's canaries: before the plan, so N counts them
        features = hooks.training_set(features)
    inputs = inputs_for(config, privacy_units(config, features), sources)
    # the model before the plan: BandMF's noise history is sized by its trainable parameters
    model, init_report = _model(config, features.info, seeds, log, initial_weights=saved_plan is None)
    model.to(device)
    check_per_example_compatible(model)
    if config.model.freeze_groups:
        freeze_block_groups(model, config.model.freeze_groups)
    trainable = _peft(model, config, log)
    # dp.max_grad_norm_per=tensor: a bound for each tensor that trains (after PEFT and frozen groups)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    plan = plan_for(config, inputs, saved_plan, parameters=trainable, names=names)
    for note in data_notes:
        log(note)
    normalizer = _feature_normalizer(config, features, plan, seeds, dist, feature_norm, loading=saved_plan is not None)
    data = normalize_dataset(features, normalizer)
    dist.broadcast_module_(model)  # identical already (same seed); made certain
    built = _with_mechanism(config, hooks, dist, device, seeds, data, fingerprint, plan, inputs.steps, normalizer,
                            model, init_report, log)  # fmt: skip
    built = _resolved_chunk(built, log)
    chunk = chunk_size_for(built.plan, built.physical_batch_size, config.augment.multiplicity)  # examples a chunk
    built.mechanism.pad_rows = fixed_rows(built.plan, chunk, config.train.fixed_shapes, config.train.compile)
    return built


def _resolved_chunk(built: Run, log: Log) -> Run:
    """train.max_physical_batch_size=auto as the number it chose (the smallest of the ranks'), in the
    run's config: config.yaml and the checkpoint record it, so a resumed run takes the same chunks."""
    train = built.config.train
    if train.max_physical_batch_size != AUTO:
        return built
    views = built.config.augment.multiplicity
    choice = run_chunk(built.engine, built.model, built.plan, built.data, views, built.device, train.memory_budget_mb)
    rows = min(built.dist.all_gather_object(choice.rows))
    log(choice.describe() + (f"; {rows} rows on every rank (the smallest rank's)" if rows != choice.rows else ""))
    built.config = replace(built.config, train=replace(train, max_physical_batch_size=rows))
    return built


def _peft(model: nn.Module, config: Config, log: Log) -> int:
    """model.peft applied (the same on resume: the checkpoint's state dict has the adapters);
    returns the trainable parameters."""
    cfg = config.model
    try:
        trainable = apply_peft(model, cfg.peft, rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=cfg.lora_targets,
                               last_groups=cfg.train_last_groups)  # fmt: skip
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if cfg.peft != "none":
        total = sum(p.numel() for p in model.parameters())
        log(f"model.peft={cfg.peft}: {trainable:,} of {total:,} parameters train (clipped and noised); the rest is frozen")
    return trainable


def open_process(config: Config) -> tuple[Distributed, torch.device, dict[str, int]]:
    """The process group (data parallel under torchrun, else one process), this rank's device
    and the run's seeds (fresh entropy: rank 0's, for all)."""
    dist = init_distributed(config.run.device)
    if dist.enabled and config.data.privacy_unit == "user":
        raise ConfigError("data.privacy_unit=user runs in one process (users are not sharded across ranks yet)")
    if config.run.out_dir is None:
        raise ConfigError("run.out_dir must be set (the CLI picks runs/<model>-<data>-<time>)")
    if config.run.threads:
        torch.set_num_threads(config.run.threads)
    device = config.run.device
    if dist.enabled and device == "cuda":
        device = f"cuda:{dist.local_rank}"  # one GPU per process
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"run.device={config.run.device} but this torch build has no usable CUDA device")
    return dist, torch.device(device), dist.broadcast_object(run_seeds(config.run.seed))


def _feature_normalizer(
    config: Config, features: Any, plan: DPPlan, seeds: dict[str, int], dist: Distributed,
    saved: dict[str, Any] | None, *, loading: bool,
) -> FeatureNormalizer:  # fmt: skip
    """A checkpoint's normaliser (its private statistics reused, never drawn again), or a new one
    (``loading``: the run continues a checkpoint, whose normalisation must be the config's)."""
    kind = (saved or {}).get("kind", "none")
    if loading and kind != config.features.normalize:
        raise ConfigError(
            f"the checkpoint's feature normalisation ({kind}) is not features.normalize={config.features.normalize} "
            "of its config; refusing to continue it"
        )
    if loading:
        _check_centring(config.features.center, "center" in (saved or {}))
    if saved is not None:
        return FeatureNormalizer.from_state_dict(saved)
    # Data Normalization's noise: 128-bit seed, or the OS CSPRNG with dp.secure_noise
    generator = noise_generator(seeds["features"], config.dp.secure_noise)
    # a stream has features.normalize=none (config validation): nothing to fit
    streamed = isinstance(features, StreamedData)
    users = run_users(plan, features) if not streamed else None  # at the user unit: one clipped row per person
    normalizer = FeatureNormalizer() if streamed else fit_normalizer(config.features, features.x_train, plan, generator, users)
    if not dist.enabled:
        return normalizer
    # One release, whatever P: every rank uses rank 0's noisy statistics.
    return FeatureNormalizer.from_state_dict(dist.broadcast_object(normalizer.state_dict()))


def _check_centring(configured: bool, saved: bool) -> None:
    """A continued run keeps its checkpoint's centring: none added (a new release its history
    never accounted), none dropped (the model was trained on centred inputs)."""
    if configured and not saved:
        raise ConfigError(
            "features.center is true but the checkpoint holds no released feature mean; refusing to continue it "
            "(drawing one now would be a release its accounting never saw)"
        )
    if saved and not configured:
        raise ConfigError(
            "the checkpoint's model trained on inputs centred by a released feature mean but features.center is "
            "false; refusing to continue it"
        )


def _model(config: Config, info: Any, seeds: dict[str, int], log: Log, initial_weights: bool) -> tuple[nn.Module, dict[str, Any] | None]:
    """The model, seeded, with model.init's weights and Mean-Var scaling applied for a new run."""
    cfg = config.model
    torch.manual_seed(seeds["init"])
    model = build_model(cfg.name, info.num_classes, info.input_shape, cfg.activation, **cfg.kwargs)
    report: dict[str, Any] | None = None
    if cfg.init and initial_weights:
        loaded = init_from(model, cfg.init, reset_head=cfg.reset_head)
        report = asdict(loaded)
        log(loaded.describe())
    if cfg.init_scaling == "meanvar" and initial_weights:
        assert cfg.init_seed_model is not None  # validate() requires it with meanvar
        counts = meanvar_init(model, read_weights(cfg.init_seed_model), torch.Generator().manual_seed(seeds["init"]))
        report = {"source": cfg.init_seed_model, "scaling": "meanvar", **counts}
        log(f"model.init_scaling=meanvar: {counts['scaled']} tensors drawn with the statistics of "
            f"{cfg.init_seed_model} ({counts['kept']} kept at their default init)")  # fmt: skip
    return model, report


def _with_mechanism(
    config: Config, hooks: RunHooks, dist: Distributed, device: torch.device, seeds: dict[str, int], data: Any,
    fingerprint: str, plan: DPPlan, total_steps: int, normalizer: FeatureNormalizer, model: nn.Module,
    init_report: dict[str, Any] | None, log: Log,
) -> Run:  # fmt: skip
    """The checked engine, optimizer, scheduler and DP mechanism around ``model``."""
    precision = make_precision(config.train.precision, config.train.fp16_loss_scale)
    engine, self_check = _checked_engine(config, plan, model, data, device, precision, log)
    tuner = getattr(engine, "tuner", None)
    if dist.enabled and tuner is not None:  # ranks timing apart could choose apart
        tuner.enabled = False  # (a resume pins rank 0's choices): the shape rule on every rank
    first_chunk_check: FirstChunkCheck | None = independence_check if config.train.self_check and plan.is_private else None
    if config.train.compile:  # the eager engine built and checked above, compiled (its checks run eagerly)
        engine, first_chunk_check = compiled_choice(engine, first_chunk_check)
        log(COMPILED_NOTE)
    if hooks.engine is not None:
        engine = hooks.engine(engine, model)
    optimizer = build_optimizer(config.optim, [p for p in model.parameters() if p.requires_grad])
    scheduler = build_scheduler(config.optim, optimizer, total_steps)
    # The mechanism keeps sampler, noise and accountant in step (the releases made before any
    # step, e.g. Data Normalization, recorded first). Only the noise rank draws noise; noise is
    # drawn on the host, then copied to the device: the same noise on CPU and CUDA.
    mechanism = DPMechanism(
        model, optimizer, plan, engine, scheduler=scheduler, noise_seed=seeds["noise"],
        sampler_seed=rank_stream_seed(seeds["sampler"], dist.rank, dist.world_size, 0),
        partition_seed=seeds["partition"],  # one partition for every rank (BandMF's b groups)
        rank=dist.rank, world_size=dist.world_size,
        # in train mode, on the first real training chunk (the set-up check saw a few examples)
        first_chunk_check=first_chunk_check,
        users=run_users(plan, data), views=config.augment.multiplicity,
    )  # fmt: skip
    mechanism.observer = hooks.observe_gradient
    ema = WeightEMA(model, config.train.ema_decay) if config.train.ema_decay else None
    ema_note = decay_not_reached_note(ema.decay, total_steps) if ema else None
    if ema_note:
        log(f"note: {ema_note}")
    return Run(
        config=config, dist=dist, device=device, seeds=seeds, data=data, data_fingerprint=fingerprint, plan=plan,
        total_steps=total_steps, feature_normalizer=normalizer, model=model, init_report=init_report,
        precision=precision, engine=engine, self_check=self_check, optimizer=optimizer, scheduler=scheduler,
        mechanism=mechanism, ema=ema,
    )  # fmt: skip


def _checked_engine(
    config: Config, plan: DPPlan, model: nn.Module, data: Any, device: torch.device, precision: Precision, log: Log
) -> tuple[PerExampleEngine, SelfCheckResult | None]:
    """The clipping engine, verified before the first step on the first few training examples
    (their K views drawn from a fixed generator: the run's streams are untouched)."""
    train, augment = config.train, config.augment
    value_range = (-1.0, 1.0) if config.data.normalize else (0.0, 1.0)
    fixed = AugmentViews(augment.type, augment.multiplicity, torch.Generator().manual_seed(0), value_range, augment.padding)
    augment_views = fixed if augment.multiplicity > 1 else None
    if plan.user_level:  # per-user quantities: the first users' padded rows, one "example" per user
        rows = rows_per_user(plan)
        chunk = first_users_chunk(data, SELF_CHECK_EXAMPLES, rows, augment.multiplicity, augment_views)
        chunk = (chunk[0].to(device), chunk[1].to(device))  # a stream's examples are read on the host
        views, loss_fn = user_engine_options(rows, augment.multiplicity, None)
        notice = ghost_per_user_notice(train.engine, rows)
        if notice:
            log(f"WARNING: {notice}")
    else:
        k = min(SELF_CHECK_EXAMPLES, len(data.y_train))
        chunk = data.head(k, device) if isinstance(data, StreamedData) else (data.x_train[:k], data.y_train[:k])
        chunk = (augment_views(chunk[0]), chunk[1]) if augment_views else chunk
        views, loss_fn = augment.multiplicity, per_example_cross_entropy
    name = _engine_name(config, precision, model)
    try:
        with precision.matmul_flags():  # as the steps will run (full float32 unless tf32)
            engine, notices, result = checked_engine(
                name, plan.max_grad_norm, model, chunk, views=views, loss_fn=loss_fn,
                # a non-private run claims no guarantee for the check to protect (and its unclipped,
                # cancelling gradient sums are where float32 reorderings look largest)
                check=train.self_check and plan.is_private, precision=precision, clip_gamma=plan.clip_gamma,
            )  # fmt: skip
    except ValueError as err:
        raise ConfigError(f"train.engine={train.engine}: {err}") from err
    checks = [result, result.independence] if result else []
    unit = " (privacy unit user: each example above is one user's padded rows, its norm the user's)" if plan.user_level else ""
    memory = [f"cpu memory: {keep_freed_memory()}"] if torch.device(device).type == "cpu" else []
    for note in notices + [check.describe() + unit for check in checks if check is not None] + memory:
        log(note)
    return engine, result


def _engine_name(config: Config, precision: Precision, model: nn.Module) -> str:
    """train.engine, or with train.compile the engine it compiles (vmap), refused in one line where it does not apply."""
    if not config.train.compile:
        return config.train.engine
    try:
        return compiled_engine_name(config.train.engine, precision, model)
    except ValueError as err:
        raise ConfigError(f"train.compile=true: {err}") from err

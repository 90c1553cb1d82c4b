"""Validation of a config: the range and consistency checks that need no data, one validator per section.

``load_config`` (``dpscale.config.load``) validates what it loads; the sections come from
``dpscale.config.schema``, for the type checker only. Dataset-dependent checks happen when a
run is built.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from dpscale.choices import (
    ACCOUNTANT_KINDS,
    CLIPPINGS,
    ENGINE_NAMES,
    MECHANISMS,
    PEFT_METHODS,
    PRECISIONS,
)
from dpscale.clip_norms import check_max_grad_norm, check_max_grad_norm_per
from dpscale.errors import ConfigError

if TYPE_CHECKING:
    from dpscale.config.schema import (
        Config,
        DPConfig,
        FeaturesConfig,
        ModelConfig,
        OptimConfig,
        RunConfig,
        TrainConfig,
    )
    from dpscale.privacy.options import Clipping, Noise, Sampling

# The allowed names of the settings only the config checks (those other layers check too are in
# dpscale.choices).
OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw")  # optim.name
LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine")  # optim.schedule
FEATURE_EXTRACTORS = ("scatternet", "model:<registry name>", "checkpoint:<run dir>")
DATA_LOADERS = ("auto", "memory", "stream")


def _either(names: tuple[str, ...]) -> str:
    """``("a", "b", "c")`` -> "a, b or c" (how a refusal lists the allowed values)."""
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]


def is_private_config(dp: DPConfig) -> bool:
    """Whether the DP section describes a private run (sigma calibrated, or given and > 0)."""
    return dp.noise_multiplier is None or dp.noise_multiplier > 0


def validate(config: Config) -> None:
    """Range checks that need no data; dataset-dependent checks happen in the trainer.

    Args:
        config: the config to check (``load_config`` checks what it loads; a config built
            directly, or changed with ``dataclasses.replace``, is checked here).

    Raises:
        ConfigError: the first value out of range or at odds with another.
    """
    # The order decides which error a config with several reports first: it is kept as it always
    # was (hence train.ema_decay after the model).
    _validate_dp(config.dp)
    _validate_train(config.train)
    _validate_compile(config.train)
    _validate_run(config.run)
    _validate_optim(config.optim)
    _validate_features(config.features, is_private_config(config.dp))
    _validate_data(config)
    _validate_model(config.model)
    _validate_ema(config.train)
    _validate_augment(config)


def _validate_dp(dp: DPConfig) -> None:
    """The dp section: privacy target and clipping, sampling, accountant, mechanism, clipping kind."""
    _validate_dp_target(dp)
    _validate_dp_sampling(dp)
    if dp.accountant not in ACCOUNTANT_KINDS:
        raise ConfigError(
            f"dp.accountant must be {_either(ACCOUNTANT_KINDS)}, got {dp.accountant!r}"
        )
    if dp.mechanism not in MECHANISMS:
        raise ConfigError(f"dp.mechanism must be {_either(MECHANISMS)}, got {dp.mechanism!r}")
    if dp.clipping not in CLIPPINGS:
        raise ConfigError(f"dp.clipping must be {_either(CLIPPINGS)}, got {dp.clipping!r}")
    # the typed options' own checks (BandMF's b included), a setting of a strategy not chosen refused
    dp_options(dp)
    _validate_mechanism(dp)


def dp_options(dp: DPConfig) -> tuple[Sampling, Clipping, Noise]:
    """The dp section's sampling, clipping and noise as ``make_private``'s typed options, through the
    translation both doors share (``dpscale.privacy.plan.options_flat``), refusals in the config's words.

    Raises:
        ConfigError: a setting out of range (``dp.clip_quantile must be in (0, 1), got 5.0``), or one of
            a strategy not chosen set to other than its default (dp.clip_quantile with dp.clipping=fixed).
    """
    from dpscale.privacy.plan.options_flat import (  # local: the config loads without the privacy core
        CLIPPING_SETTINGS,
        NOISE_SETTINGS,
        SAMPLING_SETTINGS,
        clipping_option,
        noise_option,
        sampling_option,
    )
    from dpscale.privacy.spelling import CONFIG

    values = {
        key: getattr(dp, CONFIG.key(key).removeprefix("dp."))
        for key in (*SAMPLING_SETTINGS, *CLIPPING_SETTINGS, *NOISE_SETTINGS)
        if key != "workload"
    }
    values["workload"] = None  # the config's workload is the optimizer's (train/plan_config.py)
    try:
        return (
            sampling_option(values, dp.sampling, CONFIG),
            clipping_option(values, dp.clipping, values, CONFIG),
            noise_option(values, values, CONFIG),
        )
    except ValueError as err:
        raise ConfigError(str(err)) from err


def _validate_dp_target(dp: DPConfig) -> None:
    """dp.epsilon, delta and noise_multiplier, and the clipping norms a private run needs."""
    if dp.epsilon is not None and not (dp.epsilon > 0 and math.isfinite(dp.epsilon)):
        raise ConfigError(f"dp.epsilon must be a positive finite number, got {dp.epsilon}")
    if not 0 < dp.delta < 1:
        raise ConfigError(f"dp.delta must be in (0, 1), got {dp.delta}")
    if dp.noise_multiplier is not None and not (
        dp.noise_multiplier >= 0 and math.isfinite(dp.noise_multiplier)
    ):
        raise ConfigError(f"dp.noise_multiplier must be >= 0, got {dp.noise_multiplier}")
    if dp.epsilon is None and dp.noise_multiplier is None:
        raise ConfigError(
            "set dp.epsilon (sigma is then calibrated) or dp.noise_multiplier (0 for a non-private run)"
        )
    try:
        check_max_grad_norm(dp.max_grad_norm)
    except ValueError as err:
        raise ConfigError(f"dp.{err} (or null for no clipping)") from err
    _check_max_grad_norm_per(dp)
    if is_private_config(dp) and dp.max_grad_norm is None:
        # the plan says the same (one text)
        from dpscale.privacy.spelling import CONFIG, clipping_needed

        raise clipping_needed(CONFIG)
    if dp.noise_multiplier == 0 and dp.epsilon is not None:
        raise ConfigError(
            "dp.noise_multiplier=0 is a non-private run and cannot meet dp.epsilon; set dp.epsilon=null to train without privacy"
        )


def _check_max_grad_norm_per(dp: DPConfig) -> None:
    """Refuse a dp.max_grad_norm_per that is not "group" or "tensor", and "tensor" without a norm
    or with adaptive clipping (the run's plan spells "tensor" out per tensor once the model is
    built: train/plan_config.py)."""
    try:
        check_max_grad_norm_per(dp.max_grad_norm_per, dp.max_grad_norm)
    except ValueError as err:
        raise ConfigError(f"dp.{err}") from err


def _validate_dp_sampling(dp: DPConfig) -> None:
    """dp.batch_size, sampling and simulated_batch_size (a TAN simulation)."""
    if not (dp.batch_size >= 1 and math.isfinite(dp.batch_size)):
        raise ConfigError(f"dp.batch_size must be >= 1, got {dp.batch_size}")
    # torch-free: one list, where it is used
    from dpscale.privacy.sampling.modes import SAMPLING_MODES

    if dp.sampling not in SAMPLING_MODES:
        raise ConfigError(f"dp.sampling must be {_either(SAMPLING_MODES)}, got {dp.sampling!r}")
    if dp.sampling in ("fixed", "shuffle") and not isinstance(dp.batch_size, int):
        raise ConfigError(
            f"dp.sampling={dp.sampling} needs an integer dp.batch_size, got {dp.batch_size}"
        )
    if dp.simulated_batch_size is not None:
        if not (1 <= dp.simulated_batch_size and math.isfinite(dp.simulated_batch_size)):
            raise ConfigError(
                f"dp.simulated_batch_size must be >= 1 or null, got {dp.simulated_batch_size}"
            )
        if not is_private_config(dp):
            raise ConfigError(
                "dp.simulated_batch_size simulates a private run: it needs dp.noise_multiplier > 0 or null"
            )
        if dp.sampling == "shuffle" and not isinstance(dp.simulated_batch_size, int):
            raise ConfigError(
                f"dp.sampling=shuffle needs an integer dp.simulated_batch_size, got {dp.simulated_batch_size}"
            )


def _validate_mechanism(dp: DPConfig) -> None:
    """BandMF with the rest of the dp section (what needs the data, such as b*q <= 1, is checked with the plan)."""
    if dp.mechanism == "bandmf":
        # local: keep config import-light; one text
        from dpscale.privacy.noise.correlated import check_bandmf_settings

        check_bandmf_settings(
            sampling=dp.sampling,
            simulated=dp.simulated_batch_size is not None,
            noise_multiplier=dp.noise_multiplier,
            bands=dp.bands,
        )


def _validate_train(train: TrainConfig) -> None:
    """The train section but ema_decay: length, batch sizes, precision, engine, checkpoints."""
    if train.steps is None:
        if train.epochs is None:
            raise ConfigError("set train.epochs or train.steps")
        if not (train.epochs > 0 and math.isfinite(train.epochs)):
            raise ConfigError(f"train.epochs must be a positive finite number, got {train.epochs}")
    elif train.steps < 1:
        raise ConfigError(f"train.steps must be >= 1, got {train.steps}")
    size = train.max_physical_batch_size
    if size != "auto" and (not isinstance(size, int) or size < 1):
        raise ConfigError(
            f"train.max_physical_batch_size must be auto or an integer >= 1, got {size!r}"
        )
    if train.memory_budget_mb is not None and not 0 < train.memory_budget_mb < math.inf:
        raise ConfigError(
            f"train.memory_budget_mb must be a positive number of MB or null, got {train.memory_budget_mb}"
        )
    if not train.eval_every_epochs > 0:
        raise ConfigError(f"train.eval_every_epochs must be > 0, got {train.eval_every_epochs}")
    from dpscale.privacy.clipping.precision import Precision  # local: keep config import-light

    if train.precision not in PRECISIONS:
        raise ConfigError(
            f"train.precision must be one of {', '.join(PRECISIONS)}, got {train.precision!r}"
        )
    try:
        Precision("fp16", train.fp16_loss_scale)
    except ValueError as err:
        raise ConfigError(f"train.fp16_loss_scale: {err}") from err
    if train.engine not in ENGINE_NAMES:
        raise ConfigError(f"train.engine must be {_either(ENGINE_NAMES)}, got {train.engine!r}")
    if train.eval_batch_size < 1:
        raise ConfigError(f"train.eval_batch_size must be >= 1, got {train.eval_batch_size}")
    if train.checkpoint_every_minutes is not None and not train.checkpoint_every_minutes > 0:
        raise ConfigError(
            f"train.checkpoint_every_minutes must be > 0 or null, got {train.checkpoint_every_minutes}"
        )
    if train.checkpoint_every_steps is not None and train.checkpoint_every_steps < 1:
        raise ConfigError(
            f"train.checkpoint_every_steps must be >= 1 or null, got {train.checkpoint_every_steps}"
        )


def _validate_compile(train: TrainConfig) -> None:
    """train.compile with an engine and precision it takes (the model's own refusals come when the run
    is built), and train.fixed_shapes true, false or null."""
    if train.fixed_shapes not in (True, False, None):
        raise ConfigError(
            f"train.fixed_shapes must be true, false or null (with compile), got {train.fixed_shapes!r}"
        )
    if not train.compile:
        return
    # local: keep config import-light
    from dpscale.privacy.clipping.compiled import check_compilable
    from dpscale.privacy.clipping.precision import make_precision

    try:
        check_compilable(train.engine, make_precision(train.precision))
    except ValueError as err:
        raise ConfigError(f"train.compile=true: {err}") from err


def _validate_ema(train: TrainConfig) -> None:
    """train.ema_decay (checked after the model: see ``validate``)."""
    if train.ema_decay is not None and not 0 < train.ema_decay < 1:
        raise ConfigError(f"train.ema_decay must be in (0, 1) or null, got {train.ema_decay}")


def _validate_run(run: RunConfig) -> None:
    """The run section: threads, device and seed."""
    if run.threads is not None and run.threads < 1:
        raise ConfigError(f"run.threads must be >= 1 or null, got {run.threads}")
    if not re.fullmatch(r"cpu|cuda(:\d+)?|mps", run.device):
        raise ConfigError(f"run.device must be cpu, cuda, cuda:N or mps, got {run.device!r}")
    if run.seed is not None and run.seed < 0:
        raise ConfigError(f"run.seed must be >= 0 or null, got {run.seed}")


def _validate_optim(optim: OptimConfig) -> None:
    """The optim section: optimizer, learning rate and its schedule."""
    if optim.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name must be {_either(OPTIMIZERS)}, got {optim.name!r}")
    if not optim.lr > 0:
        raise ConfigError(f"optim.lr must be > 0, got {optim.lr}")
    if optim.schedule not in LR_SCHEDULES:
        raise ConfigError(f"optim.schedule must be {_either(LR_SCHEDULES)}, got {optim.schedule!r}")
    if optim.nesterov and (optim.momentum <= 0 or optim.dampening != 0):
        raise ConfigError("optim.nesterov needs optim.momentum > 0 and optim.dampening = 0")
    if optim.warmup_steps < 0 or not 0 <= optim.min_lr_ratio <= 1:
        raise ConfigError("optim.warmup_steps must be >= 0 and optim.min_lr_ratio in [0, 1]")


def _validate_model(model: ModelConfig) -> None:
    """The model section: the initial weights and what trains (freeze_groups, PEFT)."""
    if model.reset_head and model.init is None:
        raise ConfigError(
            "model.reset_head re-initialises the head of weights loaded with model.init; set model.init"
        )
    if model.init_public and model.init is None:
        raise ConfigError(
            "model.init_public declares the run behind model.init public; set model.init"
        )
    if model.init_scaling not in ("none", "meanvar"):
        raise ConfigError(f"model.init_scaling must be none or meanvar, got {model.init_scaling!r}")
    if model.init_scaling == "meanvar" and (
        model.init_seed_model is None or model.init is not None
    ):
        raise ConfigError(
            "model.init_scaling=meanvar needs model.init_seed_model (a run directory) and no model.init"
        )
    if model.init_scaling == "none" and (
        model.init_seed_model is not None or model.init_seed_public
    ):
        raise ConfigError(
            "model.init_seed_model / init_seed_public are for model.init_scaling=meanvar"
        )
    if model.freeze_groups < 0:
        raise ConfigError(f"model.freeze_groups must be >= 0, got {model.freeze_groups}")
    if model.peft not in PEFT_METHODS:
        raise ConfigError(f"model.peft must be {_either(PEFT_METHODS)}, got {model.peft!r}")
    if model.peft != "none" and model.freeze_groups:
        raise ConfigError("model.peft chooses what trains; do not set model.freeze_groups with it")
    if model.lora_rank < 1 or model.train_last_groups < 1:
        raise ConfigError("model.lora_rank and model.train_last_groups must be >= 1")


def _validate_data(config: Config) -> None:
    """The data section: privacy unit, loader, class selection, and what streaming rules out."""
    data = config.data
    _validate_privacy_unit(config)
    if data.loader not in DATA_LOADERS:
        raise ConfigError(
            f"data.loader must be one of {', '.join(DATA_LOADERS)}, got {data.loader!r}"
        )
    if data.workers is not None and data.workers < 0:
        raise ConfigError(
            f"data.workers must be >= 0 (0: read in the training process), got {data.workers}"
        )
    if data.prefetch < 1:
        raise ConfigError(f"data.prefetch must be >= 1, got {data.prefetch}")
    if data.classes is not None and data.random_classes:
        raise ConfigError("set data.classes or data.random_classes, not both")
    if data.max_per_class is not None and data.max_per_class < 1:
        raise ConfigError(f"data.max_per_class must be >= 1, got {data.max_per_class}")
    if data.num_classes is not None and data.num_classes < 2:
        raise ConfigError(
            f"data.num_classes must be >= 2 (a classifier needs at least two classes), got {data.num_classes}"
        )
    if data.num_classes is not None and (
        data.classes is not None or data.random_classes or data.meta_classes
    ):
        raise ConfigError(
            "data.num_classes declares the stored labels; data.classes, random_classes and meta_classes "
            "choose classes and relabel them 0..k-1: set one or the other"
        )
    if data.loader == "stream" and data.selects_classes:
        raise ConfigError(
            "class subsets (data.classes, random_classes, meta_classes, max_per_class) need data.loader=memory"
        )
    if data.loader == "stream":
        if data.name not in ("imagefolder", "shards"):
            raise ConfigError(
                f"data.loader=stream reads image folders and prepared shards (data.name imagefolder or shards), not {data.name!r}"
            )
        if (
            config.features.extractor is not None
            or config.features.normalize != "none"
            or config.features.center
        ):
            raise ConfigError(
                "data.loader=stream feeds pixels to the model; features.extractor, features.normalize and "
                "features.center need data.loader=memory"
            )
        if config.eval.augtest:
            raise ConfigError(
                "eval.augtest is not available with data.loader=stream yet; use data.loader=memory"
            )


def _validate_privacy_unit(config: Config) -> None:
    """The unit's settings, checked where a plan checks them (one place for the rule)."""
    from dpscale.privacy.accounting.group_privacy import check_privacy_unit  # torch-free

    check_privacy_unit(
        config.data.privacy_unit,
        config.dp.max_examples_per_user,
        sampling=config.dp.sampling,
        simulated=config.dp.simulated_batch_size is not None,
    )


def _validate_features(features: FeaturesConfig, is_private: bool) -> None:
    """The features section: extractor, ScatterNet, normalisation (and centring, below)."""
    extractor = features.extractor
    if extractor is not None and not (
        extractor == "scatternet"
        or (extractor.startswith("model:") and len(extractor) > 6)
        or (extractor.startswith("checkpoint:") and len(extractor) > 11)
    ):
        raise ConfigError(
            f"features.extractor must be null or one of {', '.join(FEATURE_EXTRACTORS)}, got {extractor!r}"
        )
    if features.extractor_public and not (extractor or "").startswith("checkpoint:"):
        # Only a trained run can have spent privacy; anything else declared public is a mistake.
        raise ConfigError(
            f"features.extractor_public declares the run behind a checkpoint:<run dir> extractor public; "
            f"features.extractor is {extractor!r}"
        )
    if (
        features.scatter_j < 1
        or features.scatter_angles < 1
        or features.scatter_order not in (1, 2)
    ):
        raise ConfigError(
            "features.scatter_j and scatter_angles must be >= 1 and scatter_order 1 or 2"
        )
    if features.scatter_pad < 0:
        raise ConfigError(
            f"features.scatter_pad must be >= 0 (pixels per side), got {features.scatter_pad}"
        )
    from dpscale.features.normalize import NORMALIZATIONS  # local, as for AUGMENTATIONS

    if features.normalize not in NORMALIZATIONS:
        raise ConfigError(
            f"features.normalize must be one of {', '.join(NORMALIZATIONS)}, got {features.normalize!r}"
        )
    if features.groups < 1:
        raise ConfigError(f"features.groups must be >= 1, got {features.groups}")
    if not all(c > 0 and math.isfinite(c) for c in features.norm_clip):
        raise ConfigError(
            f"features.norm_clip must be two positive numbers [C1, C2], got {list(features.norm_clip)}"
        )
    if not (features.norm_noise >= 0 and math.isfinite(features.norm_noise)):
        raise ConfigError(f"features.norm_noise must be >= 0, got {features.norm_noise}")
    if not features.norm_floor > 0:
        raise ConfigError(f"features.norm_floor must be > 0, got {features.norm_floor}")
    if features.batch_size < 1:
        raise ConfigError(f"features.batch_size must be >= 1, got {features.batch_size}")
    if is_private and features.normalize == "datanorm" and features.norm_noise == 0:
        raise ConfigError(
            "features.normalize=datanorm with features.norm_noise=0 releases exact statistics of the private "
            "data; set norm_noise > 0 (the paper uses 6 or 8) or use normalize=groupnorm"
        )
    _validate_centring(features, is_private)


def _validate_centring(features: FeaturesConfig, is_private: bool) -> None:
    """features.center's clip and noise (exact means of private data refused)."""
    if not (features.center_clip > 0 and math.isfinite(features.center_clip)):
        raise ConfigError(
            f"features.center_clip must be a positive number, got {features.center_clip}"
        )
    if not (features.center_noise >= 0 and math.isfinite(features.center_noise)):
        raise ConfigError(f"features.center_noise must be >= 0, got {features.center_noise}")
    if is_private and features.center and features.center_noise == 0:
        raise ConfigError(
            "features.center with features.center_noise=0 subtracts the exact mean of the private data; "
            "set center_noise > 0 (dpscale's presets use 8)"
        )


def _validate_augment(config: Config) -> None:
    """The augment section, and eval.augtest (which votes over augmented views)."""
    augment = config.augment
    # local: keep config import-light; one list of names
    from dpscale.data.augment import AUGMENTATIONS

    if augment.multiplicity < 1:
        raise ConfigError(f"augment.multiplicity must be >= 1, got {augment.multiplicity}")
    if augment.type not in AUGMENTATIONS:
        raise ConfigError(
            f"augment.type must be one of {', '.join(AUGMENTATIONS)}, got {augment.type!r}"
        )
    if augment.padding < 0:  # the image size bounds it too: augment_views refuses padding >= H or W
        raise ConfigError(f"augment.padding must be >= 0 pixels, got {augment.padding}")
    if augment.multiplicity > 1 and config.features.extractor is not None:
        raise ConfigError(
            "augment.multiplicity > 1 augments images; it cannot be combined with features.extractor"
        )
    if config.eval.augtest and augment.multiplicity < 2:
        raise ConfigError(
            "eval.augtest votes over augment.multiplicity views: set augment.multiplicity >= 2"
        )

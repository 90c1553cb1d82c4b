"""What a run's DP plan is made of, worked out once for every caller: the Trainer, ``dpscale
tan simulate --dry-run``, ``tan privacy-search --config`` and sweeps all ask here, so they
report the same N, steps and epsilon for a config (class subsets, ``data.skip_corrupt``,
source runs and a Mean-Var seed run included)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np
import torch

from dpscale.config import Config, is_private_config, plan_labels
from dpscale.errors import ConfigError
from dpscale.data.datasets import dataset_fingerprint
from dpscale.data.image_dataset import ImageDataset
from dpscale.data.run_data import open_training_data, training_fingerprint
from dpscale.data.stream import StreamedData
from dpscale.features.source_run import read_source_run, refuse_user_level_history
from dpscale.features.pipeline import extractor_privacy, feature_releases
from dpscale.models.init import init_privacy
from dpscale.privacy.accounting.segments import AccountingSegment
from dpscale.privacy.plan.make_plan import steps_for
from dpscale.privacy.plan.dp_plan import DPPlan
from dpscale.privacy.plan.source_runs import SourceRunPrivacy
from dpscale.train.plan_config import (
    bands_request,
    check_plan_against_config,
    check_same_unit,
    plan_from_config,
    refuse_per_tensor_without_model,
)

SEED_MODEL_RUN = "init-seed-run"  # label of a Mean-Var seed run's releases in this run's accountant


@dataclass(frozen=True)
class SourceRuns:
    """The earlier runs a config draws on, and what each released before this run's first step.

    Attributes:
        extractor: a checkpoint feature extractor's run (None: none, or a public one).
        init_run: the model.init source run.
        releases: every release made before the first step, in accounting order: the
            extractor's run, the model.init run, Data Normalization, the Mean-Var seed run.
    """

    extractor: SourceRunPrivacy | None
    init_run: SourceRunPrivacy | None
    releases: tuple[AccountingSegment, ...]


@dataclass(frozen=True)
class PlanInputs:
    """The numbers a config's DP plan is made from.

    Attributes:
        dataset_size: N, the training examples the sampler draws from (after class subsets,
            skipped corrupt files and an audit's canaries).
        steps: S, logical steps.
        sources: the source runs and releases before the first step.
    """

    dataset_size: int
    steps: int
    sources: SourceRuns

    @property
    def releases(self) -> tuple[AccountingSegment, ...]:
        return self.sources.releases

    @property
    def extractor(self) -> SourceRunPrivacy | None:
        return self.sources.extractor

    @property
    def init_run(self) -> SourceRunPrivacy | None:
        return self.sources.init_run


def source_runs(config: Config, fingerprint_as: Callable[[bool], str]) -> SourceRuns:
    """The source runs of ``config``; one that cannot be composed is refused at once.

    Args:
        fingerprint_as: the run's training-set fingerprint as prepared with a given
            data.normalize (a source run is matched to this run's data by fingerprint).
    """
    private = is_private_config(config.dp)
    extractor, extractor_releases = extractor_privacy(config.features, fingerprint_as, private)
    init_run, init_releases = init_privacy(config.model, fingerprint_as, private)
    releases = (
        extractor_releases
        + init_releases
        + feature_releases(config.features)
        + seed_model_releases(config)
    )
    return SourceRuns(extractor=extractor, init_run=init_run, releases=releases)


def seed_model_releases(config: Config) -> tuple[AccountingSegment, ...]:
    """Mean-Var init releases statistics of its seed model, which trained on private data: that
    run's whole accounting history, composed into this run's plan (unless declared public)."""
    model = config.model
    if model.init_scaling != "meanvar" or model.init_seed_public:
        return ()
    assert model.init_seed_model is not None  # validate() requires it with meanvar
    try:
        source = read_source_run(model.init_seed_model)
    except ValueError as err:  # a mistyped path is the user's error: one line, naming the key
        raise ConfigError(f"model.init_seed_model={model.init_seed_model!r}: {err}") from err
    if not source.private:
        raise ConfigError(
            f"model.init_seed_model={model.init_seed_model} trained without privacy: its Mean-Var statistics would "
            "release its training data without a guarantee; use a private seed run, or set "
            "model.init_seed_public=true if its training data is public"
        )
    refuse_user_level_history(
        source, "model.init_seed_model", model.init_seed_model, "model.init_seed_public"
    )
    return tuple(replace(seg, label=f"{SEED_MODEL_RUN}:{seg.label}") for seg in source.history)


def inputs_for(config: Config, dataset_size: int, sources: SourceRuns) -> PlanInputs:
    """The plan's inputs for ``dataset_size`` privacy units (examples, or users: ``privacy_units``;
    steps from train.epochs/steps, an epoch a pass over the units)."""
    steps = steps_for(config.train.epochs, config.train.steps, dataset_size, config.dp.batch_size)
    return PlanInputs(dataset_size=dataset_size, steps=steps, sources=sources)


def privacy_units(config: Config, data: Any) -> int:
    """N of the plan: the training examples, or at data.privacy_unit=user the distinct users.

    Raises:
        ConfigError: the user unit on data without user ids (or ids that do not match its examples).
    """
    if config.data.privacy_unit == "example":
        return data.info.num_train
    ids = getattr(data, "user_ids", None)
    if ids is None:
        raise ConfigError(
            f"data.privacy_unit=user needs a user id per training image, and {config.data.name} at "
            f"{config.data.root or 'its built-in source'} names none: add a user_ids array to the npz file, a "
            "train-user-ids.txt (one id per line) beside IDX/CIFAR files, or a users.csv (path,user) in an image "
            "folder (docs/privacy-units.md)"
        )
    if len(ids) != data.info.num_train:
        raise ConfigError(
            f"{len(ids)} user ids for {data.info.num_train} training images: the ids no longer match them"
        )
    return len(np.unique(ids))


def plan_inputs(config: Config, *, log: Callable[[str], Any] = lambda _: None) -> PlanInputs:
    """The plan's inputs for ``config`` without training: its data opened as the Trainer opens
    it (on the CPU), its source runs checked. (No audit canaries: ``dpscale audit`` adds them.)
    dp.max_grad_norm_per=tensor is refused before the data is opened: its plan needs the model.

    Args:
        config: the run's config; log: prints a notice from opening the data.

    Returns:
        N, S and the source runs, as the Trainer finds them.
    """
    refuse_per_tensor_without_model(config.dp)
    images = open_training_data(config, torch.device("cpu"), log)

    def fingerprint_as(normalize: bool) -> str:  # asked only when a source run must be matched
        if normalize == config.data.normalize:
            return data_fingerprint(images)
        return training_fingerprint(config, normalize)

    return inputs_for(config, privacy_units(config, images), source_runs(config, fingerprint_as))


def data_fingerprint(images: ImageDataset | StreamedData) -> str:
    """The fingerprint checkpoints store for a run's training images (of the images, not the
    extracted features: those may differ in the last bit between machines)."""
    return images.fingerprint if isinstance(images, StreamedData) else dataset_fingerprint(images)


def _refuse_composed_sources_per_user(config: Config, sources: SourceRuns) -> None:
    """A source run trained on this data (checkpoint extractor, model.init) spent an example-level
    budget: composing it into a user-level epsilon would misstate it. Refused, in one line."""
    runs = [run for run in (sources.extractor, sources.init_run) if run is not None]
    seed_model = any(seg.label.startswith(f"{SEED_MODEL_RUN}:") for seg in sources.releases)
    if config.data.privacy_unit == "user" and (
        seed_model or any(run.case == "composed" for run in runs)
    ):
        raise ConfigError(
            "data.privacy_unit=user cannot compose a source run on the same data (its history is accounted per "
            "image): train the source on public data, or declare it public (features.extractor_public, "
            "model.init_public, model.init_seed_public)"
        )


def plan_for(
    config: Config,
    inputs: PlanInputs,
    saved: DPPlan | None = None,
    *,
    parameters: int | None = None,
    names: Sequence[str] | None = None,
) -> DPPlan:
    """The DP plan the Trainer runs under: a new one (calibrated), or a checkpoint's ``saved``
    plan checked against the config and inputs (a changed source run is refused: its releases
    differ; so is other clipping). Either way with the labels the config determines (a fixed seed,
    the source runs' cases, checks off, secure noise): they are no privacy numbers, and older
    checkpoints lack them.

    Args:
        config: the run's config; inputs: N, S and the source runs (``inputs_for``).
        saved: a checkpoint's plan (None: a new run).
        parameters: the model's trainable parameters (BandMF's noise memory; None: not checked).
        names: the model's trainable tensors' names after model.peft, in ``named_parameters()``
            order: dp.max_grad_norm_per=tensor gives each its bound (None, without a model: refused).

    Returns:
        The plan, new or ``saved``.
    """
    labels = plan_labels(config)
    n, steps, sources = inputs.dataset_size, inputs.steps, inputs.sources
    correlated = bands_request(config, steps, parameters)
    _refuse_composed_sources_per_user(config, sources)
    if saved is None:
        plan = plan_from_config(
            config.dp,
            n,
            steps,
            sources.releases,
            seeded=labels["seeded"],
            extractor=sources.extractor,
            correlated=correlated,
            names=names,
            privacy_unit=config.data.privacy_unit,
        )
    else:
        check_same_unit(saved, config.data.privacy_unit, config.dp.max_examples_per_user)
        check_plan_against_config(saved, config.dp, n, steps, sources.releases, correlated, names)
        plan = saved
    return replace(
        plan,
        extractor=sources.extractor,
        init_run=sources.init_run,
        seeded=labels["seeded"],
        engine_unchecked=labels["engine_unchecked"],
        secure_noise=labels["secure_noise"],
    )

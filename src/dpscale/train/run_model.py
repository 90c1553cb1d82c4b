"""The model a run trains: built and seeded, initialised for a new run (model.init, Mean-Var), on its
device, checked for per-example clipping, its block groups frozen and PEFT applied."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable

import torch
from torch import nn

from dpscale.config import Config
from dpscale.errors import ConfigError
from dpscale.models import build_model, freeze_block_groups
from dpscale.models.init import init_from, meanvar_init, read_weights
from dpscale.models.peft import apply_peft
from dpscale.privacy.clipping.layer_refusals import check_per_example_compatible

Log = Callable[[str], Any]


def run_model(
    config: Config,
    info: Any,
    seeds: dict[str, int],
    device: torch.device,
    log: Log,
    *,
    initial_weights: bool,
) -> tuple[nn.Module, dict[str, Any] | None, int]:
    """The model ``config`` describes, ready to train on ``device``.

    Args:
        config: the run's config (its ``model`` section).
        info: the training data's info (classes, input shape).
        seeds: the run's seeds (``init`` seeds the weights and Mean-Var's draws).
        device: where the model trains.
        log: prints a line of the run's report.
        initial_weights: a new run (model.init and Mean-Var applied); a resumed run's weights come
            from its checkpoint.

    Returns:
        The model, what initialised it (None: its default init), and its trainable parameters.
    """
    model, init_report = _model(config, info, seeds, log, initial_weights)
    model.to(device)
    check_per_example_compatible(model)
    if config.model.freeze_groups:
        freeze_block_groups(model, config.model.freeze_groups)
    return model, init_report, _peft(model, config, log)


def _peft(model: nn.Module, config: Config, log: Log) -> int:
    """model.peft applied (the same on resume: the checkpoint's state dict has the adapters);
    returns the trainable parameters."""
    cfg = config.model
    try:
        trainable = apply_peft(
            model,
            cfg.peft,
            rank=cfg.lora_rank,
            alpha=cfg.lora_alpha,
            targets=cfg.lora_targets,
            last_groups=cfg.train_last_groups,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if cfg.peft != "none":
        total = sum(p.numel() for p in model.parameters())
        log(
            f"model.peft={cfg.peft}: {trainable:,} of {total:,} parameters train (clipped and noised); the rest is frozen"
        )
    return trainable


def _model(
    config: Config, info: Any, seeds: dict[str, int], log: Log, initial_weights: bool
) -> tuple[nn.Module, dict[str, Any] | None]:
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
        counts = meanvar_init(
            model, read_weights(cfg.init_seed_model), torch.Generator().manual_seed(seeds["init"])
        )
        report = {"source": cfg.init_seed_model, "scaling": "meanvar", **counts}
        log(
            f"model.init_scaling=meanvar: {counts['scaled']} tensors drawn with the statistics of "
            f"{cfg.init_seed_model} ({counts['kept']} kept at their default init)"
        )
    return model, report

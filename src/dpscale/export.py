"""``dpscale export``: a run's model as a file to hand on, with its privacy statement attached.

The file holds the weights only (no optimizer, RNG or accountant state), LoRA adapters merged,
wrapped so that it takes float32 images in [0, 1] (the run's normalisation inside), and the
metadata of ``dpscale.exported`` (model, input, class names, test accuracy, privacy statement,
the step exported and the dpscale version). A card beside it, ``<file name>.card.md``, says the
same for people: one card per exported file. Nothing shipped names a local path (the run
directory, the data root, the home directory): those stay in the run directory's config.yaml.

A run still training (its lock held) or one that stopped before its planned steps is refused
unless ``allow_partial``; its card then says which step of how many it holds.

The writers of the three formats are in ``dpscale.export_formats``, the card in ``dpscale.export_card``.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

import dpscale
from dpscale._io import atomic_write_text, make_private_dir
from dpscale.errors import ConfigError
from dpscale.choices import EXPORT_FORMATS

# partial_note: cli/outputs.py's import
from dpscale.export_card import model_card, partial_note as partial_note
from dpscale.export_formats import WRITERS
from dpscale.exported import SUFFIXES, ImagesInUnitRange, ScatterNetFeatures
from dpscale.models.peft import merge_lora
from dpscale.runs import LOCK_NAME, NotARunDirectory, holds_checkpoint, is_run_dir, read_run
from dpscale.train.metrics import json_safe

if TYPE_CHECKING:  # loaded on demand (export imports no training code at import time)
    from dpscale.train.loop import Trainer

try:  # POSIX; elsewhere a run directory is not locked (dpscale.train.rundir.RunLock)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

EXPORT_FOLDER = "export"  # default place inside the run directory
CARD_SUFFIX = ".card.md"  # model.safetensors -> model.safetensors.card.md: one card per file, every format its own


@dataclass(frozen=True)
class Exported:
    """Attributes: path: the model file; card: its card (``<file name>.card.md``); metadata: what the file carries."""

    path: Path
    card: Path
    metadata: dict[str, Any]


def card_path(path: str | Path) -> Path:
    """The card of the exported file ``path``, beside it.

    Args:
        path: the model file.

    Returns:
        ``<path>.card.md``.
    """
    path = Path(path)
    return path.with_name(path.name + CARD_SUFFIX)


def export_run(
    run_dir: str | Path,
    fmt: str,
    out: str | Path | None = None,
    ema: bool = False,
    allow_partial: bool = False,
) -> Exported:
    """Write the model of the run in ``run_dir`` as ``fmt`` (safetensors, torchscript, onnx), and its card.

    Args:
        run_dir: the run directory.
        fmt: one of ``EXPORT_FORMATS``.
        out: the file to write (default: ``run_dir/export/model<suffix>``, EMA: ``model-ema<suffix>``).
        ema: the EMA weights instead of the raw model's (``train.ema_decay`` runs).
        allow_partial: export a run that is still training or stopped before its planned steps
            (its newest checkpoint; the card says "partial: step S of T").

    Returns:
        The file, its card and its metadata.

    Raises:
        ConfigError: an unknown format; no run, or no checkpoint, in ``run_dir``; a run still
            training or unfinished without ``allow_partial``; no EMA model with ``ema``; a
            feature-extractor run; a missing package (safetensors, onnx).
    """
    from dpscale.train.loop import Trainer

    if fmt not in EXPORT_FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(EXPORT_FORMATS)}, got {fmt!r}")
    # before the data is loaded: a refusal is quick
    holder = check_exportable(Path(run_dir), allow_partial)
    trainer = Trainer.load(run_dir, progress=False)
    model = _exportable_model(trainer, ema)
    # evaluated on the run's device
    metadata = _metadata(trainer, model, fmt, ema, training=holder is not None)
    features = _feature_stage(trainer, metadata)
    metadata = _without_local_paths(metadata, _local_paths(trainer))
    model = model.float().cpu()
    path = (
        Path(out)
        if out is not None
        else Path(run_dir) / EXPORT_FOLDER / f"model{'-ema' if ema else ''}{SUFFIXES[fmt]}"
    )
    make_private_dir(path.parent)  # owner-only, like every output
    wrapped = ImagesInUnitRange(
        model if features is None else nn.Sequential(features, model), trainer.config.data.normalize
    )
    WRITERS[fmt](wrapped.eval(), metadata, path)
    card = card_path(path)
    atomic_write_text(card, model_card(metadata, path))
    return Exported(path, card, metadata)


def check_exportable(run_dir: Path, allow_partial: bool) -> str | None:
    """Refuse what is no finished run: no run, no checkpoint yet, a run still training, one that
    stopped before its planned steps (the last two unless ``allow_partial``).

    Args:
        run_dir: the run directory.
        allow_partial: let a run still training or unfinished through.

    Returns:
        The process training in ``run_dir`` as its lock names it, or None when none is.

    Raises:
        ConfigError (NotARunDirectory for no run): one line naming the run, its lock holder and its step.
    """
    if not is_run_dir(run_dir):
        raise NotARunDirectory(f"{run_dir} is not a dpscale run directory (no config.yaml)")
    holder = training_holder(run_dir)
    training = f"{run_dir} is still training ({holder})" if holder else None
    if not holds_checkpoint(run_dir):
        raise ConfigError(
            f"{training} and has no checkpoint yet: nothing to export; wait for its first checkpoint"
            if training
            else f"{run_dir} holds a run that stopped before its first checkpoint: nothing to export; continue it "
            f"with `dpscale train --resume {run_dir}`"
        )
    if allow_partial:
        return holder
    step, planned = _progress(run_dir)
    if training:
        raise ConfigError(
            f"{training}: its newest checkpoint is step {step} of {planned}; wait for the run to "
            f"finish, or {_PARTIAL_HINT}"
        )
    if step < planned:
        raise ConfigError(
            f"{run_dir} stopped at step {step} of {planned} (not finished); finish it with "
            f"`dpscale train --resume {run_dir}`, or {_PARTIAL_HINT}"
        )
    return None


_PARTIAL_HINT = "export that checkpoint as it stands with --allow-partial (its card then says so)"


def training_holder(run_dir: Path) -> str | None:
    """The process training in ``run_dir`` now, as its lock file names it ("pid P on HOST since T"),
    or None. The flock tells, not the file: a run killed mid-training leaves a lock file that no
    process holds, and that does not count.

    Args:
        run_dir: the run directory.

    Returns:
        The holder's note, or None when no live process holds the lock.
    """
    from dpscale.train.rundir import _named_holder  # the one reader of the holder's note

    if fcntl is None:  # pragma: no cover - Windows: runs are not locked there
        return None
    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        # Shared, non-blocking and at once released: a trainer that starts in these microseconds
        # is the only one that could be refused because of it.
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _named_holder(fd)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _progress(run_dir: Path) -> tuple[int, int]:
    """(step of the newest checkpoint, planned steps S), read without loading the data."""
    _, state = read_run(run_dir)
    return int(state["step"]), int(state["mechanism"]["plan"]["steps"])


def _exportable_model(trainer: Trainer, ema: bool) -> nn.Module:
    """A copy of the run's model (or EMA model) on the run's device, LoRA merged, in eval mode."""
    config = trainer.config
    if config.features.extractor not in (None, "scatternet"):
        raise ConfigError(
            f"export takes models trained on images or ScatterNet features; this run trains on "
            f"{config.features.extractor} features (that extractor is not part of an export yet)"
        )
    if config.features.extractor is None and not trainer.built.feature_normalizer.is_identity:
        # the export's images path carries data.normalize only: without this the file would
        # silently skip the run's own input normalisation and give other logits
        raise ConfigError(
            "export takes runs on images without features.normalize or features.center "
            "(their normalisation of the images is not part of an export yet)"
        )
    average = trainer.built.ema
    if ema and average is None:
        raise ConfigError("--ema: this run has no EMA model (train.ema_decay was not set)")
    source = average.model if ema and average is not None else trainer.model
    return merge_lora(copy.deepcopy(source)).eval()


def _metadata(
    trainer: Trainer, model: nn.Module, fmt: str, ema: bool, training: bool
) -> dict[str, Any]:
    """The metadata every format carries (``dpscale.exported``).

    Args:
        trainer: the run, loaded at its newest checkpoint.
        model: the weights exported (evaluated here, as the run evaluates).
        fmt, ema: the format and which weights.
        training: the run was still training (exported with allow_partial).

    Returns:
        The metadata, JSON-safe (local paths not yet removed: ``_without_local_paths``).
    """
    from dpscale.train import report

    accuracy, loss = trainer.evaluate_model(model)  # the run's own evaluation of these weights
    privacy = report.privacy_summary(trainer.built, trainer.progress, trainer.privacy_warnings())
    privacy["privacy_status"] = trainer.plan.status(
        privacy["epsilon"], privacy["reference_epsilon"]
    )
    return json_safe(
        {
            "dpscale_export": 1,
            "dpscale_version": dpscale.__version__,
            "format": fmt,
            "weights": "ema" if ema else "final",
            **_model_and_data(trainer, model),
            "test_accuracy": accuracy,
            "test_loss": loss,
            "step": trainer.step,
            "planned_steps": trainer.total_steps,
            "partial": trainer.step < trainer.total_steps,
            "exported_while_training": training,
            "privacy": privacy,
        }
    )


def _model_and_data(trainer: Trainer, model: nn.Module) -> dict[str, Any]:
    """The metadata's "model", "input", "classes" and "data" entries (``_metadata``'s)."""
    config, info = trainer.config, trainer.data.info
    val_labels = config.data.val_labels
    return {
        "model": {
            "name": config.model.name,
            "num_classes": info.num_classes,
            "input_shape": list(info.input_shape),
            "activation": config.model.activation,
            "kwargs": dict(config.model.kwargs),
            "parameters": sum(p.numel() for p in model.parameters()),
        },
        "input": {
            "dtype": "float32",
            "layout": "NCHW",
            "shape": list(info.input_shape),
            "range": [0.0, 1.0],
            "normalize": config.data.normalize,
            "normalization": "(x - 0.5) / 0.5, inside the model"
            if config.data.normalize
            else "none",
        },
        "classes": _class_names(info),
        # no root: a local path means nothing elsewhere (the run directory's config.yaml keeps it)
        "data": {
            "name": info.name,
            "image_size": config.data.image_size,
            "val_labels": Path(val_labels).name if val_labels else None,
            "selects_classes": config.data.selects_classes,
            "test_split": info.test_split,
            "num_test": info.num_test,
        },
    }


def _class_names(info: Any) -> list[str]:
    """Output i's name, for the run's ``DatasetInfo``: the data's own (image folders, shards), and
    "i" where it names none (other datasets, or labels past its names that data.num_classes declares)."""
    names = [str(name) for name in info.classes[: info.num_classes]]
    return names + [str(k) for k in range(len(names), info.num_classes)]


def _local_paths(trainer: Trainer) -> list[tuple[str, str]]:
    """This machine's paths the run knows (absolute), each with what a shipped file says instead;
    longest first, so a run directory under the home directory is named as the run directory."""
    config = trainer.config
    named = [
        (trainer.run_dir, "<run directory>"),
        (config.data.root, "<data root>"),
        (config.data.val_labels, "<val labels>"),
        (config.model.init, "<model.init>"),
        (config.model.init_seed_model, "<model.init_seed_model>"),
        (Path.home(), "~"),
    ]
    # a path changed on resume is quoted, old and new, in the privacy section's config_changes
    named += [
        (value, "<local path>")
        for value in _strings(trainer.progress.config_changes)
        if Path(value).expanduser().is_absolute()
    ]
    found: dict[str, str] = {}
    for value, stand_in in named:
        if value is None:
            continue
        path = Path(value).expanduser()
        for form in (path.absolute(), path.resolve()):
            if len(form.parts) > 1:  # never "/" itself
                found.setdefault(str(form), stand_in)
    return sorted(found.items(), key=lambda item: -len(item[0]))


def _strings(value: Any) -> list[str]:
    """Every string in a nest of dicts and lists."""
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def _without_local_paths(value: Any, paths: list[tuple[str, str]]) -> Any:
    """``value`` (the metadata) with every path of ``paths`` in its strings replaced by its stand-in:
    caveats, warnings and the config changes asked for on resume may quote them."""
    if isinstance(value, dict):
        return {k: _without_local_paths(v, paths) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_local_paths(v, paths) for v in value]
    if isinstance(value, str):
        for path, stand_in in paths:  # a whole path only: /root is not /rootfs
            value = re.sub(re.escape(path) + r"(?![\w.-])", stand_in, value)
    return value


def _feature_stage(trainer: Trainer, metadata: dict[str, Any]) -> ScatterNetFeatures | None:
    """A ScatterNet run's feature map and normalisation as a module (None for a run on images);
    its spec goes into ``metadata["features"]`` and the input shape becomes the images'."""
    features = trainer.config.features
    if features.extractor is None:
        return None
    normalizer = trainer.built.feature_normalizer
    spec = {
        "extractor": "scatternet",
        "J": features.scatter_j,
        "L": features.scatter_angles,
        "max_order": features.scatter_order,
        "pad": features.scatter_pad,
        "image_shape": list(_image_shape(trainer)),
        "normalize": normalizer.kind,
        "groups": normalizer.groups,
        "center": normalizer.center is not None,
    }
    stats = normalizer.stats
    stage = ScatterNetFeatures(
        spec, stats.mean if stats else None, stats.var if stats else None, normalizer.center
    )
    stage.eval()
    metadata["features"], metadata["input"]["shape"] = spec, spec["image_shape"]
    return stage


def _image_shape(trainer: Trainer) -> tuple[int, int, int]:
    """The images' (C, H, W), from the features' shape: the ScatterNet's shape rule run backwards
    (and checked forwards)."""
    from dpscale.features.scatternet import scatter_channels, scatter_output_shape

    f = trainer.config.features
    channels, h, w = trainer.data.info.input_shape
    scale = 2**f.scatter_j
    image = (
        channels // scatter_channels(f.scatter_j, f.scatter_angles, f.scatter_order),
        h * scale - 2 * f.scatter_pad,
        w * scale - 2 * f.scatter_pad,
    )
    if scatter_output_shape(
        image, f.scatter_j, f.scatter_angles, f.scatter_order, f.scatter_pad
    ) != (channels, h, w):
        raise ConfigError(
            f"cannot tell the image shape behind features of shape {(channels, h, w)}"
        )
    return image

"""``dpscale export``: a run's model as a file to hand on, with its privacy statement attached.

The file holds the weights only (no optimizer, RNG or accountant state), LoRA adapters merged,
wrapped so that it takes float32 images in [0, 1] (the run's normalisation inside), and the
metadata of ``dpscale.exported`` (model, input, classes, test accuracy, privacy statement).
A ``MODEL_CARD.md`` beside it says the same for people. Load with ``dpscale.exported``.
"""

from __future__ import annotations

import copy
import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpscale._io import atomic_write_bytes, atomic_write_text
from dpscale.errors import ConfigError
from dpscale.choices import EXPORT_FORMATS
from dpscale.exported import (
    FEATURE_STATS_PREFIX,
    METADATA_KEY,
    SUFFIXES,
    TORCHSCRIPT_METADATA,
    ImagesInUnitRange,
    ScatterNetFeatures,
)
from dpscale.models.peft import merge_lora
from dpscale.train.metrics import json_safe

EXPORT_FOLDER = "export"  # default place inside the run directory
CARD_NAME = "MODEL_CARD.md"


@dataclass(frozen=True)
class Exported:
    """Attributes: path: the model file; card: MODEL_CARD.md; metadata: what the file carries."""

    path: Path
    card: Path
    metadata: dict[str, Any]


def export_run(run_dir: str | Path, fmt: str, out: str | Path | None = None, ema: bool = False) -> Exported:
    """Write the model of the run in ``run_dir`` as ``fmt`` (safetensors, torchscript, onnx).

    Args:
        out: the file to write (default: ``run_dir/export/model<suffix>``, EMA: ``model-ema<suffix>``).
        ema: the EMA weights instead of the raw model's (``train.ema_decay`` runs).

    Raises:
        ConfigError: an unknown format, no EMA model with ``ema``, a feature-extractor run, a
            missing package (safetensors, onnx).
    """
    from dpscale.train.loop import Trainer

    if fmt not in EXPORT_FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(EXPORT_FORMATS)}, got {fmt!r}")
    trainer = Trainer.load(run_dir, progress=False)
    model = _exportable_model(trainer, ema)
    metadata = _metadata(trainer, model, fmt, ema)  # evaluated on the run's device, as the run did
    features = _feature_stage(trainer, metadata)
    model = model.float().cpu()
    path = Path(out) if out is not None else Path(run_dir) / EXPORT_FOLDER / f"model{'-ema' if ema else ''}{SUFFIXES[fmt]}"
    path.parent.mkdir(parents=True, exist_ok=True)
    wrapped = ImagesInUnitRange(model if features is None else nn.Sequential(features, model), trainer.config.data.normalize)
    _WRITERS[fmt](wrapped.eval(), metadata, path)
    card = path.parent / CARD_NAME
    atomic_write_text(card, model_card(metadata, path))
    return Exported(path, card, metadata)


def _exportable_model(trainer: Any, ema: bool) -> nn.Module:
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
    if ema and trainer.built.ema is None:
        raise ConfigError("--ema: this run has no EMA model (train.ema_decay was not set)")
    source = trainer.built.ema.model if ema else trainer.model
    return merge_lora(copy.deepcopy(source)).eval()


def _metadata(trainer: Any, model: nn.Module, fmt: str, ema: bool) -> dict[str, Any]:
    """The metadata every format carries (``dpscale.exported``)."""
    from dpscale.train import report

    config, info = trainer.config, trainer.data.info
    accuracy, loss = trainer.evaluate_model(model)  # the run's own evaluation of these weights
    privacy = report.privacy_summary(trainer)
    privacy["privacy_status"] = trainer.plan.status(privacy["epsilon"], privacy["reference_epsilon"])
    return json_safe({
        "dpscale_export": 1,
        "format": fmt,
        "weights": "ema" if ema else "final",
        "model": {"name": config.model.name, "num_classes": info.num_classes, "input_shape": list(info.input_shape),
                  "activation": config.model.activation, "kwargs": dict(config.model.kwargs),
                  "parameters": sum(p.numel() for p in model.parameters())},
        "input": {"dtype": "float32", "layout": "NCHW", "shape": list(info.input_shape), "range": [0.0, 1.0],
                  "normalize": config.data.normalize,
                  "normalization": "(x - 0.5) / 0.5, inside the model" if config.data.normalize else "none"},
        "classes": [str(k) for k in range(info.num_classes)],
        # the root as this process found it (a relative root means nothing from another directory)
        "data": {"name": info.name, "root": str(Path(config.data.root).resolve()) if config.data.root else None,
                 "image_size": config.data.image_size,
                 "val_labels": config.data.val_labels, "selects_classes": config.data.selects_classes,
                 "test_split": info.test_split, "num_test": info.num_test},
        "test_accuracy": accuracy,
        "test_loss": loss,
        "step": trainer.step,
        "run_dir": str(trainer.run_dir),
        "privacy": privacy,
    })  # fmt: skip


def _feature_stage(trainer: Any, metadata: dict[str, Any]) -> ScatterNetFeatures | None:
    """A ScatterNet run's feature map and normalisation as a module (None for a run on images);
    its spec goes into ``metadata["features"]`` and the input shape becomes the images'."""
    features = trainer.config.features
    if features.extractor is None:
        return None
    normalizer = trainer.built.feature_normalizer
    spec = {
        "extractor": "scatternet", "J": features.scatter_j, "L": features.scatter_angles,
        "max_order": features.scatter_order, "pad": features.scatter_pad,
        "image_shape": list(_image_shape(trainer)), "normalize": normalizer.kind, "groups": normalizer.groups,
        "center": normalizer.center is not None,
    }  # fmt: skip
    stats = normalizer.stats
    stage = ScatterNetFeatures(spec, stats.mean if stats else None, stats.var if stats else None, normalizer.center)
    stage.eval()
    metadata["features"], metadata["input"]["shape"] = spec, spec["image_shape"]
    return stage


def _image_shape(trainer: Any) -> tuple[int, int, int]:
    """The images' (C, H, W), from the features' shape: the ScatterNet's shape rule run backwards
    (and checked forwards)."""
    from dpscale.features.scatternet import scatter_channels, scatter_output_shape

    f = trainer.config.features
    channels, h, w = trainer.data.info.input_shape
    scale = 2**f.scatter_j
    image = (channels // scatter_channels(f.scatter_j, f.scatter_angles, f.scatter_order),
             h * scale - 2 * f.scatter_pad, w * scale - 2 * f.scatter_pad)  # fmt: skip
    if scatter_output_shape(image, f.scatter_j, f.scatter_angles, f.scatter_order, f.scatter_pad) != (channels, h, w):
        raise ConfigError(f"cannot tell the image shape behind features of shape {(channels, h, w)}")
    return image


def _needs(package: str, fmt: str) -> None:
    try:
        __import__(package)
    except ImportError as err:
        raise ConfigError(f"--format {fmt} needs the {package} package: pip install {package}") from err


def _write_safetensors(model: ImagesInUnitRange, metadata: dict[str, Any], path: Path) -> None:
    _needs("safetensors", "safetensors")
    from safetensors.torch import save

    inner = model.classifier
    classifier, features = (inner[1], inner[0]) if isinstance(inner, nn.Sequential) else (inner, None)
    weights = {k: v.contiguous() for k, v in classifier.state_dict().items()}
    if features is not None and features.kind == "datanorm":  # the released statistics, as the run used them
        weights[f"{FEATURE_STATS_PREFIX}mean"] = features.norm_mean.contiguous()
        weights[f"{FEATURE_STATS_PREFIX}var"] = features.norm_var.contiguous()
    if features is not None and features.feature_center is not None:  # private centring's released mean
        weights[f"{FEATURE_STATS_PREFIX}center"] = features.feature_center.contiguous()
    atomic_write_bytes(path, save(weights, metadata={METADATA_KEY: json.dumps(metadata)}))


def _example(metadata: dict[str, Any]) -> torch.Tensor:
    return torch.rand(2, *metadata["input"]["shape"], generator=torch.Generator().manual_seed(0))


def _write_torchscript(model: ImagesInUnitRange, metadata: dict[str, Any], path: Path) -> None:
    if metadata.get("features"):  # tracing probes kymatio's deprecated attributes, which raise NameError (0.3)
        raise ConfigError("--format torchscript cannot trace the ScatterNet (kymatio 0.3); use safetensors or onnx")
    extra = {TORCHSCRIPT_METADATA: json.dumps(metadata)}
    # torch >= 2.9 marks TorchScript deprecated; it is still what torch-only consumers load
    with torch.no_grad(), warnings.catch_warnings():  # no_grad: every layer's inference path
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(model, _example(metadata))
        buffer = io.BytesIO()
        torch.jit.save(traced, buffer, _extra_files=extra)
    atomic_write_bytes(path, buffer.getvalue())


def _write_onnx(model: ImagesInUnitRange, metadata: dict[str, Any], path: Path) -> None:
    _needs("onnx", "onnx")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.export's own deprecations
        program = torch.onnx.export(
            model, (_example(metadata),), input_names=["images"], output_names=["logits"],
            dynamic_shapes={"images": {0: torch.export.Dim("batch")}}, verbose=False,
        )  # fmt: skip
    proto = program.model_proto
    proto.metadata_props.add(key=METADATA_KEY, value=json.dumps(metadata))
    atomic_write_bytes(path, proto.SerializeToString())


_WRITERS = {"safetensors": _write_safetensors, "torchscript": _write_torchscript, "onnx": _write_onnx}


def model_card(metadata: dict[str, Any], path: Path) -> str:
    """MODEL_CARD.md: what the model is, how it was trained privately, and how to load it."""
    privacy, model, data = metadata["privacy"], metadata["model"], metadata["data"]
    caveats = "\n".join(f"- {c}" for c in privacy.get("guarantee_caveats") or []) or "- none"
    return f"""# {model['name']} on {data['name']} ({metadata['weights']} weights)

File: `{path.name}` ({metadata['format']}), exported from `{metadata['run_dir']}` at step {metadata['step']}.

## Model
- {model['name']}, {model['parameters']:,} parameters, {model['num_classes']} classes, input {metadata['input']['shape']}
  (float32 images in [0, 1], NCHW; normalisation: {metadata['input']['normalization']}).{_features_line(metadata)}
- Test accuracy {100 * metadata['test_accuracy']:.2f}% on {data['name']}'s test split ({data['test_split']}, {data['num_test']} images).

## Privacy
- **{privacy['privacy_status']}**
- (epsilon, delta) = ({privacy['epsilon']}, {privacy['delta']}), {privacy['accountant']} accountant, {privacy['sampling']} sampling
  (q = {privacy['sample_rate']}, expected batch {privacy['batch_size']} of N = {privacy['dataset_size']}),
  noise multiplier {privacy['noise_multiplier']}, clipping norm {privacy['max_grad_norm']} ({privacy['clipping']}),
  {privacy['steps']} steps, mechanism {privacy['mechanism']}.
- What the guarantee covers: {privacy.get('guarantee_scope') or 'nothing (not a private run)'}
- Caveats of this run:
{caveats}

## Loading
{_LOADING[metadata['format']].format(name=path.name)}
"""


def _features_line(metadata: dict[str, Any]) -> str:
    spec = metadata.get("features")
    if not spec:
        return ""
    return (f"\n- Inside the model, before {metadata['model']['name']}: ScatterNet (J={spec['J']}, L={spec['L']}, "
            f"order {spec['max_order']}, pad {spec['pad']}) to {metadata['model']['input_shape']} features, then "
            f"{spec['normalize']}"
            + (" (its statistics: a private release, counted in epsilon)" if spec["normalize"] == "datanorm" else "")
            + (", then minus the training set's mean feature vector (a private release, counted in epsilon)."
               if spec.get("center") else "."))  # fmt: skip


_LOADING = {
    "safetensors": "`model, meta = dpscale.exported.load_exported(\"{name}\")` rebuilds the zoo model (needs dpscale's "
    "models and safetensors); `dpscale.exported.evaluate_exported(\"{name}\")` gives its test accuracy.",
    "torchscript": "`torch.jit.load(\"{name}\")` (torch alone); the metadata: "
    "`torch.jit.load(\"{name}\", _extra_files={{\"dpscale.json\": \"\"}})` or `dpscale.exported.read_metadata`.",
    "onnx": "`onnxruntime.InferenceSession(\"{name}\")`, input `images`, output `logits`; the metadata is the "
    "model's `metadata_props` entry `dpscale` (`dpscale.exported.read_metadata`).",
}

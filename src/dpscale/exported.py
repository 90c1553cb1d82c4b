"""Loading a model that ``dpscale export`` wrote, without dpscale's training code.

An exported model takes float32 images in [0, 1], shape (B, C, H, W), and returns logits (B, K):
the run's input normalisation is part of it, and for a ScatterNet run the ScatterNet and the
feature normalisation too (``ScatterNetFeatures``). Every format carries the same metadata (JSON):
the model (zoo name, input shape, activation, kwargs), the class names (``classes[i]`` is output
i), the input convention, the test accuracy the run measured, the step exported of the planned
steps (``partial`` when short of them), the dpscale version, and the full privacy statement
(epsilon, delta, accountant, sampling, caveats); no local path. Where it is stored:

- safetensors: the header's ``__metadata__["dpscale"]``; ``load_exported`` rebuilds the zoo model;
- TorchScript: the extra file ``dpscale.json`` (``torch.jit.load(path, _extra_files=...)``);
  the module itself needs nothing but torch;
- ONNX: the model's ``metadata_props`` entry ``dpscale``; runs in onnxruntime.

This module imports ``dpscale.models`` (and ``dpscale.data`` in ``evaluate_exported``) only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpscale.choices import EXPORT_FORMATS

__all__ = [
    "EXPORT_FORMATS",
    "ImagesInUnitRange",
    "ScatterNetFeatures",
    "accuracy",
    "evaluate_exported",
    "load_exported",
    "read_metadata",
]

SUFFIXES = {"safetensors": ".safetensors", "torchscript": ".pt", "onnx": ".onnx"}
METADATA_KEY = "dpscale"  # safetensors metadata key / ONNX metadata_props key
TORCHSCRIPT_METADATA = "dpscale.json"  # TorchScript extra file
# safetensors: Data Normalization's (and centring's) released statistics
FEATURE_STATS_PREFIX = "dpscale_datanorm."
# data.normalize: (x - 0.5) / 0.5, as dpscale.data.run_data
NORMALIZE_SHIFT, NORMALIZE_SCALE = (0.5, 0.5)


class ImagesInUnitRange(nn.Module):
    """The exported model: ``data.normalize``'s (x - 0.5) / 0.5 when the run used it, then the classifier."""

    def __init__(self, classifier: nn.Module, normalize: bool) -> None:
        super().__init__()
        self.classifier, self.normalize = classifier, normalize

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.normalize:
            images = (images - NORMALIZE_SHIFT) / NORMALIZE_SCALE
        return self.classifier(images)


class ScatterNetFeatures(nn.Module):
    """A ScatterNet run's fixed feature map inside the export: the ScatterNet coefficients of the
    images, then the run's feature normalisation (per-example GroupNorm, or Data Normalization
    with the statistics the run released privately; their cost is in the run's epsilon), then
    the privately released mean feature vector subtracted when the run centred its features.

    Args:
        spec: the metadata's ``features`` entry (J, L, max_order, pad, image_shape, normalize, groups, center).
        mean, var: Data Normalization's released per-channel statistics (None otherwise).
        center: the released mean feature vector (None when the run did not centre).
    """

    # buffers (registered in __init__): the type checker's view of them
    norm_mean: torch.Tensor  # with kind "datanorm" only
    norm_var: torch.Tensor
    feature_center: torch.Tensor | None

    def __init__(
        self,
        spec: dict[str, Any],
        mean: torch.Tensor | None = None,
        var: torch.Tensor | None = None,
        center: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        from dpscale.features.scatternet import ScatterNet

        self.scatter = ScatterNet(
            tuple(spec["image_shape"]),
            J=spec["J"],
            L=spec["L"],
            max_order=spec["max_order"],
            pad=spec["pad"],
        )
        self.kind, self.groups = spec["normalize"], spec["groups"]
        if self.kind == "datanorm":  # kept in their own dtype: the same arithmetic as the run's
            if mean is None or var is None:  # (what .clone() would raise: no statistics to keep)
                raise AttributeError("'NoneType' object has no attribute 'clone'")
            self.register_buffer("norm_mean", mean.clone())
            self.register_buffer("norm_var", var.clone())
        if spec.get("center") and center is None:
            raise ValueError(
                "the export's metadata says the run centred its features, but the released mean is missing"
            )
        # kept in float64: the same arithmetic as the run's
        self.register_buffer(
            "feature_center", center.clone() if spec.get("center") and center is not None else None
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        from dpscale.features.normalize import group_normalize

        features = self.scatter(images)
        if self.kind == "groupnorm":
            features = group_normalize(features, self.groups)
        elif self.kind == "datanorm":  # as dpscale.features.normalize.DataNormStats.apply
            shape = (1, -1) + (1,) * (features.dim() - 2)
            mean = self.norm_mean.to(dtype=features.dtype).reshape(shape)
            std = self.norm_var.sqrt().to(dtype=features.dtype).reshape(shape)
            features = (features - mean) / std
        if self.feature_center is not None:  # as dpscale.features.normalize.FeatureNormalizer
            features = features - self.feature_center.to(dtype=features.dtype)
        return features


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of an exported file (any format, told by its suffix)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return json.loads(f.metadata()[METADATA_KEY])
    if path.suffix == ".onnx":
        import onnx

        props = {
            p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props
        }
        return json.loads(props[METADATA_KEY])
    extra = {TORCHSCRIPT_METADATA: ""}
    torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
    return json.loads(extra[TORCHSCRIPT_METADATA])


def load_exported(path: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """The model of a safetensors or TorchScript export (in eval mode) and its metadata.

    Args:
        path: a ``.safetensors`` file (the zoo model is rebuilt from its metadata) or a ``.pt``
            TorchScript file. ONNX files run in onnxruntime instead (``read_metadata`` reads them).

    Returns:
        (model: float32 images in [0, 1] (B, C, H, W) -> logits (B, K), metadata).
    """
    path = Path(path)
    metadata = read_metadata(path)
    if path.suffix == ".onnx":
        raise ValueError(
            f"{path}: run ONNX files with onnxruntime (metadata: dpscale.exported.read_metadata)"
        )
    if path.suffix != ".safetensors":
        return torch.jit.load(str(path), map_location="cpu").eval(), metadata
    from safetensors.torch import load_file

    from dpscale.models import build_model

    spec, tensors = metadata["model"], load_file(str(path))
    classifier = build_model(
        spec["name"],
        spec["num_classes"],
        tuple(spec["input_shape"]),
        spec["activation"],
        **spec["kwargs"],
    )
    stats = {
        k: tensors.pop(f"{FEATURE_STATS_PREFIX}{k}")
        for k in ("mean", "var", "center")
        if f"{FEATURE_STATS_PREFIX}{k}" in tensors
    }
    classifier.load_state_dict(tensors)
    if metadata.get("features"):
        stage = ScatterNetFeatures(
            metadata["features"], stats.get("mean"), stats.get("var"), stats.get("center")
        )
        classifier = nn.Sequential(stage, classifier)
    return ImagesInUnitRange(classifier, metadata["input"]["normalize"]).eval(), metadata


@torch.no_grad()
def accuracy(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 1000
) -> float:
    """Top-1 accuracy (fraction) of an exported model on images in [0, 1] (the run's evaluation batch size)."""
    correct = sum(
        int((model(images[i : i + batch_size]).argmax(1) == labels[i : i + batch_size]).sum())
        for i in range(0, len(images), batch_size)
    )
    return correct / len(images)


def evaluate_exported(
    path: str | Path, data_root: str | None = None, val_labels: str | None = None
) -> float:
    """Test accuracy of an export on its run's test split (the dataset named in its metadata).

    Args:
        path: the exported file (safetensors or TorchScript).
        data_root: where the dataset lies on this machine: an export names no local path (older
            exports named the run's root, which is used when this is None). Not needed for mnist-5k.
        val_labels: the label file of a flat ``val`` folder, when the run read one (the metadata
            names its file name only).

    Returns:
        The top-1 accuracy (fraction).

    Raises:
        ValueError: the run kept a subset of the classes, or it read a label file and none is given.
    """
    from dpscale.data.datasets import load_dataset

    model, metadata = load_exported(path)
    data = metadata["data"]
    if data["selects_classes"]:
        raise ValueError(
            f"{path}: the run kept a subset of the classes (data.classes ...); evaluate it on that subset"
        )
    if data["val_labels"] and val_labels is None and "root" not in data:
        raise ValueError(
            f"{path}: the run read its test labels from {data['val_labels']}; pass val_labels (that file here)"
        )
    root = data_root or data.get("root")
    labels = val_labels or (data["val_labels"] if "root" in data else None)
    test = load_dataset(data["name"], root, image_size=data["image_size"], val_labels=labels)
    return accuracy(model, test.x_test, test.y_test)

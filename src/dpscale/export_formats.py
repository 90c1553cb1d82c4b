"""The three file formats of ``dpscale export`` (safetensors, TorchScript, ONNX): one writer each, no local path inside."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
import zipfile
from pathlib import Path
from typing import Any, Iterator, cast

import torch
from torch import nn

from dpscale._io import atomic_write_bytes
from dpscale.errors import ConfigError
from dpscale.exported import (
    FEATURE_STATS_PREFIX,
    METADATA_KEY,
    TORCHSCRIPT_METADATA,
    ImagesInUnitRange,
    ScatterNetFeatures,
)


def _needs(package: str, fmt: str) -> None:
    try:
        __import__(package)
    except ImportError as err:
        raise ConfigError(
            f"--format {fmt} needs the {package} package: pip install {package}"
        ) from err


def _write_safetensors(model: ImagesInUnitRange, metadata: dict[str, Any], path: Path) -> None:
    _needs("safetensors", "safetensors")
    from safetensors.torch import save

    inner = model.classifier
    classifier, features = inner, None
    if isinstance(inner, nn.Sequential):  # export_run's (features, classifier)
        classifier, features = inner[1], cast(ScatterNetFeatures, inner[0])
    weights = {k: v.contiguous() for k, v in classifier.state_dict().items()}
    # the released statistics, as the run used them
    if features is not None and features.kind == "datanorm":
        weights[f"{FEATURE_STATS_PREFIX}mean"] = features.norm_mean.contiguous()
        weights[f"{FEATURE_STATS_PREFIX}var"] = features.norm_var.contiguous()
    # private centring's released mean
    if features is not None and features.feature_center is not None:
        weights[f"{FEATURE_STATS_PREFIX}center"] = features.feature_center.contiguous()
    atomic_write_bytes(path, save(weights, metadata={METADATA_KEY: json.dumps(metadata)}))


def _example(metadata: dict[str, Any]) -> torch.Tensor:
    return torch.rand(2, *metadata["input"]["shape"], generator=torch.Generator().manual_seed(0))


def _write_torchscript(model: ImagesInUnitRange, metadata: dict[str, Any], path: Path) -> None:
    # tracing probes kymatio's deprecated attributes, which raise NameError (0.3)
    if metadata.get("features"):
        raise ConfigError(
            "--format torchscript cannot trace the ScatterNet (kymatio 0.3); use safetensors or onnx"
        )
    extra = {TORCHSCRIPT_METADATA: json.dumps(metadata)}
    # torch >= 2.9 marks TorchScript deprecated; it is still what torch-only consumers load
    with torch.no_grad(), warnings.catch_warnings():  # no_grad: every layer's inference path
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(model, _example(metadata))
        buffer = io.BytesIO()
        torch.jit.save(traced, buffer, _extra_files=extra)
    atomic_write_bytes(path, _without_debug_records(buffer.getvalue()))


def _without_debug_records(archive: bytes) -> bytes:
    """A TorchScript archive without its ``*.debug_pkl`` records: they map the code to the
    source files it was traced from, by this machine's absolute paths. ``torch.jit.load`` runs
    the same code without them (its error messages then quote the saved code, not the sources)."""
    source, out = zipfile.ZipFile(io.BytesIO(archive)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as kept:  # stored, as torch.jit.save writes
        for record in source.infolist():
            if not record.filename.endswith(".debug_pkl"):
                kept.writestr(record, source.read(record))
    return out.getvalue()


# The ONNX exporter's noise, silenced by its exact text so that any other warning still shows:
# a log record for each torchvision operator it skips when torchvision is not installed (the
# model has none), and torch's own deprecation of LeafSpec, raised inside torch.export.
_SKIPPED_TORCHVISION = (
    "torch.onnx._internal.exporter._registration",
    "torchvision is not installed. Skipping %s",
)
_LEAFSPEC_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


class _DropMessage(logging.Filter):
    """Drops the log records of one message template (``record.msg``, before its arguments)."""

    def __init__(self, template: str) -> None:
        super().__init__()
        self.template = template

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self.template


@contextlib.contextmanager
def _quiet_onnx_exporter() -> Iterator[None]:
    """The ONNX export without the exporter's known noise (``_SKIPPED_TORCHVISION``, ``_LEAFSPEC_DEPRECATION``)."""
    logger, template = logging.getLogger(_SKIPPED_TORCHVISION[0]), _SKIPPED_TORCHVISION[1]
    drop = _DropMessage(template)
    logger.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_LEAFSPEC_DEPRECATION, category=FutureWarning)
            yield
    finally:
        logger.removeFilter(drop)


def _write_onnx(model: ImagesInUnitRange, metadata: dict[str, Any], path: Path) -> None:
    _needs("onnx", "onnx")
    with torch.no_grad(), _quiet_onnx_exporter():
        program = torch.onnx.export(
            model,
            (_example(metadata),),
            input_names=["images"],
            output_names=["logits"],
            dynamic_shapes={"images": {0: torch.export.Dim("batch")}},
            verbose=False,
        )
    assert program is not None  # the dynamo exporter (torch's default) returns its program
    proto = program.model_proto
    _drop_stack_traces(proto)
    proto.metadata_props.add(key=METADATA_KEY, value=json.dumps(metadata))
    atomic_write_bytes(path, proto.SerializeToString())


# per node: the Python stack, by this machine's absolute paths
_ONNX_STACK_TRACE = "pkg.torch.onnx.stack_trace"


def _drop_stack_traces(proto: Any) -> None:
    """Remove every node's ``_ONNX_STACK_TRACE`` entry (graph, functions, subgraphs) from the ONNX ``proto``."""
    for node in _onnx_nodes([*proto.graph.node, *(n for f in proto.functions for n in f.node)]):
        kept = [(p.key, p.value) for p in node.metadata_props if p.key != _ONNX_STACK_TRACE]
        del node.metadata_props[:]
        for key, value in kept:
            node.metadata_props.add(key=key, value=value)


def _onnx_nodes(nodes: Any) -> Iterator[Any]:
    """``nodes`` and the nodes of their subgraphs (If, Loop, Scan bodies), depth first."""
    for node in nodes:
        yield node
        for attribute in node.attribute:
            for graph in ([attribute.g] if attribute.HasField("g") else []) + list(
                attribute.graphs
            ):
                yield from _onnx_nodes(graph.node)


# dpscale export --format: its writer, called as writer(model, metadata, path)
WRITERS = {
    "safetensors": _write_safetensors,
    "torchscript": _write_torchscript,
    "onnx": _write_onnx,
}

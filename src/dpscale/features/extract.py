"""Fixed feature extractors (ScatterNet, a registry model, a trained run) and a disk cache.

DP-SGD's guarantee covers what is trained on the features, not the features themselves, so an
extractor must not depend on the private training data: a ScatterNet is data-independent, a
``model:`` extractor is a seeded random initialisation, and a ``checkpoint:`` extractor is only
private if the run it comes from was trained on *public* data or its privacy cost is counted
(``dpscale.features.source_run``: what that run spent, and how it enters the guarantee, for a
``model.init`` run too).

Extracting ScatterNet features for CIFAR-10 takes minutes on a CPU, so :func:`load_or_extract`
keeps them in ``<cache dir>/<key>.pt``, where the key hashes everything the features depend on.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path
from typing import Any, Callable, cast

import torch
from torch import nn
from tqdm import tqdm

from dpscale.data import ImageDataset
from dpscale.models import build_model

from .scatternet import ScatterNet, import_kymatio
from .source_run import SourceRun, read_run, read_source_run, source_run_privacy

__all__ = [
    "CACHE_FORMAT",
    "FeatureExtractor",
    "default_cache_dir",
    "extract_features",
    "feature_cache_key",
    "load_or_extract",
    "make_extractor",
    "read_source_run",
    "source_run_privacy",
    "SourceRun",
]

CACHE_FORMAT = 1  # bump when the cache file layout or the key's contents change
MODEL_SEED = 0  # initialisation seed of "model:<name>" extractors
MODEL_NUM_CLASSES = 10  # head size of "model:<name>" extractors (the head is never used)
EXTRACTOR_FORMS = "'scatternet', 'model:<registry name>' (e.g. model:papernot-cnn), 'checkpoint:<run directory or its checkpoint.pt>'"
# Shapes fixed by the dataset format, to catch a checkpoint used on images of another shape.
_KNOWN_CHANNELS = {"mnist-5k": 1, "mnist": 1, "fashion-mnist": 1, "cifar10": 3, "cifar100": 3}
_KNOWN_SIZE = {"mnist-5k": 28, "cifar10": 32, "cifar100": 32}
_KNOWN_CLASSES = {"mnist-5k": 10, "mnist": 10, "fashion-mnist": 10, "cifar10": 10, "cifar100": 100}


@dataclass(frozen=True, eq=False)
class FeatureExtractor:
    """A fixed feature map, put in eval mode with gradients off.

    Attributes:
        module: maps a float32 batch [N, *input_shape] to [N, *output_shape].
        spec: JSON-serialisable description of everything that determines the output (kind,
            parameters and, for model weights, their sha256); part of the cache key.
        output_shape: shape of the features of one image, e.g. (81, 7, 7) or (512,).
        name: short label for messages, e.g. "scatternet" or "model:papernot-cnn".
        input_shape: (C, H, W) the extractor was built for; None accepts any shape.
    """

    module: nn.Module
    spec: dict[str, Any]
    output_shape: tuple[int, ...]
    name: str = ""
    input_shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self.module.eval()
        self.module.requires_grad_(False)
        # JSON round trip: fails early if not serialisable, and makes tuples lists so that a
        # spec read back from a cache file compares equal.
        object.__setattr__(self, "spec", json.loads(json.dumps(self.spec, sort_keys=True)))
        object.__setattr__(self, "output_shape", tuple(int(d) for d in self.output_shape))
        if self.input_shape is not None:
            object.__setattr__(self, "input_shape", tuple(int(d) for d in self.input_shape))
        if not self.name:
            object.__setattr__(self, "name", str(self.spec.get("kind", "features")))

    @property
    def device(self) -> torch.device:
        """Where the module's weights (or filters) live; inputs are moved there."""
        tensor = next(chain(self.module.parameters(), self.module.buffers()), None)
        return tensor.device if tensor is not None else torch.device("cpu")


class _ForwardFeatures(nn.Module):
    """A classifier cut before its head: ``forward`` is the model's ``forward_features``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a method of the model's class: torch's stubs type a Module's attributes as Tensor | Module
        forward_features = cast(Callable[[torch.Tensor], torch.Tensor], self.model.forward_features)
        return forward_features(x)


def _weights_sha256(module: nn.Module) -> str:
    """sha256 of a module's state dict (names, dtypes, shapes and raw bytes)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        # uint8 view: bf16 has no numpy dtype
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _model_extractor(
    model: nn.Module,
    input_shape: tuple[int, int, int],
    spec: dict[str, Any],
    name: str,
    device: torch.device,
) -> FeatureExtractor:
    """Wrap a classifier's ``forward_features``; a dry run on one blank image gives the output shape."""
    spec = {**spec, "input_shape": list(input_shape), "weights_sha256": _weights_sha256(model)}
    module = _ForwardFeatures(model).to(device).eval()
    try:
        with torch.no_grad():
            out = module(torch.zeros((1, *input_shape), device=device))
    except RuntimeError as err:  # conv/linear size mismatches
        raise ValueError(
            f"{name} cannot take images of shape {tuple(input_shape)} (C, H, W): {err}"
        ) from err
    return FeatureExtractor(module, spec, tuple(out.shape[1:]), name=name, input_shape=input_shape)


def _build_seeded(*args: Any, **kwargs: Any) -> nn.Module:
    """build_model under seed MODEL_SEED, leaving the global RNG state as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED)
        return build_model(*args, **kwargs)


def _data_key(data_name: str) -> str:
    return data_name.strip().lower().replace("_", "-")  # as dpscale.data.load_dataset reads it


def _trained_input_shape(
    data_name: str, image_size: int | None
) -> tuple[int | None, int | None, int | None]:
    """(C, H, W) a run's images had, as far as its data config fixes it (None where unknown)."""
    key = _data_key(data_name)
    size = image_size if image_size is not None else _KNOWN_SIZE.get(key)
    return (_KNOWN_CHANNELS.get(key), size, size)


def _trained_on_images(config: Any, run_dir: Path) -> None:
    """Refuse a run trained on features (checked before its checkpoint is read)."""
    trained_on = getattr(getattr(config, "features", None), "extractor", None)
    if trained_on:
        # Its model takes (normalised) features, not images: it would need that pipeline in front.
        raise ValueError(
            f"the run in {run_dir} was trained on {trained_on} features, not on images; "
            "only runs trained on images can serve as feature extractors"
        )


def _checkpoint_extractor(
    where: str, input_shape: tuple[int, int, int], device: torch.device
) -> FeatureExtractor:
    run_dir, ckpt, config, state = read_run(where, _trained_on_images)
    weights = state.get("model")
    if not isinstance(weights, dict):
        raise ValueError(f"checkpoint {ckpt} holds no model weights")
    trained = _trained_input_shape(config.data.name, config.data.image_size)
    if any(t is not None and t != s for t, s in zip(trained, input_shape)):
        shown = "x".join("?" if d is None else str(d) for d in trained)
        raise ValueError(
            f"the run in {run_dir} was trained on {config.data.name} images of shape {shown} (C x H x W), "
            f"but features are wanted for images of shape {'x'.join(map(str, input_shape))}"
        )
    # The head's size is read off the weights (the final "head.*weight" has num_classes rows), so
    # the run's dataset need not be loaded; a strict load below checks the guess.
    head = [k for k in weights if k.startswith("head.") and k.endswith("weight")]
    num_classes = (
        int(weights[head[-1]].shape[0]) if head else _KNOWN_CLASSES.get(_data_key(config.data.name))
    )
    if num_classes is None:
        raise ValueError(
            f"cannot tell the number of classes of the model in {ckpt} (no head.* weights)"
        )
    m = config.model
    model = _build_seeded(m.name, num_classes, input_shape, m.activation, **m.kwargs)
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:
        raise ValueError(
            f"the weights in {ckpt} do not fit {m.name} on images of shape {tuple(input_shape)}; was the run "
            f"trained on images of another shape? ({err})"
        ) from err
    spec = {
        "kind": "checkpoint",
        "model": m.name,
        "activation": m.activation,
        "kwargs": json.loads(json.dumps(m.kwargs, default=repr)),
        "num_classes": num_classes,
    }
    return _model_extractor(model, input_shape, spec, f"checkpoint:{where}", device)


def make_extractor(
    spec: str,
    input_shape: tuple[int, int, int],
    *,
    J: int = 2,
    L: int = 8,
    max_order: int = 2,
    pad: int = 0,
    device: str | torch.device = "cpu",
) -> FeatureExtractor:
    """Build a fixed feature extractor for images of shape ``input_shape``.

    Args:
        spec: ``"scatternet"``; ``"model:<registry name>"``, the penultimate-layer features
            (``forward_features``) of that model at a fixed random initialisation (seed 0);
            or ``"checkpoint:<path>"``, the ``forward_features`` of the trained model in a dpscale
            run directory (``path`` is the directory or its ``checkpoint.pt``).
        input_shape: (C, H, W) of one image, in pixels.
        J, L, max_order, pad: ScatterNet scales, angles, depth and zero padding in pixels per side
            (ignored by other kinds).
        device: where the features are computed, e.g. "cpu" or "cuda".

    Returns:
        The extractor, in eval mode with gradients off, on ``device``.

    Raises:
        ValueError: unknown spec, bad parameters, or images of a shape the extractor cannot take
            (e.g. a checkpoint trained on 3x32x32 images used on 1x28x28 ones).
        ImportError: ``"scatternet"`` without kymatio installed.
    """
    if len(input_shape) != 3 or any(int(d) < 1 for d in input_shape):
        raise ValueError(
            f"input_shape must be (C, H, W) with positive sizes, got {tuple(input_shape)}"
        )
    shape = (int(input_shape[0]), int(input_shape[1]), int(input_shape[2]))
    device = torch.device(device)
    kind, _, arg = spec.strip().partition(":")
    kind, arg = kind.strip().lower(), arg.strip()
    if kind == "scatternet" and not arg:
        net = ScatterNet(shape, J=J, L=L, max_order=max_order, pad=pad).to(device)
        params = {"J": J, "L": L, "max_order": max_order}
        if pad:  # only when set, so the cache keys of unpadded features stay as they were
            params["pad"] = pad
        settings = ", ".join(f"{key}={value}" for key, value in params.items())
        name = "scatternet" if (J, L, max_order, pad) == (2, 8, 2, 0) else f"scatternet({settings})"
        spec_dict = {"kind": "scatternet", **params, "input_shape": list(shape)}
        return FeatureExtractor(net, spec_dict, net.output_shape, name=name, input_shape=shape)
    if kind == "model" and arg:
        model = _build_seeded(arg, num_classes=MODEL_NUM_CLASSES, input_shape=shape)
        spec_dict = {
            "kind": "model",
            "model": arg,
            "activation": "tanh",
            "num_classes": MODEL_NUM_CLASSES,
            "seed": MODEL_SEED,
        }
        return _model_extractor(model, shape, spec_dict, f"model:{arg}", device)
    if kind == "checkpoint" and arg:
        return _checkpoint_extractor(arg, shape, device)
    raise ValueError(f"unknown feature extractor {spec!r}; valid forms: {EXTRACTOR_FORMS}")


def extract_features(
    extractor: FeatureExtractor,
    images: torch.Tensor,
    batch_size: int = 512,
    progress: bool = True,
    desc: str = "features",
) -> torch.Tensor:
    """Run ``extractor`` over ``images`` in batches, without gradients, on the extractor's device.

    Args:
        extractor: the feature map.
        images: [N, C, H, W] images (any device; cast to float32).
        batch_size: images per forward pass.
        progress: show a progress bar (on stderr).
        desc: progress bar label.

    Returns:
        float32 CPU tensor [N, *extractor.output_shape].
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if extractor.input_shape is not None and tuple(images.shape[1:]) != extractor.input_shape:
        raise ValueError(
            f"{extractor.name} was built for images of shape {extractor.input_shape} (C, H, W), "
            f"got images of shape {tuple(images.shape[1:])}"
        )
    n = len(images)
    out = torch.empty((n, *extractor.output_shape), dtype=torch.float32)
    device = extractor.device
    bar = tqdm(
        total=n, disable=not progress, file=sys.stderr, desc=desc, unit="img", dynamic_ncols=True
    )
    with torch.no_grad(), bar:
        for start in range(0, n, batch_size):
            batch = images[start : start + batch_size].to(device=device, dtype=torch.float32)
            features = extractor.module(batch)
            if tuple(features.shape) != (len(batch), *extractor.output_shape):
                raise ValueError(
                    f"{extractor.name} returned features of shape {tuple(features.shape[1:])}, expected {extractor.output_shape}"
                )
            out[start : start + len(batch)] = features  # copies to CPU float32
            bar.update(len(batch))
    return out


def _split_hash(x: torch.Tensor, y: torch.Tensor) -> str:
    """sha256 of one split's full content (shapes, dtype, every label and every pixel): a cache
    hit must mean the very same images (~0.5 s per 200 MB; extraction costs far more)."""
    digest = hashlib.sha256()
    digest.update(repr((tuple(x.shape), tuple(y.shape), str(x.dtype))).encode())
    digest.update(y.detach().cpu().contiguous().numpy().tobytes())
    # ndarray.data: the array's memoryview
    digest.update(x.detach().cpu().contiguous().numpy().data.cast("B"))
    return digest.hexdigest()


def feature_cache_key(extractor: FeatureExtractor, dataset: ImageDataset) -> str:
    """Cache key of ``extractor``'s features of ``dataset``: a sha256 hex digest.

    Hashes the extractor spec, the full content of the train and test splits and the torch (and
    kymatio) versions, whose numerics the features depend on.
    """
    payload: dict[str, Any] = {
        "format": CACHE_FORMAT,
        "extractor": extractor.spec,
        "output_shape": list(extractor.output_shape),
        "train": _split_hash(dataset.x_train, dataset.y_train),
        "test": _split_hash(dataset.x_test, dataset.y_test),
        "torch": ".".join(torch.__version__.split(".")[:2]),
    }
    if extractor.spec.get("kind") == "scatternet":
        payload["kymatio"] = import_kymatio().__version__
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def default_cache_dir() -> Path:
    """``$DPSCALE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/dpscale/features`` (``~/.cache`` if unset)."""
    if os.environ.get("DPSCALE_CACHE_DIR"):
        return Path(os.environ["DPSCALE_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "dpscale" / "features"


def _read_cache(
    path: Path, key: str, extractor: FeatureExtractor, dataset: ImageDataset
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached (x_train, x_test), or ValueError saying why the file cannot be used."""
    from dpscale._io import load_torch_file

    state = load_torch_file(path, CACHE_FORMAT, "feature cache")
    if state.get("key") != key or state.get("spec") != extractor.spec:
        raise ValueError("it was written for other data or another extractor")
    features = []
    for split, n in (("x_train", len(dataset.x_train)), ("x_test", len(dataset.x_test))):
        x = state.get(split)
        expected = (n, *extractor.output_shape)
        if (
            not isinstance(x, torch.Tensor)
            or x.dtype != torch.float32
            or tuple(x.shape) != expected
        ):
            got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{split} is {got}, expected float32 {expected}")
        features.append(x)
    return features[0], features[1]


def _write_cache(
    path: Path, key: str, extractor: FeatureExtractor, x_train: torch.Tensor, x_test: torch.Tensor
) -> None:
    from dpscale._io import save_torch_file

    save_torch_file(
        path,
        {"key": key, "spec": extractor.spec, "x_train": x_train, "x_test": x_test},
        CACHE_FORMAT,
    )


def load_or_extract(
    extractor: FeatureExtractor,
    dataset: ImageDataset,
    cache_dir: Path | str | None = None,
    batch_size: int = 512,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    use_cache: bool = True,
) -> tuple[ImageDataset, bool]:
    """``dataset`` with its images replaced by their features, from the cache when possible.

    A cache file that is unreadable or does not match is reported through ``log`` and
    recomputed (then overwritten); failing to write the cache is reported, not raised.

    Args:
        extractor: the feature map.
        dataset: the images (any device).
        cache_dir: directory of ``<key>.pt`` files (default :func:`default_cache_dir`).
        batch_size: images per forward pass.
        progress: show progress bars (on stderr).
        log: receives one line on a hit or after computing (nothing is logged if None).
        use_cache: False computes the features without reading or writing the cache.

    Returns:
        (features dataset, cache hit). The new dataset holds float32 CPU features of shape
        [N, *output_shape], the original labels, and ``info.input_shape = output_shape``, which
        for ``forward_features`` of some models is 1-D, e.g. (512,), not (C, H, W).
    """
    say = log if log is not None else (lambda _: None)
    key, path = "", None
    if use_cache:
        key = feature_cache_key(extractor, dataset)
        path = (
            Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser()
            / f"{key}.pt"
        )
        if path.is_file():
            try:
                x_train, x_test = _read_cache(path, key, extractor, dataset)
            except ValueError as err:
                say(f"features: ignoring cache file {path} ({err}); recomputing")
            else:
                say(f"features: loaded from cache {path}")
                return _with_features(dataset, extractor, x_train, x_test), True
    started = time.perf_counter()
    x_train = extract_features(
        extractor, dataset.x_train, batch_size, progress, desc=f"{extractor.name} train"
    )
    x_test = extract_features(
        extractor, dataset.x_test, batch_size, progress, desc=f"{extractor.name} test"
    )
    done = f"features: computing {extractor.name} for {len(x_train)}+{len(x_test)} images ..."
    if path is None:
        say(f"{done} done, not cached ({time.perf_counter() - started:.1f} s)")
    else:
        try:
            _write_cache(path, key, extractor, x_train, x_test)
        except OSError as err:
            say(
                f"{done} done, but could not save to {path} ({err}) ({time.perf_counter() - started:.1f} s)"
            )
        else:
            say(f"{done} saved to {path} ({time.perf_counter() - started:.1f} s)")
    return _with_features(dataset, extractor, x_train, x_test), False


def _with_features(
    dataset: ImageDataset, extractor: FeatureExtractor, x_train: torch.Tensor, x_test: torch.Tensor
) -> ImageDataset:
    # may be 1-D, see load_or_extract
    info = replace(dataset.info, input_shape=extractor.output_shape)
    return replace(dataset, x_train=x_train, x_test=x_test, info=info)

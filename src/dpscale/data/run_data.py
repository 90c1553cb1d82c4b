"""A run's data as its config describes it: loaded, class-selected and scaled in memory, or
streamed from disk (``data.loader``). The Trainer and the commands that predict its plan
(``tan simulate``, ``tan privacy-search``) open data through here, so they see the same N."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable, Sequence

import numpy as np
import torch

from dpscale.config import Config
from dpscale.errors import ConfigError
from dpscale.data.datasets import dataset_fingerprint, load_dataset
from dpscale.data.image_dataset import ImageDataset
from dpscale.data.labels import check_labels, labels_line
from dpscale.data.stream import StreamedData, default_workers, materialize, open_stream
from dpscale.data.subsets import random_classes, select as select_classes


def data_workers(config: Config) -> int:
    """Decoding processes: ``data.workers``, or a default for this machine."""
    return default_workers() if config.data.workers is None else config.data.workers


def prepare_data(
    config: Config, device: torch.device, data: ImageDataset | None = None
) -> ImageDataset:
    """The whole dataset in memory on ``device`` (data.loader=memory): loaded (unless ``data``
    is given, already decoded), class-selected and scaled as the config says."""
    cfg = config.data
    if data is None:
        data = load_dataset(
            cfg.name,
            cfg.root,
            image_size=cfg.image_size,
            val_labels=cfg.val_labels,
            skip_corrupt=cfg.skip_corrupt,
            workers=data_workers(config),
        )
    if cfg.selects_classes:
        classes: Sequence[int] | None = cfg.classes
        if cfg.random_classes:
            classes = random_classes(data.info.num_classes, cfg.random_classes, cfg.subset_seed)
        data = select_classes(
            data,
            classes=classes,
            meta_classes=cfg.meta_classes,
            max_per_class=cfg.max_per_class,
            seed=cfg.subset_seed,
        )
    x_train, x_test = data.x_train, data.x_test
    if config.data.normalize:  # data-independent constants: no privacy cost
        x_train, x_test = (x_train - 0.5) / 0.5, (x_test - 0.5) / 0.5
    return ImageDataset(
        x_train.to(device),
        data.y_train.to(device),
        x_test.to(device),
        data.y_test.to(device),
        data.info,
        user_ids=data.user_ids,
    )


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def open_training_data(
    config: Config, device: torch.device, log: Callable[[str], Any] = print
) -> ImageDataset | StreamedData:
    """The run's data: in memory, or streamed from disk (data.loader; "auto" streams when the
    decoded float32 training and test sets would take more than a quarter of physical memory).

    Args:
        config: the run's config.
        device: where in-memory data goes.
        log: prints a line of the run's report (here: the labels of each split).

    Returns:
        The data, its ``info.num_classes`` checked against its labels (``data.labels``).
    """
    data = _open_data(config, device, log)
    y_train, y_test = data.y_train.cpu().numpy(), data.y_test.cpu().numpy()
    classes = check_labels(
        y_train,
        y_test,
        data.info.num_classes,
        config.data.num_classes,
        data.info.source,
        k_from_labels=data.info.name == "npz",  # the one loader whose K is the largest label + 1
    )
    log(labels_line(y_train, y_test, classes))
    return (
        data
        if classes == data.info.num_classes
        else replace(data, info=replace(data.info, num_classes=classes))
    )


def _open_data(
    config: Config, device: torch.device, log: Callable[[str], Any]
) -> ImageDataset | StreamedData:
    """The run's data as ``data.loader`` says (:func:`open_training_data`), labels unchecked."""
    cfg = config.data
    if cfg.loader == "auto" and cfg.name in ("imagefolder", "shards") and cfg.root is not None:
        streamed = _open_stream(config)
        info = streamed.info
        decoded = 4 * (info.num_train + info.num_test) * int(np.prod(info.input_shape))
        memory = _physical_memory_bytes()
        features = config.features
        in_memory_only = (
            features.extractor is not None or features.normalize != "none" or config.eval.augtest
        )
        if memory and decoded > memory / 4 and not in_memory_only:
            log(
                f"data.loader=auto: streaming {cfg.root} from disk (decoded it would take {decoded / 2**30:.1f} GiB "
                f"of {memory / 2**30:.1f} GiB)"
            )
            return streamed
        # decoded from the listing already made
        return prepare_data(config, device, materialize(streamed))
    if cfg.loader == "stream":
        return _open_stream(config)
    return prepare_data(config, device)


def _open_stream(config: Config) -> StreamedData:
    cfg = config.data
    if cfg.root is None:
        raise ConfigError(
            "data.loader=stream needs data.root (the image folder or prepared shards)"
        )
    return open_stream(
        cfg.name,
        cfg.root,
        image_size=cfg.image_size,
        normalize=cfg.normalize,
        val_labels=cfg.val_labels,
        skip_corrupt=cfg.skip_corrupt,
        workers=data_workers(config),
    )


def training_fingerprint(config: Config, normalize: bool | None = None) -> str:
    """``dataset_fingerprint`` of the training images a run with ``config`` prepares (on the CPU).

    Args:
        config: the run's config.
        normalize: the data.normalize to prepare them with (None: the config's own).

    Returns:
        The fingerprint, as checkpoints store it in ``data_fingerprint``.
    """
    if normalize is not None:
        config = replace(config, data=replace(config.data, normalize=normalize))
    return dataset_fingerprint(prepare_data(config, torch.device("cpu")))

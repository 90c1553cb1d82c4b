"""Streaming: training on datasets larger than memory, with the sampling unchanged.

The Poisson (or shuffle) sampler draws a logical batch's indices exactly as for an in-memory
dataset; the indices are split into physical chunks, and a ``torch.utils.data.DataLoader`` with
``workers`` processes reads each chunk (decoding JPEGs, or slicing memory-mapped shards) while
the device trains on earlier ones. Workers return the decoded pixels (uint8, or float32 for a set
with samples wider than 8 bits); the conversion to float (and any augmentation) happens in the
training process, in training order, so a streamed run sees the same chunks, pixels and views as
the in-memory run of the same seed.

The loader asks for chunks ahead of training, so the sampler draws logical batches ahead too;
:class:`StreamFeed` remembers the sampler's state before each draw, and a checkpoint stores the
state before the first step not yet trained: a resumed run redraws the same batches.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Protocol

import numpy as np
import torch

from .datasets import DatasetInfo
from .folder import image_array
from .formats import DatasetError
from .user_ids import user_slices

if TYPE_CHECKING:
    from .datasets import ImageDataset


class ImageSource(Protocol):
    """One split of a dataset, read one example at a time (in a loader worker)."""

    @property
    def labels(self) -> np.ndarray:  # read-only: the sources are frozen dataclasses
        """Every example's label (int64)."""
        ...

    def __len__(self) -> int: ...

    def read(self, index: int) -> np.ndarray:
        """Example ``index`` as a (C, H, W) array (uint8, or float32 in [0, 1])."""
        ...


@dataclass(frozen=True)
class FolderSource:
    """Image files decoded on demand (``folder.image_array``: the in-memory loader's pixels)."""

    files: tuple[Path, ...]
    labels: np.ndarray
    mode: str
    image_size: int | None
    dtype: str = "uint8"

    def __len__(self) -> int:
        return len(self.files)

    def read(self, index: int) -> np.ndarray:
        return image_array(self.files[index], self.mode, self.image_size, self.dtype)


def default_workers() -> int:
    """All cores but one (at least one)."""
    return max(1, (os.cpu_count() or 2) - 1)


def to_model_input(x: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Decoded pixels -> float32 in [0, 1] (or [-1, 1] with ``normalize``), by the same operations
    as the in-memory loaders, so both give the same floats bit for bit: uint8 divided by 255,
    float32 (already in [0, 1]) as it is. One float tensor at a time: a 512-image chunk at 160 px
    is 157 MB as float32, and ``(x - 0.5) / 0.5`` held three of them at once (issue 62)."""
    if x.dtype == torch.uint8:
        pixels = x.float().div_(255.0)  # a new tensor: normalised in place, by the same operations
        return pixels.sub_(0.5).div_(0.5) if normalize else pixels
    pixels = x.float()  # may be ``x`` itself: never written in place
    return (pixels - 0.5).div_(0.5) if normalize else pixels


@dataclass(frozen=True)
class StreamedData:
    """A dataset the trainer reads from disk: the counts and labels in memory, pixels on demand."""

    train: ImageSource
    test: ImageSource
    info: DatasetInfo
    normalize: bool
    fingerprint: str
    user_ids: np.ndarray | None = None  # each training example's user (an image folder's users.csv)

    @property
    def y_train(self) -> torch.Tensor:
        return torch.from_numpy(self.train.labels)

    @property
    def y_test(self) -> torch.Tensor:
        return torch.from_numpy(self.test.labels)

    def head(self, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``count`` training examples as model input (for the engine's self-check)."""
        x = torch.from_numpy(np.stack([self.train.read(i) for i in range(count)]))
        return to_model_input(x.to(device), self.normalize), self.y_train[:count].to(device)


@dataclass(frozen=True)
class _ReadFailure:
    """A worker's ``DatasetError``, sent to the training process as its class and sentence: torch
    re-raises a worker's exception with the worker's whole traceback as its message (a
    3,000-character "one line" for a truncated PNG, issue 62)."""

    kind: type[DatasetError]
    message: str


def _unless_failed(item: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
    """A loader's item, or the worker's ``DatasetError`` raised again here in its own words."""
    if isinstance(item[1], _ReadFailure):
        raise item[1].kind(item[1].message)
    return item


class _Chunks(torch.utils.data.Dataset):
    """Map-style dataset whose items are whole chunks: a worker reads all of a chunk's examples
    (or, when a file cannot be read, returns the ``DatasetError`` as a ``_ReadFailure``)."""

    def __init__(self, source: ImageSource, shape: tuple[int, ...]) -> None:
        self.source, self.shape = source, shape

    def __len__(self) -> int:  # items are requests, not examples
        return 0

    def __getitem__(
        self, request: tuple[Any, torch.Tensor]
    ) -> tuple[Any, torch.Tensor | _ReadFailure, torch.Tensor | None]:
        tag, indices = request
        rows = indices.tolist()
        try:
            x = (
                np.stack([self.source.read(i) for i in rows])
                if rows
                else np.zeros((0, *self.shape), np.uint8)
            )
        except DatasetError as err:
            return tag, _ReadFailure(type(err), str(err)), None
        return tag, torch.from_numpy(x), torch.from_numpy(self.source.labels[rows])


def _loader(
    dataset: _Chunks, requests: Any, workers: int, prefetch: int, pin: bool
) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=None,
        sampler=requests,
        num_workers=workers,
        pin_memory=pin,
        prefetch_factor=prefetch
        if workers > 0
        else None,  # None: torch's default, and all it takes without workers
    )


class _BatchRequests:
    """Iterated by the DataLoader in the training process: draws logical batches as the loader
    asks for chunks, recording the sampler's state before each draw."""

    def __init__(self, feed: "StreamFeed") -> None:
        self.feed = feed

    def __iter__(self) -> Iterator[tuple[tuple, torch.Tensor]]:
        feed = self.feed
        for step in range(feed.next_draw, feed.total_steps):
            feed.states[step] = feed.sampler.state_dict()
            chunks = self._draw()
            feed.next_draw = step + 1
            for j, (chunk, *unit) in enumerate(chunks):
                yield (step, j == len(chunks) - 1, *unit), chunk

    def _draw(self) -> list[tuple[torch.Tensor, ...]]:
        """One logical batch as chunk requests: (indices,) of at most ``chunk_size`` examples, or
        at the user unit (indices, local offsets) of at most ``chunk_size`` whole users."""
        feed = self.feed
        if not hasattr(feed.sampler, "sample_units"):
            indices = feed.sampler.sample()
            # an empty batch: one empty chunk
            return [(c,) for c in indices.split(feed.chunk_size)] or [(indices,)]
        drawn = feed.sampler.sample_units()
        parts: list[tuple[torch.Tensor, ...]] = [
            (drawn.indices[a:b], local)
            for a, b, local in user_slices(drawn.offsets, feed.chunk_size)
        ]
        return parts or [(drawn.indices, torch.zeros(1, dtype=torch.int64))]


class StreamFeed:
    """A training run's chunks from disk, prefetched by ``workers`` processes.

    Args:
        data: the streamed dataset.
        sampler: the run's batch sampler (``sample()``, ``state_dict()``); the feed draws from it.
        chunk_size: examples per physical chunk (users, for a user-level sampler: ``sample_units``).
        start_step: the first step to feed (the sampler stands just before its draw).
        total_steps: the last step + 1 (nothing is drawn beyond it).
        device: where chunks go (pinned host memory and non-blocking copies on a GPU).
        workers: loader processes (0: read in this process).
        prefetch: chunks each worker reads ahead.
    """

    def __init__(
        self,
        data: StreamedData,
        sampler: Any,
        *,
        chunk_size: int,
        start_step: int,
        total_steps: int,
        device: torch.device,
        workers: int,
        prefetch: int = 2,
    ) -> None:
        self.data, self.sampler, self.chunk_size = data, sampler, chunk_size
        self.next_draw, self.total_steps, self.device = start_step, total_steps, device
        self.states: dict[int, dict] = {}
        self.workers, self.prefetch = workers, prefetch
        self._iterator: Iterator | None = None
        self.wait_s = 0.0  # time the training process waited for a chunk (s)
        self.examples = 0  # examples delivered

    def sampler_state(self, step: int) -> dict:
        """The sampler's state before step ``step``'s draw (what a checkpoint after ``step - 1`` holds)."""
        return self.states[step] if step in self.states else self.sampler.state_dict()

    def chunks(self, step: int) -> Iterator[tuple[torch.Tensor, ...]]:
        """Step ``step``'s chunks, as model input on the device, in sampling order: (x, y), or at the
        user unit (x, y, offsets) of whole users."""
        if self._iterator is None:
            shape = tuple(self.data.info.input_shape)
            self._iterator = iter(
                _loader(
                    _Chunks(self.data.train, shape),
                    _BatchRequests(self),
                    self.workers,
                    self.prefetch,
                    self.device.type == "cuda",
                )
            )
        for old in [s for s in self.states if s < step]:
            del self.states[old]
        while True:
            started = time.perf_counter()
            try:
                (chunk_step, last, *unit), x, y = _unless_failed(next(self._iterator))
            except BaseException:  # a worker failed: stop the workers now, not when collected
                self._iterator = None
                raise
            self.wait_s += time.perf_counter() - started
            self.examples += len(y)
            if chunk_step != step:
                raise RuntimeError(
                    f"stream out of order: got a chunk of step {chunk_step} while training step {step}"
                )
            if len(y):
                blocking = self.device.type != "cuda"
                yield (
                    to_model_input(
                        x.to(self.device, non_blocking=not blocking), self.data.normalize
                    ),
                    y.to(self.device, non_blocking=not blocking),
                    *unit,
                )
            if last:
                return

    def close(self, next_step: int) -> None:
        """Stop the workers and put the sampler back before step ``next_step``'s draw (the
        batches drawn ahead are drawn again by the next ``chunks`` call)."""
        self._iterator = None
        if next_step in self.states:
            self.sampler.load_state_dict(self.states[next_step])
            self.next_draw = next_step
        self.states.clear()


def eval_batches(
    data: StreamedData, batch_size: int, device: torch.device, workers: int, prefetch: int = 2
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The test set in order, ``batch_size`` examples at a time, as model input on ``device``."""
    requests = [(None, chunk) for chunk in torch.arange(len(data.test)).split(batch_size)]
    loader = _loader(
        _Chunks(data.test, tuple(data.info.input_shape)),
        requests,
        min(workers, len(requests)),
        prefetch,
        device.type == "cuda",
    )
    for item in loader:
        _, x, y = _unless_failed(item)
        yield to_model_input(x.to(device), data.normalize), y.to(device)


def _fingerprint(name: str, train: ImageSource, shape: tuple[int, ...]) -> str:
    """Labels, shape and 16 evenly spaced training images: a resumed run notices other data."""
    import hashlib

    digest = hashlib.sha256(repr((name, len(train), shape)).encode())
    digest.update(np.ascontiguousarray(train.labels).tobytes())
    for i in np.linspace(0, len(train) - 1, num=min(16, len(train))).astype(int):
        digest.update(train.read(int(i)).tobytes())
    return digest.hexdigest()


def open_stream(
    name: str,
    root: str | os.PathLike,
    *,
    image_size: int | None = None,
    normalize: bool = True,
    val_labels: str | os.PathLike | None = None,
    skip_corrupt: bool = False,
    workers: int = 1,
) -> StreamedData:
    """A dataset to stream: an image folder ("imagefolder") or prepared shards ("shards").

    Args:
        name: "imagefolder" or "shards".
        root: the folder, or the directory ``dpscale data prepare`` wrote.
        image_size: folders only: resize to this square size (None: all images share one size).
        normalize: map pixels to [-1, 1] (data.normalize).
        val_labels, skip_corrupt: as for ``folder.list_image_folder``.
        workers: processes for the start-up check of a folder.

    Returns:
        The streamed dataset (N = the readable training images).
    """
    from .shards import open_shards

    train: ImageSource
    test: ImageSource
    if name == "shards":
        if image_size is not None:
            raise DatasetError(
                "data.image_size does not apply to prepared shards (their size was fixed by `dpscale data prepare --size`)"
            )
        manifest, shard_train, test = open_shards(root)
        train, users = shard_train, shard_train.user_ids
        classes, source, split = (
            manifest["classes"],
            str(root),
            manifest.get("test_split", "official"),
        )
        skipped = tuple(manifest.get("skipped_files", ()))
        notes: tuple[str, ...] = ()  # printed by `dpscale data prepare`
    elif name == "imagefolder":
        from .folder import list_image_folder

        listing = list_image_folder(
            root,
            image_size=image_size,
            val_labels=val_labels,
            skip_corrupt=skip_corrupt,
            workers=workers,
        )
        train = FolderSource(
            listing.train_files, listing.train_labels, listing.mode, image_size, listing.dtype
        )
        test = FolderSource(
            listing.test_files, listing.test_labels, listing.mode, image_size, listing.dtype
        )
        classes, source, split, skipped = (
            listing.classes,
            str(listing.root),
            listing.test_split,
            listing.skipped,
        )
        users, notes = listing.train_users, listing.notes
    else:
        raise DatasetError(
            f"data.loader=stream reads image folders and prepared shards, not {name!r}"
        )
    shape = tuple(int(d) for d in train.read(0).shape)
    info = DatasetInfo(
        name,
        len(train),
        len(test),
        len(classes),
        shape,  # type: ignore[arg-type]
        source,
        split,
        skipped,
        classes=tuple(classes),
        notes=notes,
    )
    return StreamedData(
        train, test, info, normalize, _fingerprint(name, train, shape), user_ids=users
    )


def materialize(data: StreamedData) -> "ImageDataset":
    """The streamed dataset decoded into memory: the pixels, labels and info the in-memory loaders
    give for the same folder or shards (the same ``read`` per example, the same float conversion)."""
    from .datasets import ImageDataset, images_to_float

    def decode(source: ImageSource) -> torch.Tensor:
        if not len(source):
            return torch.zeros((0, *data.info.input_shape))
        return images_to_float(np.stack([source.read(i) for i in range(len(source))]))

    return ImageDataset(
        decode(data.train),
        data.y_train.clone(),
        decode(data.test),
        data.y_test.clone(),
        data.info,
        user_ids=data.user_ids,
    )

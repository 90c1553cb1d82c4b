"""Reading a ``.npz`` dataset file: its named arrays (no pickled objects), and images in any layout
as float32 NCHW in [0, 1].

Splitting, tensor conversion and :class:`DatasetInfo` bookkeeping live in :mod:`dpscale.data.datasets`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .formats import DatasetError


def read_npz(
    path: Path, keys: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, np.ndarray]:
    """Load the named arrays from an ``.npz`` file without allowing pickled objects.

    Args:
        path: The ``.npz`` file.
        keys: Array names that must all be present.
        optional: Array names read when present.

    Returns:
        ``{key: array}`` for each requested key, and each optional one the file holds.
    """
    if not path.is_file():
        raise DatasetError(f"npz file {path} does not exist")
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in keys if k not in npz.files]
            if missing:
                raise DatasetError(
                    f"{path} is missing key {missing[0]!r} (needs {', '.join(keys)}; has {', '.join(npz.files) or 'nothing'})"
                )
            return {k: npz[k] for k in keys + tuple(k for k in optional if k in npz.files)}
    except DatasetError:
        raise
    except Exception as e:  # zipfile/numpy raise many types for a damaged file
        raise DatasetError(
            f"{path} could not be read as an npz archive: {type(e).__name__}: {e}"
        ) from e


def images_to_nchw_float(x: np.ndarray, path: Path, key: str) -> np.ndarray:
    """Convert NHW / NHWC / NCHW images (uint8 0..255 or float 0..1) to float32 NCHW in [0, 1].

    The channel axis is axis 1 when it has size 1 or 3, otherwise the last axis; this is
    unambiguous for any image larger than 3x3 pixels.

    Args:
        x: The image array.
        path: File the array came from (for error messages).
        key: Array name (for error messages).

    Returns:
        A new C-contiguous float32 array of shape (N, C, H, W).
    """
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4:
        if x.shape[1] not in (1, 3):
            if x.shape[3] not in (1, 3):
                raise DatasetError(
                    f"{path}: {key} has shape {x.shape}; expected NHW, NHWC or NCHW with 1 or 3 channels"
                )
            x = x.transpose(0, 3, 1, 2)
    else:
        raise DatasetError(f"{path}: {key} has shape {x.shape}; expected NHW, NHWC or NCHW images")
    if len(x) == 0:
        raise DatasetError(f"{path}: {key} holds no images")
    if np.issubdtype(x.dtype, np.integer) and not np.issubdtype(x.dtype, np.bool_):
        if x.min() < 0 or x.max() > 255:
            raise DatasetError(
                f"{path}: integer {key} must hold pixels 0..255, found {x.min()}..{x.max()}"
            )
        out = x.astype(np.float32) / np.float32(255)
    elif np.issubdtype(x.dtype, np.floating):
        # on the stored values: a huge float64 turns infinite in float32
        _require_finite(x, path, key)
        out = x.astype(np.float32)
        if out.min() < 0 or out.max() > 1:
            raise DatasetError(
                f"{path}: float {key} must lie in [0, 1], found {out.min()}..{out.max()} (store uint8 0..255 or divide by 255 first)"
            )
    else:
        raise DatasetError(f"{path}: {key} has dtype {x.dtype}; expected uint8 or float")
    return np.ascontiguousarray(out)


def _require_finite(x: np.ndarray, path: Path, key: str) -> None:
    """Refuse NaN or infinite pixels, counting them and naming the first image holding one.

    Args:
        x: float images, one per index of the first axis.
        path: File the array came from (for error messages).
        key: Array name (for error messages).

    Raises:
        DatasetError: e.g. "d.npz: 1 NaN pixel in x_train[17]; ...".
    """
    finite = np.isfinite(x)
    if finite.all():
        return
    nan = int(np.isnan(x).sum())
    counts = [
        f"{n} {what} pixel{'s' if n > 1 else ''}"
        for n, what in ((nan, "NaN"), (int((~finite).sum()) - nan, "infinite"))
        if n
    ]
    images = np.flatnonzero(~finite.reshape(len(x), -1).all(axis=1))
    where = (
        f"{key}[{images[0]}]"
        if len(images) == 1
        else f"{len(images)} images of {key}, the first {key}[{images[0]}]"
    )
    raise DatasetError(
        f"{path}: {' and '.join(counts)} in {where}; pixels must be finite numbers in [0, 1]: "
        f"fix or drop {'that image' if len(images) == 1 else 'those images'}"
    )

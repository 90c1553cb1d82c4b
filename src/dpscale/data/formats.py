"""Low-level readers for on-disk image formats: IDX, CIFAR "python" pickles and image files (npz: ``npz_file``).

Everything here returns plain numpy arrays (or PIL images) and raises :class:`DatasetError` with a
message that names the offending file. Splitting, tensor conversion and :class:`DatasetInfo`
bookkeeping live in :mod:`dpscale.data.datasets`.
"""

from __future__ import annotations

import gzip
import pickle
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image, ImageFile, UnidentifiedImageError

from dpscale.errors import UserError

__all__ = [
    "DatasetError",
    "IMAGE_EXTENSIONS",
    "read_bytes",
    "read_idx_images",
    "read_idx_labels",
    "read_cifar_batch",
    "read_image",
    "read_image_samples",
    "wide_samples",
    "wide_pixels",
    "WideSamples",
    "ImageFormatError",
    "labels_to_int64",
    "require_two_classes",
]


class DatasetError(UserError, ValueError):
    """A dataset file or directory is missing, malformed or inconsistent.

    The message always names the file (or directory) and says what is wrong with it.
    """


IMAGE_EXTENSIONS = frozenset(
    {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm"}
)


def is_image_file(path: Path) -> bool:
    """A file an image folder reads: an ``IMAGE_EXTENSIONS`` suffix (any case), not hidden."""
    return (
        path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS and not path.name.startswith(".")
    )


MIN_CLASSES = 2  # fewer: every prediction is right, the accuracy is 100% and means nothing

_IDX_IMAGES_MAGIC = 0x00000803  # unsigned byte, 3 dimensions
_IDX_LABELS_MAGIC = 0x00000801  # unsigned byte, 1 dimension


def read_bytes(path: Path) -> bytes:
    """Read a whole file, transparently decompressing names ending in ``.gz``.

    Args:
        path: The file to read.

    Returns:
        The (decompressed) file contents.
    """
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except FileNotFoundError as err:
        raise DatasetError(f"{path} does not exist") from err
    # A damaged .gz surfaces as BadGzipFile (an OSError), EOFError (cut short) or zlib.error.
    except (OSError, EOFError, zlib.error) as e:
        raise DatasetError(f"{path} could not be read: {e}") from e


def read_idx_images(path: Path) -> np.ndarray:
    """Parse an IDX3 image file (``*-images-idx3-ubyte[.gz]``).

    Args:
        path: The file to read.

    Returns:
        uint8 array of shape (n, rows, cols).
    """
    data = read_bytes(path)
    if len(data) < 16:
        raise DatasetError(
            f"{path} is too short for an IDX image header: {len(data)} bytes, need 16"
        )
    magic, n, rows, cols = struct.unpack(">IIII", data[:16])
    if magic != _IDX_IMAGES_MAGIC:
        hint = " (it looks like a label file)" if magic == _IDX_LABELS_MAGIC else ""
        raise DatasetError(
            f"{path} is not an IDX image file: magic number 0x{magic:08x}, expected 0x{_IDX_IMAGES_MAGIC:08x}{hint}"
        )
    if rows == 0 or cols == 0:
        raise DatasetError(f"{path} has a header claiming {rows}x{cols} images")
    expected, payload = n * rows * cols, len(data) - 16
    if payload != expected:
        what = "is truncated" if payload < expected else "has trailing bytes"
        raise DatasetError(
            f"{path} {what}: header says {n} images of {rows}x{cols} = {expected} bytes, file has {payload} after the 16-byte header"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=16).reshape(n, rows, cols)


def read_idx_labels(path: Path) -> np.ndarray:
    """Parse an IDX1 label file (``*-labels-idx1-ubyte[.gz]``).

    Args:
        path: The file to read.

    Returns:
        uint8 array of shape (n,).
    """
    data = read_bytes(path)
    if len(data) < 8:
        raise DatasetError(
            f"{path} is too short for an IDX label header: {len(data)} bytes, need 8"
        )
    magic, n = struct.unpack(">II", data[:8])
    if magic != _IDX_LABELS_MAGIC:
        hint = " (it looks like an image file)" if magic == _IDX_IMAGES_MAGIC else ""
        raise DatasetError(
            f"{path} is not an IDX label file: magic number 0x{magic:08x}, expected 0x{_IDX_LABELS_MAGIC:08x}{hint}"
        )
    payload = len(data) - 8
    if payload != n:
        what = "is truncated" if payload < n else "has trailing bytes"
        raise DatasetError(
            f"{path} {what}: header says {n} labels = {n} bytes, file has {payload} after the 8-byte header"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=8)


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler that only resolves the globals needed to rebuild numpy arrays.

    A plain ``pickle.load`` on a downloaded file can execute arbitrary code; CIFAR batches only
    ever contain dicts, lists, bytes and uint8 arrays, so anything else is refused.
    """

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),  # written by numpy 1.x (the official files)
        ("numpy._core.multiarray", "_reconstruct"),  # numpy 2.x, protocol <= 4
        ("numpy.core.numeric", "_frombuffer"),  # protocol 5
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # Python 3 writes bytes this way under protocol 2
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")
        if module.startswith("numpy.core.") and hasattr(np, "_core"):
            # numpy 2 keeps numpy.core only as a deprecated alias.
            module = "numpy._core." + module[len("numpy.core.") :]
        return super().find_class(module, name)


def _dict_get(d: dict, key: bytes) -> Any:
    # encoding="bytes" leaves keys written by Python 2 as bytes but keys written by Python 3 as str.
    return d[key] if key in d else d.get(key.decode())


def read_cifar_batch(
    path: Path, label_key: bytes, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Load one CIFAR "python version" batch file.

    Args:
        path: The pickled batch (e.g. ``data_batch_1`` or ``train``).
        label_key: ``b"labels"`` (CIFAR-10) or ``b"fine_labels"`` (CIFAR-100).
        num_classes: Labels must lie in ``0..num_classes-1``.

    Returns:
        ``(x, y)``: uint8 images of shape (n, 3, 32, 32) and int64 labels of shape (n,).
    """
    if not path.is_file():
        raise DatasetError(f"CIFAR batch file {path} does not exist")
    try:
        with open(path, "rb") as f:
            obj = _NumpyOnlyUnpickler(f, encoding="bytes").load()
    # Unpickling garbage can raise almost any exception type; all of them mean "bad file".
    except Exception as e:
        raise DatasetError(
            f"{path} could not be unpickled as a CIFAR batch: {type(e).__name__}: {e}"
        ) from e
    if not isinstance(obj, dict):
        raise DatasetError(
            f"{path} does not hold a dict (found {type(obj).__name__}); not a CIFAR batch"
        )
    data, labels = _dict_get(obj, b"data"), _dict_get(obj, label_key)
    for key, value in ((b"data", data), (label_key, labels)):
        if value is None:
            raise DatasetError(
                f"{path} has no {key.decode()!r} entry (keys: {sorted(map(str, obj))})"
            )
    x = np.asarray(data)
    if x.ndim != 2 or x.shape[1] != 3 * 32 * 32:
        raise DatasetError(
            f"{path}: 'data' has shape {x.shape}, expected (n, 3072) for 3x32x32 images"
        )
    if x.dtype != np.uint8:
        if not np.issubdtype(x.dtype, np.integer) or (x.size and (x.min() < 0 or x.max() > 255)):
            raise DatasetError(
                f"{path}: 'data' must hold uint8 pixels 0..255, found dtype {x.dtype}"
            )
        x = x.astype(np.uint8)
    y = labels_to_int64(np.asarray(labels), path, label_key.decode())
    if len(y) != len(x):
        raise DatasetError(f"{path} has {len(x)} images but {len(y)} {label_key.decode()}")
    _check_label_range(y, num_classes, path)
    return x.reshape(-1, 3, 32, 32), y


def _check_label_range(y: np.ndarray, num_classes: int, path: Path) -> None:
    bad = np.flatnonzero((y < 0) | (y >= num_classes))
    if bad.size:
        i = int(bad[0])
        raise DatasetError(
            f"{path} is mislabeled: labels must be in 0..{num_classes - 1}, found {int(y[i])} at index {i} ({bad.size} bad in total)"
        )


class ImageFormatError(DatasetError):
    """An image file that decodes but whose pixels dpscale cannot convert faithfully.

    Refused even with ``skip_corrupt``: the file is not damaged, and leaving out every file of
    its kind could drop whole classes unnoticed.
    """


@dataclass(frozen=True)
class WideSamples:
    """How to read an image whose samples are wider than 8 bits: ``value / full_scale``, in float.

    Attributes:
        kind: the stored sample type, for messages (e.g. "16-bit").
        full_scale: the value read as 1.0: the type's maximum (a signed type's positive maximum).
        unsigned32: Pillow holds unsigned 32-bit samples in a signed int32 (wrapped), so they are
            read back as uint32.
    """

    kind: str
    full_scale: float
    unsigned32: bool = False


# Integer samples Pillow widens to mode "I;16" or "I", by the decoder's raw mode. A signed type's
# full scale is its positive maximum (scikit-image's img_as_float convention): 0 stays black.
_WIDE_INTEGERS = {
    **dict.fromkeys(("I;16", "I;16B", "I;16L", "I;16N", "I;16R"), WideSamples("16-bit", 65535.0)),
    "I;12": WideSamples("12-bit", 4095.0),  # TIFF 12-bit: Pillow keeps the values 0..4095
    **dict.fromkeys(("I;16S", "I;16BS"), WideSamples("signed 16-bit", 32767.0)),
    **dict.fromkeys(
        ("I;32", "I;32B", "I;32N"), WideSamples("unsigned 32-bit", 4294967295.0, unsigned32=True)
    ),
    **dict.fromkeys(("I;32S", "I;32BS"), WideSamples("signed 32-bit", 2147483647.0)),
}
# float pixels are taken as they are: they must lie in [0, 1]
FLOAT_SAMPLES = WideSamples("32-bit float", 1.0)
# PGM with any maxval above 255: Pillow rescales the samples to 0..65535 (mode "I")
_PGM_SAMPLES = WideSamples("16-bit", 65535.0)
# Raw modes of colour (or grey + alpha) samples wider than 8 bits, which Pillow cuts to 8 bits
# (BMP's "BGR;16" is 5-6-5 bits per pixel, not 16 per sample, and does not match)
_WIDE_COLOUR = re.compile(r";16[BLN]$")


def _decoder_args(img: ImageFile.ImageFile) -> tuple[str, int]:
    """The raw mode the file's decoder was given and a PPM file's maxval (0 if none)."""
    args = img.tile[0].args if img.tile else ""
    if isinstance(args, str):
        return args, 0
    if not isinstance(args, tuple) or not args:
        return "", 0
    raw = args[0] if isinstance(args[0], str) else ""
    # PPM's "ppm" decoder gets (raw mode, maxval) and rescales the samples to 8 bits (16 for grey)
    maxval = args[1] if img.format == "PPM" and len(args) == 2 and isinstance(args[1], int) else 0
    return raw, maxval


def wide_samples(img: ImageFile.ImageFile, path: Path) -> WideSamples | None:
    """How to read an opened image's samples; call before ``load()`` (it drops the raw mode).

    Args:
        img: the image, opened and not yet decoded.
        path: its file (for error messages).

    Returns:
        None for samples of at most 8 bits (Pillow converts those to L or RGB); otherwise the
        type and full scale the pixels are divided by.

    Raises:
        ImageFormatError: colour samples wider than 8 bits, or 32-bit integers of unknown range.
    """
    raw, maxval = _decoder_args(img)
    if img.mode == "F":
        return FLOAT_SAMPLES
    if img.mode == "I" and img.format == "PPM":
        return _PGM_SAMPLES
    if img.mode == "I" or img.mode.startswith("I;16"):
        if raw in _WIDE_INTEGERS:
            return _WIDE_INTEGERS[raw]
        if img.mode != "I":  # a 16-bit container: its type's range
            return _WIDE_INTEGERS["I;16"]
        raise ImageFormatError(
            f"{path}: integer image (Pillow mode I, raw mode {raw or 'unknown'}) whose value range dpscale cannot tell; "
            "save it as 8- or 16-bit grayscale PNG or TIFF"
        )
    if _WIDE_COLOUR.search(raw) or maxval > 255:
        raise ImageFormatError(
            f"{path}: {img.mode} image with more than 8 bits per sample (raw mode {raw}{f', maxval {maxval}' if maxval else ''}); "
            f"Pillow reads {img.mode} at 8 bits and would drop the rest: save it as 16-bit grayscale (PNG or TIFF, no "
            f"alpha) if it is grey, else as 8-bit {img.mode}"
        )
    return None


def wide_pixels(img: Image.Image, wide: WideSamples, path: Path) -> np.ndarray:
    """A wide-sample image's pixels as float32 in [0, 1]: value / full scale, computed in float64
    (never through 8 bits).

    Args:
        img: the decoded single-channel image (mode I;16*, I or F).
        wide: its sample type (:func:`wide_samples`).
        path: its file (for error messages).

    Returns:
        A float32 (H, W) array.

    Raises:
        ImageFormatError: a pixel outside 0..full scale (a negative one of a signed type, a float
            outside [0, 1]) or not finite.
    """
    raw = np.asarray(img)
    if wide.unsigned32:
        raw = raw.view(np.uint32)
    values = raw.astype(np.float64) / wide.full_scale
    finite = np.isfinite(values)
    if finite.all() and (values.size == 0 or (values.min() >= 0 and values.max() <= 1)):
        return values.astype(np.float32)
    shown = raw[finite] if wide is FLOAT_SAMPLES else raw
    span = f"{shown.min():g}..{shown.max():g}" if shown.size else "none finite"
    odd = f" and {int((~finite).sum())} NaN or infinite" if not finite.all() else ""
    if wide is FLOAT_SAMPLES:
        rule = "float images must lie in [0, 1]: rescale it"
    else:
        scale = f"{wide.full_scale:.0f}"
        rule = f"dpscale reads a {wide.kind} pixel as value / {scale}, so it must lie in 0..{scale}: shift or rescale it"
    raise ImageFormatError(
        f"{path}: {wide.kind} image (mode {img.mode}) with pixels {span}{odd}; {rule}"
    )


def read_image_samples(path: Path) -> tuple[Image.Image, WideSamples | None]:
    """Open and fully decode one image file.

    Args:
        path: The image file.

    Returns:
        The decoded PIL image, in its original mode (a palette image as RGBA), and how to read
        its samples (:func:`wide_samples`).
    """
    try:
        with Image.open(path) as img:
            wide = wide_samples(img, path)
            img.load()  # decode now, so a corrupt file fails here rather than later
            return (img.copy() if img.mode != "P" else img.convert("RGBA")), wide
    except DatasetError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise DatasetError(f"could not read image {path}: {e}") from e


def read_image(path: Path) -> Image.Image:
    """Open and fully decode one image file.

    Args:
        path: The image file.

    Returns:
        The decoded PIL image, in its original mode.
    """
    return read_image_samples(path)[0]


def labels_to_int64(y: np.ndarray, path: Path, key: str) -> np.ndarray:
    """Check that labels are a 1-D integer vector (``(N, 1)`` is flattened) and return int64.

    Args:
        y: The label array.
        path: File the labels came from (for error messages).
        key: Array name (for error messages).

    Returns:
        A new int64 array of shape (N,).
    """
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]  # e.g. keras.datasets.cifar10 stores labels as (N, 1)
    if y.ndim != 1:
        raise DatasetError(
            f"{path}: {key} has shape {y.shape}; expected a 1-D vector of class indices"
        )
    if y.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.bool_):
        raise DatasetError(f"{path}: {key} has dtype {y.dtype}; class labels must be integers")
    if y.min() < 0:
        raise DatasetError(
            f"{path} is mislabeled: {key} contains the negative label {int(y.min())}"
        )
    return y.astype(np.int64)


def require_two_classes(
    labels: np.ndarray, where: str, names: Sequence[str] | None = None, note: str = ""
) -> None:
    """Refuse a training set whose labels hold fewer than two classes.

    A one-class set trains without complaint and reports 100% test accuracy (every test label is
    that class), so it is refused when the data is loaded instead.

    Args:
        labels: the training labels (class indices).
        where: what the labels came from, first in the message (e.g. the file or folder).
        names: class names by index, shown instead of the bare label when given.
        note: appended to the message (e.g. why classes are missing).

    Raises:
        DatasetError: fewer than two distinct labels.
    """
    present = np.unique(np.asarray(labels))
    if len(present) >= MIN_CLASSES:
        return
    shown = ", ".join(
        repr(names[int(c)]) if names is not None else f"label {int(c)}" for c in present
    )
    which = f"only one class ({shown})" if len(present) else "no class"
    raise DatasetError(
        f"{where}: the training set has {which}{note}; a classifier needs at least two classes"
    )

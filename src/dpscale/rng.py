"""The random number generator of every privacy-relevant stream: DP-SGD noise, batch sampling
and the noise of private feature normalisation.

What it is: numpy's PCG64DXSM bit generator (a 128-bit LCG state with a strong output mix,
numpy's upgrade of PCG64 for many parallel streams), seeded through ``np.random.SeedSequence``
from a non-negative integer of any size, so every bit of a 128-bit seed counts. torch's CPU
generator (mt19937) keeps only the low 32 bits of ``manual_seed``: 2^32 possible noise streams,
few enough to try them all against released statistics and recover the noise (and with it a
target's membership).

What it is NOT: a cryptographically secure generator. PCG64DXSM's output is not designed to
resist an adversary who sees many outputs and solves for the state; a 128-bit seed only rules
out enumerating seeds. For that, ``dp.secure_noise`` draws the noise with ``SecureRandom``:
every bit from the operating system's CSPRNG, nothing recorded.

Draws are made on the host and then copied to the requested device, so a run draws exactly the
same noise on CPU and on CUDA. numpy draws on one thread, at about half ``torch.randn``'s speed
on 2 cores; so a draw of more than ``PARALLEL_CHUNK`` normals takes a fresh 128-bit key from
the stream and fills fixed chunks of ``PARALLEL_CHUNK`` from child generators
(``SeedSequence(key, spawn_key=(chunk,))``) on ``torch.get_num_threads()`` threads. The chunks,
not the threads, fix the values: any number of threads gives the same draws. Measured costs are
in docs/privacy.md ("Random numbers").
"""

from __future__ import annotations

import copy
import functools
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Union, cast

import numpy as np
import torch

if TYPE_CHECKING:
    from numpy.random._pcg64 import _PCG64State  # numpy's type of a PCG64(DXSM) state (stubs only)

BIT_GENERATOR = "PCG64DXSM"
# Normals per chunk of a parallel draw (4 MB of float32): large enough that creating a child
# generator (~20 us) is negligible, small enough to share a ResNet's noise among the threads.
PARALLEL_CHUNK = 1 << 20
SEED_BITS = 128  # bits of the seeds derive_seed gives (the run's stream seeds are as wide)
# float32 draws serve the half-precision dtypes too (then cast): numpy has no bf16/fp16 normals.
_HostDtype = Union[type[np.float32], type[np.float64]]
_HOST_DTYPE: dict[torch.dtype, _HostDtype] = {
    torch.float32: np.float32,
    torch.bfloat16: np.float32,
    torch.float16: np.float32,
    torch.float64: np.float64,
}


_FRACTION_BITS = 53  # DPRandom.uniform's float64 draws are j / 2^53, j an integer below 2^53
_HALF_BITS = 27  # floor(j * n / 2^53) is taken in two halves of j, so that int64 never overflows


def uniform_below(uniforms: torch.Tensor, bounds: torch.Tensor | int) -> torch.Tensor:
    """floor(u * n) for 53-bit uniforms u = j / 2^53, exactly (in integers): uniform over 0..n-1
    to within n / 2^53.

    Args:
        uniforms: float64 draws of ``DPRandom.uniform`` (each a multiple of 2^-53 in [0, 1)).
        bounds: n >= 1 (below 2^36), one for all or one per uniform.

    Returns:
        int64 values in 0..n-1, shaped like ``uniforms``.
    """
    j = (uniforms * 2.0**_FRACTION_BITS).to(torch.int64)
    high, low = j >> _HALF_BITS, j & ((1 << _HALF_BITS) - 1)
    # floor(j n / 2^53) = floor((high n + floor(low n / 2^27)) / 2^26): within int64 for n < 2^36,
    # where j n itself would overflow for n >= 2^10
    return (high * bounds + ((low * bounds) >> _HALF_BITS)) >> (_FRACTION_BITS - _HALF_BITS)


def is_dprandom_state(state: Any) -> bool:
    """True for a ``DPRandom.state_dict()`` (False e.g. for a torch generator's ByteTensor state,
    as checkpoints written before this generator existed hold)."""
    return isinstance(state, dict) and state.get("bit_generator") == BIT_GENERATOR


def words_to_int(words: np.ndarray) -> int:
    """The integer whose little-endian unsigned words (uint32 or uint64) are ``words``.

    Args:
        words: e.g. ``SeedSequence(...).generate_state(4, dtype=np.uint32)``.

    Returns:
        a non-negative python int of up to ``words.size * word bits`` bits.
    """
    width = 8 * np.dtype(words.dtype).itemsize
    return sum(int(w) << (width * i) for i, w in enumerate(words))


def _to_device(host: torch.Tensor, device: Any, dtype: torch.dtype) -> torch.Tensor:
    """``host`` as ``dtype`` on ``device``; to a GPU through pinned memory without blocking the
    host (a copy from pageable memory would wait for the device's queue to drain)."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device=device, dtype=dtype)
    return host.pin_memory().to(device=device, non_blocking=True).to(dtype)


def derive_seed(entropy: int, spawn_key: tuple[int, ...] = ()) -> int:
    """A ``SEED_BITS``-bit seed from ``entropy`` and ``spawn_key``, through ``np.random.SeedSequence``
    (``spawn_key`` is its way to derive independent children of one entropy).

    Args:
        entropy: a non-negative integer of any size.
        spawn_key: non-negative integers naming the child (e.g. world size, rank, step).

    Returns:
        a python int below 2^SEED_BITS.
    """
    sequence = np.random.SeedSequence(int(entropy), spawn_key=tuple(int(k) for k in spawn_key))
    return words_to_int(sequence.generate_state(SEED_BITS // 32, dtype=np.uint32))


def require_dprandom(generator: Any, stream: str) -> "DPRandom":
    """``generator``, checked to be a DPRandom: a torch generator must not slip back into a
    privacy-relevant stream (it keeps only 32 bits of its seed).

    Args:
        generator: the generator handed to a noise or sampling function.
        stream: what it is for, for the error message (e.g. "DP-SGD noise").

    Returns:
        ``generator``.

    Raises:
        TypeError: if it is anything else.
    """
    if not isinstance(generator, DPRandom):
        raise TypeError(f"{stream} needs a dpscale.rng.DPRandom, got {type(generator).__name__}")
    return generator


@functools.lru_cache(maxsize=4)
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dprandom")


def _parallel_normals(key: int, count: int, host_dtype: _HostDtype) -> np.ndarray:
    """``count`` standard normals: chunk j of ``PARALLEL_CHUNK`` comes from the child generator
    ``SeedSequence(key, spawn_key=(j,))`` (numpy releases the GIL while it fills a chunk)."""
    out: np.ndarray = np.empty(count, dtype=host_dtype)

    def fill(j: int) -> None:
        child = np.random.Generator(
            np.random.PCG64DXSM(np.random.SeedSequence(key, spawn_key=(j,)))
        )
        child.standard_normal(
            out=out[j * PARALLEL_CHUNK : (j + 1) * PARALLEL_CHUNK], dtype=host_dtype
        )

    chunks = range(-(-count // PARALLEL_CHUNK))
    workers = max(1, min(torch.get_num_threads(), len(chunks)))
    if workers == 1:
        for j in chunks:
            fill(j)
    else:
        list(_pool(workers).map(fill, chunks))
    return out


class DPRandom:
    """A 128-bit-seeded PCG64DXSM generator that returns torch tensors.

    Args:
        seed: a non-negative integer of any size; all of its bits enter the SeedSequence
            (use at least 128 bits of entropy for a stream an adversary must not guess).
    """

    def __init__(self, seed: int) -> None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"DPRandom needs a non-negative integer seed, got {seed!r}")
        self._bit_generator = np.random.PCG64DXSM(np.random.SeedSequence(int(seed)))
        self._rng = np.random.Generator(self._bit_generator)

    def normal(
        self,
        shape: tuple[int, ...] | torch.Size,
        dtype: torch.dtype = torch.float32,
        device: Any = "cpu",
    ) -> torch.Tensor:
        """Independent standard normals.

        Drawn on the host in float32 (for float32, bfloat16, float16) or float64 (for float64),
        then cast and copied to ``device``: the same values whatever the device.

        Args:
            shape: the tensor's shape.
            dtype: a floating dtype (float32, float64, bfloat16 or float16).
            device: where the tensor goes (e.g. "cpu", "cuda:0").

        Returns:
            a tensor of ``shape``, ``dtype`` on ``device``.
        """
        host = _HOST_DTYPE.get(dtype)
        if host is None:
            raise TypeError(
                f"DPRandom.normal draws floating tensors (float32/64, bf16, fp16), not {dtype}"
            )
        count = math.prod(tuple(shape))
        if count <= PARALLEL_CHUNK:
            draws = self._rng.standard_normal(tuple(shape), dtype=host)
        else:
            key = words_to_int(self._rng.integers(0, 2**32, size=SEED_BITS // 32, dtype=np.uint32))
            draws = _parallel_normals(key, count, host).reshape(tuple(shape))
        return _to_device(torch.from_numpy(draws), device, dtype)

    def uniform(self, n: int) -> torch.Tensor:
        """``n`` independent uniforms on [0, 1) in float64 (53 random bits each), on the CPU.

        Args:
            n: how many.

        Returns:
            a float64 CPU tensor of shape [n].
        """
        return torch.from_numpy(self._rng.random(int(n), dtype=np.float64))

    def permutation(self, n: int) -> torch.Tensor:
        """A uniformly random permutation of 0..n-1, as an int64 CPU tensor.

        Args:
            n: its length.

        Returns:
            an int64 CPU tensor of shape [n].
        """
        return torch.from_numpy(self._rng.permutation(int(n)).astype(np.int64, copy=False))

    def state_dict(self) -> dict[str, Any]:
        """The generator's whole state: a dict of python ints and strings (``torch.save`` writes
        it and ``torch.load(weights_only=True)`` reads it back).

        Returns:
            a copy of numpy's ``bit_generator.state``.
        """
        return dict(copy.deepcopy(self._bit_generator.state))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the generator that wrote ``state`` stood.

        Args:
            state: from ``state_dict()``.

        Raises:
            ValueError: if ``state`` is not a DPRandom state (e.g. a torch generator's ByteTensor).
        """
        if isinstance(state, dict) and state.get("bit_generator") == SECURE_SOURCE:
            raise ValueError(
                "this checkpoint's noise came from dp.secure_noise (it holds no state to continue); resume it with dp.secure_noise"
            )
        if not is_dprandom_state(state):
            raise ValueError(f"not a {BIT_GENERATOR} DPRandom state: {type(state).__name__}")
        # checked by is_dprandom_state
        self._bit_generator.state = cast("_PCG64State", copy.deepcopy(state))

    def __repr__(self) -> str:  # never the state: it is as secret as the noise
        return f"DPRandom({BIT_GENERATOR})"


SECURE_SOURCE = "os.urandom"  # the "bit_generator" a SecureRandom's state_dict names
_SECURE_CHUNK = 1 << 22  # normals per os.urandom call (32 MB of bytes), filled on the thread pool


def _secure_normals(count: int) -> np.ndarray:
    """``count`` float64 standard normals, every random bit from ``os.urandom``: pairs of 53-bit
    uniforms through the Box-Muller transform (8 bytes of OS randomness per normal)."""
    pairs = -(-count // 2)
    out = np.empty(2 * pairs, dtype=np.float64)

    def fill(j: int) -> None:
        lo, hi = j * _SECURE_CHUNK // 2, min(pairs, (j + 1) * _SECURE_CHUNK // 2)
        words = np.frombuffer(os.urandom(16 * (hi - lo)), dtype=np.uint64).reshape(2, -1)
        # (0, 1]: log is finite
        u1 = ((words[0] >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53
        u2 = (words[1] >> np.uint64(11)).astype(np.float64) * 2.0**-53  # [0, 1)
        radius = np.sqrt(-2.0 * np.log(u1))
        out[2 * lo : 2 * hi : 2] = radius * np.cos(2 * np.pi * u2)
        out[2 * lo + 1 : 2 * hi : 2] = radius * np.sin(2 * np.pi * u2)

    chunks = range(-(-2 * pairs // _SECURE_CHUNK))
    workers = max(1, min(torch.get_num_threads(), len(chunks)))
    if workers == 1:
        for j in chunks:
            fill(j)
    else:  # os.urandom releases the GIL
        list(_pool(workers).map(fill, chunks))
    return out[:count]


class SecureRandom(DPRandom):
    """Gaussian noise from the operating system's cryptographically secure generator
    (``os.urandom``: getrandom(2) on Linux), for ``dp.secure_noise``. It has no seed and no state:
    nothing written anywhere lets anyone reproduce the noise, and a resumed run continues with
    fresh noise (so it is not bit-identical to an uninterrupted one; nothing about it is).

    Floating-point leaks of sampled normals (Mironov 2012; Jin et al. 2022) are not addressed:
    the normals are float64 Box-Muller values, cast to the gradient's dtype.
    """

    def __init__(self) -> None:  # no seed: nothing to record
        pass

    def normal(
        self,
        shape: tuple[int, ...] | torch.Size,
        dtype: torch.dtype = torch.float32,
        device: Any = "cpu",
    ) -> torch.Tensor:
        """Independent standard normals from the OS CSPRNG (see ``DPRandom.normal`` for the arguments)."""
        if dtype not in _HOST_DTYPE:
            raise TypeError(
                f"SecureRandom.normal draws floating tensors (float32/64, bf16, fp16), not {dtype}"
            )
        draws = _secure_normals(math.prod(tuple(shape))).reshape(tuple(shape))
        return _to_device(torch.from_numpy(draws), device, dtype)

    def uniform(self, n: int) -> torch.Tensor:
        """``n`` uniforms on [0, 1), 53 OS-random bits each, float64 on the CPU."""
        words = np.frombuffer(os.urandom(8 * int(n)), dtype=np.uint64)
        return torch.from_numpy((words >> np.uint64(11)).astype(np.float64) * 2.0**-53)

    def permutation(self, n: int) -> torch.Tensor:
        raise TypeError(
            "SecureRandom serves the DP-SGD noise only; batch sampling uses the run's DPRandom"
        )

    def state_dict(self) -> dict[str, Any]:
        """A marker with no state: a checkpoint holds nothing that reproduces the noise."""
        return {"bit_generator": SECURE_SOURCE}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Accept a SecureRandom marker (nothing to restore); refuse a seeded generator's state,
        which belongs to a run without dp.secure_noise."""
        if not (isinstance(state, dict) and state.get("bit_generator") == SECURE_SOURCE):
            raise ValueError(
                "this checkpoint's noise came from a seeded generator, not dp.secure_noise; refusing to mix them"
            )

    def __repr__(self) -> str:
        return f"SecureRandom({SECURE_SOURCE})"


def noise_generator(seed: int, secure: bool) -> DPRandom:
    """A noise generator (DP-SGD, Data Normalization): ``SecureRandom`` for dp.secure_noise, else ``DPRandom(seed)``."""
    return SecureRandom() if secure else DPRandom(seed)

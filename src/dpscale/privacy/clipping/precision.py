"""Mixed precision for DP-SGD: the model runs in 16 bits, the privacy arithmetic in 32.

``train.precision`` chooses how the model's forward and backward passes compute:

* ``fp32``: plain float32 (also on CUDA, where cuDNN's default would run convolutions in TF32).
* ``tf32``: float32 tensors, with CUDA matmuls and convolutions allowed to use TF32 tensor cores
  (10-bit mantissa inputs; no effect on CPU).
* ``bf16`` / ``fp16``: the forward pass under ``torch.autocast``; parameters stay float32.

Whatever the choice, each example's gradient is taken to float32 *before* its norm is measured,
and its norm, clip factor, the clipped sum and the noise are computed in float32 from that same
float32 gradient. The released contribution of an example is therefore clipped exactly as in
fp32 (its norm is at most C under worst-case float32 rounding: ``clipping.clip_margin`` and
``clipping.release_slack``): 16 bits change which gradient is clipped, never the bound.

fp16's narrow range needs loss scaling: the summed loss is multiplied by a fixed power of two S
before the backward pass, and each example's gradient divided by S in float32 (exact for a power
of two) before anything else. The scale is fixed, never adapted: a dynamic scale reacts to
overflows, and whether an overflow happened depends on the private examples. An example whose
gradient is not finite (overflow, or a NaN from its own data) contributes exactly zero (the same
per-example function of that example alone, still bounded by C). The same holds in fp32 and tf32
(an input of 3e38 overflows there too): otherwise 0 * inf = NaN would make the whole update NaN,
showing that the example was in the batch. Each step counts such examples.

The vmap engine runs normalisation layers on a float32 copy of a 16-bit input
(``float32_normalization``): CPU autocast leaves them mixed (16-bit input, float32 affine
parameters), which torch's batching rules cannot differentiate.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from dpscale.choices import PRECISIONS

DEFAULT_FP16_LOSS_SCALE = 1024.0
_AUTOCAST_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Comparisons with a float32 reference (self-check, route check) use the tolerance of the
# precision the gradients were computed in; TF32 inputs keep fp16's 10-bit mantissa.
_COMPARE_DTYPE = {
    "fp32": torch.float32,
    "tf32": torch.float16,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class Precision:
    """How the model computes, and the fixed fp16 loss scale.

    Attributes:
        name: "fp32", "tf32", "bf16" or "fp16".
        loss_scale: S, a power of two (fp16 only; 1 otherwise).
    """

    name: str = "fp32"
    loss_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.name!r}")
        if not self.loss_scale > 0 or math.frexp(self.loss_scale)[0] != 0.5:
            raise ValueError(
                f"the loss scale must be a positive power of two, got {self.loss_scale}"
            )
        if self.name != "fp16" and self.loss_scale != 1.0:
            raise ValueError(f"a loss scale is for fp16 only (precision {self.name})")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The 16-bit type the forward pass runs in (None: float32)."""
        return _AUTOCAST_DTYPE.get(self.name)

    @property
    def low(self) -> bool:
        """The model computes in 16 bits (gradients must be taken to float32 and checked)."""
        return self.autocast_dtype is not None

    @property
    def compare_dtype(self) -> torch.dtype:
        """The dtype whose tolerance applies when comparing with a float32 reference."""
        return _COMPARE_DTYPE[self.name]

    @contextlib.contextmanager
    def forward(self, device: torch.device) -> Iterator[None]:
        """The model's forward pass in this precision (autocast for bf16/fp16)."""
        dtype = self.autocast_dtype
        if dtype is None:
            yield
            return
        with torch.autocast(device_type=device.type, dtype=dtype):
            yield

    def matmul_flags(self) -> contextlib.AbstractContextManager[None]:
        """CUDA matmuls and convolutions while inside (restored after): TF32 for ``tf32``, full
        float32 otherwise. Set both ways because cuDNN's own default is TF32: "fp32" left to it ran
        convolutions in TF32 on an H200, and the batch and a batch of one then rounded differently
        enough (7e-3 relative on resnet18-gn at 224x224) for the self-check to refuse the engine."""
        return _tf32(self.name == "tf32")


FP32 = Precision()


@contextlib.contextmanager
def _tf32(allowed: bool) -> Iterator[None]:
    """CUDA matmuls and convolutions may (or may not) use TF32 while inside; restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def exact_float32() -> contextlib.AbstractContextManager[None]:
    """Full float32 matmuls and convolutions while inside, whatever the user's TF32 setting: the
    engines' per-example norms and clipped sums run here (a TF32 Gram matrix or clipped sum
    would carry 10-bit rounding into the clip bound)."""
    return _tf32(False)


def make_precision(name: str, fp16_loss_scale: float = DEFAULT_FP16_LOSS_SCALE) -> Precision:
    """The ``Precision`` for a config's ``train.precision`` (the loss scale applies to fp16 only)."""
    return Precision(name, fp16_loss_scale if name == "fp16" else 1.0)


def finite_examples(rows_finite: torch.Tensor, views: int) -> torch.Tensor:
    """Per-example finiteness (B,) from per-row finiteness (B*K,): all of an example's K views."""
    return rows_finite.reshape(-1, views).all(1)


# On the CPU nothing runs ahead of the host, so reading whether a chunk has a non-finite example
# costs nothing and a clean chunk skips the zeroing pass; on an accelerator that read would stall
# the host (the training loop reads no tensor during a step), so the pass always runs there. Tests
# set it False to run the accelerator's path on the CPU.
SKIP_CLEAN_CHUNKS_ON_CPU = True


def needs_zeroing(finite: torch.Tensor) -> bool:
    """Whether to run the zeroing pass for per-example finiteness ``finite``: always on an
    accelerator (no host read), on the CPU only when some example is not finite. The pass is
    exact either way: it sets no finite example's rows to zero."""
    if finite.device.type != "cpu" or not SKIP_CLEAN_CHUNKS_ON_CPU:
        return True
    return not bool(finite.all())


def zero_rows(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``t`` (rows first) with the rows where ``keep`` is False set to exactly zero (not
    multiplied: 0 * inf would be NaN)."""
    return torch.where(
        keep.view(-1, *([1] * (t.dim() - 1))), t, torch.zeros((), dtype=t.dtype, device=t.device)
    )


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or kept in its own type when that is wider (float64)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


# Normalisations whose CPU autocast kernels take a 16-bit input with float32 affine parameters
# (or running statistics): torch's vmap batching rules for their backward pass refuse the mix
# ("expected scalar type BFloat16 but found Float"). F.* and torch.* names: a user may call either
# (getattr: an older torch may lack rms_norm).
_NORM_NAMES = ("layer_norm", "group_norm", "instance_norm", "batch_norm", "rms_norm")
_NORMALIZATIONS = frozenset(
    f for m in (F, torch) for f in (getattr(m, n, None) for n in _NORM_NAMES) if f is not None
)
_SIXTEEN_BITS = (torch.bfloat16, torch.float16)


def _wider_operand(args: tuple, kwargs: dict) -> bool:
    """Whether a floating tensor among ``args``/``kwargs`` is wider than 16 bits (float32 parameters)."""
    operands = [*args, *kwargs.values()]
    return any(
        isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in _SIXTEEN_BITS
        for t in operands
    )


class _Float32Normalization(TorchFunctionMode):
    """Runs a normalisation with a 16-bit input and wider parameters on a float32 copy of the input."""

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        x = args[0] if args else None
        mixed = (
            func in _NORMALIZATIONS
            and isinstance(x, torch.Tensor)
            and x.dtype in _SIXTEEN_BITS
            and _wider_operand(args[1:], kwargs)
        )
        # (x is one when mixed: this tells the type checker)
        if not mixed or not isinstance(x, torch.Tensor):
            return func(*args, **kwargs)
        out = func(x.float(), *args[1:], **kwargs)
        # CUDA's autocast runs normalisations in float32 and returns float32; elsewhere the mixed
        # kernel returns the input's type, and so does this (upcasting a 16-bit value is exact, and
        # the mixed kernels compute in float32 too): the engines see the same forward pass, up to
        # the kernels' order of summation.
        return out if x.device.type == "cuda" else out.to(x.dtype)


def float32_normalization(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """While inside, a normalisation (layer/group/instance/batch/RMS norm) called with a 16-bit
    input and float32 parameters computes on a float32 copy of its input, returning the type the
    plain autocast forward pass returns. For the vmap engine under bf16/fp16 autocast, whose
    per-example backward pass cannot take the mixed types.

    Args:
        enabled: False gives a context that changes nothing (a float32 model needs none).

    Returns:
        the context manager (a torch function mode, active on this thread only).
    """
    return _Float32Normalization() if enabled else contextlib.nullcontext()

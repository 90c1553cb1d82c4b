"""The Scattering Network (ScatterNet) feature extractor of Oyallon & Mallat (2015).

Tramèr & Boneh (2021), "Differentially private learning needs better features", train linear
models and small CNNs with DP-SGD on ScatterNet features instead of pixels (Sections 2.1, C.1).
The transform is a fixed cascade of wavelet transforms and complex moduli followed by 2^J x 2^J
spatial averaging, applied to each colour channel separately. It has no trainable parameters and
is chosen without looking at any data, so applying it to each example independently costs no
privacy: DP-SGD's guarantee covers whatever is trained on top of it.

kymatio computes the transform; it is imported only when a ScatterNet is built, so the rest of
dpscale works without it.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

__all__ = [
    "KYMATIO_HINT",
    "ScatterNet",
    "import_kymatio",
    "scatter_output_shape",
    "scatter_channels",
]

KYMATIO_HINT = "ScatterNet features need kymatio: pip install -c constraints.txt kymatio"


def import_kymatio() -> ModuleType:
    """Import kymatio, or raise ImportError saying how to install it."""
    try:
        import kymatio
    except ImportError as err:
        raise ImportError(f"{KYMATIO_HINT} ({err})") from err
    return kymatio


def scatter_channels(J: int = 2, L: int = 8, max_order: int = 2) -> int:
    """K, the number of scattering coefficients per input channel.

    Order 0 gives 1 low-pass coefficient, order 1 one per scale and angle (J * L), and order 2 one
    per pair of angles and increasing scales (L^2 * J(J-1)/2); J=2, L=8, order 2 gives K = 81.
    """
    if J < 1:
        raise ValueError(f"ScatterNet J (number of scales) must be >= 1, got {J}")
    if L < 1:
        raise ValueError(f"ScatterNet L (number of angles) must be >= 1, got {L}")
    if max_order not in (1, 2):
        raise ValueError(f"ScatterNet max_order must be 1 or 2, got {max_order}")
    k = 1 + J * L
    if max_order == 2:
        k += L * L * J * (J - 1) // 2
    return k


def scatter_output_shape(
    input_shape: tuple[int, int, int], J: int = 2, L: int = 8, max_order: int = 2, pad: int = 0
) -> tuple[int, int, int]:
    """Shape of the ScatterNet features of one image, without running the transform.

    Args:
        input_shape: (C, H, W) of one image, in pixels.
        J: number of scales; the output is subsampled by 2^J in each spatial dimension.
        L: number of wavelet angles.
        max_order: scattering depth, 1 or 2.
        pad: zero pixels added on each side of the image before the transform (>= 0).

    Returns:
        (C * K, (H + 2 pad) / 2^J, (W + 2 pad) / 2^J), e.g. (81, 7, 7) for (1, 28, 28), (81, 8, 8)
        for (1, 28, 28) with pad 2, and (243, 8, 8) for (3, 32, 32).

    Raises:
        ValueError: bad parameters, or padded H or W smaller than or not divisible by 2^J.
    """
    k = scatter_channels(J, L, max_order)
    if len(input_shape) != 3 or any(int(d) < 1 for d in input_shape):
        raise ValueError(
            f"ScatterNet input_shape must be (C, H, W) with positive sizes, got {tuple(input_shape)}"
        )
    if pad < 0:
        raise ValueError(f"ScatterNet pad must be >= 0, got {pad}")
    c, h, w = (int(d) for d in input_shape)
    h, w = h + 2 * pad, w + 2 * pad
    step = 2**J
    for what, size in (("height", h), ("width", w)):
        if size < step:
            raise ValueError(
                f"ScatterNet with J={J} needs images at least {step} pixels in {what}, got {size}"
            )
        if size % step:
            raise ValueError(
                f"ScatterNet with J={J} needs image {what} divisible by 2^J = {step}, got {size}; "
                "resize the images (data.image_size), pad them (features.scatter_pad) or pick another J"
            )
    return (c * k, h // step, w // step)


class ScatterNet(nn.Module):
    """ScatterNet features: [N, C, H, W] images -> [N, C*K, H/2^J, W/2^J] coefficients.

    A fixed, data-independent transform with no trainable parameters (only constant filter
    buffers), so extracting features costs no privacy. Channels are ordered channel-major: the K
    coefficients of input channel 0 first, then those of channel 1, and so on.

    Args:
        input_shape: (C, H, W) of one image; H and W must be multiples of 2^J.
        J: number of scales (2 in the paper).
        L: number of wavelet angles (8 in the paper).
        max_order: scattering depth, 1 or 2 (2 in the paper).
        pad: zero pixels added on each side before the transform (0 in the paper). On 28x28
            Fashion-MNIST, pad 2 gives 8x8 instead of 7x7 coefficients and the wavelets stop
            wrapping around the border; it raised DP linear-head accuracy (docs/results.md, issue 28).

    Raises:
        ValueError: bad parameters or image size (see :func:`scatter_output_shape`).
        ImportError: kymatio is not installed.
    """

    def __init__(
        self,
        input_shape: tuple[int, int, int],
        J: int = 2,
        L: int = 8,
        max_order: int = 2,
        pad: int = 0,
    ) -> None:
        super().__init__()
        # Validate first so a bad shape is reported as such even without kymatio.
        self.output_shape = scatter_output_shape(input_shape, J, L, max_order, pad)
        self.input_shape = tuple(int(d) for d in input_shape)
        self.J, self.L, self.max_order, self.pad = J, L, max_order, pad
        kymatio = import_kymatio()
        # kymatio.Scattering2D(frontend="torch") rather than kymatio.torch, whose import fails
        # with recent scipy; the result is an nn.Module whose filters are buffers.
        _, h, w = self.input_shape
        h, w = h + 2 * pad, w + 2 * pad
        self.scattering = kymatio.Scattering2D(
            J=J, shape=(h, w), L=L, max_order=max_order, frontend="torch"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(
                f"ScatterNet built for images of shape {self.input_shape} (C, H, W) got a batch of shape {tuple(x.shape)}"
            )
        if self.pad:
            x = nn.functional.pad(x, (self.pad,) * 4)  # zeros: a fixed, data-independent border
        out = self.scattering(x.contiguous())  # [N, C, K, H/2^J, W/2^J]
        return out.reshape(x.shape[0], *self.output_shape)

    def extra_repr(self) -> str:
        return f"input_shape={self.input_shape}, J={self.J}, L={self.L}, max_order={self.max_order}, pad={self.pad}"

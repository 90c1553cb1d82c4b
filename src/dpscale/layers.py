"""Small layers shared by the models and the clipping engines (no other dpscale imports: the engines use them without loading the model zoo)."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn


class ClassTokenPositionEmbedding(nn.Module):
    """Prepends a learned class token to (B, T, D) tokens and adds a learned position embedding.

    Its own module (not loose parameters on the model) so per-example clipping engines can
    handle it exactly: the per-example gradient of the position embedding is the output
    gradient itself, and that of the class token is its first row.
    """

    def __init__(self, num_tokens: int, dim: int) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, num_tokens + 1, dim) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)
        return torch.cat([cls, tokens], dim=1) + self.pos_embed


def standardized(weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(W - mean) / sqrt(fan_in * var + eps) per output row (dim 0) of a conv or linear weight."""
    dims = tuple(range(1, weight.dim()))
    mean = weight.mean(dim=dims, keepdim=True)
    var = weight.var(dim=dims, keepdim=True, unbiased=False)
    return (weight - mean) * torch.rsqrt(var * weight[0].numel() + eps)


class ScaledStdConv2d(nn.Conv2d):
    """Conv2d with scaled weight standardisation (Brock et al. 2021):
    W' = gain * (W - mean) / sqrt(fan_in * var + eps), per output filter.

    The engines' exact rule for it maps each example's gradient with respect to W' through the
    standardisation's Jacobian (``dpscale.privacy.clipping.ghost.conv``)."""

    def __init__(self, *args, eps: float = 1e-4, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.ones(self.out_channels, 1, 1, 1))
        self.eps = eps

    def standardized_weight(self) -> torch.Tensor:
        """(W - mean) / sqrt(fan_in * var + eps), without the gain."""
        return standardized(self.weight, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.standardized_weight() * self.gain
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class ScaledStdLinear(nn.Linear):
    """Linear with the same scaled weight standardisation per output row:
    W' = gain * (W - mean) / sqrt(in_features * var + eps).

    Why for DP-SGD: the noise added to a row changes its norm as well as its direction, and a
    tanh after the layer saturates as the norms grow; standardising gives the scale to one
    trainable gain per row. The engines' exact rule is ``dpscale.privacy.clipping.ghost.rules``."""

    def __init__(self, *args, eps: float = 1e-4, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.ones(self.out_features, 1))
        self.eps = eps

    def standardized_weight(self) -> torch.Tensor:
        """(W - mean) / sqrt(in_features * var + eps), without the gain."""
        return standardized(self.weight, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.standardized_weight() * self.gain, self.bias)


def group_norm(channels: int, groups: int) -> nn.Module:
    """GroupNorm with ``groups`` groups (or the largest divisor of channels below it); 0: none."""
    if groups <= 0:
        return nn.Identity()
    g = min(groups, channels)
    while channels % g:
        g -= 1
    return nn.GroupNorm(g, channels)


class ScalarGain(nn.Module):
    """x * (scale * gain) with one trainable scalar ``gain`` (SkipInit's zero-initialised
    residual gain). Its own module, so that the engines record it: the per-example gradient of
    the gain is scale * sum(x_i * g_i)."""

    def __init__(self, scale: float = 1.0, init: float = 0.0) -> None:
        super().__init__()
        self.scale = scale
        self.gain = nn.Parameter(torch.full((), float(init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (self.scale * self.gain)


class _WithFrozenLayer:
    """LoRA's down-projection A run in one call with the frozen layer W it adapts: it computes
    [A; W] x in one convolution or matrix product (W's bias on W's rows), returns A x, its own
    output as the engines record it, and keeps W x + b for the adapter (``take_frozen_output``).
    The input (a convolution's patches) is read once instead of twice, most of LoRA's extra cost
    on small models (docs/transfer.md: a private step 0.92x that of two calls on papernot-cnn and
    resnet18-gn, with less memory)."""

    # a tuple, so that the adapter alone owns W as a submodule
    _frozen: tuple[nn.Linear | nn.Conv2d, ...]
    _frozen_output: torch.Tensor | None
    weight: torch.Tensor  # A's, from the layer class it is mixed into (nn.Linear or nn.Conv2d)

    def _product(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """The layer's own operation with ``weight`` and ``bias`` (each subclass defines it)."""
        raise NotImplementedError

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[A; W] and [0; b] (None without a bias)."""
        frozen, rank = self._frozen[0], self.weight.shape[0]
        weight = torch.cat([self.weight, frozen.weight.to(self.weight.dtype)])
        if frozen.bias is None:
            return weight, None
        return weight, torch.cat([frozen.bias.new_zeros(rank), frozen.bias]).to(self.weight.dtype)

    def _forward(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return self._split(self._product(x, *self._weights()), dim)

    def _split(self, both: torch.Tensor, dim: int) -> torch.Tensor:
        rank = self.weight.shape[0]
        # split, not two narrows: backward then joins the parts' gradients into one tensor
        # instead of padding each to the full width.
        down, self._frozen_output = torch.split(both, [rank, both.shape[dim] - rank], dim)
        return down.clone()  # a view would keep W x (the wide part) alive until backward

    def take_frozen_output(self) -> torch.Tensor:
        """W x + b of the last call (handed over once: the layer keeps no reference after)."""
        out, self._frozen_output = self._frozen_output, None
        if out is None:
            raise RuntimeError("take_frozen_output() before the layer ran")
        return out


class LoRADownLinear(_WithFrozenLayer, nn.Linear):
    """LoRA's A (in -> r) for a frozen ``nn.Linear``, computed together with it (``_WithFrozenLayer``)."""

    def __init__(self, frozen: nn.Linear, rank: int) -> None:
        kwargs = {"device": frozen.weight.device, "dtype": frozen.weight.dtype}
        super().__init__(frozen.in_features, rank, bias=False, **kwargs)
        self._frozen, self._frozen_output = (frozen,), None

    def _product(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, -1)


class LoRADownConv2d(_WithFrozenLayer, nn.Conv2d):
    """LoRA's A for a frozen ``nn.Conv2d``: a convolution with W's kernel size, stride, padding and
    dilation and r output channels, computed together with W (``_WithFrozenLayer``)."""

    def __init__(self, frozen: nn.Conv2d, rank: int) -> None:
        # torch types a Conv2d's geometry as tuples of any length; a Conv2d's are pairs
        kernel_size, stride, dilation = (
            cast("tuple[int, int]", v) for v in (frozen.kernel_size, frozen.stride, frozen.dilation)
        )
        super().__init__(
            frozen.in_channels,
            rank,
            kernel_size,
            stride=stride,
            padding=cast("str | tuple[int, int]", frozen.padding),
            dilation=dilation,
            bias=False,
            device=frozen.weight.device,
            dtype=frozen.weight.dtype,
        )
        self._frozen, self._frozen_output = (frozen,), None

    def _product(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return self._conv_forward(x, weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, 1)


class _ChannelsLastMaxPool(torch.autograd.Function):
    """Max pooling computed in channels-last memory, with the usual NCHW backward kernel.

    On CPU, torch's NCHW max-pool forward is 2.6-8x slower than its channels-last one (measured
    on this project's CNN shapes, 2 cores, torch 2.13), while the NCHW backward is the cheaper
    one. Both kernels scan a window in the same order and keep the first maximum (NaN wins), so
    values, indices and gradients are those of ``F.max_pool2d``, bit for bit."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, kernel, stride, padding, dilation, ceil_mode: bool
    ) -> torch.Tensor:
        out, indices = F.max_pool2d(
            x.contiguous(memory_format=torch.channels_last),
            kernel,
            stride,
            padding,
            dilation,
            ceil_mode,
            return_indices=True,
        )
        ctx.save_for_backward(x, indices.contiguous())
        ctx.geometry = (kernel, stride, padding, dilation, ceil_mode)
        return out.contiguous()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple:
        x, indices = ctx.saved_tensors
        kernel, stride, padding, dilation, ceil_mode = (
            _pair(v) if not isinstance(v, bool) else v for v in ctx.geometry
        )
        grad_x = torch.ops.aten.max_pool2d_with_indices_backward(
            grad.contiguous(), x, kernel, stride, padding, dilation, ceil_mode, indices
        )
        return grad_x, None, None, None, None, None


def _pair(v: int | tuple[int, ...]) -> list[int]:
    return [v, v] if isinstance(v, int) else list(v)


class MaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` (same arguments, values and gradients) that pools in channels-last
    memory on CPU, where that kernel is several times faster (see ``_ChannelsLastMaxPool``).
    Anywhere else (GPUs, inside ``torch.func`` transforms or ``torch.compile``, unbatched 3-D
    inputs) it is the plain layer (the compiler cannot trace the functorch test, and fuses the
    plain pooling itself)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # first: the functorch test below cannot be traced
            return super().forward(x)
        if (
            x.device.type != "cpu"
            or x.dim() != 4
            or self.return_indices
            or torch._C._functorch.is_functorch_wrapped_tensor(x)
        ):
            return super().forward(x)
        args = (self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)
        if not (torch.is_grad_enabled() and x.requires_grad):
            return F.max_pool2d(x.contiguous(memory_format=torch.channels_last), *args).contiguous()
        return _ChannelsLastMaxPool.apply(x, *args)

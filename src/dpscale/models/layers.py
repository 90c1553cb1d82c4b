"""Small layers shared by models (kept free of other dpscale imports so engines can use them)."""

from __future__ import annotations

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


class ScaledStdConv2d(nn.Conv2d):
    """Conv2d with scaled weight standardisation (Brock et al. 2021):
    W' = gain * (W - mean) / sqrt(fan_in * var + eps), per output filter.

    The engines' exact rule for it maps each example's gradient with respect to W' through the
    standardisation's Jacobian (``dpscale.privacy.ghost``)."""

    def __init__(self, *args, eps: float = 1e-4, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.ones(self.out_channels, 1, 1, 1))
        self.eps = eps

    def standardized_weight(self) -> torch.Tensor:
        """(W - mean) / sqrt(fan_in * var + eps), without the gain."""
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        var = w.var(dim=(1, 2, 3), keepdim=True, unbiased=False)
        return (w - mean) * torch.rsqrt(var * w[0].numel() + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.standardized_weight() * self.gain
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


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

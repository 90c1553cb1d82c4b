"""Activation functions, including Papernot et al.'s tempered sigmoid.

Bounded activations keep activations (and therefore per-example gradients) from
exploding under DP-SGD, so clipping discards less signal (Papernot Section 3.2).
"""

from __future__ import annotations

import re

import torch
from torch import nn


class TemperedSigmoid(nn.Module):
    """phi(x) = s * sigmoid(T * x) - o  (Papernot et al.); tanh is s=2, T=2, o=1.

    Args:
        scale: s, the output range width.
        inverse_temperature: T, the slope at the origin is s * T / 4.
        offset: o, shifts the output range to [-o, s - o].
    """

    def __init__(
        self, scale: float = 2.0, inverse_temperature: float = 2.0, offset: float = 1.0
    ) -> None:
        super().__init__()
        self.scale, self.inverse_temperature, self.offset = (
            float(scale),
            float(inverse_temperature),
            float(offset),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * torch.sigmoid(self.inverse_temperature * x) - self.offset

    def extra_repr(self) -> str:
        return f"s={self.scale:g}, T={self.inverse_temperature:g}, o={self.offset:g}"


_SIMPLE = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "elu": nn.ELU, "gelu": nn.GELU}
_TEMPERED = re.compile(r"^tempered_sigmoid(?:\((?P<args>[^)]*)\))?$")
_TEMPERED_KEYS = {"s": "scale", "T": "inverse_temperature", "o": "offset"}

ACTIVATION_HELP = (
    "relu, tanh, sigmoid, elu, gelu, tempered_sigmoid or tempered_sigmoid(s=2,T=2,o=1)"
)


def make_activation(spec: str) -> nn.Module:
    """Build an activation from its name.

    Args:
        spec: one of ``ACTIVATION_HELP``; tempered_sigmoid without arguments is tanh's (2, 2, 1).

    Returns:
        a fresh ``nn.Module``.
    """
    spec = spec.strip()
    if spec in _SIMPLE:
        return _SIMPLE[spec]()
    match = _TEMPERED.match(spec.replace(" ", ""))
    if not match:
        raise ValueError(f"unknown activation {spec!r}; choose {ACTIVATION_HELP}")
    kwargs: dict[str, float] = {}
    for item in filter(None, (match.group("args") or "").split(",")):
        key, _, value = item.partition("=")
        if key not in _TEMPERED_KEYS or not value:
            raise ValueError(
                f"bad tempered_sigmoid argument {item!r} in {spec!r}; use s=..,T=..,o=.."
            )
        kwargs[_TEMPERED_KEYS[key]] = float(value)
    return TemperedSigmoid(**kwargs)

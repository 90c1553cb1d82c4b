"""The small CNNs of Papernot et al. (2021) and Tramer & Boneh (2021), and a linear model.

No batch-mixing layers (no BatchNorm), so per-example gradients are well defined.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from dpscale.models.activations import make_activation
from dpscale.models.registry import register_model


class Classifier(nn.Module):
    """A feature extractor followed by a head; the common model interface.

    Args:
        features: maps a (B, C, H, W) batch to (B, feature_dim).
        feature_dim: width of the features.
        num_classes: logits size.
        head_hidden: widths of hidden fully connected layers in the head.
        activation: activation name for hidden head layers.
    """

    def __init__(
        self,
        features: nn.Module,
        feature_dim: int,
        num_classes: int,
        head_hidden: Sequence[int] = (),
        activation: str = "tanh",
    ) -> None:
        super().__init__()
        self.features = features
        self.feature_dim = feature_dim
        self.head_hidden = tuple(head_hidden)
        self.activation = activation
        self.head = self._make_head(num_classes)

    def _make_head(self, num_classes: int) -> nn.Sequential:
        layers: list[nn.Module] = []
        width = self.feature_dim
        for hidden in self.head_hidden:
            layers += [nn.Linear(width, hidden), make_activation(self.activation)]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        return nn.Sequential(*layers)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def reset_head(self, num_classes: int) -> None:
        """Replace the head with a freshly initialised one with ``num_classes`` outputs."""
        self.head = self._make_head(num_classes)


def _conv_out(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    return (size + 2 * padding - kernel) // stride + 1


@register_model("papernot-cnn")
def papernot_cnn(
    num_classes: int = 10,
    input_shape: tuple[int, int, int] = (1, 28, 28),
    activation: str = "tanh",
    filters: Sequence[int] = (16, 32),
    hidden: int = 32,
) -> Classifier:
    """MNIST CNN of Tramer & Boneh Table 6 / Papernot et al. Table 1.

    conv k1 8x8/2 pad 2, maxpool 2x2/1, conv k2 4x4/2, maxpool 2x2/1, fc ``hidden``, fc classes.
    26,010 parameters with the default filters (16, 32) on 28x28x1. Papernot Table 1 uses
    ``filters=(k, k)``.
    """
    if len(filters) != 2:
        raise ValueError(f"papernot-cnn takes two filter counts, got {list(filters)}")
    k1, k2 = (int(f) for f in filters)
    channels, height, width = input_shape
    h = _conv_out(_conv_out(_conv_out(_conv_out(height, 8, 2, 2), 2), 4, 2), 2)
    w = _conv_out(_conv_out(_conv_out(_conv_out(width, 8, 2, 2), 2), 4, 2), 2)
    if h < 1 or w < 1:
        raise ValueError(f"input {input_shape} is too small for papernot-cnn")
    features = nn.Sequential(
        nn.Conv2d(channels, k1, 8, stride=2, padding=2),
        make_activation(activation),
        nn.MaxPool2d(2, stride=1),
        nn.Conv2d(k1, k2, 4, stride=2),
        make_activation(activation),
        nn.MaxPool2d(2, stride=1),
        nn.Flatten(),
    )
    return Classifier(features, k2 * h * w, num_classes, head_hidden=(hidden,), activation=activation)


def _vgg_features(
    channels: int, widths: Sequence[int], pool_after: Sequence[int], activation: str
) -> tuple[nn.Sequential, int]:
    """3x3 'same' convs with 2x2/2 max-pooling after the listed (1-based) conv indices."""
    layers: list[nn.Module] = []
    for i, width in enumerate(widths, start=1):
        layers += [nn.Conv2d(channels, width, 3, padding=1), make_activation(activation)]
        channels = width
        if i in pool_after:
            layers.append(nn.MaxPool2d(2, stride=2))
    layers.append(nn.Flatten())
    return nn.Sequential(*layers), len(pool_after)


def _tramer_cnn(widths, pool_after, num_classes, input_shape, activation, hidden) -> Classifier:
    channels, height, width = input_shape
    features, num_pools = _vgg_features(channels, widths, pool_after, activation)
    h, w = height >> num_pools, width >> num_pools
    if h < 1 or w < 1:
        raise ValueError(f"input {input_shape} is too small for {len(widths)} convs with {num_pools} poolings")
    return Classifier(features, widths[-1] * h * w, num_classes, head_hidden=(hidden,), activation=activation)


@register_model("tramer-cifar-cnn", input_shape=(3, 32, 32))
def tramer_cifar_cnn(
    num_classes: int = 10,
    input_shape: tuple[int, int, int] = (3, 32, 32),
    activation: str = "tanh",
    hidden: int = 128,
) -> Classifier:
    """CIFAR-10 CNN of Tramer & Boneh Table 7: convs 32-32-64-64-128-128, fc 128 (551K params)."""
    return _tramer_cnn((32, 32, 64, 64, 128, 128), (2, 4, 6), num_classes, input_shape, activation, hidden)


@register_model("tramer-cifar-cnn-small", input_shape=(3, 32, 32))
def tramer_cifar_cnn_small(
    num_classes: int = 10,
    input_shape: tuple[int, int, int] = (3, 32, 32),
    activation: str = "tanh",
    hidden: int = 128,
) -> Classifier:
    """The smaller Table 7 variant (Tramer & Boneh Section 4): convs 16-16-32-32-64, pools after
    the 2nd, 4th and 5th conv, fc 128 (168K params)."""
    return _tramer_cnn((16, 16, 32, 32, 64), (2, 4, 5), num_classes, input_shape, activation, hidden)


@register_model("linear")
def linear(
    num_classes: int = 10,
    input_shape: tuple[int, int, int] = (1, 28, 28),
    activation: str = "tanh",
) -> Classifier:
    """Multinomial logistic regression on flattened pixels (``activation`` is unused)."""
    channels, height, width = input_shape
    return Classifier(nn.Flatten(), channels * height * width, num_classes, activation=activation)

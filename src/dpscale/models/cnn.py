"""The small CNNs of Papernot et al. (2021) and Tramer & Boneh (2021), and a linear model.

No batch-mixing layers (no BatchNorm), so per-example gradients are well defined.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from dpscale.models.activations import make_activation
from dpscale.layers import MaxPool2d, ScaledStdConv2d, ScaledStdLinear, group_norm
from dpscale.models.registry import register_family, register_model


class Classifier(nn.Module):
    """A feature extractor followed by a head; the common model interface.

    Args:
        features: maps a (B, C, H, W) batch to (B, feature_dim).
        feature_dim: width of the features.
        num_classes: logits size.
        head_hidden: widths of hidden fully connected layers in the head.
        activation: activation name for hidden head layers.
        head_weight_standardization: the hidden head layers weight-standardised
            (``ScaledStdLinear``); the logits layer stays plain.
    """

    def __init__(
        self,
        features: nn.Module,
        feature_dim: int,
        num_classes: int,
        head_hidden: Sequence[int] = (),
        activation: str = "tanh",
        head_weight_standardization: bool = False,
    ) -> None:
        super().__init__()
        self.features = features
        self.feature_dim = feature_dim
        self.head_hidden = tuple(head_hidden)
        self.activation = activation
        self.hidden_linear = ScaledStdLinear if head_weight_standardization else nn.Linear
        self.head = self._make_head(num_classes)

    def _make_head(self, num_classes: int) -> nn.Sequential:
        layers: list[nn.Module] = []
        width = self.feature_dim
        for hidden in self.head_hidden:
            layers += [self.hidden_linear(width, hidden), make_activation(self.activation)]
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

    def block_groups(self) -> list[list[nn.Parameter]]:
        """Parameter groups in input-to-output order: one per feature layer with parameters,
        one per hidden head layer, and the logits layer last (freeze a prefix to fine-tune)."""
        return _layer_groups(self.features) + _layer_groups(self.head)


def _layer_groups(module: nn.Module) -> list[list[nn.Parameter]]:
    """One group per sub-module that owns parameters, in registration (= forward) order."""
    return [
        list(m.parameters(recurse=False))
        for m in module.modules()
        if list(m.parameters(recurse=False))
    ]


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
        MaxPool2d(2, stride=1),
        nn.Conv2d(k1, k2, 4, stride=2),
        make_activation(activation),
        MaxPool2d(2, stride=1),
        nn.Flatten(),
    )
    return Classifier(
        features, k2 * h * w, num_classes, head_hidden=(hidden,), activation=activation
    )


def _vgg_features(
    channels: int,
    widths: Sequence[int],
    pool_after: Sequence[int],
    activation: str,
    norm_groups: int = 0,
    weight_standardization: bool = False,
) -> tuple[nn.Sequential, int]:
    """3x3 'same' convs with 2x2/2 max-pooling after the listed (1-based) conv indices; each conv
    optionally weight-standardised (ScaledStdConv2d) and followed by GroupNorm before its activation."""
    conv = ScaledStdConv2d if weight_standardization else nn.Conv2d
    layers: list[nn.Module] = []
    for i, width in enumerate(widths, start=1):
        # no norm layer at all without groups: the paper's network keeps its state-dict keys
        norm = [group_norm(width, norm_groups)] if norm_groups > 0 else []
        layers += [conv(channels, width, 3, padding=1), *norm, make_activation(activation)]
        channels = width
        if i in pool_after:
            layers.append(MaxPool2d(2, stride=2))
    layers.append(nn.Flatten())
    return nn.Sequential(*layers), len(pool_after)


def _tramer_cnn(
    widths,
    pool_after,
    num_classes,
    input_shape,
    activation,
    hidden,
    norm_groups=0,
    weight_standardization=False,
    head_weight_standardization=False,
) -> Classifier:
    channels, height, width = input_shape
    features, num_pools = _vgg_features(
        channels, widths, pool_after, activation, norm_groups, weight_standardization
    )
    h, w = height >> num_pools, width >> num_pools
    if h < 1 or w < 1:
        raise ValueError(
            f"input {input_shape} is too small for {len(widths)} convs with {num_pools} poolings"
        )
    return Classifier(
        features,
        widths[-1] * h * w,
        num_classes,
        head_hidden=(hidden,),
        activation=activation,
        head_weight_standardization=head_weight_standardization,
    )


@register_model("tramer-cifar-cnn", input_shape=(3, 32, 32))
def tramer_cifar_cnn(
    num_classes: int = 10,
    input_shape: tuple[int, int, int] = (3, 32, 32),
    activation: str = "tanh",
    hidden: int = 128,
) -> Classifier:
    """CIFAR-10 CNN of Tramer & Boneh Table 7: convs 32-32-64-64-128-128, fc 128 (551K params)."""
    return _tramer_cnn(
        (32, 32, 64, 64, 128, 128), (2, 4, 6), num_classes, input_shape, activation, hidden
    )


@register_model("tramer-cifar-cnn-small", input_shape=(3, 32, 32))
def tramer_cifar_cnn_small(
    num_classes: int = 10,
    input_shape: tuple[int, int, int] = (3, 32, 32),
    activation: str = "tanh",
    hidden: int = 128,
) -> Classifier:
    """The smaller Table 7 variant (Tramer & Boneh Section 4): convs 16-16-32-32-64, pools after
    the 2nd, 4th and 5th conv, fc 128 (168K params)."""
    return _tramer_cnn(
        (16, 16, 32, 32, 64), (2, 4, 5), num_classes, input_shape, activation, hidden
    )


@register_model("papernot-cifar-cnn", input_shape=(3, 32, 32))
def papernot_cifar_cnn(
    num_classes: int = 10,
    input_shape: tuple[int, int, int] = (3, 32, 32),
    activation: str = "relu",
    hidden: int = 1024,
) -> Classifier:
    """Papernot et al. Table 2 CIFAR-10 CNN: convs 32-32-64-64-128-128 (3x3, 'same'), 2x2 max-pool
    after each pair, fc 1024, fc classes; 2,395,434 parameters (the count implies a pool after the
    last pair too, as in Tramer Table 7). ReLU as in the paper's transfer experiments."""
    return _tramer_cnn(
        (32, 32, 64, 64, 128, 128), (2, 4, 6), num_classes, input_shape, activation, hidden
    )


def parse_simplevgg(spec: str) -> tuple[list[tuple[int, int]], int]:
    """'32(2)-64(2)-128(2)-128' -> ([(32, 2), (64, 2), (128, 2)], 128): blocks of (width, convs), fc width."""
    parts = spec.split("-")
    try:
        blocks = []
        for part in parts[:-1]:
            width, _, rest = part.partition("(")
            if not rest.endswith(")"):
                raise ValueError(part)
            blocks.append((int(width), int(rest[:-1])))
        fc = int(parts[-1])
    except ValueError as err:
        raise ValueError(
            f"bad simpleVGG spec {spec!r}; expected blocks width(convs) then the fc width, e.g. simplevgg-32(2)-64(2)-128(2)-128"
        ) from err
    if not blocks or any(w < 1 or n < 1 for w, n in blocks) or fc < 1:
        raise ValueError(
            f"bad simpleVGG spec {spec!r}: needs at least one block and positive sizes"
        )
    return blocks, fc


@register_family("simplevgg", example="simplevgg-32(2)-64(2)-128(2)-128", input_shape=(3, 32, 32))
def simplevgg(
    spec: str,
    num_classes: int = 10,
    input_shape: tuple[int, int, int] = (3, 32, 32),
    activation: str = "tanh",
    norm_groups: int = 0,
    weight_standardization: bool = False,
    head_weight_standardization: bool = False,
) -> Classifier:
    """Kurakin et al. Appendix H simpleVGG: blocks of equal-width 3x3 convs with 2x2 max-pooling
    after each block, then fc (128 in the paper) and the logits; tanh by default.
    simplevgg-32(2)-64(2)-128(2)-128 is the Tramer Table 7 network.

    Args:
        norm_groups: GroupNorm after every conv with this many groups (the largest divisor of the
            width below it); 0: none (the paper's network). Per-example, so DP-SGD's clipping holds.
        weight_standardization: scaled weight standardisation of every conv (Brock et al. 2021,
            as in NF-ResNets and De et al.'s WRNs).
        head_weight_standardization: the same for the hidden fc layer (``ScaledStdLinear``; the
            logits layer stays plain)."""
    if norm_groups < 0:
        raise ValueError(
            f"simplevgg: norm_groups must be >= 0 (0: no GroupNorm), got {norm_groups}"
        )
    blocks, fc = parse_simplevgg(spec)
    widths, pools, count = [], [], 0
    for width, convs in blocks:
        widths += [width] * convs
        count += convs
        pools.append(count)
    return _tramer_cnn(
        tuple(widths),
        tuple(pools),
        num_classes,
        input_shape,
        activation,
        fc,
        norm_groups,
        weight_standardization,
        head_weight_standardization,
    )


class AllConvNet(nn.Module):
    """Papernot et al. Appendix A (Table 6) all-convolutional CIFAR-10 model: 3x3 convs
    64-128 | avgpool | 128-256 | avgpool | 256-512 | avgpool | conv to classes, spatial mean.
    The head is the last conv and the mean (2,334,730 parameters with 10 classes)."""

    def __init__(
        self, num_classes: int, input_shape: tuple[int, int, int], activation: str
    ) -> None:
        super().__init__()
        channels = input_shape[0]
        layers: list[nn.Module] = []
        for i, width in enumerate((64, 128, 128, 256, 256, 512)):
            layers += [nn.Conv2d(channels, width, 3, padding=1), make_activation(activation)]
            channels = width
            if i % 2 == 1:
                layers.append(nn.AvgPool2d(2))
        self.features = nn.Sequential(*layers)
        self.feature_channels = channels
        self.head = nn.Conv2d(channels, num_classes, 3, padding=1)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(features).mean(dim=(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def reset_head(self, num_classes: int) -> None:
        self.head = nn.Conv2d(self.feature_channels, num_classes, 3, padding=1)

    def block_groups(self) -> list[list[nn.Parameter]]:
        return _layer_groups(self.features) + [list(self.head.parameters())]


@register_model("papernot-allconv", input_shape=(3, 32, 32))
def papernot_allconv(
    num_classes: int = 10, input_shape: tuple[int, int, int] = (3, 32, 32), activation: str = "tanh"
) -> AllConvNet:
    """Papernot Appendix A all-convolutional model (tanh, as in their Section 4.2 column)."""
    if input_shape[1] < 8 or input_shape[2] < 8:
        raise ValueError(f"input {input_shape} is too small for three 2x2 poolings")
    return AllConvNet(num_classes, input_shape, activation)


@register_model("linear")
def linear(
    num_classes: int = 10, input_shape: tuple[int, int, int] = (1, 28, 28), activation: str = "tanh"
) -> Classifier:
    """Multinomial logistic regression on flattened inputs of any shape, e.g. pixels (C, H, W) or
    features (D,) for a linear probe (``activation`` is unused)."""
    return Classifier(nn.Flatten(), math.prod(input_shape), num_classes, activation=activation)

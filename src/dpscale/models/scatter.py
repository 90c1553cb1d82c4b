"""Heads trained on ScatterNet features (Tramer & Boneh 2021, Appendix C.2).

Their input is the feature tensor (K, H/4, W/4) made by ``dpscale.features`` (K = 81 for
grayscale images, 243 for RGB), already normalised (GroupNorm or private Data Normalization
happen in the feature pipeline, not in the model).

The paper's Tables 8 and 9 list max-pooling layers that its parameter counts (Table 4: 33K for
MNIST/Fashion-MNIST, 187K for CIFAR-10) and its released code do not have. We follow the
parameter counts by default; ``paper_table_pooling=True`` builds the tables literally.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from dpscale.models.activations import make_activation
from dpscale.layers import MaxPool2d
from dpscale.models.cnn import Classifier, _conv_out, linear
from dpscale.models.registry import register_model

SCATTER_GRAY_SHAPE = (81, 7, 7)  # ScatterNet(J=2, L=8) of a 28x28 grayscale image
SCATTER_RGB_SHAPE = (243, 8, 8)  # ... of a 32x32 RGB image


class WithLinearSkip(nn.Module):
    """Concatenates a branch's output with the flattened input, so the head that follows is a
    linear model of the features plus the branch's contribution (a scatter-linear model that the
    CNN branch can only add to)."""

    def __init__(self, branch: nn.Module) -> None:
        super().__init__()
        self.branch = branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch(x), x.flatten(1)], dim=1)


@register_model("scatter-linear", input_shape=SCATTER_GRAY_SHAPE)
def scatter_linear(
    num_classes: int = 10,
    input_shape: tuple[int, int, int] = SCATTER_GRAY_SHAPE,
    activation: str = "tanh",
) -> Classifier:
    """Logistic regression (with per-class bias) on flattened features: 3969 x 10 weights for
    MNIST / Fashion-MNIST, 15552 x 10 for CIFAR-10 (Tramer Table 5). The ``linear`` model under
    its paper name and usual feature input shape."""
    return linear(num_classes, input_shape, activation)


@register_model("scatter-cnn", input_shape=SCATTER_GRAY_SHAPE)
def scatter_cnn(
    num_classes: int = 10,
    input_shape: tuple[int, int, int] = SCATTER_GRAY_SHAPE,
    activation: str = "tanh",
    variant: str | None = None,
    paper_table_pooling: bool = False,
    widths: Sequence[int] = (16, 32, 32),
    linear_skip: bool = False,
) -> Classifier:
    """CNN on ScatterNet features, tanh by default.

    Args:
        variant: "mnist" (Table 8: conv 16 3x3 stride 2, conv 32 3x3, FC 32, FC classes; 33,066
            parameters on 81x7x7) or "cifar" (Table 9: conv 64 3x3, max-pool 2, conv 64 3x3,
            FC classes; 187,210 parameters on 243x8x8). Default: "mnist" for inputs of at most
            81 channels, else "cifar".
        paper_table_pooling: add the max-pools the tables list (stride-1 pools after both convs
            for "mnist", a second stride-2 pool for "cifar").
        widths: the "mnist" variant's two conv widths and its hidden FC width (the paper's
            (16, 32, 32) by default).
        linear_skip: the logits also get a linear map of the flattened features (one Linear
            layer reads the CNN's hidden FC output and the features side by side).
    """
    channels, height, width = input_shape
    variant = variant or ("mnist" if channels <= SCATTER_GRAY_SHAPE[0] else "cifar")
    act = lambda: make_activation(activation)  # noqa: E731
    hidden: tuple[int, ...]  # the head's hidden FC widths
    if variant == "mnist":
        if len(widths) != 3 or min(widths) < 1:
            raise ValueError(f"scatter-cnn widths are (conv1, conv2, fc) >= 1, got {list(widths)}")
        conv1, conv2, fc = (int(w) for w in widths)
        size_h, size_w = _conv_out(height, 3, 2, 1), _conv_out(width, 3, 2, 1)
        layers = [nn.Conv2d(channels, conv1, 3, stride=2, padding=1), act()]
        if paper_table_pooling:
            layers.append(MaxPool2d(2, stride=1))
            size_h, size_w = size_h - 1, size_w - 1
        layers += [nn.Conv2d(conv1, conv2, 3, stride=1, padding=1), act()]
        if paper_table_pooling:
            layers.append(MaxPool2d(2, stride=1))
            size_h, size_w = size_h - 1, size_w - 1
        hidden, out_channels = (fc,), conv2
    elif variant == "cifar":
        layers = [nn.Conv2d(channels, 64, 3, padding=1), act(), MaxPool2d(2, 2)]
        size_h, size_w = height // 2, width // 2
        layers += [nn.Conv2d(64, 64, 3, padding=1), act()]
        if paper_table_pooling:
            layers.append(MaxPool2d(2, 2))
            size_h, size_w = size_h // 2, size_w // 2
        hidden, out_channels = (), 64
    else:
        raise ValueError(f"scatter-cnn variant must be 'mnist' or 'cifar', got {variant!r}")
    if size_h < 1 or size_w < 1:
        raise ValueError(f"scatter-cnn ({variant}) needs larger features than {input_shape}")
    convs = nn.Sequential(*layers, nn.Flatten())
    features: nn.Module = convs
    feature_dim = out_channels * size_h * size_w
    if linear_skip:
        for hidden_width in hidden:
            convs.extend([nn.Linear(feature_dim, hidden_width), act()])
            feature_dim = hidden_width
        features, feature_dim, hidden = (
            WithLinearSkip(convs),
            feature_dim + channels * height * width,
            (),
        )
    return Classifier(features, feature_dim, num_classes, hidden, activation)

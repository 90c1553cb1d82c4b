"""Residual networks for DP training: GroupNorm instead of BatchNorm.

* ``wrn16-4``: the 16-4 WideResNet of TAN (Sander et al. 2023, Section 4.4) with the
  normalisation order selectable: ``conv-norm-act`` (the usual CONV-GN-ReLU) or
  ``conv-act-norm`` (CONV-ReLU-GN, which TAN found much better under DP-SGD).
* ``resnet18-gn`` / ``resnet50-gn``: ResNet-v2 (pre-activation, He et al. 2016b) with GroupNorm,
  as in Kurakin et al. 2022: 7x7 stem (or a 3x3 CIFAR stem), four block groups.

``block_groups()`` returns [stem + group 1, group 2, ...] then the logits layer, so freezing
k = 4 groups of a ResNet leaves only the logits layer trainable (Kurakin Appendix G).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch
from torch import nn

from dpscale.models.activations import make_activation
from dpscale.layers import MaxPool2d, group_norm
from dpscale.models.registry import register_model

ORDERS = ("conv-norm-act", "conv-act-norm")


class ResidualNetwork(nn.Module):
    """stem -> stages -> pooled features -> logits, with the common model interface."""

    def __init__(
        self,
        stem: nn.Module,
        stages: Sequence[nn.Module],
        final: nn.Module,
        width: int,
        num_classes: int,
    ):
        super().__init__()
        self.stem = stem
        self.stages = nn.ModuleList(stages)
        self.final = final  # normalisation/activation after the last stage (part of the last group)
        self.feature_dim = width
        self.head = nn.Linear(width, num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.final(x).mean(dim=(2, 3))

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def reset_head(self, num_classes: int) -> None:
        self.head = nn.Linear(self.feature_dim, num_classes)

    def block_groups(self) -> list[list[nn.Parameter]]:
        groups = [list(self.stem.parameters()) + list(self.stages[0].parameters())]
        groups += [list(stage.parameters()) for stage in self.stages[1:]]
        groups[-1] += list(self.final.parameters())
        return groups + [list(self.head.parameters())]


# ------------------------------------------------------------------------------- WideResNet


class WideBlock(nn.Module):
    """Two 3x3 convs with a residual connection, in the given normalisation order."""

    def __init__(
        self, cin: int, cout: int, stride: int, order: str, groups: int, activation: str
    ) -> None:
        super().__init__()
        self.order = order
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm1 = group_norm(cout, groups)
        self.act1 = make_activation(activation)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.norm2 = group_norm(cout, groups)
        self.act2 = make_activation(activation)
        self.shortcut = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Conv2d(cin, cout, 1, stride=stride, bias=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.order == "conv-norm-act":  # CONV-GN-ReLU, CONV-GN, add, ReLU
            h = self.act1(self.norm1(self.conv1(x)))
            return self.act2(self.norm2(self.conv2(h)) + self.shortcut(x))
        h = self.norm1(self.act1(self.conv1(x)))  # CONV-ReLU-GN, CONV-ReLU-GN, add
        return self.norm2(self.act2(self.conv2(h))) + self.shortcut(x)


@register_model("wrn16-4", input_shape=(3, 32, 32))
def wrn16_4(
    num_classes: int = 10,
    input_shape: tuple[int, int, int] = (3, 32, 32),
    activation: str = "relu",
    order: str = "conv-act-norm",
    norm_groups: int = 16,
    depth: int = 16,
    width: int = 4,
) -> ResidualNetwork:
    """WideResNet-depth-width (default 16-4) with GroupNorm (``norm_groups`` groups, 0: none).

    Args:
        order: "conv-act-norm" (TAN's better order under DP) or "conv-norm-act" (standard).
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    if (depth - 4) % 6:
        raise ValueError(f"WideResNet depth must be 6n + 4, got {depth}")
    blocks = (depth - 4) // 6
    widths = [16 * width, 32 * width, 64 * width]
    stem_layers: dict[str, nn.Module] = {
        "conv": nn.Conv2d(input_shape[0], 16, 3, padding=1, bias=False)
    }
    pair = {"norm": group_norm(16, norm_groups), "act": make_activation(activation)}
    for key in ("norm", "act") if order == "conv-norm-act" else ("act", "norm"):
        stem_layers[key] = pair[key]  # named, so both orders share one state-dict layout
    stem = nn.Sequential(OrderedDict(stem_layers))
    stages, cin = [], 16
    for i, cout in enumerate(widths):
        layers = [
            WideBlock(
                cin if j == 0 else cout,
                cout,
                (1 if i == 0 else 2) if j == 0 else 1,
                order,
                norm_groups,
                activation,
            )
            for j in range(blocks)
        ]
        stages.append(nn.Sequential(*layers))
        cin = cout
    return ResidualNetwork(stem, stages, nn.Identity(), cin, num_classes)


# --------------------------------------------------------------------------- ResNet-v2 (GN)


class PreActBlock(nn.Module):
    """ResNet-v2 basic block: (GN, act, conv3x3) x 2; the projection shortcut sees the pre-activated input."""

    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int, groups: int, activation: str) -> None:
        super().__init__()
        cout = planes * self.expansion
        self.norm1, self.act1 = group_norm(cin, groups), make_activation(activation)
        self.conv1 = nn.Conv2d(cin, planes, 3, stride=stride, padding=1, bias=False)
        self.norm2, self.act2 = group_norm(planes, groups), make_activation(activation)
        self.conv2 = nn.Conv2d(planes, cout, 3, padding=1, bias=False)
        self.shortcut = (
            None
            if stride == 1 and cin == cout
            else nn.Conv2d(cin, cout, 1, stride=stride, bias=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.act1(self.norm1(x))
        skip = x if self.shortcut is None else self.shortcut(pre)
        h = self.conv1(pre)
        return self.conv2(self.act2(self.norm2(h))) + skip


class PreActBottleneck(nn.Module):
    """ResNet-v2 bottleneck: (GN, act, conv) with 1x1, 3x3 (stride), 1x1 x4 expansion."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int, groups: int, activation: str) -> None:
        super().__init__()
        cout = planes * self.expansion
        self.norm1, self.act1 = group_norm(cin, groups), make_activation(activation)
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.norm2, self.act2 = group_norm(planes, groups), make_activation(activation)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.norm3, self.act3 = group_norm(planes, groups), make_activation(activation)
        self.conv3 = nn.Conv2d(planes, cout, 1, bias=False)
        self.shortcut = (
            None
            if stride == 1 and cin == cout
            else nn.Conv2d(cin, cout, 1, stride=stride, bias=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.act1(self.norm1(x))
        skip = x if self.shortcut is None else self.shortcut(pre)
        h = self.conv1(pre)
        h = self.conv2(self.act2(self.norm2(h)))
        return self.conv3(self.act3(self.norm3(h))) + skip


def _resnet_v2(
    block: type[PreActBlock | PreActBottleneck],
    counts: Sequence[int],
    num_classes: int,
    input_shape,
    activation: str,
    norm_groups: int,
    stem: str,
) -> ResidualNetwork:
    channels = input_shape[0]
    if stem == "imagenet":  # 7x7/2 conv + 3x3/2 max-pool (224x224 inputs)
        stem_module = nn.Sequential(
            nn.Conv2d(channels, 64, 7, stride=2, padding=3, bias=False), MaxPool2d(3, 2, 1)
        )
    elif stem == "cifar":  # 3x3/1 conv, no pooling (32x32 inputs)
        stem_module = nn.Sequential(nn.Conv2d(channels, 64, 3, padding=1, bias=False))
    else:
        raise ValueError(f"stem must be imagenet or cifar, got {stem!r}")
    stages, cin = [], 64
    for i, (planes, count) in enumerate(zip((64, 128, 256, 512), counts)):
        blocks = []
        for j in range(count):
            blocks.append(
                block(cin, planes, 2 if (j == 0 and i > 0) else 1, norm_groups, activation)
            )
            cin = planes * block.expansion
        stages.append(nn.Sequential(*blocks))
    final = nn.Sequential(group_norm(cin, norm_groups), make_activation(activation))
    return ResidualNetwork(stem_module, stages, final, cin, num_classes)


@register_model("resnet18-gn", input_shape=(3, 224, 224))
def resnet18_gn(
    num_classes: int = 10,
    input_shape: tuple[int, int, int] = (3, 224, 224),
    activation: str = "relu",
    norm_groups: int = 32,
    stem: str | None = None,
) -> ResidualNetwork:
    """ResNet-v2-18 with GroupNorm (Kurakin et al.); ``stem`` defaults to cifar for inputs <= 64 px."""
    stem = stem or ("cifar" if input_shape[1] <= 64 else "imagenet")
    return _resnet_v2(
        PreActBlock, (2, 2, 2, 2), num_classes, input_shape, activation, norm_groups, stem
    )


@register_model("resnet50-gn", input_shape=(3, 224, 224))
def resnet50_gn(
    num_classes: int = 10,
    input_shape: tuple[int, int, int] = (3, 224, 224),
    activation: str = "relu",
    norm_groups: int = 32,
    stem: str | None = None,
) -> ResidualNetwork:
    """ResNet-v2-50 (bottleneck) with GroupNorm (Kurakin et al.)."""
    stem = stem or ("cifar" if input_shape[1] <= 64 else "imagenet")
    return _resnet_v2(
        PreActBottleneck, (3, 4, 6, 3), num_classes, input_shape, activation, norm_groups, stem
    )

"""Normaliser-free ResNet-50 (Brock et al. 2021): no normalisation layers at all; signal
propagation is kept in check by scaled weight standardisation, scaled activations and
residual branches x + alpha * f(x / beta) with a zero-initialised skip gain (SkipInit).

Weight standardisation re-parametrises the convolution weights; the bk/ghost engines have an
exact rule for it (the standardisation's Jacobian applied to each example's gradient), and the
skip gain is its own ``ScalarGain`` layer, so NF-ResNets train with bk.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dpscale.models.activations import make_activation
from dpscale.layers import MaxPool2d, ScalarGain, ScaledStdConv2d
from dpscale.models.registry import register_model
from dpscale.models.resnet import ResidualNetwork

# gamma such that gamma * relu(x) has unit variance for x ~ N(0, 1) (Brock et al. 2021a).
RELU_GAIN = math.sqrt(2.0 / (1.0 - 1.0 / math.pi))


class _ScaledActivation(nn.Module):
    def __init__(self, activation: str) -> None:
        super().__init__()
        self.act = make_activation(activation)
        self.scale = RELU_GAIN if activation == "relu" else 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x) * self.scale


class NFBottleneck(nn.Module):
    def __init__(
        self, cin: int, planes: int, stride: int, alpha: float, beta: float, activation: str
    ) -> None:
        super().__init__()
        cout = 4 * planes
        self.alpha, self.beta = alpha, beta
        self.act1, self.act2, self.act3 = (_ScaledActivation(activation) for _ in range(3))
        self.conv1 = ScaledStdConv2d(cin, planes, 1)
        self.conv2 = ScaledStdConv2d(planes, planes, 3, stride=stride, padding=1)
        self.conv3 = ScaledStdConv2d(planes, cout, 1)
        self.shortcut = (
            ScaledStdConv2d(cin, cout, 1, stride=stride) if stride != 1 or cin != cout else None
        )
        self.skip_gain = ScalarGain(alpha)  # SkipInit: zero, so each block starts as the identity
        self._register_load_state_dict_pre_hook(_skip_gain_as_a_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.act1(x) / self.beta
        skip = x if self.shortcut is None else self.shortcut(pre)
        h = self.conv2(self.act2(self.conv1(pre)))
        h = self.conv3(self.act3(h))
        return skip + self.skip_gain(h)


def _skip_gain_as_a_layer(state_dict: dict, prefix: str, *args) -> None:
    """Checkpoints from before ScalarGain stored the gain as ``<block>.skip_gain``."""
    old = prefix + "skip_gain"
    if old in state_dict:
        state_dict[old + ".gain"] = state_dict.pop(old)


def _nf_resnet(
    counts,
    num_classes: int,
    input_shape: tuple[int, int, int],
    activation: str,
    alpha: float = 0.2,
    stem: str | None = None,
) -> ResidualNetwork:
    stem = stem or ("cifar" if input_shape[1] <= 64 else "imagenet")
    if stem == "imagenet":
        stem_module = nn.Sequential(
            ScaledStdConv2d(input_shape[0], 64, 7, stride=2, padding=3), MaxPool2d(3, 2, 1)
        )
    elif stem == "cifar":
        stem_module = nn.Sequential(ScaledStdConv2d(input_shape[0], 64, 3, padding=1))
    else:
        raise ValueError(f"stem must be imagenet or cifar, got {stem!r}")
    stages, cin = [], 64
    for i, (planes, count) in enumerate(zip((64, 128, 256, 512), counts)):
        expected_var, blocks = 1.0, []
        for j in range(count):
            stride = 2 if (j == 0 and i > 0) else 1
            blocks.append(
                NFBottleneck(cin, planes, stride, alpha, math.sqrt(expected_var), activation)
            )
            # A transition block's shortcut re-normalises the signal; identity blocks add alpha^2.
            expected_var = 1.0 + alpha**2 if j == 0 else expected_var + alpha**2
            cin = 4 * planes
        stages.append(nn.Sequential(*blocks))
    return ResidualNetwork(stem_module, stages, _ScaledActivation(activation), cin, num_classes)


@register_model("nf-resnet50", input_shape=(3, 224, 224))
def nf_resnet50(
    num_classes: int = 10,
    input_shape: tuple[int, int, int] = (3, 224, 224),
    activation: str = "relu",
    alpha: float = 0.2,
    stem: str | None = None,
) -> ResidualNetwork:
    """NF-ResNet-50 (TAN's best ImageNet model): bottleneck layout 3-4-6-3, no normalisation."""
    return _nf_resnet((3, 4, 6, 3), num_classes, input_shape, activation, alpha, stem)

"""Dirac canaries that the run's own engine differentiates, norms, clips and sums.

A gradient canary must contribute M e_j to the clipped sum before clipping: M on coordinate j of
one trainable tensor, zero everywhere else. No input of the whole model has such a gradient, so
each canary is an example of a *probe* instead: a module that holds the training model and, per
example, calls the one layer owning coordinate j on a crafted input, then turns that layer's
output into a cross-entropy logit. The probe's examples go to the run's engine like any chunk
(vmap differentiates the probe; bk and ghost record the layer's input and output gradient and
apply their layer rules), so a canary's norm, clip factor and share of the sum are the engine's.

How a layer gets a Dirac gradient (its per-example weight gradient is sum_t g_t a_t^T over
positions t, its bias gradient sum_t g_t):

* weight (k, l) of a Linear: input a_0 = G M e_l at position 0, output gradient e_k there and, if
  the bias is trainable, -e_k at a second position whose input is zero, so the bias gets nothing;
* weight (o, c, p, q) of a Conv1d/Conv2d: one input pixel G M in channel c, placed where output
  position (i0, j0) sees it at kernel offset (p, q); output gradient e_o at (i0, j0) and -e_o at
  an output position (i2, j0) whose receptive field misses the pixel;
* a bias entry: zero input and output gradient G M e_k at one position.

G = 2 undoes the logit's gradient: the logit is t - t.detach() (value 0, whatever the weights),
and cross-entropy against the other class at logits (0, 0) has gradient exactly 1/2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union, cast

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parametrize

from dpscale.privacy.noise.gaussian import Params

HOST_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d)  # exact types: a subclass may compute otherwise
PREFIX = "net."  # the training model's parameter names inside the probe
CANARY_LABEL = 1  # cross-entropy against logit 1 (always 0): d loss / d logit 0 = 1/2
LOGIT_GAIN = 2.0  # 1 / (1/2)
_Conv = Union[nn.Conv1d, nn.Conv2d]  # the host layers but Linear


def can_host(module: nn.Module, local: str) -> bool:
    """Whether parameter ``local`` of ``module`` can carry a Dirac canary (a plain Linear/Conv
    weight or bias with zero padding, not reparametrised)."""
    if (
        type(module) not in HOST_LAYERS
        or local not in ("weight", "bias")
        or parametrize.is_parametrized(module)
    ):
        return False
    return type(module) is nn.Linear or (
        module.padding_mode == "zeros" and not isinstance(module.padding, str)
    )


def host_sizes(model: nn.Module, params: Params) -> list[tuple[str, int]]:
    """(name, numel) of the trainable tensors that can carry a Dirac canary, sorted by name.

    Args:
        model: the training model.
        params: its trainable parameters by name (``trainable_params``).

    Returns:
        the hosts, in the order canary coordinates are drawn over.
    """
    hosts = []
    for name, p in sorted(params.items()):
        path, _, local = name.rpartition(".")
        if can_host(model.get_submodule(path), local):
            hosts.append((name, p.numel()))
    return hosts


def _axis(
    kernel: int, stride: int, pad: int, dilation: int, offset: int
) -> tuple[int, int, int, int]:
    """Along one conv axis, for kernel offset ``offset``: (output position i0 that sees the input
    at that offset, the input position r it sees there, the first output position i2 whose
    receptive field starts after r, the input length that has both outputs)."""
    # the first output whose offset lands inside the input
    i0 = -(-max(0, pad - offset * dilation) // stride)
    r = i0 * stride - pad + offset * dilation
    i2 = (r + pad) // stride + 1
    return i0, r, i2, max(r + 1, i2 * stride + dilation * (kernel - 1) + 1 - 2 * pad)


@dataclass
class _Host:
    """One layer the probe calls: where its crafted input and output direction sit in a probe row."""

    path: str
    in_shape: tuple[int, ...]  # one example's layer input
    out_shape: tuple[int, ...]  # one example's layer output
    a_start: int = 0
    w_start: int = 0


def _linear_host(path: str, m: nn.Linear) -> _Host:
    # 2: the bias gradient cancels
    positions = 2 if m.bias is not None and m.bias.requires_grad else 1
    return _Host(path, (positions, m.in_features), (positions, m.out_features))


def _padding(m: _Conv) -> tuple[int, ...]:
    """A host conv's padding (torch's type admits a string such as "same", which ``can_host`` refuses)."""
    return cast(tuple[int, ...], m.padding)


def _conv_host(path: str, m: _Conv) -> _Host:
    sizes, outs = [], []
    for axis, k in enumerate(m.kernel_size):
        s, pad, d = m.stride[axis], _padding(m)[axis], m.dilation[axis]
        n = max(_axis(k, s, pad, d, offset)[3] for offset in range(k))
        sizes.append(n)
        outs.append((n + 2 * pad - d * (k - 1) - 1) // s + 1)
    return _Host(path, (m.in_channels, *sizes), (m.out_channels, *outs))


def _flat(shape: Sequence[int], index: Sequence[int]) -> int:
    return int(np.ravel_multi_index(tuple(index), tuple(shape)))


def _entries(
    host: _Host, m: nn.Module, local: str, flat: int, value: float
) -> list[tuple[int, float]]:
    """The nonzero entries (index in a probe row, value) of the canary on ``local``[flat] of ``m``."""
    if local == "bias":  # zero input, the whole magnitude on one output position
        first = (
            (flat,) + (0,) * (len(host.out_shape) - 1) if type(m) is not nn.Linear else (0, flat)
        )
        return [(host.w_start + _flat(host.out_shape, first), value)]
    if type(m) is nn.Linear:
        index = np.unravel_index(flat, tuple(m.weight.shape))
        k, col = int(index[0]), int(index[1])
        pixel = [
            (host.a_start + _flat(host.in_shape, (0, col)), value),
            (host.w_start + _flat(host.out_shape, (0, k)), 1.0),
        ]
        cancel = (
            [(host.w_start + _flat(host.out_shape, (1, k)), -1.0)] if host.out_shape[0] == 2 else []
        )
        return pixel + cancel
    # the other host layers are convs (HOST_LAYERS)
    return _conv_entries(host, cast(_Conv, m), flat, value)


def _conv_entries(host: _Host, m: _Conv, flat: int, value: float) -> list[tuple[int, float]]:
    """``_entries`` for weight[flat] of a Conv1d/Conv2d: the pixel, and the output positions that see and miss it."""
    index = np.unravel_index(flat, tuple(m.weight.shape))
    o, c_local, offsets = int(index[0]), int(index[1]), [int(i) for i in index[2:]]
    channel = o // (m.out_channels // m.groups) * (m.in_channels // m.groups) + c_local
    axes = [
        _axis(k, m.stride[a], _padding(m)[a], m.dilation[a], offsets[a])
        for a, k in enumerate(m.kernel_size)
    ]
    pixel = tuple(r for _, r, _, _ in axes)
    seen = tuple(i0 for i0, _, _, _ in axes)
    # further along the first axis: its receptive field misses the pixel
    missed = (axes[0][2], *seen[1:])
    return [
        (host.a_start + _flat(host.in_shape, (channel, *pixel)), value),
        (host.w_start + _flat(host.out_shape, (o, *seen)), 1.0),
        (host.w_start + _flat(host.out_shape, (o, *missed)), -1.0),
    ]


class DiracProbe(nn.Module):
    """The model's layers, called one per canary on crafted inputs (see the module docstring).

    Args:
        model: the training model (held as the submodule ``net``: its parameters are the
            probe's, named with ``PREFIX``).
        coordinates: per canary, (parameter name, flat index); every parameter ``host_sizes`` lists.
        magnitude: M, each canary's gradient norm before clipping.
    """

    def __init__(
        self, model: nn.Module, coordinates: Sequence[tuple[str, int]], magnitude: float
    ) -> None:
        super().__init__()
        self.net = model
        hosts: dict[str, _Host] = {}
        width = 0
        for name, _ in coordinates:
            path = name.rpartition(".")[0]
            if path not in hosts:
                m = model.get_submodule(path)
                # a host (HOST_LAYERS)
                host = (
                    _linear_host(path, m)
                    if type(m) is nn.Linear
                    else _conv_host(path, cast(_Conv, m))
                )
                host.a_start = width
                host.w_start = width + int(np.prod(host.in_shape))
                width = host.w_start + int(np.prod(host.out_shape))
                hosts[path] = host
        self.hosts, self.width = list(hosts.values()), width
        rows, order = [], list(hosts)
        for name, flat in coordinates:
            path, _, local = name.rpartition(".")
            rows.append(
                _entries(
                    hosts[path], model.get_submodule(path), local, flat, LOGIT_GAIN * magnitude
                )
            )
        self.host_of = torch.tensor(
            [order.index(name.rpartition(".")[0]) for name, _ in coordinates], dtype=torch.long
        )
        # the layers forward calls: those of the last batch's canaries
        self.active = list(range(len(self.hosts)))
        most = max((len(r) for r in rows), default=1)
        # padded with (0, 0.0): scatter-adding zero changes nothing
        self.index = torch.tensor(
            [[i for i, _ in r] + [0] * (most - len(r)) for r in rows], dtype=torch.long
        )
        self.value = torch.tensor(
            [[v for _, v in r] + [0.0] * (most - len(r)) for r in rows], dtype=torch.float64
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (B, 2) of probe rows x (B, width): logit 0 is sum over hosts of <layer(a), w>,
        shifted to value 0 so that cross-entropy's gradient is 1/2 whatever the weights."""
        t = x.new_zeros(x.shape[0])
        for host in (self.hosts[i] for i in self.active):  # a layer not called has zero gradient
            a = x[:, host.a_start : host.w_start].reshape(-1, *host.in_shape)
            w = x[:, host.w_start : host.w_start + int(np.prod(host.out_shape))].reshape(
                -1, *host.out_shape
            )
            t = t + (self.net.get_submodule(host.path)(a) * w).flatten(1).sum(1)
        return torch.stack([t - t.detach(), torch.zeros_like(t)], 1)

    def batch(
        self, canaries: torch.Tensor, views: int, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The probe chunk of canaries ``canaries`` (ids): x (B, width), or (B, K, width) with
        augmentation multiplicity K (each view the same), in ``like``'s dtype and device; labels.
        The next forward passes call only these canaries' layers."""
        ids = canaries.cpu()
        self.active = sorted(set(self.host_of[ids].tolist()))
        x = torch.zeros(len(ids), self.width, dtype=torch.float64)
        x.scatter_add_(1, self.index[ids], self.value[ids])
        x = x.to(like.device, like.dtype)
        if views > 1:
            x = x.unsqueeze(1).expand(-1, views, -1).contiguous()
        return x, torch.full((len(ids),), CANARY_LABEL, dtype=torch.long, device=like.device)

    @staticmethod
    def params(params: Params) -> Params:
        """The training model's parameters under the probe's names."""
        return {PREFIX + name: p for name, p in params.items()}

    @staticmethod
    def model_names(grad_sum: Params) -> Params:
        """A probe gradient under the training model's names."""
        return {name[len(PREFIX) :]: g for name, g in grad_sum.items()}

    def describe(self) -> str:
        """The layers the canaries pass through, by type: 'Linear head.0, head.2; Conv2d features.0'."""
        by_type: dict[str, list[str]] = {}
        for host in self.hosts:
            by_type.setdefault(type(self.net.get_submodule(host.path)).__name__, []).append(
                host.path
            )
        return "; ".join(
            f"{kind} {', '.join(sorted(paths))}" for kind, paths in sorted(by_type.items())
        )

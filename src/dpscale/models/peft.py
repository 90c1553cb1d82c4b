"""Parameter-efficient fine-tuning for DP: LoRA, BiTFiT and "last k groups".

Private fine-tuning of a pretrained backbone pays clipping and noise only on what it trains: the
noise's norm grows with the square root of the trainable parameters, and per-example clipping's
cost with them. These adapters leave the backbone frozen (``requires_grad=False``), so no engine
records, clips or noises it.

- **LoRA** (Hu et al. 2021; for DP: Yu et al. 2022, fastDP): a frozen ``Linear``/``Conv2d`` W gets a
  trainable low-rank update, y = W x + (alpha / r) B(A(x)) with A: in -> r (for a convolution, W's
  kernel, stride, padding and dilation) and B: r -> out (1x1), B = 0 at the start. A and B are
  themselves ``nn.Linear``/``nn.Conv2d`` layers (A a ``dpscale.layers.LoRADown*``, which computes
  W x + b in the same call), so the bk and ghost engines clip them with their exact rules (no
  vmap fallback), and ``merge_lora`` folds them into W for export. Without
  gradients (evaluation) an adapted layer computes with the merged weight: one layer's cost, the
  exported model's arithmetic.
- **BiTFiT** (Bu et al. 2022): only the biases (and the logits layer) train.
- **last k groups**: only the last k of ``model.block_groups()`` train.

The logits layer (the last of ``block_groups()``, else the last ``Linear``) always trains in full:
fine-tuning for a new task starts it afresh (``model.reset_head``).
"""

from __future__ import annotations

import math
from fnmatch import fnmatchcase
from typing import Sequence, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from dpscale.choices import PEFT_METHODS
from dpscale.layers import LoRADownConv2d, LoRADownLinear
from dpscale.models.adapt import block_groups_of

_Layer = TypeVar("_Layer", bound=nn.Module)


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable rank-r update (alpha / r) B A."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base, self.scale = base, alpha / rank
        base.requires_grad_(False)
        kwargs = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_a = LoRADownLinear(base, rank)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False, **kwargs)
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)  # the wrapped layer computes W x at the start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation: one layer, the merged weight (as exported)
            return F.linear(x, self.merged_weight(), self.base.bias)
        down = self.lora_a(x)  # A x, computed with W x + b in one product
        return torch.add(self.lora_a.take_frozen_output(), self.lora_b(down), alpha=self.scale)

    def merged_weight(self) -> torch.Tensor:
        """W + (alpha / r) B A."""
        return self.base.weight + self.scale * (self.lora_b.weight @ self.lora_a.weight)

    def merged(self) -> nn.Linear:
        """The plain ``nn.Linear`` with W + (alpha / r) B A."""
        layer = _copy(self.base)
        with torch.no_grad():
            layer.weight.copy_(self.merged_weight())
        return layer


class LoRAConv2d(nn.Module):
    """A frozen ``nn.Conv2d`` plus a trainable rank-r update: A, a conv with W's geometry and r
    output channels, then B, a 1x1 conv to W's output channels, scaled by alpha / r."""

    def __init__(self, base: nn.Conv2d, rank: int, alpha: float) -> None:
        super().__init__()
        if base.groups != 1 or not isinstance(base.padding, tuple) or base.padding_mode != "zeros":
            raise ValueError(
                f"LoRA takes Conv2d layers with groups=1 and numeric zero padding, got {base}"
            )
        self.base, self.scale = base, alpha / rank
        base.requires_grad_(False)
        self.lora_a = LoRADownConv2d(base, rank)
        self.lora_b = nn.Conv2d(
            rank,
            base.out_channels,
            1,
            bias=False,
            device=base.weight.device,
            dtype=base.weight.dtype,
        )
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # evaluation: one convolution, the merged weight (as exported)
        if not torch.is_grad_enabled():
            return self.base._conv_forward(x, self.merged_weight(), self.base.bias)
        down = self.lora_a(x)  # A x, computed with W x + b in one convolution
        return torch.add(self.lora_a.take_frozen_output(), self.lora_b(down), alpha=self.scale)

    def merged_weight(self) -> torch.Tensor:
        """W + (alpha / r) B A (B's 1x1 kernel applied to A's kernels)."""
        update = torch.einsum("or,rikl->oikl", self.lora_b.weight[:, :, 0, 0], self.lora_a.weight)
        return self.base.weight + self.scale * update

    def merged(self) -> nn.Conv2d:
        """The plain ``nn.Conv2d`` with W + (alpha / r) B A."""
        layer = _copy(self.base)
        with torch.no_grad():
            layer.weight.copy_(self.merged_weight())
        return layer


def _copy(layer: _Layer) -> _Layer:
    """A trainable deep copy of ``layer`` (the merged layer is the model's own again)."""
    import copy

    clone = copy.deepcopy(layer)
    clone.requires_grad_(True)
    return clone


def logits_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The logits layer's parameters: the last of ``block_groups()``, else the last Linear's."""
    groups = block_groups_of(model)
    if groups is not None:
        return list(groups[-1])
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(
            f"{type(model).__name__} has no block_groups() and no Linear layer: cannot find its logits layer"
        )
    return list(linears[-1].parameters())


def apply_lora(
    model: nn.Module, rank: int, alpha: float | None = None, targets: Sequence[str] = ("*",)
) -> int:
    """Freeze ``model`` and wrap its Linear/Conv2d layers (those whose module name matches a
    pattern of ``targets``; never the logits layer, which trains in full) in LoRA adapters, in place.

    Args:
        model: the model (pretrained weights already loaded).
        rank: r >= 1.
        alpha: the update's scale numerator (alpha / r); None: alpha = r (scale 1).
        targets: ``fnmatch`` patterns over module names (``model.named_modules()``).

    Returns:
        the number of trainable parameters left.

    Raises:
        ValueError: a bad rank, or no layer matched.
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"model.lora_rank must be an integer >= 1, got {rank!r}")
    alpha = float(rank if alpha is None else alpha)
    head = {id(p) for p in logits_parameters(model)}
    model.requires_grad_(False)
    chosen = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, nn.Conv2d))
        and any(fnmatchcase(name, t) for t in targets)
        and not any(id(p) in head for p in module.parameters())
    ]
    if not chosen:
        raise ValueError(
            f"model.lora_targets {list(targets)} match no Linear or Conv2d layer outside the logits layer"
        )
    for name, module in chosen:
        wrapper = (
            LoRALinear(module, rank, alpha)
            if isinstance(module, nn.Linear)
            else LoRAConv2d(module, rank, alpha)
        )
        _set_submodule(model, name, wrapper)
    return _train_also(model, logits_parameters(model))


def apply_bitfit(model: nn.Module) -> int:
    """Train only the biases and the logits layer (BiTFiT, Bu et al. 2022), in place.

    Returns:
        the number of trainable parameters left.
    """
    model.requires_grad_(False)
    biases = [p for name, p in model.named_parameters() if name.rpartition(".")[2] == "bias"]
    return _train_also(model, biases + logits_parameters(model))


def train_last_groups(model: nn.Module, k: int) -> int:
    """Train only the last ``k`` of ``model.block_groups()`` (k >= 1), in place.

    Returns:
        the number of trainable parameters left.
    """
    groups = block_groups_of(model)
    if groups is None:
        raise ValueError(
            f"{type(model).__name__} has no block_groups(); cannot train its last groups"
        )
    if not 1 <= k <= len(groups):
        raise ValueError(
            f"model.train_last_groups must be in 1..{len(groups)} for this model, got {k}"
        )
    model.requires_grad_(False)
    return _train_also(model, [p for group in groups[-k:] for p in group])


def _train_also(model: nn.Module, params: list[nn.Parameter]) -> int:
    for p in params:
        p.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA adapter into its layer, in place: the model is then its plain architecture
    again (the state dict of ``build_model``'s model), computing the same function.

    Returns:
        ``model``.
    """
    for name, module in list(model.named_modules()):
        if isinstance(module, (LoRALinear, LoRAConv2d)):
            _set_submodule(model, name, module.merged())
    return model


def apply_peft(
    model: nn.Module,
    method: str,
    *,
    rank: int = 8,
    alpha: float | None = None,
    targets: Sequence[str] = ("*",),
    last_groups: int = 1,
) -> int:
    """Apply ``method`` ("none", "lora", "bitfit", "last_groups") to ``model`` in place.

    Returns:
        the number of trainable parameters left.
    """
    if method == "lora":
        return apply_lora(model, rank, alpha, targets)
    if method == "bitfit":
        return apply_bitfit(model)
    if method == "last_groups":
        return train_last_groups(model, last_groups)
    if method != "none":
        raise ValueError(f"model.peft must be one of {', '.join(PEFT_METHODS)}, got {method!r}")
    return sum(p.numel() for p in model.parameters() if p.requires_grad)

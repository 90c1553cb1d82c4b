"""Adapting models for DP training: freezing block groups, replacing BatchNorm."""

from __future__ import annotations

from torch import nn


def freeze_block_groups(model: nn.Module, k: int) -> int:
    """Freeze the first ``k`` of ``model.block_groups()`` (Kurakin Appendix G fine-tuning).

    Args:
        model: a model exposing ``block_groups()`` (input stem first, logits layer last).
        k: number of leading groups to freeze; 0 freezes nothing.

    Returns:
        the number of parameters left trainable.

    Raises:
        ValueError: if the model has no ``block_groups`` or ``k`` would freeze everything.
    """
    if not hasattr(model, "block_groups"):
        raise ValueError(f"{type(model).__name__} has no block_groups(); cannot freeze groups")
    groups = model.block_groups()
    if not 0 <= k < len(groups):
        raise ValueError(f"can freeze 0..{len(groups) - 1} block groups of this model (it has {len(groups)}), got {k}")
    for group in groups[:k]:
        for p in group:
            p.requires_grad_(False)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _group_count(channels: int, preferred: int) -> int:
    """Largest divisor of ``channels`` not above ``preferred``."""
    for groups in range(min(preferred, channels), 0, -1):
        if channels % groups == 0:
            return groups
    return 1


def convert_batchnorm_to_groupnorm(model: nn.Module, num_groups: int = 32) -> nn.Module:
    """Replace every BatchNorm (which mixes examples) by a GroupNorm over the same channels.

    Affine parameters are copied (they play the same role); running statistics are dropped.
    The number of groups is the largest divisor of the channel count up to ``num_groups``.
    Returns the same model, modified in place.
    """
    for name, child in list(model.named_children()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            channels = child.num_features
            norm = nn.GroupNorm(_group_count(channels, num_groups), channels, eps=child.eps, affine=child.affine)
            if child.affine:
                norm.weight.data.copy_(child.weight.data)
                norm.bias.data.copy_(child.bias.data)
            setattr(model, name, norm.to(child.weight.device if child.affine else "cpu"))
        else:
            convert_batchnorm_to_groupnorm(child, num_groups)
    return model

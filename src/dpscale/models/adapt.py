"""Adapting models for DP training: freezing block groups, replacing BatchNorm."""

from __future__ import annotations

from torch import nn


def block_groups_of(model: nn.Module) -> list[list[nn.Parameter]] | None:
    """``model.block_groups()`` (input stem first, logits layer last), or None for a model without
    one. A getattr: ``nn.Module.__getattr__`` types a missing method as a Tensor or a Module."""
    block_groups = getattr(model, "block_groups", None)
    return None if block_groups is None else block_groups()


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
    groups = block_groups_of(model)
    if groups is None:
        raise ValueError(f"{type(model).__name__} has no block_groups(); cannot freeze groups")
    if not 0 <= k < len(groups):
        raise ValueError(
            f"can freeze 0..{len(groups) - 1} block groups of this model (it has {len(groups)}), got {k}"
        )
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


def _groupnorm_for(batchnorm: nn.modules.batchnorm._BatchNorm, num_groups: int) -> nn.GroupNorm:
    """The GroupNorm that replaces ``batchnorm``, its affine parameters copied.

    Args:
        batchnorm: the layer to replace (its running statistics are dropped).
        num_groups: the most groups a BatchNorm2d/3d's channels are split into.

    Returns:
        a GroupNorm on the same device: one group for BatchNorm1d, whose (N, C) input has one
        value per channel (a group of one channel has no variance: torch refuses it in
        training), else the largest divisor of the channel count up to ``num_groups``.
    """
    channels = batchnorm.num_features
    if isinstance(batchnorm, nn.BatchNorm1d) and channels == 1:
        # GroupNorm(1, 1) on (N, 1) input normalises each example's one value to 0: it erases its input
        raise ValueError(
            "BatchNorm1d(1) has no per-example equivalent (normalising one value per example erases it): "
            "remove the layer or replace it by nn.Identity() before convert_batchnorm_to_groupnorm"
        )
    groups = 1 if isinstance(batchnorm, nn.BatchNorm1d) else _group_count(channels, num_groups)
    norm = nn.GroupNorm(groups, channels, eps=batchnorm.eps, affine=batchnorm.affine)
    if batchnorm.affine:
        norm.weight.data.copy_(batchnorm.weight.data)
        norm.bias.data.copy_(batchnorm.bias.data)
    return norm.to(batchnorm.weight.device if batchnorm.affine else "cpu")


def convert_batchnorm_to_groupnorm(model: nn.Module, num_groups: int = 32) -> nn.Module:
    """Replace every BatchNorm (which mixes examples) by a GroupNorm over the same channels,
    which normalises each example by its own statistics.

    BatchNorm1d becomes ``GroupNorm(1, C)``: each example's features (and positions, on
    (N, C, L) input) normalised together, as LayerNorm does, so it trains on (N, C) input too.
    BatchNorm2d/3d becomes ``GroupNorm(G, C)`` with G the largest divisor of C up to
    ``num_groups``. Affine parameters are copied (they play the same role); running
    statistics are dropped.

    Args:
        model: the model, changed in place.
        num_groups: the most groups for a BatchNorm2d/3d (32, as in Wu & He 2018).

    Returns:
        ``model``.

    Raises:
        ValueError: a BatchNorm1d of one feature (no per-example form keeps its input).
    """
    for name, child in list(model.named_children()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            try:
                setattr(model, name, _groupnorm_for(child, num_groups))
            except ValueError as err:
                raise ValueError(f"convert_batchnorm_to_groupnorm: layer {name!r}: {err}") from err
        else:
            convert_batchnorm_to_groupnorm(child, num_groups)
    return model

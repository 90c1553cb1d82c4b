"""Vision Transformers (Dosovitskiy et al. 2021) as used by TAN: ViT-Tiny and ViT-Small,
patch 16 for 224x224 inputs and patch 4 for 32x32. LayerNorm only (no batch statistics)."""

from __future__ import annotations

import torch
from torch import nn

from dpscale.models.activations import make_activation
from dpscale.layers import ClassTokenPositionEmbedding
from dpscale.models.registry import register_model


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        weights = torch.softmax(q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5, dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int, activation: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim),
            make_activation(activation),
            nn.Linear(mlp_ratio * dim, dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(
        self,
        num_classes: int,
        input_shape: tuple[int, int, int],
        patch: int,
        dim: int,
        depth: int,
        heads: int,
        mlp_ratio: int = 4,
        activation: str = "gelu",
    ) -> None:
        super().__init__()
        channels, height, width = input_shape
        if height % patch or width % patch:
            raise ValueError(f"input {input_shape} is not divisible into {patch}x{patch} patches")
        self.patch_embed = nn.Conv2d(channels, dim, patch, stride=patch)
        self.tokens = ClassTokenPositionEmbedding((height // patch) * (width // patch), dim)
        self.blocks = nn.Sequential(
            *(Block(dim, heads, mlp_ratio, activation) for _ in range(depth))
        )
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.dim = dim
        self.head = nn.Linear(dim, num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patch_embed(x).flatten(2).transpose(1, 2)
        return self.norm(self.blocks(self.tokens(tokens)))[:, 0]

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def reset_head(self, num_classes: int) -> None:
        self.head = nn.Linear(self.dim, num_classes)

    def block_groups(self) -> list[list[nn.Parameter]]:
        """[patch + token embeddings], one group per transformer block (final norm with the last), [head]."""
        groups = [list(self.patch_embed.parameters()) + list(self.tokens.parameters())]
        groups += [list(block.parameters()) for block in self.blocks]
        groups[-1] += list(self.norm.parameters())
        return groups + [list(self.head.parameters())]


def _patch(input_shape: tuple[int, int, int], patch: int | None) -> int:
    return patch or (4 if input_shape[1] <= 64 else 16)


@register_model("vit-tiny", input_shape=(3, 224, 224))
def vit_tiny(
    num_classes: int = 10,
    input_shape: tuple[int, int, int] = (3, 224, 224),
    activation: str = "gelu",
    patch: int | None = None,
    depth: int = 12,
) -> VisionTransformer:
    """ViT-Tiny: width 192, 12 blocks, 3 heads, MLP 768; patch 16 (224 px) or 4 (32 px)."""
    return VisionTransformer(
        num_classes, input_shape, _patch(input_shape, patch), 192, depth, 3, 4, activation
    )


@register_model("vit-small", input_shape=(3, 224, 224))
def vit_small(
    num_classes: int = 10,
    input_shape: tuple[int, int, int] = (3, 224, 224),
    activation: str = "gelu",
    patch: int | None = None,
    depth: int = 12,
) -> VisionTransformer:
    """ViT-Small: width 384, 12 blocks, 6 heads, MLP 1536."""
    return VisionTransformer(
        num_classes, input_shape, _patch(input_shape, patch), 384, depth, 6, 4, activation
    )

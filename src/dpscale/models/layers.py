"""Small layers shared by models (kept free of other dpscale imports so engines can use them)."""

from __future__ import annotations

import torch
from torch import nn


class ClassTokenPositionEmbedding(nn.Module):
    """Prepends a learned class token to (B, T, D) tokens and adds a learned position embedding.

    Its own module (not loose parameters on the model) so per-example clipping engines can
    handle it exactly: the per-example gradient of the position embedding is the output
    gradient itself, and that of the class token is its first row.
    """

    def __init__(self, num_tokens: int, dim: int) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, num_tokens + 1, dim) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)
        return torch.cat([cls, tokens], dim=1) + self.pos_embed

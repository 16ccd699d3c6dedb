"""A small pre-norm transformer on ``F.scaled_dot_product_attention`` (random weights):
the tests' and the latency benchmark's model, split by the default splitting ops."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """Pre-norm transformer block: LayerNorm + causal SDPA + MLP."""

    def __init__(self, dim: int = 32, heads: int = 4, mlp_ratio: int = 2):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """``layers`` blocks and a final LayerNorm; ``(batch, seq, dim) -> (batch, seq, dim)``."""

    def __init__(self, layers: int = 2, dim: int = 32, heads: int = 4, seed: int = 0,
                 mlp_ratio: int = 2):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

"""Small models written for the tests (random weights, nothing downloaded)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dynamo_sizebackend.models.sdpa import Block, TinyTransformer  # noqa: F401  (the tests' models)


class MLP(nn.Module):
    """No attention at all: one piece."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def batch(size: int, seq: int = 8, dim: int = 32, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + size)
    return torch.randn(size, seq, dim, generator=g)


def compile_sb(model, **options):
    """``torch.compile`` with the backend found by name, batch dim dynamic from the start.

    ``dynamic=True`` makes Dynamo trace one graph with a symbolic batch (and seq) from the
    first call; sizes 0 and 1 still get graphs of their own (0/1 specialization).
    """
    return torch.compile(model, backend="sizebackend", dynamic=True, options=options)


class NormNet(nn.Module):
    """RMS norm with its eps as a float attribute (as HF models keep it), then attention:
    under ``dynamic=True`` Dynamo lifts the eps into a graph input."""

    def __init__(self, dim: int = 32, heads: int = 4, eps: float = 1e-6):
        super().__init__()
        self.heads, self.eps = heads, eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        h = self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(h).chunk(3, -1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(a.transpose(1, 2).reshape(b, t, d))

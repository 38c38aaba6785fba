"""A small deterministic transformer for tests, benchmarks and the demo.

Not part of the training API: it exists so that ``bench/`` and ``tests/`` train
the same model. Attention is written out (matmul, softmax, matmul) by default, so the saved
activations are those of a plain PyTorch model; ``attention="sdpa"`` uses
``F.scaled_dot_product_attention`` instead (fused kernels on a GPU, the shape
of activations in current LLM training).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["TinyTransformer", "make_batch"]


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, attention: str) -> None:
        super().__init__()
        self.heads = heads
        self.attention = attention
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.ln1(x)
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            y = scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v
        y = y.transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyTransformer(nn.Module):
    """A pre-norm decoder: embedding, ``depth`` blocks, final norm and LM head.

    ``attention`` is ``"explicit"`` (matmul, softmax, matmul) or ``"sdpa"``.
    """

    def __init__(
        self,
        *,
        vocab: int = 512,
        width: int = 256,
        depth: int = 6,
        heads: int = 4,
        attention: str = "explicit",
    ) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width ({width}) must be divisible by heads ({heads}).")
        if attention not in ("explicit", "sdpa"):
            raise ValueError(f"attention must be 'explicit' or 'sdpa', got {attention!r}.")
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_Block(width, heads, attention) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of next-token prediction."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def make_batch(
    batch: int, seq: int, *, vocab: int = 512, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and shifted targets, reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()

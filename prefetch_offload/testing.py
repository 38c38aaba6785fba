"""A small deterministic transformer for tests, benchmarks and the demo.

Not part of the training API: it exists so that ``bench/`` and ``tests/`` train
the same model. Attention is written out (matmul, softmax, matmul) by default, so the saved
activations are those of a plain PyTorch model; ``attention="sdpa"`` uses
``F.scaled_dot_product_attention`` instead (fused kernels on a GPU, the shape
of activations in current LLM training).

``saved_storage_bytes`` measures what a forward saves for backward.
``warm_up_unary_ops`` works around a PyTorch bug that breaks bit-exact
comparisons on the CPU: NOTE [first unary call].
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "TinyTransformer",
    "make_batch",
    "saved_storage_bytes",
    "trainer_checkpointing",
    "warm_up_unary_ops",
]


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


# NOTE [first unary call]
# pytorch/pytorch#188792: ATen sends contiguous float unary ops (sin, exp, sqrt,
# erf, ...) to MKL VML, one call per intra-op thread on its chunk, and the oneMKL
# bundled with the CPU wheels (2024.2) picks each VML function's kernel on its
# first call. When that first call runs on several threads at once, one thread
# can run a low-accuracy kernel over its whole chunk (measured here: half of a
# 16384-element sin ~700-1300 ulps off; 3 of 40 fresh processes under a CPU
# hog, none after a warm-up). Later calls are right. A comparison of offload
# against no offload whose first such call lands in one of the two runs then
# differs for that reason alone, so tests and benchmarks call these ops once on
# one thread before they compare anything.
_UNARY_OPS = (
    "acos", "asin", "atan", "atanh", "cos", "cosh", "erf", "erfc", "erfinv", "exp",
    "expm1", "lgamma", "log", "log10", "log1p", "log2", "reciprocal", "rsqrt",
    "sigmoid", "sin", "sinh", "sqrt", "tan", "tanh",
)  # fmt: skip


def warm_up_unary_ops() -> None:
    """Call each float unary op that may go to MKL VML once, on one intra-op thread,
    in float32 and float64 (NOTE [first unary call])."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.rand(4096) * 0.8 + 0.1  # in every op's domain
        for dtype in (torch.float32, torch.float64):
            y = x.to(dtype)
            for name in _UNARY_OPS:
                getattr(torch, name)(y)
            torch.nn.functional.gelu(y)
    finally:
        torch.set_num_threads(threads)


def trainer_checkpointing(transformers: Any, on: bool) -> dict[str, bool]:
    """``TrainingArguments`` keywords that switch the Trainer's own checkpointing:
    ``activation_checkpointing`` in transformers 5 (``gradient_checkpointing`` is
    deprecated there), ``gradient_checkpointing`` before; nothing when ``on`` is false."""
    if not on:
        return {}
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    if "activation_checkpointing" in fields:
        return {"activation_checkpointing": True}
    return {"gradient_checkpointing": True}


def saved_storage_bytes(model: nn.Module, forward: Callable[[], Any]) -> list[int]:
    """Bytes of each distinct storage ``forward()`` (a forward of ``model``, or of a
    part of it) saves for backward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return list(storages.values())

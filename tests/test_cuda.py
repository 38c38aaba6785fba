"""The CUDA path, on a real GPU. Marked gpu_only: skipped on CPU-only machines.

The same span-copy logic runs on the CPU in tests/test_context.py through the
CPU twin (``SpanCopyDevice("cpu")``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from prefetch_offload import offload_context
from prefetch_offload.testing import TinyTransformer, make_batch

pytestmark = [
    pytest.mark.gpu_only,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _setup() -> tuple[TinyTransformer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyTransformer(vocab=128, width=64, depth=2, heads=2).cuda()
    tokens, targets = make_batch(4, 64, vocab=128)
    return model, tokens.cuda(), targets.cuda()


@pytest.mark.parametrize("target", ["cpu", "disk"])
@pytest.mark.parametrize("depth", [0, 1, 4])
def test_cuda_grads_bit_identical(save_dir: Path, target: str, depth: int) -> None:
    model, tokens, targets = _setup()
    ref = copy.deepcopy(model)
    ref(tokens, targets).backward()
    kw = {"save_dir": str(save_dir)} if target == "disk" else {}
    with offload_context(target, prefetch_depth=depth, min_offload_bytes=0, **kw) as engine:
        model(tokens, targets).backward()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert engine.stats().tensors_offloaded > 0


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_cuda_race_with_queued_gpu_work(save_dir: Path, target: str) -> None:
    """Long GPU work queued before each copy: a too-early free or reuse corrupts values."""
    kw = {"save_dir": str(save_dir)} if target == "disk" else {}
    x = torch.randn(1 << 20, device="cuda", requires_grad=True)
    with offload_context(target, min_offload_bytes=0, **kw):
        ys = []
        for i in range(4):
            torch.cuda._sleep(50_000_000)  # ~tens of ms of queued work
            ys.append((x * (i + 2)).sin())
        loss = sum(y.sum() for y in ys)
        torch.cuda._sleep(50_000_000)
        loss.backward()
    expected = sum((i + 2) * (x.detach() * (i + 2)).cos() for i in range(4))
    assert torch.equal(x.grad, expected)


def test_cuda_peak_memory_drops_by_the_offloaded_bytes(save_dir: Path) -> None:
    model, tokens, targets = _setup()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = model(tokens, targets)
    plain_peak = torch.cuda.max_memory_allocated() - base
    loss.backward()
    del loss
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with offload_context("cpu", min_offload_bytes=0) as engine:
        loss = model(tokens, targets)
        offload_peak = torch.cuda.max_memory_allocated() - base
        loss.backward()
    assert offload_peak < plain_peak
    assert plain_peak - offload_peak >= 0.5 * engine.stats().bytes_offloaded

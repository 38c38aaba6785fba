"""Memory the engine gives back is poisoned the moment it is given back.

Every read buffer returned to the read pool, every run returned to a pinned (or,
on the CPU twin, mapped) arena, and every slab extent freed is overwritten with
0xFF bytes (NaN in a float) before anything can reuse it, while each IO job
starts after a random delay (seeded). A record or tensor that still used memory
the engine had given back would then change a gradient: the silent bug of
buffers reused while still referenced, made loud. Each workload's gradients
must be bit-identical to the same workload without hooks, at every step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import (
    Poisoned,
    assert_same_grads,
    engine_with_hooks,
    grads_of,
    poison_freed_memory,
    tiny_model,
    twin_with_hooks,
)
from torch.utils.checkpoint import checkpoint

from prefetch_offload.testing import TinyTransformer, make_batch


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> Poisoned:
    return poison_freed_memory(monkeypatch)


def _train(model: TinyTransformer, steps: int, flush: Callable[[], None] | None) -> list[Any]:
    """``steps`` SGD steps on fixed batches; every step's gradients. ``flush`` runs
    before every other backward, so that reads happen whatever the IO timing."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        tokens, targets = make_batch(4, 32, vocab=64, seed=step)
        loss = model(tokens, targets)
        if flush is not None and step % 2:
            flush()
        loss.backward()
        out.append(grads_of(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def _same(a: list[Any], b: list[Any]) -> None:
    """Every step's gradients bit-identical (assert_same_grads per step)."""
    assert len(a) == len(b) and a
    for ga, gb in zip(a, b, strict=True):
        assert_same_grads(ga, gb)


@pytest.mark.parametrize(
    "kw",
    [
        {"prefetch_depth": 0},
        {"prefetch_depth": 8, "io_workers": 3},
        {"chunk_bytes": 4096},  # many small write batches, each its own job
        {"device_budget": 200_000},  # some records stay, the oldest go to disk
        {"io_method": "mmap"},
        {"io_method": "buffered", "prefetch_bytes": 1 << 16},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_training_steps_with_freed_memory_poisoned(
    save_dir: Path, poisoned: Poisoned, kw: dict[str, Any]
) -> None:
    model = tiny_model()
    ref = _train(copy.deepcopy(model), 3, None)
    with engine_with_hooks(save_dir, **kw) as engine:
        got = _train(model, 3, engine.flush)
        stats = engine.stats()
    _same(got, ref)
    assert stats.bytes_read > 0, stats
    assert poisoned.buffers > 0 and poisoned.extents > 0


def test_backward_twice_and_checkpoint_with_freed_memory_poisoned(
    save_dir: Path, poisoned: Poisoned
) -> None:
    model = tiny_model()
    tokens, targets = make_batch(4, 32, vocab=64)

    def step(m: TinyTransformer, flush: Callable[[], None] = lambda: None) -> None:
        x = m.embed(tokens)
        for block in m.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = m.head(m.norm(x))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        flush()
        loss.backward(retain_graph=True)
        loss.backward()

    ref = copy.deepcopy(model)
    step(ref)
    with engine_with_hooks(save_dir) as engine:
        step(model, engine.flush)
        stats = engine.stats()
    _same([grads_of(model)], [grads_of(ref)])
    assert stats.bytes_read > 0 and poisoned.buffers > 0 and poisoned.extents > 0


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_twin_copies_with_freed_memory_poisoned(
    save_dir: Path, poisoned: Poisoned, target: str
) -> None:
    """The CPU twin of the CUDA path: host copies in arena runs, late side-stream copies."""
    model = tiny_model()
    ref = _train(copy.deepcopy(model), 3, None)
    with twin_with_hooks(target, save_dir, delay=0.001) as (engine, _):
        got = _train(model, 3, engine.flush)
        stats = engine.stats()
    _same(got, ref)
    assert stats.tensors_offloaded > 0
    assert poisoned.arena_runs > 0
    if target == "disk":
        assert poisoned.extents > 0

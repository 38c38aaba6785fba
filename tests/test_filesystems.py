"""Real small and read-only filesystems (tmpfs mounts); skipped where mounting is not allowed."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from engine_helpers import mounted_tmpfs

from prefetch_offload import OffloadFallbackWarning, offload_context
from prefetch_offload.testing import TinyTransformer, make_batch


def test_full_disk_falls_back_to_memory_with_exact_gradients(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyTransformer(vocab=128, width=128, depth=4, heads=4)
    tokens, targets = make_batch(8, 128, vocab=128)  # ~60 MB saved: far more than 16 MiB
    ref = copy.deepcopy(model)
    ref(tokens, targets).backward()
    with mounted_tmpfs(tmp_path / "small", "16m") as small:
        with (
            pytest.warns(OffloadFallbackWarning, match=str(small)) as record,
            offload_context(
                "disk", str(small), min_offload_bytes=0, slab_bytes=1 << 20, chunk_bytes=1 << 14
            ) as engine,
        ):
            model(tokens, targets).backward()
        assert list(small.iterdir()) == []
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    stats = engine.stats()
    assert stats.fallbacks > 0
    assert stats.peak_disk_bytes_reserved <= 16 << 20
    assert stats.tensors_offloaded + stats.writes_skipped > 0  # what fit went to disk
    assert len([w for w in record if w.category is OffloadFallbackWarning]) == 1


def test_read_only_filesystem_is_refused_at_entry(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        with pytest.raises(ValueError, match="read-only filesystem"):
            with offload_context("disk", str(ro)):
                pytest.fail("the body must not run")

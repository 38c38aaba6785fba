"""Records and handles: wrapper subclasses (NOTE [wrapper subclasses])."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from engine_helpers import engine_with_hooks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")


@pytest.fixture
def mesh(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A one-rank gloo mesh on the CPU."""
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x
    for i in range(4):
        h = ((h @ w) * (1.0 + i / 8)).sin()
    return h.sum()


def test_dtensor_local_tensors_are_offloaded_and_rebuilt(save_dir: Path, mesh: Any) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    x0, w0 = torch.randn(256, 64), torch.randn(64, 64) / 8
    ref_x = distribute_tensor(x0, mesh, [Shard(0)]).requires_grad_()
    ref_w = distribute_tensor(w0, mesh, [Replicate()]).requires_grad_()
    _step(ref_x, ref_w).backward()
    x = distribute_tensor(x0, mesh, [Shard(0)]).requires_grad_()
    w = distribute_tensor(w0, mesh, [Replicate()]).requires_grad_()
    with engine_with_hooks(save_dir, chunk_bytes=4096) as engine:
        loss = _step(x, w)
        engine.flush()
        written = engine.stats()
        loss.backward()
        stats = engine.stats()
    assert written.tensors_offloaded > 0 and stats.bytes_read > 0
    # Wrapper leaves that require grad stay: x, saved once, and w, saved by all 4 matmuls.
    assert stats.subclasses_kept == 5
    for a, b in ((x, ref_x), (w, ref_w)):
        assert type(a.grad).__name__ == "DTensor"
        assert torch.equal(a.grad.to_local(), b.grad.to_local())
        assert a.grad.placements == b.grad.placements


@pytest.mark.parametrize("written", [False, True])
def test_a_dtensor_changed_in_place_after_its_save_raises(
    save_dir: Path, mesh: Any, written: bool
) -> None:
    """NOTE [version check]: the in-place op moves the DTensor's version counter, not its
    local tensor's; plain autograd raises, and so must the engine, written or not."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    w = distribute_tensor(torch.randn(64, 64), mesh, [Replicate()]).requires_grad_()
    x = distribute_tensor(torch.randn(64, 64), mesh, [Replicate()])
    with engine_with_hooks(save_dir, chunk_bytes=4096) as engine:
        h = x @ w
        loss = (h @ w).sum()  # saves h
        if written:
            engine.flush()
        h.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


class _Tagged(torch.Tensor):
    """A subclass the engine cannot rebuild."""


def test_other_subclasses_stay_in_memory_and_are_counted(save_dir: Path) -> None:
    x = torch.randn(1 << 14).as_subclass(_Tagged).requires_grad_()
    with engine_with_hooks(save_dir) as engine:
        (x * 2).sin().sum().backward()
        stats = engine.stats()
    assert stats.subclasses_kept >= 1 and stats.tensors_offloaded == 0
    assert torch.equal(
        x.grad.as_subclass(torch.Tensor), (2 * (2 * x).cos()).as_subclass(torch.Tensor)
    )


@pytest.mark.parametrize("write_lands", [False, True])
def test_a_result_over_the_saved_memory_keeps_its_counter_when_the_write_lands_meanwhile(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch, write_lands: bool
) -> None:
    """NOTE [handouts]: a read that hands out the saved tensor's own memory gives it the
    tensor's own version counter, also when the write lands (and the record lets the
    memory go) between the read and the handout."""
    from prefetch_offload import offload_context
    from prefetch_offload.reader import ReadPath

    materialize = ReadPath.materialize

    def landing(self: ReadPath, rec: Any, **kw: Any) -> Any:
        out = materialize(self, rec, **kw)
        if write_lands:
            rec.engine._writer.wait()
        return out

    monkeypatch.setattr(ReadPath, "materialize", landing)  # read outside backward: queued
    x = torch.randn(256, 1024, requires_grad=True)
    with offload_context("disk", str(save_dir), min_offload_bytes=0, io_method="buffered"):
        a = x * 2
        b = a.sin()
        result = b.grad_fn._saved_self
        assert result.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
        before = a._version
        result.add_(0)
        assert a._version != before

"""The read path: the order copies to a device are queued in, and unpacks from threads."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import twin_with_hooks


def test_a_missed_copy_is_queued_before_its_window(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [head of line]: copies to the device run in order on one stream; the record
    backward waits for goes first, its window's prefetches after it."""
    x = torch.randn(1 << 12, requires_grad=True)
    with twin_with_hooks("cpu", save_dir, prefetch_depth=3) as (engine, layer):
        h, sizes = x, []
        for i in range(6):
            h = (h.repeat(2) if i else h * 1.0).sin()  # saved tensors of distinct sizes
            sizes.append(h.numel() * 4)
        loss = h.sum()
        engine.flush()
        order: list[int] = []
        real = layer.to_device

        def logged(storage: Any, base: int, nbytes: int, *args: Any) -> Any:
            order.append(nbytes)
            return real(storage, base, nbytes, *args)

        monkeypatch.setattr(layer, "to_device", logged)
        loss.backward()
    # The first unpack wants the newest tensor; its window holds the three before it.
    assert order[:4] == [sizes[-1], sizes[-2], sizes[-3], sizes[-4]], (order, sizes)
    ref = x.detach().clone().requires_grad_()
    h = ref
    for i in range(6):
        h = (h.repeat(2) if i else h * 1.0).sin()
    h.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, ref.grad)


def _backward(loss: torch.Tensor, barrier: threading.Barrier, errors: list[BaseException]) -> None:
    try:
        barrier.wait()
        loss.backward()
    except BaseException as exc:  # reported by the caller
        errors.append(exc)


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_unpacks_from_two_threads_at_once(save_dir: Path, target: str) -> None:
    """NOTE [unpack threads]: two backward calls on two threads, over graphs packed by
    one engine, both get exact gradients, and every unpack is counted once."""
    xs = [torch.randn(1 << 13, requires_grad=True) for _ in range(2)]

    def chain(x: torch.Tensor) -> torch.Tensor:
        h = x
        for i in range(12):
            h = (h * (1.0 + i / 32)).sin()
        return h.sum()

    refs = []
    for x in xs:
        r = x.detach().clone().requires_grad_()
        chain(r).backward()
        refs.append(r.grad)
    with twin_with_hooks(target, save_dir, chunk_bytes=4096, prefetch_depth=2) as (engine, _):
        for _ in range(5):
            for x in xs:
                x.grad = None
            losses = [chain(x) for x in xs]
            barrier = threading.Barrier(2)
            errors: list[BaseException] = []

            threads = [
                threading.Thread(target=_backward, args=(loss, barrier, errors)) for loss in losses
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors, errors
            for x, ref in zip(xs, refs, strict=True):
                assert x.grad is not None and torch.equal(x.grad, ref)
        stats = engine.stats()
    assert stats.prefetch_hits + stats.prefetch_misses == 5 * 2 * 12


def test_read_buffers_are_kept_across_steps_and_reused(save_dir: Path) -> None:
    """NOTE [read buffer pool]: the next backward's reads land in the blocks the last
    one used (already faulted in); the engine unmaps them when it closes."""
    from prefetch_offload import OffloadConfig, OffloadEngine

    w = torch.randn(1 << 16, requires_grad=True)
    engine = OffloadEngine(
        # No prefetch: reads are leased one at a time, in unpack order, whatever the
        # timing, so the blocks a step needs are the same every step.
        OffloadConfig(target="disk", save_dir=str(save_dir), min_offload_bytes=0, prefetch_depth=0)
    )
    pool = engine._reader.read_pool
    misses: list[int] = []
    grads: list[torch.Tensor] = []
    try:
        with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
            for _ in range(3):
                before = pool.misses
                h = w
                for _ in range(4):
                    h = (h * 1.5).sin()  # four saved tensors of 256 KiB
                loss = h.sum()
                engine.flush()  # the writes land: backward reads from disk
                loss.backward()
                misses.append(pool.misses - before)
                assert pool.idle_bytes > 0  # kept into the next forward
                grads.append(w.grad.clone())
                w.grad = None
        assert engine.stats().bytes_read > 0
    finally:
        engine.close()
    assert pool.idle_bytes == 0
    # The first step maps the blocks; the next two reuse them (a block
    # returned late costs one more), where an emptied pool maps them all again.
    assert misses[0] > 0 and misses[1] + misses[2] < misses[0], misses
    ref = w.detach().clone().requires_grad_()
    h = ref
    for _ in range(4):
        h = (h * 1.5).sin()
    h.sum().backward()
    assert all(torch.equal(g, ref.grad) for g in grads)


def test_a_record_every_layer_shares_is_read_once_a_backward(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [recently restored]: a record several saves share (a table every layer
    multiplies by) is consumed at its first unpack; it stays restored until its last
    save has unpacked, instead of being read again, synchronously, by each layer."""
    from prefetch_offload import offload_context
    from prefetch_offload.reader import ReadPath

    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(12))
    scale = torch.nn.Parameter(torch.ones(64, 256))

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        table = scale * 1.0  # saved by every layer's mul: one record, shared
        for layer in layers:
            x = torch.tanh(layer(x)) * table
        return x.square().mean()

    x = torch.randn(64, 256)
    loss_of(x).backward()
    ref = [p.grad.clone() for p in [*layers.parameters(), scale]]
    for p in [*layers.parameters(), scale]:
        p.grad = None
    reads: list[int] = []
    read_job = ReadPath._read_job

    def counted(self: ReadPath, rec: Any) -> Any:
        reads.append(rec.seq)
        return read_job(self, rec)

    monkeypatch.setattr(ReadPath, "_read_job", counted)
    with offload_context("disk", str(save_dir), min_offload_bytes=0) as engine:
        for _ in range(2):
            reads.clear()
            loss = loss_of(x)
            engine.flush()
            loss.backward()
    (shared,) = [seq for seq in set(reads) if reads.count(seq) > 1] or [None]
    assert shared is None, f"record {shared} read {reads.count(shared)} times in one backward"
    grads = [p.grad for p in [*layers.parameters(), scale]]
    assert all(torch.equal(a, 2 * b) for a, b in zip(grads, ref, strict=True))

"""The device path (span copies, side streams, pinned arena) end to end, on the CPU twin.

``SpanCopyDevice("cpu")`` runs the CUDA path's code with worker-thread streams
(NOTE [copy streams]); a delay before every copy makes a buffer that is read,
freed or reused too early show up as a wrong gradient. tests/test_cuda.py runs
the same checks on a GPU.
"""

from __future__ import annotations

import copy
import errno
import fcntl
import gc
import os
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import twin_with_hooks

from prefetch_offload import OffloadConfig, OffloadEngine, OffloadError, OffloadFallbackWarning
from prefetch_offload import device as device_module
from prefetch_offload.device import (
    HostDevice,
    RoutingDevice,
    SpanCopyDevice,
    direct_io_roundtrip,
)
from prefetch_offload.slab import direct_io_supported
from prefetch_offload.streams import ThreadStreams, _ThreadFence
from prefetch_offload.testing import TinyTransformer, make_batch


def _model() -> tuple[TinyTransformer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyTransformer(vocab=64, width=32, depth=2, heads=2)
    tokens, targets = make_batch(2, 16, vocab=64)
    return model, tokens, targets


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("target", ["cpu", "disk"])
@pytest.mark.parametrize("depth", [0, 1, 4])
@pytest.mark.parametrize("delay", [0.0, 0.002])
def test_twin_grads_bit_identical(save_dir: Path, target: str, depth: int, delay: float) -> None:
    model, tokens, targets = _model()
    ref = copy.deepcopy(model)
    ref(tokens, targets).backward()
    with twin_with_hooks(target, save_dir, delay=delay, prefetch_depth=depth) as (engine, _):
        loss = model(tokens, targets)
        if not depth:  # every copy settled: none is served from device memory
            engine.flush()
        loss.backward()
    for a, b in zip(_grads(model), _grads(ref), strict=True):
        assert torch.equal(a, b)
    stats = engine.stats()
    # Copied off the device; for "disk" a write may have been dropped by the write tail
    # (the tiny model's step fits in it), its host copy served back instead.
    assert stats.tensors_offloaded + stats.writes_skipped > 0
    if depth:
        assert stats.prefetch_hits > 0  # copies to the device were issued ahead
    else:  # copies back on demand (hits: views sharing a restored span)
        assert stats.prefetch_misses > stats.prefetch_hits


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_twin_race_freed_and_reused_memory(save_dir: Path, target: str) -> None:
    """The CPU analogue of queued GPU work: every copy runs late, while forward frees
    each saved tensor and the allocator hands its memory to the next one."""
    x = torch.randn(1 << 14, requires_grad=True)

    def step() -> torch.Tensor:
        loss = torch.zeros(())
        for i in range(6):
            y = (x * (i + 2)).sin()  # saves x * (i + 2), freed at the next iteration
            loss = loss + y.sum()
            scratch = torch.full_like(x, float("nan"))  # likely reuses freed memory
            del y, scratch
        return loss

    step().backward()
    expected, x.grad = x.grad, None
    with twin_with_hooks(target, save_dir, delay=0.01) as (_, layer):
        step().backward()
    assert torch.equal(x.grad, expected)
    assert layer.pool.pin_calls > 0


def test_twin_copy_made_at_a_later_pack_waits_for_the_mark_of_its_own(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [copy streams]: a record a budget keeps on its device is copied when a later
    pack puts the tier over budget; that copy must wait for the work before its own pack
    (a CUDA event on the stream current then), not for whatever stream is current now."""
    marks: list[_ThreadFence] = []

    def mark(self: ThreadStreams) -> _ThreadFence:
        marks.append(_ThreadFence())  # set by hand below: "the producing work is done"
        return marks[-1]

    monkeypatch.setattr(ThreadStreams, "mark", mark)
    x = torch.randn(4096, requires_grad=True)
    ((x * 2).sin() * 3).sin().sum().backward()
    expected, x.grad = x.grad, None
    with twin_with_hooks("cpu", save_dir, device_budget=4096 * 4) as (engine, _):
        a = (x * 2).sin()  # sin saves x * 2: one record of 16 KiB, within the budget
        loss = (a * 3).sin().sum()  # saves a * 3: over budget, the first record is copied
        assert len(marks) == 2 and engine.stats().bytes_demoted_to_host == 4096 * 4
        fence = next(iter(engine._copying.values()))[0][0]
        time.sleep(0.05)
        assert not fence.done()  # the copy waits for the first record's own mark
        marks[0].set()
        fence.wait()
        marks[1].set()
        loss.backward()
    assert torch.equal(x.grad, expected)


def test_twin_device_memory_changed_after_its_copy_settled_is_not_used(save_dir: Path) -> None:
    """NOTE [version check]: once a record's copy is settled, it no longer watches the
    device memory's version; a detached alias of the dead owner then changes that
    memory. Backward must use the host copy (or refuse, as autograd would)."""
    x = torch.randn(1 << 14, requires_grad=True)
    (x * 2).exp().sum().backward()
    expected, x.grad = x.grad, None
    with twin_with_hooks("cpu", save_dir) as (engine, _):
        y = (x * 2).exp()  # exp saves its output
        alias = y.detach()
        loss = y.sum()
        del y
        engine.flush()  # the copy has run and is settled
        alias.mul_(2)
        try:
            loss.backward()
        except RuntimeError as exc:
            assert "modified by an inplace operation" in str(exc)
        else:
            assert torch.equal(x.grad, expected), "backward used bytes changed after the copy"


def test_twin_inplace_change_before_the_copy_ran_is_caught(save_dir: Path) -> None:
    """NOTE [version check]: the owner is gone by backward; the copy might have seen
    either value, so the engine must refuse, as autograd does."""
    x = torch.randn(4096, requires_grad=True)
    with twin_with_hooks("cpu", save_dir, delay=0.05):
        y = x * 2
        z = y.sin()  # saves y
        y.mul_(3)  # in place, while the copy of y is still queued
        del y
        with pytest.raises(OffloadError, match="modified by an inplace operation"):
            z.sum().backward()


def test_twin_activation_freed_once_copied(save_dir: Path) -> None:
    x = torch.randn(1 << 16, requires_grad=True)
    with twin_with_hooks("cpu", save_dir, delay=0.02) as (_, layer):
        y = x * 2
        ref = weakref.ref(y.untyped_storage())
        z = y.sin()
        del y
        gc.collect()
        assert ref() is not None  # the copy has not run yet: kept alive for it
        for s in layer._streams.values():
            s.synchronize()
        (x * 1).sin()  # any later pack settles finished copies
        gc.collect()
        assert ref() is None  # the host copy holds it now; the device memory is free
        z.sum().backward()
    assert torch.equal(x.grad, 2 * (2 * x.detach()).cos())


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_twin_arena_stops_pinning_and_growing_after_warmup(save_dir: Path, target: str) -> None:
    """NOTE [pinned arena]: sequence lengths alternate step by step; once each was seen,
    no arena is pinned and the pinned bytes do not grow (pinning costs ms and driver locks)."""
    torch.manual_seed(0)
    model = TinyTransformer(vocab=64, width=32, depth=2, heads=2)
    batches = [make_batch(2, seq, vocab=64) for seq in (16, 40)]
    small_steps = {"arena_step_bytes": 256 << 10}  # several arenas in the first steps
    # Disk: the leases live at once depend on IO timing (staging blocks wait for their
    # writes); a small write cap bounds them, so that the warm-up reaches the bound.
    kw = {"max_pending_write_bytes": 128 << 10} if target == "disk" else {}
    warmup = 2 if target == "cpu" else 4
    with twin_with_hooks(target, save_dir, delay=0.001, layer_kw=small_steps, **kw) as (_, layer):
        seen = []
        for i in range(warmup + 8):
            tokens, targets = batches[i % 2]
            model(tokens, targets).backward()
            gc.collect()
            seen.append((layer.pool.pin_calls, layer.pool.pinned_bytes))
    assert seen[0][0] > 1  # the first step grew the arenas: growth was exercised
    assert all(s == seen[warmup - 1] for s in seen[warmup:]), seen
    assert layer.pageable_fallbacks() == 0


def _fallback_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, OffloadFallbackWarning)]


def test_twin_failed_pinning_warns_once_and_counts_pageable_copies(save_dir: Path) -> None:
    """Pinning fails: host copies fall back to pageable memory (copies become synchronous
    on a GPU), with one warning that says so and what to change, and a count."""
    calls: list[int] = []

    def refuse(size: int) -> Any:
        calls.append(size)
        raise RuntimeError("CUDA error: out of memory (simulated)")

    model, tokens, targets = _model()
    ref = copy.deepcopy(model)
    ref(tokens, targets).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with twin_with_hooks("cpu", save_dir, layer_kw={"pin": refuse}) as (engine, layer):
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                model(tokens, targets).backward()
    (message,) = _fallback_warnings(caught)
    assert "could not pin" in message and "host_budget" in message and "synchronous" in message
    assert len(calls) == 1  # not retried at every lease: each try costs milliseconds
    assert layer.pageable_fallbacks() == engine.stats().tensors_offloaded > 0  # every lease
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), _grads(ref), strict=True))


def test_twin_pinned_limit_bounds_the_arenas(save_dir: Path) -> None:
    """Past the pinned limit (host budget), leases are pageable: counted, warned once."""
    model, tokens, targets = _model()
    ref = copy.deepcopy(model)
    ref(tokens, targets).backward()
    layer_kw = {"host_budget": 512 << 10, "arena_step_bytes": 128 << 10}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with twin_with_hooks("cpu", save_dir, layer_kw=layer_kw) as (_, layer):
            model(tokens, targets).backward()
            assert 0 < layer.pool.peak_pinned_bytes <= 512 << 10
    (message,) = _fallback_warnings(caught)
    assert "limit of 524288 bytes" in message
    assert layer.pageable_fallbacks() > 0
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), _grads(ref), strict=True))


def test_twin_direct_io_from_pinned_memory(save_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [direct IO from pinned memory]: a round trip through an arena lease decides,
    once per folder; a kernel that refuses O_DIRECT from that memory gets one warning."""
    if not direct_io_supported(str(save_dir)):
        pytest.skip("this folder takes no O_DIRECT")
    layer = SpanCopyDevice("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert layer.direct_io_ok(str(save_dir))
    assert not _fallback_warnings(caught)
    layer.close()

    real = os.pwrite

    def refuse_probe(fd: int, data: Any, pos: int) -> int:
        if len(data) >= 1 << 20:  # the probe's requests, not direct_io_supported's page
            raise OSError(errno.EFAULT, "Bad address")
        return real(fd, data, pos)

    monkeypatch.setattr(os, "pwrite", refuse_probe)
    layer = SpanCopyDevice("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not layer.direct_io_ok(str(save_dir))
        assert not layer.direct_io_ok(str(save_dir))  # decided once
        routed = RoutingDevice([layer])
        assert not routed.direct_io_ok(str(save_dir))
    (message,) = _fallback_warnings(caught)
    assert "not from pinned host memory" in message and "Bad address" in message
    assert layer.pool.leased_bytes == 0  # the probe's lease went back
    layer.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="without CUDA only")
def test_cuda_layer_without_cuda_probes_nothing(save_dir: Path) -> None:
    """CPU training with target disk: the CUDA layer must not try to pin (and warn)."""
    layer = SpanCopyDevice("cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert layer.direct_io_ok(str(save_dir)) == direct_io_supported(str(save_dir))
    assert not caught and layer.pool.pin_calls == 0 and layer.pageable_fallbacks() == 0
    layer.close()


def test_cuda_layer_waits_for_a_context_before_it_pins(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [direct IO from pinned memory]: with no CUDA context anywhere, the probe is not
    run (pinning would make a context on the current device, GPU 0 in every rank)."""
    if not direct_io_supported(str(save_dir)):
        pytest.skip("this folder takes no O_DIRECT")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device_module, "cuda_context_exists", lambda: False)
    layer = SpanCopyDevice("cuda")
    assert layer.direct_io_ok(str(save_dir)) is None
    assert layer.pool.pin_calls == 0 and layer.pool.leased_bytes == 0
    assert RoutingDevice([layer, HostDevice()]).direct_io_ok(str(save_dir)) is None
    assert layer.direct_io_ok(str(save_dir)) is None  # not decided: asked again later
    layer.close()


class _TwinRefusingLater(SpanCopyDevice):
    """The CPU twin, which cannot tell while the engine is built and then refuses."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.asked: list[bool] = []

    def direct_io_ok(self, directory: str, *, now: bool = False) -> bool | None:
        self.asked.append(now)
        return None if not now else False


@pytest.mark.parametrize("cpu_bytes_first", [False, True])
def test_engine_probes_at_the_first_tensor_that_needs_host_buffers(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch, cpu_bytes_first: bool
) -> None:
    """NOTE [direct IO from pinned memory]: the probe the constructor could not run runs
    at the first pack of a device tensor, once; a refusal moves the store, and any slab
    CPU tensors' bytes opened first, to the page cache; the gradients stay exact."""
    if not direct_io_supported(str(save_dir)):
        pytest.skip("this folder takes no O_DIRECT")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    layer = _TwinRefusingLater()
    config = OffloadConfig(target="disk", save_dir=str(save_dir), min_offload_bytes=0)
    engine = OffloadEngine(config, device=RoutingDevice([layer]))
    try:
        assert engine.io_method == "direct" and layer.asked == [False]
        store = engine._store
        assert store is not None
        if cpu_bytes_first:  # a slab opened with O_DIRECT before the first device tensor
            extent = store.allocate(4096)
            assert extent is not None
            fd = store._slabs[extent.slab].fd
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        x = torch.randn(1 << 14, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
            loss = (x * 2).sin().sum()
            engine.flush()
        loss.backward()
        assert layer.asked == [False, True]  # asked again at the first pack, and only then
        assert engine.io_method == "buffered"
        if cpu_bytes_first:
            assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        assert engine.stats().bytes_read > 0
        assert torch.equal(x.grad, 2 * (2 * x.detach()).cos())
    finally:
        engine.close()


def test_direct_io_roundtrip_checks_the_bytes(save_dir: Path) -> None:
    if not direct_io_supported(str(save_dir)):
        pytest.skip("this folder takes no O_DIRECT")
    layer = SpanCopyDevice("cpu")
    host, region = layer.pool.lease(3 << 20)
    try:
        wrote, read = direct_io_roundtrip(str(save_dir), region, request=1 << 20)
        assert wrote > 0 and read > 0
    finally:
        region.release()
        del host
        layer.close()
    assert not list(save_dir.iterdir())  # the scratch file was never visible


def test_twin_write_waits_for_its_copy(save_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Target disk: the IO thread writes the host copy only once the D2H copy is done."""
    model, tokens, targets = _model()
    ref = copy.deepcopy(model)
    ref(tokens, targets).backward()
    with twin_with_hooks("disk", save_dir, delay=0.005) as (engine, _):
        loss = model(tokens, targets)
        engine.flush()  # everything on disk: backward reads it all back
        loss.backward()
    for a, b in zip(_grads(model), _grads(ref), strict=True):
        assert torch.equal(a, b)
    assert engine.stats().bytes_read > 0


def test_twin_graph_used_after_exit(save_dir: Path) -> None:
    x = torch.randn(4096, requires_grad=True)
    with twin_with_hooks("cpu", save_dir, delay=0.01):
        loss = (x * 3).sin().sum()
    loss.backward()  # streams closed: copies run inline
    assert torch.equal(x.grad, 3 * (3 * x.detach()).cos())


class _SavesAndChecksAlignment(torch.autograd.Function):
    """Saves its input; backward checks that the restored tensor kept its address mod 512."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.align = x.data_ptr() % 512
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        assert x.data_ptr() % 512 == ctx.align, (x.data_ptr() % 512, ctx.align)
        return g * 2


@pytest.mark.parametrize("target", ["cpu", "disk"])
@pytest.mark.parametrize("flush", [False, True])
def test_twin_restored_views_keep_their_alignment(save_dir: Path, target: str, flush: bool) -> None:
    """Kernels choose code paths by pointer alignment; a restored view must not change it."""
    x = torch.randn(1 << 16, requires_grad=True)
    with twin_with_hooks(target, save_dir, delay=0.001) as (engine, _):
        ys = [_SavesAndChecksAlignment.apply((x * 1)[i : i + 50_000]) for i in (3, 17, 100)]
        if flush:
            engine.flush()
        sum(y.sum() for y in ys).backward()
    stats = engine.stats()
    assert stats.tensors_offloaded + stats.writes_skipped == 3  # all three went through copies


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_twin_engine_dropped_without_close_stops_its_threads(save_dir: Path, target: str) -> None:
    """An engine built directly and dropped without close() leaves no thread behind:
    neither the IO pool's nor the twin streams' workers."""
    kw: dict[str, Any] = {"min_offload_bytes": 0}
    if target == "disk":
        kw.update(save_dir=str(save_dir), chunk_bytes=16384)
    layer = SpanCopyDevice("cpu", twin_delay=0.001)
    engine = OffloadEngine(OffloadConfig(target=target, **kw), device=RoutingDevice([layer]))
    x = torch.randn(4096, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
        loss = (x * 3).sin().sum()
    loss.backward()
    names = {t.name for t in threading.enumerate() if t.name.startswith("prefetch_offload")}
    assert "prefetch_offload-twin-d2h" in names  # the twin ran: there is something to stop
    engine.flush()
    del engine, layer, loss
    gc.collect()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        left = [t.name for t in threading.enumerate() if t.name.startswith("prefetch_offload")]
        if not left:
            break
        time.sleep(0.01)
    assert not left, left


def test_twin_full_disk_issues_no_device_copy(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slab space is reserved before the device-to-host copy: with the disk full, packs
    keep their tensors without copying them (and gradients stay exact)."""
    from prefetch_offload.streams import ThreadStreams

    copies: list[int] = []
    real = ThreadStreams._d2h

    def counting(self: ThreadStreams, dst: torch.Tensor, src: torch.Tensor) -> Any:
        copies.append(src.numel())
        return real(self, dst, src)

    monkeypatch.setattr(ThreadStreams, "_d2h", counting)
    model, tokens, targets = _model()
    ref = copy.deepcopy(model)
    ref(tokens, targets).backward()
    with twin_with_hooks("disk", save_dir) as (engine, _):
        assert engine._store is not None
        monkeypatch.setattr(engine._store, "allocate", lambda n: None)
        with pytest.warns(OffloadFallbackWarning):
            model(tokens, targets).backward()
        stats = engine.stats()
    assert copies == [] and stats.fallbacks > 0 and stats.tensors_offloaded == 0
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), _grads(ref), strict=True))


def test_twin_host_block_off_the_page_start_is_reserved_again(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host block that does not start a page (its alignment was guessed as 0 before
    the copy) gets its slab space reserved again for the real alignment: exact."""
    real = SpanCopyDevice.to_host

    def shifted(
        self: SpanCopyDevice, storage: Any, base: int, nbytes: int, after: Any = None
    ) -> Any:
        host, hbase, fence = real(self, storage, base, nbytes + 512, after)  # room for the shift
        assert hbase == 0 and fence is not None
        fence.wait()  # the twin's copy landed at 0: move it to 512
        raw = torch.empty(0, dtype=torch.uint8).set_(host)
        raw[512 : 512 + nbytes] = raw[:nbytes].clone()
        return host, 512, None

    monkeypatch.setattr(SpanCopyDevice, "to_host", shifted)
    model, tokens, targets = _model()
    ref = copy.deepcopy(model)
    ref(tokens, targets).backward()
    with twin_with_hooks("disk", save_dir) as (engine, _):
        calls: list[int] = []
        real_allocate = engine._allocate

        def allocate(store: Any, n: int) -> Any:
            calls.append(n)
            return real_allocate(store, n)

        monkeypatch.setattr(engine, "_allocate", allocate)
        loss = model(tokens, targets)
        engine.flush()
        loss.backward()
        stats = engine.stats()
    assert stats.tensors_offloaded > 0 and stats.bytes_read > 0
    assert len(calls) >= 2 * stats.tensors_offloaded  # the guess, then the real alignment
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), _grads(ref), strict=True))


class _TwoFakeDevices(SpanCopyDevice):
    """The twin with two fake devices: a storage whose address is in ``second`` is
    copied off on cpu:1's side stream, every other one on cpu:0's."""

    def __init__(self, *, second_delay: float) -> None:
        super().__init__("cpu")
        self.second: set[int] = set()
        self.lanes = [
            ThreadStreams(device=torch.device("cpu", 0)),
            ThreadStreams(delay=second_delay, device=torch.device("cpu", 1)),
        ]
        for lane in self.lanes:  # poll() and close() reach them
            self._streams[lane.device] = lane

    def to_host(
        self, storage: torch.UntypedStorage, base: int, nbytes: int, after: Any = None
    ) -> Any:
        lane = self.lanes[storage.data_ptr() in self.second]
        host, region = self.pool.lease(nbytes)
        region.release()
        src = torch.empty((0,), dtype=torch.uint8).set_(storage, base, (nbytes,), (1,))
        return host.untyped_storage(), 0, lane.d2h(host[:nbytes], src, after)


def test_twin_copies_settle_per_device() -> None:
    """NOTE [version check]: one device's copies end in order, another's need not. A
    copy still running on cpu:1 must not keep cpu:0's finished records holding their
    device memory (they drop it at the next pack)."""
    layer = _TwoFakeDevices(second_delay=0.5)
    engine = OffloadEngine(
        OffloadConfig(target="cpu", min_offload_bytes=0), device=RoutingDevice([layer])
    )
    try:
        slow = torch.randn(4096)
        layer.second.add(slow.untyped_storage().data_ptr())
        fast = [torch.randn(4096) for _ in range(3)]
        handles = [engine.pack(t) for t in (slow, *fast)]  # cpu:1's copy is the oldest
        for h in handles[1:]:
            h.record.source[2].wait()  # cpu:0's copies have ended
        engine.pack(torch.randn(16))  # the next pack settles what has ended
        assert [h.record.saved is None for h in handles] == [False, True, True, True]
        engine.flush()
        assert handles[0].record.saved is None
    finally:
        engine.close()


class _MarkedFence(_ThreadFence):
    """A save-time mark of the twin (its work is done already) that notes the waits."""

    def __init__(self, waited: list[_MarkedFence]) -> None:
        super().__init__()
        self.waited = waited
        self.set()

    def wait(self) -> None:
        self.waited.append(self)
        super().wait()


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_a_shared_record_s_copy_waits_for_the_later_save(
    save_dir: Path, target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [dedup]: a device record whose copy is not issued yet when a later save
    shares it is copied after the work queued before that save too (on CUDA, bytes no
    saved view held may be written between the two saves), not only before the first.
    The twin's copies run after the hook thread's work whatever they wait for, so the
    gradients only guard the twin; what the copy waited for is the test."""
    n, first, gap, second = 10000, slice(0, 6000), slice(6000, None), slice(6000, None)

    def step(engine: OffloadEngine | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        x = torch.randn(n)
        w1 = torch.ones(6000, requires_grad=True)
        w2 = torch.ones(4000, requires_grad=True)
        w3 = torch.ones(20000, requires_grad=True)
        a = x[first] * w1  # saves x[:6000]: its record spans all of x (NOTE [whole storage])
        x.data[gap].mul_(2)  # bytes no saved view holds, no version bump
        b = x[second] * w2  # inside a's record, still on the device: shared
        c = torch.randn(20000) * w3  # over the budget: a's record is copied now
        (a.sum() + b.sum() + c.sum()).backward()
        return [w1.grad, w2.grad, w3.grad]

    ref = step(None)
    waited: list[_MarkedFence] = []
    marks: list[_MarkedFence] = []

    def mark() -> _MarkedFence:
        marks.append(_MarkedFence(waited))
        return marks[-1]

    with twin_with_hooks(target, save_dir, device_budget=40000 + 4096) as (engine, layer):
        monkeypatch.setattr(layer.streams(torch.device("cpu")), "mark", mark)
        got = step(engine)
        engine.flush()
        assert engine.stats().dedup_hits == 1
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(g, r)
    assert len(marks) == 3  # a's save, b's share, c's save
    assert marks[0] in waited and marks[1] in waited, "the copy did not wait for b's save"


def test_a_save_while_the_copy_is_issued_does_not_share_an_unseen_span(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [dedup]: a save on another thread while a demotion issues the record's copy
    cannot add to what that copy waits for: a span no dense saved view covers gets a
    record of its own then (a dense view inside one may still share). The other
    thread's saves are played by packs from inside the copy's issue."""
    with twin_with_hooks("cpu", save_dir, device_budget=40000 + 4096) as (engine, layer):
        x = torch.randn(10000)
        first = engine.pack(x[:6000])  # a record spanning all of x, kept on the device
        during: list[Any] = []
        real = layer.to_host

        def to_host(*args: Any, **kw: Any) -> Any:
            if not during:  # the other thread's saves, while the copy is being issued
                during.append(engine.pack(x[6000:]))
                during.append(engine.pack(x[1000:2000]))
            return real(*args, **kw)

        monkeypatch.setattr(layer, "to_host", to_host)
        engine.pack(torch.randn(20000))  # over the budget: x's record is demoted
        assert during
        gap, inside = during
        assert gap.record is not first.record  # x[6000:] lies in no saved dense view
        assert inside.record is first.record  # x[1000:2000] lies in x[:6000]
        assert torch.equal(engine.unpack(gap), x[6000:])
        assert torch.equal(engine.unpack(inside), x[1000:2000])


def test_cuda_context_exists_says_yes_when_it_cannot_tell(monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(index: int) -> bool:
        raise RuntimeError("CUDA driver error: initialization error")

    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", fails, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device_module.cuda_context_exists()
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda i: i == 1, raising=False)
    assert device_module.cuda_context_exists()
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda i: False, raising=False)
    assert not device_module.cuda_context_exists()

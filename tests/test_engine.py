"""The engine end to end: exact gradients in every mode, lifetime, dedup, stats, errors."""

from __future__ import annotations

import contextlib
import errno
import gc
import itertools
import os
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import (
    assert_same_grads,
    engine_with_hooks,
    grads_of,
    reference_grads,
    run_in_threads,
    slow_store,
    tiny_model,
    twin_with_hooks,
)
from torch.utils.checkpoint import checkpoint

from prefetch_offload import (
    OffloadConfig,
    OffloadEngine,
    OffloadError,
    OffloadFallbackWarning,
    OffloadIOError,
    offload_context,
)
from prefetch_offload import writer as writer_module
from prefetch_offload.records import version_probe
from prefetch_offload.testing import TinyTransformer, make_batch


def _fd_targets(save_dir: Path) -> list[str]:
    """Open file descriptors of this process that point into ``save_dir``."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(save_dir)):
                out.append(target)
    return out


# -- exact gradients --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("depth", [0, 1, 4])
@pytest.mark.parametrize("flush", [False, True], ids=["overlapped", "read-from-disk"])
def test_transformer_grads_bit_identical(
    save_dir: Path, dtype: torch.dtype, depth: int, flush: bool
) -> None:
    model = tiny_model(dtype)
    tokens, targets = make_batch(4, 32, vocab=64)

    def step(m: torch.nn.Module) -> None:
        m(tokens, targets).backward()

    ref = reference_grads(model, step)
    with offload_context("disk", save_dir, prefetch_depth=depth, min_offload_bytes=0) as engine:
        loss = model(tokens, targets)
        if flush:
            engine.flush()  # every saved tensor is on disk; backward must read it all back
        loss.backward()
    assert_same_grads(grads_of(model), ref)
    stats = engine.stats()
    assert stats.tensors_offloaded + stats.writes_skipped > 10  # NOTE [write tail]
    if flush:
        assert stats.writes_skipped == 0 and stats.tensors_offloaded > 10
        assert stats.bytes_read >= stats.bytes_offloaded
        assert stats.prefetch_hits + stats.prefetch_misses >= stats.tensors_offloaded


@pytest.mark.parametrize("io_method", ["direct", "buffered", "mmap"])
@pytest.mark.parametrize("inline", [True, False], ids=["inline-pool", "thread-pool"])
def test_io_methods_and_pools_agree(save_dir: Path, io_method: str, inline: bool) -> None:
    from prefetch_offload.slab import direct_io_supported

    if io_method == "direct" and not direct_io_supported(str(save_dir)):
        pytest.skip("filesystem without O_DIRECT")
    model = tiny_model()
    tokens, targets = make_batch(4, 32, vocab=64)
    ref = reference_grads(model, lambda m: m(tokens, targets).backward())
    with engine_with_hooks(
        save_dir, inline=inline, io_method=io_method, chunk_bytes=8192
    ) as engine:
        loss = model(tokens, targets)
        engine.flush()
        loss.backward()
    assert engine.io_method == io_method
    assert_same_grads(grads_of(model), ref)
    assert engine.stats().bytes_read > 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint(save_dir: Path, reentrant: bool) -> None:
    """Non-reentrant: the frame keeps block inputs. Reentrant: block inputs go through the
    hooks, and the recompute packs and unpacks again inside backward."""
    model = tiny_model()
    tokens, targets = make_batch(4, 32, vocab=64)

    def step(m: TinyTransformer) -> None:
        x = m.embed(tokens)
        for block in m.blocks:
            x = checkpoint(block, x, use_reentrant=reentrant)
        logits = m.head(m.norm(x))
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()

    ref = reference_grads(model, step)
    with offload_context("disk", save_dir, min_offload_bytes=0) as engine:
        step(model)
    assert_same_grads(grads_of(model), ref)
    stats = engine.stats()
    assert stats.tensors_offloaded + stats.writes_skipped > 0


def test_retain_graph_backward_twice(save_dir: Path) -> None:
    model = tiny_model()
    tokens, targets = make_batch(4, 32, vocab=64)

    def step(m: torch.nn.Module) -> None:
        loss = m(tokens, targets)
        loss.backward(retain_graph=True)
        loss.backward()

    ref = reference_grads(model, step)
    with engine_with_hooks(save_dir) as engine:
        loss = model(tokens, targets)
        engine.flush()
        loss.backward(retain_graph=True)
        gc.collect()
        loss.backward()
    assert_same_grads(grads_of(model), ref)
    stats = engine.stats()
    assert stats.bytes_read >= 2 * stats.bytes_offloaded


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_two_micro_batches_either_order(save_dir: Path, order: tuple[int, int]) -> None:
    model = tiny_model()
    batches = [make_batch(4, 32, vocab=64, seed=s) for s in (1, 2)]

    def step(m: torch.nn.Module) -> None:
        losses = [m(x, y) for x, y in batches]
        for i in order:
            losses[i].backward()

    ref = reference_grads(model, step)
    with offload_context("disk", save_dir, min_offload_bytes=0):
        step(model)
    assert_same_grads(grads_of(model), ref)


def test_backward_after_context_exit(save_dir: Path) -> None:
    model = tiny_model()
    tokens, targets = make_batch(4, 32, vocab=64)
    ref = reference_grads(model, lambda m: m(tokens, targets).backward())
    with offload_context("disk", save_dir, min_offload_bytes=0) as engine:
        loss = model(tokens, targets)
    assert engine.closed
    assert not [t for t in threading.enumerate() if t.name.startswith("prefetch_offload")]
    assert os.listdir(save_dir) == []
    loss.backward()
    assert_same_grads(grads_of(model), ref)
    assert engine.stats().bytes_read > 0


def test_two_threads_each_with_own_context(save_dir: Path) -> None:
    models = [tiny_model(seed=s) for s in (0, 1)]
    batches = [make_batch(4, 32, vocab=64, seed=s) for s in (3, 4)]
    refs = [
        reference_grads(m, lambda m, b=b: m(*b).backward())
        for m, b in zip(models, batches, strict=True)
    ]
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def train(i: int) -> None:
        try:
            with offload_context("disk", save_dir, min_offload_bytes=0) as engine:
                barrier.wait()
                for _ in range(3):
                    loss = models[i](*batches[i])
                    barrier.wait()  # both threads are mid-step at the same time
                    loss.backward()
            stats = engine.stats()
            assert stats.tensors_offloaded + stats.writes_skipped > 0
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    run_in_threads(train)
    assert not errors, errors
    for m, ref in zip(models, refs, strict=True):
        assert_same_grads(grads_of(m), [3 * g for g in ref])


# -- lifetime and space -------------------------------------------------------------------


def test_saved_activation_released_once_on_disk(save_dir: Path) -> None:
    a = torch.randn(1 << 16, requires_grad=True)
    with engine_with_hooks(save_dir) as engine:
        b = a * 2
        c = b.sin()  # saves b
        ref = weakref.ref(b)
        del b
        engine.flush()
        gc.collect()
        assert ref() is None, "the saved activation is still held after its write finished"
        c.sum().backward()
    assert torch.equal(a.grad, 2 * (a.detach() * 2).cos())


def test_space_is_reused_across_steps(save_dir: Path) -> None:
    model = tiny_model()
    tokens, targets = make_batch(4, 32, vocab=64)
    with offload_context("disk", save_dir, min_offload_bytes=0, slab_bytes=1 << 20) as engine:
        model(tokens, targets).backward()
        engine.flush()  # a write may still be running for a tensor backward took from memory
        gc.collect()
        first = engine.stats()
        assert first.disk_bytes_in_use == 0
        for _ in range(15):
            model(tokens, targets).backward()
            engine.flush()
            gc.collect()
            stats = engine.stats()
            assert stats.disk_bytes_in_use == 0
            assert stats.disk_bytes_reserved == first.disk_bytes_reserved
    assert stats.peak_disk_bytes_reserved == first.peak_disk_bytes_reserved
    # NOTE [write tail]: a step's last tensors may skip the disk; every one is counted once.
    per_step = first.tensors_offloaded + first.writes_skipped
    assert stats.tensors_offloaded + stats.writes_skipped == 16 * per_step


def test_nothing_left_behind_after_exit_or_exception(save_dir: Path) -> None:
    model = tiny_model()
    tokens, targets = make_batch(4, 32, vocab=64)
    with offload_context("disk", save_dir, min_offload_bytes=0) as engine:
        loss = model(tokens, targets)
        assert os.listdir(save_dir) == []  # slab files are never visible
        assert _fd_targets(save_dir)
        loss.backward()
    assert os.listdir(save_dir) == []
    del loss, engine
    gc.collect()
    assert _fd_targets(save_dir) == []  # every slab file closed: disk space is back

    with pytest.raises(ZeroDivisionError), offload_context("disk", save_dir, min_offload_bytes=0):
        loss = model(tokens, targets)
        raise ZeroDivisionError
    del loss
    gc.collect()
    assert os.listdir(save_dir) == []
    assert _fd_targets(save_dir) == []


def test_unpacked_tensors_are_never_recycled(save_dir: Path) -> None:
    """Memory handed to autograd must not be reused while a tensor still uses it."""
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    class Stash(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x)
            return x.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            (saved,) = ctx.saved_tensors
            kept.append((saved, saved.clone()))  # hold the unpacked tensor past backward
            return g

    w = torch.ones(1, requires_grad=True)
    with engine_with_hooks(save_dir, prefetch_depth=4) as engine:
        for step in range(6):
            outs = [Stash.apply(torch.full((4096,), float(step * 10 + i)) * w) for i in range(8)]
            engine.flush()
            sum(o.sum() for o in outs).backward()
    assert len(kept) == 48
    for held, copy_at_backward in kept:
        assert torch.equal(held, copy_at_backward)


@pytest.mark.parametrize("min_bytes", [1 << 30, 0], ids=["kept", "offloaded"])
def test_graph_dropped_without_backward_is_freed(save_dir: Path, min_bytes: int) -> None:
    """NOTE [no cycles]: relu saves its own output; dropping the graph must free it."""
    x = torch.randn(1 << 14, requires_grad=True)
    with engine_with_hooks(save_dir, min_offload_bytes=min_bytes) as engine:
        y = (x * 2).relu()
        ref = weakref.ref(y)
        del y
        gc.collect()
        assert ref() is None
        engine.flush()
    gc.collect()
    assert engine.stats().disk_bytes_in_use == 0


def test_in_place_through_a_detached_alias_is_caught(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The saved tensor is gone, a .detach() alias (same counter) modifies the bytes."""
    x = torch.randn(1 << 14, requires_grad=True)
    with engine_with_hooks(save_dir, io_workers=1) as engine:
        slow_store(engine, monkeypatch, "write", 0.05)
        y = (x * 2).exp()  # exp saves its output
        alias = y.detach()
        loss = y.sum()
        del y
        alias.mul_(2)  # before the write has finished
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            engine.flush()
            loss.backward()


def test_in_place_through_a_detached_alias_after_the_write_is_caught(save_dir: Path) -> None:
    """NOTE [version check]: the write has landed and the record let go of the tensor,
    the owner is dead; a change through a .detach() alias still raises, as autograd
    does, whatever the IO's timing."""
    x = torch.randn(1 << 14, requires_grad=True)
    with engine_with_hooks(save_dir) as engine:
        y = (x * 2).exp()  # exp saves its output
        alias = y.detach()
        loss = y.sum()
        del y
        gc.collect()
        engine.flush()  # written: the record no longer holds the tensor
        assert engine.stats().bytes_offloaded > 0
        alias.mul_(3)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_the_version_probe_holds_no_memory_and_shares_the_counter() -> None:
    t = torch.randn(1 << 16)
    storage = weakref.ref(t.untyped_storage())
    alias = t.detach()
    probe = version_probe(t)
    assert probe is not None and probe.numel() == 0
    assert probe.untyped_storage().nbytes() == 0
    del t
    gc.collect()
    assert storage() is not None  # the alias keeps it, not the probe
    other = version_probe(torch.randn(8))  # its data is the same 0-element tensor
    assert other is not None
    before, other_before = probe._version, other._version
    alias.add_(1)
    assert probe._version == before + 1 and other._version == other_before
    del alias
    gc.collect()
    assert storage() is None


def test_dedup_needs_the_same_version_counter(save_dir: Path) -> None:
    """``a`` and ``a.data`` share a storage but not a counter: no sharing of records."""
    w = torch.randn(1 << 14, requires_grad=True)
    a = torch.randn(1 << 14)
    with engine_with_hooks(save_dir, inline=True) as engine:
        w * a  # saves a (version 0)
        b = a.data
        b.mul_(3)  # b's own counter moves; a's stays at 0
        b2 = a.data  # a fresh counter, also at version 0
        (w * b2).sum().backward()
    assert torch.equal(w.grad, b2)
    assert engine.stats().dedup_hits == 0


def test_space_comes_back_for_a_graph_used_after_exit(save_dir: Path) -> None:
    x = torch.randn(1 << 18, requires_grad=True)
    with offload_context("disk", save_dir, slab_bytes=1 << 20) as engine:
        loss = sum((x * (i + 2)).exp().sum() for i in range(8))
    assert engine.stats().disk_bytes_reserved > 0
    loss.backward()
    del loss
    gc.collect()
    x.grad = None
    (x * 2).sum().backward()  # unrelated work; the engine object is still referenced
    stats = engine.stats()
    assert (stats.disk_bytes_in_use, stats.disk_bytes_reserved) == (0, 0)
    assert _fd_targets(save_dir) == []


def test_unpack_during_forward_keeps_memory_within_the_cap(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """autograd.grad inside forward triggers the write-tail skip; forward resuming writes them."""
    x = torch.randn(1 << 16, requires_grad=True)  # 256 KiB tensors
    cap = 1 << 20
    with engine_with_hooks(save_dir, io_workers=1, max_pending_write_bytes=cap) as engine:
        slow_store(engine, monkeypatch, "write", 0.002)
        h = x * 1.0
        for _ in range(30):
            h = (h * 1.0001).sin()
            torch.autograd.grad((x * 1.5).exp().sum(), x)  # an unpack mid-forward
        engine.flush()
        stats = engine.stats()
        # Skipped writes were queued again when forward resumed: of the chain's 30 saved
        # tensors, only the last unpack's skips (at most a cap's worth) are in memory.
        gc.collect()
        live = [r() for r in engine._plan._order]
        in_memory = [r for r in live if r is not None and r.source is not None]
        assert len(in_memory) <= cap // (1 << 18) + 1, len(in_memory)
        assert stats.tensors_offloaded >= 30 - len(in_memory)
        assert stats.peak_pending_write_bytes <= cap + (1 << 18) + 8192
        h.sum().backward()
    ref_x = x.detach().clone().requires_grad_()
    h = ref_x * 1.0
    for _ in range(30):
        h = (h * 1.0001).sin()
    h.sum().backward()
    assert torch.equal(x.grad, ref_x.grad)


def test_write_requests_are_page_aligned_and_near_equal() -> None:
    from prefetch_offload.writer import split_requests as _split

    for pages in (1, 2, 15, 16, 17, 31, 32, 33, 273, 1000):
        for chunk_pages in (1, 2, 16, 2048):
            b = _split(pages * 4096, chunk_pages * 4096)
            sizes = [hi - lo for lo, hi in itertools.pairwise(b)]
            assert b[0] == 0 and b[-1] == pages * 4096
            assert all(s % 4096 == 0 and s > 0 for s in sizes)
            assert max(sizes) - min(sizes) <= 4096
            assert max(sizes) < 2 * chunk_pages * 4096 or len(sizes) == 1


# -- dedup ---------------------------------------------------------------------------------


def test_same_tensor_saved_three_times_is_written_once(save_dir: Path) -> None:
    v = torch.randn(256, requires_grad=True)
    w = torch.randn(256, requires_grad=True)
    x0 = torch.randn(64, 256)

    def step(v: torch.Tensor, w: torch.Tensor) -> None:
        x = x0 * v  # sin, cos and mul each save x
        (x.sin() + x.cos() + x * w).sum().backward()

    v_ref, w_ref = (t.detach().clone().requires_grad_() for t in (v, w))
    step(v_ref, w_ref)
    with engine_with_hooks(save_dir, inline=True) as engine:  # every write lands before backward
        step(v, w)
    assert torch.equal(v.grad, v_ref.grad) and torch.equal(w.grad, w_ref.grad)
    stats = engine.stats()
    assert stats.tensors_offloaded == 2  # x0 (saved by x0 * v) and x
    assert stats.dedup_hits == 2
    assert stats.bytes_offloaded == 2 * 64 * 256 * 4
    # Taken in once each, as written (v and w, small, stay as they are: not packed)
    assert stats.bytes_packed == 2 * 64 * 256 * 4


def test_a_small_view_of_an_offloaded_tensor_shares_its_record(save_dir: Path) -> None:
    """NOTE [dedup]: a view under min_offload_bytes of a storage with a live record
    shares the record; kept, it would hold the whole storage in memory beside it."""
    w = torch.randn(256, 256, requires_grad=True)
    z = torch.randn(64, 1, requires_grad=True)
    x = torch.randn(64, 256)

    def step(w: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x @ w  # 64 KiB
        return h.sin().sum() + (h[:, :1] * z).sum()  # sin saves h, mul saves h[:, :1]

    w_ref, z_ref = (t.detach().clone().requires_grad_() for t in (w, z))
    step(w_ref, z_ref).backward()
    with engine_with_hooks(save_dir, inline=True, min_offload_bytes=4096) as engine:
        loss = step(w, z)
        stats = engine.stats()
        # x (saved by the matmul) and h moved; h[:, :1] (256 bytes) shares h's record;
        # z (256 bytes, saved by the mul) is kept.
        assert (stats.tensors_offloaded, stats.dedup_hits, stats.tensors_kept) == (2, 1, 1)
        loss.backward()
    assert torch.equal(w.grad, w_ref.grad) and torch.equal(z.grad, z_ref.grad)


def test_dedup_not_fooled_by_address_reuse(save_dir: Path) -> None:
    """A new storage at a freed tensor's address, same shape and version, is a new tensor."""
    mem = bytearray(4 * 4096)
    with engine_with_hooks(save_dir) as engine:
        a = torch.frombuffer(mem, dtype=torch.float32)
        a.fill_(1.0)
        addr, version = a.data_ptr(), a._version
        h1 = engine.pack(a)
        engine.flush()
        del a
        gc.collect()
        b = torch.frombuffer(mem, dtype=torch.float32)
        assert b.data_ptr() == addr
        b.fill_(2.0)  # bumps b's own counter; make it match a's so only identity differs
        assert b._version >= version
        h2 = engine.pack(b)
        engine.flush()
        assert engine.stats().dedup_hits == 0
        assert torch.equal(engine.unpack(h1), torch.ones(4096))
        assert torch.equal(engine.unpack(h2), torch.full((4096,), 2.0))


def test_dedup_sees_in_place_updates(save_dir: Path) -> None:
    with engine_with_hooks(save_dir) as engine:
        buf = torch.zeros(4096)
        h1 = engine.pack(buf)
        engine.flush()
        buf.add_(1)
        h2 = engine.pack(buf)
        engine.flush()
        stats = engine.stats()
        assert (stats.dedup_hits, stats.tensors_offloaded) == (0, 2)
        assert torch.equal(engine.unpack(h2), torch.ones(4096))
        with pytest.raises(OffloadError, match="modified by an inplace operation"):
            engine.unpack(h1)  # NOTE [version check]: as autograd would without hooks


@pytest.mark.parametrize("size", [8, 1 << 15], ids=["kept", "offloaded"])
def test_in_place_update_after_save_is_caught_like_autograd(save_dir: Path, size: int) -> None:
    x = torch.randn(size, requires_grad=True)
    with engine_with_hooks(save_dir, min_offload_bytes=1024) as engine:
        y = (x * 2).exp()  # exp saves its output
        loss = y.sum()
        engine.flush()
        y.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_views_of_one_storage_share_one_record(save_dir: Path) -> None:
    """softmax saves its 4-D output, bmm a 3-D view of it: one record, written once."""
    x = torch.randn(2, 3, 16, 16, requires_grad=True)
    v = torch.randn(6, 16, 8, requires_grad=True)

    def step(x: torch.Tensor, v: torch.Tensor) -> None:
        p = (x * 1).softmax(-1)
        (p.view(6, 16, 16) @ v).sum().backward()

    xr, vr = (t.detach().clone().requires_grad_() for t in (x, v))
    step(xr, vr)
    with engine_with_hooks(save_dir, prefetch_depth=2) as engine:
        p = (x * 1).softmax(-1)
        out = (p.view(6, 16, 16) @ v).sum()
        del p
        engine.flush()
        out.backward()
    assert torch.equal(x.grad, xr.grad) and torch.equal(v.grad, vr.grad)
    stats = engine.stats()
    assert stats.dedup_hits >= 1
    p_bytes = 2 * 3 * 16 * 16 * 4
    # x * 1 is not saved (mul by a constant); softmax output once, v is a leaf (kept).
    assert stats.bytes_offloaded == p_bytes
    assert stats.bytes_read == p_bytes  # read once, shared by both views


def test_views_outside_a_record_or_misaligned_get_their_own(save_dir: Path) -> None:
    with engine_with_hooks(save_dir, inline=True) as engine:
        buf = torch.arange(4096, dtype=torch.float32)
        h1 = engine.pack(buf[:1024])  # record A: bytes [0, 4096) of buf
        h2 = engine.pack(buf[512:2048])  # overlaps A but is not inside it: record B
        h3 = engine.pack(buf[100:900:2])  # inside A: shares it
        z = torch.randn(2048, dtype=torch.complex64)
        zr = torch.view_as_real(z)  # float32 view of z (same owner, same counter)
        h4 = engine.pack(zr.flatten()[1:2001])  # record C: bytes [4, 8008) of z
        h5 = engine.pack(z[1:900])  # inside C, 4 bytes in: not complex64-aligned: D
        engine.flush()
        stats = engine.stats()
        assert stats.tensors_offloaded == 4
        assert stats.dedup_hits == 1
        assert torch.equal(engine.unpack(h1), buf[:1024])
        assert torch.equal(engine.unpack(h2), buf[512:2048])
        assert torch.equal(engine.unpack(h3), buf[100:900:2])
        assert torch.equal(engine.unpack(h4), zr.flatten()[1:2001])
        assert torch.equal(engine.unpack(h5), z[1:900])


@pytest.mark.parametrize("depth", [0, 1, 4])
def test_each_record_is_read_once_per_backward_pass(save_dir: Path, depth: int) -> None:
    model = tiny_model()
    tokens, targets = make_batch(4, 32, vocab=64)
    with engine_with_hooks(save_dir, prefetch_depth=depth) as engine:
        loss = model(tokens, targets)
        engine.flush()
        loss.backward(retain_graph=True)
        once = engine.stats()
        assert once.bytes_read == once.bytes_offloaded
        loss.backward()
    assert engine.stats().bytes_read == 2 * once.bytes_offloaded


# -- what is and is not offloaded ---------------------------------------------------------


def test_parameters_small_and_leaf_tensors_stay_in_memory(save_dir: Path) -> None:
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)  # a leaf input: held by the user anyway
    with engine_with_hooks(save_dir, min_offload_bytes=1 << 20) as engine:
        big = (x * 3).relu()  # relu saves its 64 KiB result: under the threshold
        lin(big).sum().backward()
    stats = engine.stats()
    assert stats.tensors_offloaded == 0
    assert stats.tensors_kept >= 2  # the weight view (weight.t()) and small tensors
    with engine_with_hooks(save_dir) as engine:
        lin(x).sum().backward()  # saves x (leaf) and weight.t() (a Parameter's view)
    assert engine.stats().tensors_offloaded == 0


def test_no_bytes_under_no_grad(save_dir: Path) -> None:
    model = tiny_model()
    tokens, targets = make_batch(4, 32, vocab=64)
    with offload_context("disk", save_dir, min_offload_bytes=0) as engine, torch.no_grad():
        model(tokens, targets)
    stats = engine.stats()
    assert stats.tensors_offloaded == stats.bytes_offloaded == stats.tensors_kept == 0


def test_stats_exact_for_a_chain(save_dir: Path) -> None:
    """Inline pool, depth 1: the first unpack reads synchronously, each one prefetches the next."""
    n = 6
    x = torch.randn(4096, requires_grad=True)
    with engine_with_hooks(save_dir, inline=True, prefetch_depth=1) as engine:
        y = x * 1.0
        for _ in range(n):
            y = y.sin()  # each sin saves its input: n distinct 16 KiB tensors
        y.sum().backward()
    stats = engine.stats()
    assert stats.tensors_offloaded == n
    assert stats.bytes_offloaded == n * 4096 * 4
    assert stats.bytes_read == n * 4096 * 4
    assert (stats.prefetch_misses, stats.prefetch_hits) == (1, n - 1)
    assert stats.hit_rate == pytest.approx((n - 1) / n)


def test_depth_zero_reads_synchronously(save_dir: Path) -> None:
    x = torch.randn(4096, requires_grad=True)
    with engine_with_hooks(save_dir, prefetch_depth=0) as engine:
        y = x * 1.0
        for _ in range(5):
            y = y.sin()
        engine.flush()
        y.sum().backward()
    stats = engine.stats()
    assert (stats.prefetch_hits, stats.prefetch_misses) == (0, 5)
    assert stats.stall_seconds > 0


# -- IO under pressure and failure ------------------------------------------------------


def test_slow_writes_are_served_from_memory_and_capped(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model()
    tokens, targets = make_batch(4, 32, vocab=64)
    ref = reference_grads(model, lambda m: m(tokens, targets).backward())
    cap = 128 << 10  # above the largest saved tensor, so the cap is never exceeded
    with engine_with_hooks(save_dir, max_pending_write_bytes=cap) as engine:
        # 20 ms a write: forward outruns the writes even on a loaded machine.
        slow_store(engine, monkeypatch, "write", 0.02)
        model(tokens, targets).backward()
    assert_same_grads(grads_of(model), ref)
    stats = engine.stats()
    assert stats.peak_pending_write_bytes <= cap
    assert stats.pack_wait_seconds > 0


@pytest.mark.parametrize("chunk", [8 << 20, 8192], ids=["one-request", "many-requests"])
def test_queued_writes_of_the_tail_are_skipped_at_backward(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """NOTE [write tail]: writes still queued when backward starts never happen."""
    model = tiny_model()
    tokens, targets = make_batch(4, 32, vocab=64)
    ref = reference_grads(model, lambda m: m(tokens, targets).backward())
    with engine_with_hooks(save_dir, io_workers=1, chunk_bytes=chunk) as engine:
        slow_store(engine, monkeypatch, "write", 0.01)
        model(tokens, targets).backward()
        engine.flush()
        gc.collect()
        stats = engine.stats()
    assert_same_grads(grads_of(model), ref)
    assert stats.writes_skipped > 0  # how many were written first depends on the scheduler
    assert stats.bytes_read <= stats.bytes_offloaded
    assert stats.disk_bytes_in_use == 0


def test_slow_reads_stall_but_stay_exact(save_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model()
    tokens, targets = make_batch(4, 32, vocab=64)
    ref = reference_grads(model, lambda m: m(tokens, targets).backward())
    with engine_with_hooks(save_dir, prefetch_depth=2) as engine:
        slow_store(engine, monkeypatch, "read", 0.003)
        loss = model(tokens, targets)
        engine.flush()
        loss.backward()
    assert_same_grads(grads_of(model), ref)
    assert engine.stats().stall_seconds > 0


def test_engine_keeps_working_after_a_write_error(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model()
    tokens, targets = make_batch(4, 32, vocab=64)
    ref = reference_grads(model, lambda m: m(tokens, targets).backward())
    with engine_with_hooks(save_dir) as engine:
        real_write = engine._store.write
        _fail_writes(engine, monkeypatch, "injected write failure")
        with pytest.raises(OffloadIOError, match="injected write failure") as info:
            model(tokens, targets)  # raised by the first pack after a failed write
            engine.flush()
        assert isinstance(info.value.__cause__, OSError)
        assert engine.stats().fallbacks > 0
        monkeypatch.setattr(engine._store, "write", real_write)
        model.zero_grad()
        model(tokens, targets).backward()
    assert_same_grads(grads_of(model), ref)


def _fail_writes(
    engine: OffloadEngine, monkeypatch: pytest.MonkeyPatch, message: str = "injected"
) -> None:
    def failing_write(*args: Any) -> None:
        raise OSError(errno.EIO, message)

    monkeypatch.setattr(engine._store, "write", failing_write)


def test_write_error_raised_at_next_pack(save_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4096, requires_grad=True)
    with engine_with_hooks(save_dir, inline=True) as engine:
        _fail_writes(engine, monkeypatch)
        y = (x * 2).sin()  # the inline write fails here and is recorded ...
        with pytest.raises(OffloadIOError, match="injected"):
            y.cos()  # ... and raised at the next pack
        y.sum().backward()  # the tensor stayed in memory
    assert torch.equal(x.grad, 2 * (x.detach() * 2).cos())


def test_write_error_raised_at_exit(save_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4096, requires_grad=True)
    with pytest.raises(OffloadIOError, match="injected"):
        with offload_context("disk", save_dir, min_offload_bytes=0) as engine:
            _fail_writes(engine, monkeypatch)
            (x * 2).sin()


def test_a_record_whose_write_failed_does_not_keep_the_failure(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [errors from workers]: the failure goes to the user, not into the record.
    Kept there, its traceback (which holds the write job's frame, and so the records
    of the batch) made a cycle of records, which a record's death (it revives its
    engine's queue of the dead) left for a second collection: their activations and
    slab space stayed until then."""
    x = torch.randn(4096, requires_grad=True)
    with engine_with_hooks(save_dir) as engine:
        _fail_writes(engine, monkeypatch)
        y = (x * 2).sin()
        with pytest.raises(OffloadIOError, match="injected") as info:
            engine.flush()
        failure = info.value.__cause__
        assert isinstance(failure, OSError)
        records = [r for r in gc.get_referrers(failure) if type(r).__name__ == "Record"]
        assert records == []
        y.sum().backward()  # the tensor stayed in memory
    assert torch.equal(x.grad, 2 * (2 * x.detach()).cos())


def test_full_disk_during_a_write_warns_once_and_keeps_tensors(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model()
    tokens, targets = make_batch(4, 32, vocab=64)
    ref = reference_grads(model, lambda m: m(tokens, targets).backward())
    with pytest.warns(OffloadFallbackWarning, match="no space left") as record:
        with engine_with_hooks(save_dir) as engine:

            def no_space(*args: Any) -> None:
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(engine._store, "write", no_space)
            loss = model(tokens, targets)
            engine.flush()  # no error: a full disk is not a failure
            loss.backward()
    assert_same_grads(grads_of(model), ref)
    stats = engine.stats()
    assert stats.fallbacks > 1 and stats.tensors_offloaded == 0
    assert len([w for w in record if w.category is OffloadFallbackWarning]) == 1


def test_read_error_raises_at_the_unpack_that_needed_it(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(4096, requires_grad=True)
    with engine_with_hooks(save_dir, prefetch_depth=0) as engine:
        y = (x * 2).sin()
        engine.flush()
        monkeypatch.setattr(
            engine._store, "read", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "bad read"))
        )
        with pytest.raises(OffloadIOError, match=r"saved tensor #\d+ \(shape \[4096\]") as info:
            y.sum().backward()
    assert isinstance(info.value.__cause__, OSError)


def test_a_backward_after_a_failed_read_reads_again(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read error ends a backward; prefetches it issued failed too. Once the disk is
    well, the next backward of the same graph reads those records again rather than
    raising their old failures, and is exact."""
    x = torch.randn(4096, requires_grad=True)
    with engine_with_hooks(save_dir, prefetch_depth=4) as engine:
        y = x
        for _ in range(6):
            y = torch.tanh(y * 1.01)
        loss = y.sum()
        engine.flush()
        real = engine._store.read

        def failing(*args: Any) -> None:
            raise OSError(errno.EIO, "transient")

        monkeypatch.setattr(engine._store, "read", failing)
        with pytest.raises(OffloadIOError, match="transient"):
            loss.backward(retain_graph=True)
        time.sleep(0.05)  # the prefetches it issued have failed by now
        monkeypatch.setattr(engine._store, "read", real)
        loss.backward()
    ref = x.detach().clone().requires_grad_()
    y = ref
    for _ in range(6):
        y = torch.tanh(y * 1.01)
    y.sum().backward()
    assert torch.equal(x.grad, ref.grad)


def test_a_failed_copy_prefetch_is_copied_again_where_backward_needs_it(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA path's twin: a prefetch copying a host copy back to the device fails
    once; the unpack that needs it copies again from the host copy (its bytes are not
    on disk), exact."""
    torch.manual_seed(0)
    w = torch.randn(256, 256, requires_grad=True)

    def body() -> torch.Tensor:
        return sum((w * (i + 2)).sin().sum() for i in range(6))  # type: ignore[return-value]

    body().backward()
    ref, w.grad = w.grad, None
    kw = {"host_budget": 1 << 30, "prefetch_depth": 4}
    with twin_with_hooks("disk", save_dir, **kw) as (_, layer):
        real, calls = layer.to_device, [0]

        def flaky(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == 2:  # a prefetch's copy
                raise OSError(errno.ENOMEM, "Cannot allocate memory")
            return real(*args, **kwargs)

        monkeypatch.setattr(layer, "to_device", flaky)
        loss = body()
        loss.backward()
        assert calls[0] > 2
    assert ref is not None and torch.equal(w.grad, ref)


def test_verify_keeps_gradients_exact(save_dir: Path) -> None:
    model = tiny_model()
    tokens, targets = make_batch(4, 32, vocab=64)
    ref = reference_grads(model, lambda m: m(tokens, targets).backward())
    with engine_with_hooks(save_dir, verify=True, chunk_bytes=8192) as engine:
        loss = model(tokens, targets)
        engine.flush()
        loss.backward()
    assert_same_grads(grads_of(model), ref)
    assert engine.stats().bytes_read > 0


@pytest.mark.parametrize("where", ["first", "last"])
def test_verify_catches_a_corrupted_byte(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    x = torch.randn(1 << 14, requires_grad=True)
    with engine_with_hooks(save_dir, verify=True, prefetch_depth=0, chunk_bytes=8192) as engine:
        y = (x * 2).sin()
        engine.flush()
        real_read = engine._store.read
        (rec,) = [r() for r in engine._plan._order if r() is not None]
        pad, nbytes = rec.span.pad, rec.span.nbytes
        target = pad if where == "first" else pad + nbytes - 1

        def corrupting_read(extent: Any, offset: int, out: memoryview) -> None:
            real_read(extent, offset, out)
            if offset <= target < offset + len(out):
                out[target - offset] ^= 0x01  # one flipped bit on the way back

        monkeypatch.setattr(engine._store, "read", corrupting_read)
        with pytest.raises(OffloadIOError, match="checksum mismatch"):
            y.sum().backward()


def test_without_verify_corruption_goes_unseen(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reason verify exists: the same corruption is silent without it."""
    x = torch.randn(1 << 14, requires_grad=True)
    with engine_with_hooks(save_dir, prefetch_depth=0) as engine:
        y = (x * 2).sin()
        engine.flush()
        real_read = engine._store.read

        def corrupting_read(extent: Any, offset: int, out: memoryview) -> None:
            real_read(extent, offset, out)
            # An exponent bit of a float in the middle: a change no rounding can hide.
            out[(len(out) // 2) // 4 * 4 + 3] ^= 0x40

        monkeypatch.setattr(engine._store, "read", corrupting_read)
        y.sum().backward()
    assert not torch.equal(x.grad, 2 * (x.detach() * 2).cos())


def test_disk_cap_falls_back_to_memory_with_one_warning(save_dir: Path) -> None:
    model = tiny_model()
    tokens, targets = make_batch(4, 32, vocab=64)
    ref = reference_grads(model, lambda m: m(tokens, targets).backward())
    with (
        pytest.warns(OffloadFallbackWarning, match="disk_bytes_limit") as record,
        offload_context(
            "disk", save_dir, min_offload_bytes=0, slab_bytes=1 << 16, disk_bytes_limit=1 << 17
        ) as engine,
    ):
        model(tokens, targets).backward()
    assert_same_grads(grads_of(model), ref)
    stats = engine.stats()
    assert stats.fallbacks > 0 and stats.peak_disk_bytes_in_use > 0
    assert stats.peak_disk_bytes_reserved <= 1 << 17
    assert len([w for w in record if w.category is OffloadFallbackWarning]) == 1


def test_disk_cap_below_slab_bytes_still_offloads_up_to_the_cap(save_dir: Path) -> None:
    """A disk_bytes_limit below slab_bytes reserves one slab cut to the cap (it once
    offloaded nothing: every slab was slab_bytes)."""
    model = tiny_model()
    tokens, targets = make_batch(4, 32, vocab=64)
    ref = reference_grads(model, lambda m: m(tokens, targets).backward())
    cap = 100 << 10  # not a multiple of slab_bytes, nor of a 64 KiB chunk
    with (
        pytest.warns(OffloadFallbackWarning, match="disk_bytes_limit"),
        offload_context(
            "disk", save_dir, min_offload_bytes=0, slab_bytes=1 << 20, disk_bytes_limit=cap
        ) as engine,
    ):
        loss = model(tokens, targets)
        engine.flush()  # written, not left in the open batch (NOTE [write tail])
        loss.backward()
    assert_same_grads(grads_of(model), ref)
    stats = engine.stats()
    assert stats.tensors_offloaded > 0 and stats.fallbacks > 0
    assert 0 < stats.peak_disk_bytes_reserved <= cap


def test_overlapping_views_share_the_whole_storage(save_dir: Path) -> None:
    """NOTE [whole storage]: q, k, v of a fused projection are written once, not three times."""
    x = torch.randn(4, 64, 96, requires_grad=True)

    def step() -> torch.Tensor:
        qkv = x * 1
        q, k, v = qkv.view(4, 64, 3, 2, 16).permute(2, 0, 3, 1, 4)
        return (q * k + k * v).sum()  # mul saves its operands: views, not copies

    step().backward()
    ref, x.grad = x.grad, None
    with engine_with_hooks(save_dir) as engine:
        loss = step()
        engine.flush()
        stats = engine.stats()
        assert stats.tensors_offloaded == 1 and stats.dedup_hits == 3
        assert stats.bytes_offloaded == x.numel() * 4  # qkv's storage, once
        loss.backward()
    assert torch.equal(x.grad, ref)


def test_restored_spans_are_let_go_when_backward_ends(save_dir: Path) -> None:
    """NOTE [recently restored]: nothing restored outlives the backward pass."""
    x = torch.randn(1 << 16, requires_grad=True)
    with engine_with_hooks(save_dir) as engine:
        y = (x * 2).sin()
        engine.flush()
        refs: list[weakref.ref[torch.UntypedStorage]] = []
        y.grad_fn.register_hook(lambda *_: refs.append(weakref.ref(engine._reader.recent[-1])))
        y.sum().backward()
        gc.collect()
        assert refs and refs[0]() is None and not engine._reader.recent
        y2 = (x * 3).sin()
        y2.sum().backward(retain_graph=True)
        y2.sum().backward()  # a second pass queues its own callback
        assert not engine._reader.recent
    got, x.grad = x.grad, None
    (x * 2).sin().sum().backward()
    y2 = (x * 3).sin()
    y2.sum().backward(retain_graph=True)
    y2.sum().backward()
    assert torch.equal(got, x.grad)


def _spy_writes(engine: OffloadEngine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record how many buffers each slab write carried."""
    calls: list[int] = []
    real = engine._store.write

    def spy(extent: Any, offset: int, data: Any) -> None:
        calls.append(1 if isinstance(data, memoryview) else len(data))
        real(extent, offset, data)

    monkeypatch.setattr(engine._store, "write", spy)
    return calls


def test_write_batches_merge_adjacent_records(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [write batches]: records queued together go out in one vectored write."""
    x = torch.randn(1 << 16, requires_grad=True)  # 256 KiB
    with engine_with_hooks(save_dir, chunk_bytes=1 << 20) as engine:
        calls = _spy_writes(engine, monkeypatch)
        ys = [(x * (i + 2)).sin() for i in range(8)]  # 8 saved tensors of 256 KiB
        engine.flush()
        stats = engine.stats()
        assert stats.tensors_offloaded == 8
        assert len(calls) < 8 and max(calls) > 1  # batches of adjacent records
        sum(y.sum() for y in ys).backward()
    ref = x.grad.clone()
    x.grad = None
    sum((x * (i + 2)).sin().sum() for i in range(8)).backward()
    assert torch.equal(ref, x.grad)


def test_open_batch_is_never_written_when_backward_comes_first(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [write tail]: the batch still open when backward starts stays in memory."""
    x = torch.randn(1 << 14, requires_grad=True)
    with engine_with_hooks(save_dir) as engine:  # default 8 MiB batches: these never fill one
        calls = _spy_writes(engine, monkeypatch)
        loss = sum((x * (i + 2)).sin().sum() for i in range(4))
        loss.backward()
        stats = engine.stats()
    assert calls == [] and stats.writes_skipped == 4 and stats.tensors_offloaded == 0
    assert stats.bytes_read == 0


def test_write_cap_submits_the_open_batch(save_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cap below the batch size must not deadlock pack: the batch goes out at cap / 2."""
    x = torch.randn(1 << 15, requires_grad=True)  # 128 KiB per saved tensor
    cap = 300 << 10
    with engine_with_hooks(save_dir, max_pending_write_bytes=cap) as engine:
        slow_store(engine, monkeypatch, "write", 0.01)
        ys = [(x * (i + 2)).sin() for i in range(12)]
        stats = engine.stats()
        assert stats.peak_pending_write_bytes <= cap + (128 << 10)
        assert stats.pack_wait_seconds > 0
        sum(y.sum() for y in ys).backward()
    assert engine.stats().tensors_offloaded > 0


def test_skipped_batch_of_a_dropped_graph_releases_its_bytes(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queued batch whose graph was dropped is skipped at the next backward, and its
    bytes leave the pending count (else the write cap would block pack for good)."""
    x = torch.randn(1 << 16, requires_grad=True)
    with engine_with_hooks(save_dir, io_workers=1, chunk_bytes=4096) as engine:
        slow_store(engine, monkeypatch, "write", 0.05)  # writes queue up behind a slow one
        dropped = [(x * (i + 2)).sin() for i in range(6)]
        del dropped  # forward 1's graph is gone while its batches wait
        gc.collect()
        (x * 9).sin().sum().backward()  # the first unpack skips the queued batches
        engine.flush()
        assert engine._writer.pending_bytes == 0
        assert engine.stats().writes_skipped > 0


def test_a_backward_that_raises_does_not_stop_end_of_backward_cleanup(save_dir: Path) -> None:
    """Autograd runs no final callbacks for a failed backward; the next one queues its own."""
    x = torch.randn(1 << 14, requires_grad=True)
    with engine_with_hooks(save_dir) as engine:
        y = x * 2
        z = y.sin()
        y.mul_(3)  # in place after save: backward raises
        with pytest.raises(OffloadError):
            z.sum().backward()
        w = (x * 4).sin()
        engine.flush()
        w.sum().backward()
        assert not engine._end_tasks and not engine._reader.recent


def test_a_backward_a_user_hook_broke_does_not_stop_the_next_ones_cleanup(
    save_dir: Path,
) -> None:
    """A backward that raised outside the engine (a tensor hook) runs no final callback;
    the next backward on that thread, with no forward in between, still cleans up."""

    class Boom(Exception):
        pass

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raise Boom

    x = torch.randn(1 << 14, requires_grad=True)
    with engine_with_hooks(save_dir) as engine:
        a = (x * 2).sin()
        broken = a.cos().exp()
        a.register_hook(boom)  # raises midway through the first backward
        other = (x * 3).sin().cos()  # a second graph of the same forward
        engine.flush()
        with pytest.raises(Boom):
            broken.sum().backward()
        other.sum().backward()
        assert not engine._end_tasks and not engine._reader.recent


def test_an_unpack_outside_backward_does_not_stop_end_of_backward_cleanup(
    save_dir: Path,
) -> None:
    """``grad_fn._saved_self`` unpacks outside any backward: no graph task will end."""
    x = torch.randn(1 << 14, requires_grad=True)
    with engine_with_hooks(save_dir) as engine:
        y = (x * 2).sin()
        engine.flush()
        assert torch.equal(y.grad_fn._saved_self, x * 2)  # type: ignore[union-attr]
        y.sum().backward()
        assert not engine._end_tasks and not engine._reader.recent


# -- NOTE [write staging] ----------------------------------------------------------------


def _direct_or_skip(engine: OffloadEngine) -> None:
    if engine.io_method != "direct":
        pytest.skip("staging applies to O_DIRECT writes; this folder has no O_DIRECT")


def test_staged_writes_are_exact(save_dir: Path) -> None:
    """stage_writes="always": every byte goes through the staging buffer and comes back
    bit-identical."""
    model = tiny_model()
    tokens, targets = make_batch(4, 32, vocab=64)
    ref = reference_grads(model, lambda m: m(tokens, targets).backward())
    with engine_with_hooks(save_dir, stage_writes="always", io_workers=1) as engine:
        _direct_or_skip(engine)
        loss = model(tokens, targets)
        engine.flush()  # every record is on disk: backward reads all of them
        loss.backward()
        stats = engine.stats()
        leased = engine._writer.stage_pool.leased_bytes
    assert_same_grads(grads_of(model), ref)
    assert stats.bytes_read > 0
    # Everything written went through staging (whole pages: at least the span bytes).
    assert stats.bytes_staged >= stats.bytes_offloaded > 0
    assert leased == 0  # every staging buffer went back to its pool


@pytest.mark.parametrize("chunk", [8 << 20, 1 << 20], ids=["one-run", "split-records"])
def test_staged_runs_longer_than_the_buffer_are_exact(save_dir: Path, chunk: int) -> None:
    """Runs of several staging buffers and a partial last one (records of 5 MiB + 3 pages,
    in one request or split into chunk-sized pieces) land byte for byte."""
    n = ((5 << 20) + 3 * 4096) // 4
    x = torch.randn(n, requires_grad=True)
    ref = x.detach().clone().requires_grad_()
    sum(((ref * (i + 2)).sin() * (i + 1)).sum() for i in range(3)).backward()
    with engine_with_hooks(
        save_dir, stage_writes="always", chunk_bytes=chunk, io_workers=2
    ) as engine:
        _direct_or_skip(engine)
        loss = sum(((x * (i + 2)).sin() * (i + 1)).sum() for i in range(3))
        engine.flush()
        loss.backward()
        stats = engine.stats()
    assert torch.equal(x.grad, ref.grad)
    assert stats.bytes_staged >= stats.bytes_offloaded >= 3 * n * 4
    assert stats.bytes_read >= 3 * n * 4 - (8 << 20)  # all but what stayed in memory


def test_auto_staging_starts_when_forward_waits_and_ends_with_backward(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(1 << 15, requires_grad=True)  # 128 KiB per saved tensor
    with engine_with_hooks(save_dir, max_pending_write_bytes=300 << 10, io_workers=1) as engine:
        _direct_or_skip(engine)
        slow_store(engine, monkeypatch, "write", 0.01)
        ys = [(x * (i + 2)).sin() for i in range(12)]
        engine.flush()
        waited = engine.stats()
        assert waited.pack_wait_seconds > 0  # the cap was hit: forward waited on writes
        assert 0 < waited.bytes_staged <= waited.bytes_offloaded + 12 * 4096
        sum(y.sum() for y in ys).backward()
        staged_grad, x.grad = x.grad, None
        assert not engine._writer.staging  # the next forward starts unstaged
        assert engine._writer.stage_pool.idle_bytes == 0  # its buffers were let go
        # A forward that never waits stages nothing.
        before = engine.stats().bytes_staged
        monkeypatch.undo()
        zs = [(x * (i + 2)).cos() for i in range(2)]
        engine.flush()
        assert engine.stats().bytes_staged == before
        assert engine.stats().bytes_offloaded > waited.bytes_offloaded
        sum(z.sum() for z in zs).backward()
    # The staged bytes came back exact (the reference runs without hooks).
    ref = x.detach().clone().requires_grad_()
    sum((ref * (i + 2)).sin().sum() for i in range(12)).backward()
    assert torch.equal(staged_grad, ref.grad)
    ref.grad = None
    sum((ref * (i + 2)).cos().sum() for i in range(2)).backward()
    assert torch.equal(x.grad, ref.grad)


@pytest.mark.parametrize("mode", ["auto", "never"])
def test_no_staging_without_waits_or_when_off(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    x = torch.randn(1 << 15, requires_grad=True)
    cap = (300 << 10) if mode == "never" else (64 << 20)  # "never" waits, "auto" does not
    with engine_with_hooks(
        save_dir, stage_writes=mode, max_pending_write_bytes=cap, io_workers=1
    ) as eng:
        _direct_or_skip(eng)
        if mode == "never":
            slow_store(eng, monkeypatch, "write", 0.01)
        ys = [(x * (i + 2)).sin() for i in range(12)]
        eng.flush()
        stats = eng.stats()
        sum(y.sum() for y in ys).backward()
    assert stats.bytes_offloaded > 0 and stats.bytes_staged == 0
    assert (stats.pack_wait_seconds > 0) == (mode == "never")


def test_failed_staged_write_keeps_the_tensor_and_returns_the_buffer(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [errors from workers] holds on the staged path: the error reaches the next hook
    call, the tensor stays in memory (exact gradients), and the buffer is not leaked while
    the error (and its traceback) is still held."""
    x = torch.randn(1 << 15, requires_grad=True)
    ref = x.detach().clone().requires_grad_()
    (ref * 3).sin().sum().backward()
    with engine_with_hooks(save_dir, stage_writes="always", io_workers=1) as engine:
        _direct_or_skip(engine)

        def broken(*args: Any) -> None:
            raise OSError(errno.EIO, "injected")

        monkeypatch.setattr(engine._store, "write", broken)
        y = (x * 3).sin()
        engine._wait_writes()
        pool = engine._writer.stage_pool
        assert pool.idle_bytes == writer_module._STAGE_BYTES  # re-files what came back
        assert pool.leased_bytes == 0
        with pytest.raises(OffloadIOError) as err:
            (x * 4).sin()
        assert err.value.__cause__ is not None or "injected" in str(err.value)
        monkeypatch.undo()
        y.sum().backward()
        assert engine.stats().bytes_staged == 0
    assert torch.equal(x.grad, ref.grad)


def test_an_engine_is_freed_without_the_cycle_collector(save_dir: Path) -> None:
    """Its parts hold no reference back to it: dropping the last reference (no graph
    alive) closes its slabs at once, not at some later collection."""
    gc.collect()
    gc.disable()
    try:
        engine = OffloadEngine(OffloadConfig(target="disk", save_dir=str(save_dir)))
        x = torch.randn(1 << 14, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
            (x * 2).sin().sum().backward()
        engine.close()
        ref = weakref.ref(engine)
        del engine
        assert ref() is None
    finally:
        gc.enable()


def test_a_warning_made_an_error_in_a_write_settles_the_batch_and_is_raised(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [errors from workers]: with warnings turned into errors, the full-disk warning
    raised in an IO thread must not leave the rest of its batch pending (the write cap
    would never be given back) and must reach the user."""
    x = torch.randn(3, 4096, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OffloadFallbackWarning)
        with engine_with_hooks(save_dir, chunk_bytes=1 << 20) as engine:

            def no_space(*args: Any) -> None:
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(engine._store, "write", no_space)
            ys = [(x[i] * 2).sin() for i in range(3)]  # three records, one batch
            with pytest.raises(OffloadFallbackWarning, match="no space left"):
                engine.flush()
            assert engine._writer.pending_bytes == 0  # every record of the batch settled
            sum(y.sum() for y in ys).backward()
    assert torch.equal(x.grad, 2 * (2 * x.detach()).cos())


def test_a_backward_after_exit_gives_the_slab_space_back_as_it_ends(save_dir: Path) -> None:
    """Records that die in a backward run after the context exited return their space
    when that backward ends, not at a later stats() call or garbage collection."""
    x = torch.randn(1 << 18, requires_grad=True)
    with offload_context("disk", str(save_dir), min_offload_bytes=0) as engine:
        loss = (x * 2).sin().sum()
        engine.flush()
    store = engine._store
    assert store is not None and store.used_bytes > 0
    loss.backward()
    assert store.used_bytes == 0 and store.reserved_bytes == 0


@pytest.mark.parametrize("how", ["dropped", "raised"])
def test_a_graph_dropped_after_exit_gives_the_slab_space_back(save_dir: Path, how: str) -> None:
    """NOTE [record lifetime]: a graph that outlives the context (kept, or held by an
    exception's traceback) and is dropped without a backward returns its slab space and
    closes the slab files, with the engine object still held and nothing called on it."""
    x = torch.randn(1 << 18, requires_grad=True)
    graphs: list[torch.Tensor] = []
    with contextlib.suppress(RuntimeError):
        with offload_context("disk", str(save_dir), min_offload_bytes=0) as engine:
            graphs.append((x * 2).sin().sum())
            engine.flush()
            if how == "raised":
                raise RuntimeError("forward failed")
    store = engine._store
    assert store is not None and store.used_bytes > 0
    graphs.clear()
    gc.collect()  # (the exception's traceback holds the frame in a cycle)
    assert store.used_bytes == 0 and store.reserved_bytes == 0
    assert _fd_targets(save_dir) == []
    assert not engine._dedup  # its entries went with it (NOTE [dedup])


def test_the_first_pack_after_a_backward_that_raised_ends_it(save_dir: Path) -> None:
    """Autograd runs no final callback for a backward that raised: the next forward's
    first pack turns write staging off and lets the restored spans go, as the end of
    backward does."""
    x = torch.randn(1 << 16, requires_grad=True)
    with offload_context("disk", str(save_dir), min_offload_bytes=0) as engine:
        y = (x * 2).sin()
        engine.flush()
        engine._writer.staging = True  # as forward waiting at the write cap turns it on

        def fail(grad: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("backward failed")

        y.register_hook(fail)  # after exp's backward has unpacked what it saved
        with pytest.raises(RuntimeError, match="backward failed"):
            y.exp().sum().backward()
        assert engine._writer.staging and engine._reader.recent  # it never ended
        w = (x * 3).sin()
        assert not engine._writer.staging and not engine._reader.recent
        w.sum().backward()


def test_the_views_of_one_fused_projection_share_a_record_whatever_the_io_timing(
    save_dir: Path,
) -> None:
    """NOTE [write batches]: a full batch is submitted at the next record's pack, so
    q, k and v of one fused projection share q's record even when the IO threads would
    have begun writing it before k and v were saved; every step makes the same records."""
    x = torch.randn(64, 128, requires_grad=True)
    w = torch.randn(128, 3 * 128, requires_grad=True)
    with offload_context("disk", str(save_dir), min_offload_bytes=0, chunk_bytes=4096) as eng:
        hits = []
        for _ in range(3):
            before = eng.stats().dedup_hits
            q, k, v = (x @ w).split(128, dim=-1)
            a = q.sin()  # saves q: its record covers qkv's whole storage, a full batch
            time.sleep(0.05)  # an IO thread would have begun a submitted write by now
            b, c = k.sin(), v.sin()
            hits.append(eng.stats().dedup_hits - before)
            (a.sum() + b.sum() + c.sum()).backward()
    assert hits == [2, 2, 2]


def test_a_saved_tensor_read_during_forward_changes_nothing_else(save_dir: Path) -> None:
    """NOTE [reads outside backward]: ``grad_fn._saved_result`` read mid-forward (a
    debugger, torchviz) neither switches the engine into backward nor cuts the step
    in two: every step from the second on runs on its learned order."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(6))
    peeked = []
    with offload_context("disk", str(save_dir), min_offload_bytes=0) as engine:
        for _ in range(4):
            x = torch.randn(64, 256)
            for i, layer in enumerate(layers):
                x = torch.tanh(layer(x))
                if i == 2:
                    engine.flush()  # written: the read restores it from disk
                    peeked.append(x.grad_fn._saved_result.clone())
                    assert torch.equal(peeked[-1], x.detach())
            loss = x.square().mean()
            engine.flush()
            loss.backward()
        stats = engine.stats()
    assert stats.predicted_steps == 3

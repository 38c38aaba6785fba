"""Adversarial probes of the engine: aliases with their own version counters, odd views,
double backward, checkpointing with real writes, nested engines, failed forwards."""

from __future__ import annotations

import contextlib
import copy
import errno
import gc
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import (
    Grads,
    ZeroesItsSaved,
    assert_same_grads,
    engine_with_hooks,
    grads_of,
    hang_guard,
    tiny_model,
    twin_with_hooks,
)
from torch.utils.checkpoint import checkpoint

from prefetch_offload import (
    OffloadEngine,
    OffloadError,
    OffloadFallbackWarning,
    OffloadIOError,
    offload_context,
)
from prefetch_offload.policy import DISK
from prefetch_offload.stats import StatsCounter
from prefetch_offload.testing import TinyTransformer, make_batch

# -- memory the record no longer watches ---------------------------------------------------


def test_memory_served_before_the_write_is_not_reused_after_an_alias_changed_it(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [version check]: a CPU record unpacked while its write runs hands out the
    tensor's own memory. After the write the record stops watching that memory's
    version; a detached alias (the owner is gone) then modifies it. Autograd would
    raise at the second backward; the engine must not silently feed the new bytes in."""
    x = torch.randn(1 << 14, requires_grad=True)
    started, release = threading.Event(), threading.Event()
    with engine_with_hooks(save_dir, io_workers=1, chunk_bytes=4096) as engine:
        real = engine._store.write

        def gated(*args: Any) -> None:
            started.set()
            assert release.wait(10)
            real(*args)

        monkeypatch.setattr(engine._store, "write", gated)
        y = (x * 2).exp()  # exp saves its output; one page batch: submitted at once
        alias = y.detach()
        loss = y.sum()
        del y
        assert started.wait(10)  # a worker is writing it: backward cannot skip it
        loss.backward(retain_graph=True)  # served from the tensor's memory
        release.set()
        engine.flush()
        alias.mul_(2)  # shares the dead owner's counter; autograd refuses pass two
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


# -- dedup and bytes that no saved view holds ---------------------------------------------


def _write_unsaved(x: torch.Tensor, index: slice, how: str) -> None:
    """Double ``x[index]`` through an alias with its own version counter."""
    if how == "data":
        x.data[index].mul_(2)
    else:
        x.numpy()[index] *= 2


@pytest.mark.parametrize("how", ["data", "numpy"])
@pytest.mark.parametrize("flush", [False, True], ids=["write-pending", "written"])
@pytest.mark.parametrize("layout", ["strided-gaps", "rest-of-storage", "expanded-gaps"])
def test_bytes_outside_saved_views_may_change_between_saves(
    save_dir: Path, how: str, flush: bool, layout: str
) -> None:
    """NOTE [dedup]: the gaps of a strided view, and the rest of a whole storage (NOTE
    [whole storage]), hold no saved element; writing them through ``x.data`` or numpy
    between two saves is legal, and the second save must see the new values. An
    expanded strided view has as many elements as bytes in its span yet skips most of
    them: it covers none of its gaps."""
    if layout == "strided-gaps":  # a spans 19999 of 50000 elements: no whole storage
        n, gap, second = 50000, slice(1, 20000, 2), slice(1, 19999, 2)

        def first(x: torch.Tensor) -> torch.Tensor:
            return x[0:20000:2]
    elif layout == "rest-of-storage":  # a spans 60% of the storage: its record takes all of it
        n, gap, second = 10000, slice(6000, None), slice(6000, None)

        def first(x: torch.Tensor) -> torch.Tensor:
            return x[:6000]
    else:  # stride (101, 0), 100 x 100: 10000 elements over 10000 spanned, 100 distinct
        n, gap, second = 50000, slice(1, 101), slice(1, 101)

        def first(x: torch.Tensor) -> torch.Tensor:
            return x[::101][:100].unsqueeze(1).expand(100, 100)

    def step(engine: OffloadEngine | None) -> Grads:
        torch.manual_seed(0)
        x = torch.randn(n)
        w1 = torch.ones(first(x).shape, requires_grad=True)
        w2 = torch.ones(x[second].shape, requires_grad=True)
        a = first(x) * w1  # saves the view first(x)
        if engine is not None and flush:
            engine.flush()  # its record's bytes are on disk now
        _write_unsaved(x, gap, how)
        b = x[second] * w2  # lies inside a's record
        (a.sum() + b.sum()).backward()
        return [w1.grad, w2.grad]

    ref = step(None)
    with engine_with_hooks(save_dir, prefetch_depth=1) as engine:
        got = step(engine)
    assert_same_grads(got, ref)
    # Before the write starts, the record may still be shared (it will read the new bytes).
    assert engine.stats().dedup_hits == (0 if flush else 1)


def test_dense_views_still_share_a_written_record(save_dir: Path) -> None:
    """The check above costs nothing for views inside a dense saved view."""
    x = torch.randn(64, 256, requires_grad=True)
    with engine_with_hooks(save_dir, inline=True) as engine:  # each record written as it is packed
        h = x * 1.5
        y = h.sin() + h.cos()  # both save h: the second after h's record was written
        z = (h[:, 8:].t() * 2).sum()  # t() saves nothing; no extra save of h
        (y.sum() + z).backward()
    got, x.grad = x.grad.clone(), None
    h = x * 1.5
    (h.sin() + h.cos()).sum().add((h[:, 8:].t() * 2).sum()).backward()
    assert torch.equal(got, x.grad)
    assert engine.stats().dedup_hits == 1


# -- odd views of one storage -------------------------------------------------------------


class _Stash(torch.autograd.Function):
    """Saves arbitrary tensors and hands what backward unpacked to ``_Stash.got``."""

    got: list[list[torch.Tensor]] = []  # noqa: RUF012

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *saved: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*saved)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _Stash.got.append([t.clone() for t in ctx.saved_tensors])
        _Stash.got.append(list(ctx.saved_tensors))
        return (g,) + (None,) * len(ctx.saved_tensors)


def _odd_views() -> list[torch.Tensor]:
    torch.manual_seed(1)
    b = torch.randn(129, 257) * 3  # 129 * 257 * 4 bytes: views start off the page grid
    c = torch.randn(64, 300, dtype=torch.complex64)
    bf = torch.randn(300, 300).to(torch.bfloat16)
    f64 = torch.randn(100, 100, dtype=torch.float64)
    flags = torch.randn(300, 300) > 0
    return [
        b,
        b.t(),
        b[1::2],
        b[:, 3:],
        b.view(torch.int32),
        b[5:].view(torch.int16),
        b.view(torch.uint8)[:, 1:],
        b.as_strided((100, 100), (1, 1), 7),  # overlapping elements
        b.as_strided((50, 50, 4), (200, 1, 0), 3),
        b[3:][::3, 1::5],
        b.unsqueeze(0).expand(3, 129, 257),
        c,
        c[:, 1::2],
        torch.view_as_real(c)[:, :, 1],
        bf,
        bf.t()[3:],
        f64,
        f64[1:, 1:],
        flags,
        flags[1::3],
    ]


@pytest.mark.parametrize("inline", [True, False], ids=["inline-pool", "thread-pool"])
@pytest.mark.parametrize("flush", [False, True], ids=["overlapped", "read-from-disk"])
def test_odd_views_of_shared_storages_come_back_exact(
    save_dir: Path, inline: bool, flush: bool
) -> None:
    views = _odd_views()
    expect = [(t.clone(), t.stride(), t.dtype) for t in views]
    _Stash.got = []
    w = torch.ones(4, requires_grad=True)
    with engine_with_hooks(save_dir, inline=inline, prefetch_depth=2, chunk_bytes=8192) as engine:
        out = _Stash.apply(w * 1, *views)
        del views
        if flush:
            engine.flush()
        out.sum().backward()
    copies, unpacked = _Stash.got
    for (value, stride, dtype), got, t in zip(expect, copies, unpacked, strict=True):
        assert (t.stride(), t.dtype) == (stride, dtype)
        assert torch.equal(got, value)
    stats = engine.stats()
    assert stats.tensors_kept == 0 and stats.dedup_hits > 5
    if flush:
        assert stats.bytes_read > 0


# -- double backward and checkpointing with real writes -----------------------------------


@pytest.mark.parametrize("inline", [True, False], ids=["inline-pool", "thread-pool"])
@pytest.mark.parametrize("depth", [0, 2])
def test_double_backward_through_offloaded_tensors(
    save_dir: Path, inline: bool, depth: int
) -> None:
    """create_graph: the first backward saves tensors it unpacked (views of read
    buffers) for the second, and they are offloaded again: a backward that keeps its
    graph saves for later (NOTE [packs inside backward])."""
    torch.manual_seed(0)
    x0, w0 = torch.randn(64, 256), torch.randn(256, 256) * 0.1

    def step(engine: OffloadEngine | None) -> Grads:
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        h = (x @ w).tanh()
        out = ((h * h).sigmoid() @ w).sum()
        if engine is not None:
            engine.flush()
        (gx,) = torch.autograd.grad(out, x, create_graph=True)
        if engine is not None:
            engine.flush()
        gx.pow(2).sum().backward()
        return [x.grad, w.grad]

    ref = step(None)
    with engine_with_hooks(
        save_dir, inline=inline, prefetch_depth=depth, chunk_bytes=4096
    ) as engine:
        got = step(engine)
    assert_same_grads(got, ref)
    stats = engine.stats()
    # Forward's two records, what the first backward saved, and gx saved by the
    # penalty's pow (a write may be dropped by the write tail as a backward starts).
    assert stats.tensors_offloaded + stats.writes_skipped > 6 and stats.bytes_read > 0
    assert stats.kept_in_backward == 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_with_every_record_written(save_dir: Path, reentrant: bool) -> None:
    """Block inputs are written and read back; a reentrant recompute, inside backward,
    stays in memory (NOTE [packs inside backward])."""
    model = tiny_model()
    tokens, targets = make_batch(4, 32, vocab=64)

    def step(m: TinyTransformer, engine: OffloadEngine | None = None) -> None:
        x = m.embed(tokens)
        for block in m.blocks:
            x = checkpoint(block, x, use_reentrant=reentrant)
        logits = m.head(m.norm(x))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        if engine is not None:
            engine.flush()
        loss.backward(retain_graph=not reentrant)

    ref_model = copy.deepcopy(model)
    step(ref_model)
    with engine_with_hooks(save_dir, inline=True) as engine:
        step(model, engine)
    assert_same_grads(grads_of(model), grads_of(ref_model))
    stats = engine.stats()
    assert stats.tensors_offloaded > 0 and stats.bytes_read > 0
    assert (stats.kept_in_backward > 0) == reentrant


@pytest.mark.parametrize("retain", [False, True])
def test_reentrant_recompute_stays_in_memory_with_or_without_retain_graph(
    save_dir: Path, retain: bool
) -> None:
    """NOTE [packs inside backward]: the recompute stays in memory, also under
    retain_graph=True (the checkpoint's node tells it from saves for a later backward)."""
    x = torch.randn(1 << 12, requires_grad=True)

    def step() -> torch.Tensor:
        h = x.sin()
        for _ in range(3):
            h = checkpoint(lambda a: (a * 1.5).sin().cos(), h, use_reentrant=True)
        return h.sum()

    step().backward()
    expected, x.grad = x.grad, None
    with engine_with_hooks(save_dir, min_offload_bytes=1) as engine:
        loss = step()
        engine.flush()
        before = engine.stats()
        loss.backward(retain_graph=retain)
        engine.flush()
        after = engine.stats()
    assert x.grad is not None and torch.equal(x.grad, expected)
    kept = after.kept_in_backward - before.kept_in_backward
    moved = after.tensors_offloaded - before.tensors_offloaded
    assert kept > 0 and moved == 0


def test_a_create_graph_backward_leaves_the_write_tail_in_memory(save_dir: Path) -> None:
    """The write tail keeps forward's last tensors in memory for the backward that uses
    them; what that backward saves under create_graph is offloaded, one record at a
    time, without demoting them again (NOTE [packs inside backward])."""
    x0 = torch.randn(1 << 14)

    def fwd(x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(6):
            h = h.sin()
        return h.sum()

    ref = x0.clone().requires_grad_()
    (expected,) = torch.autograd.grad(fwd(ref), ref)
    with engine_with_hooks(save_dir) as engine:  # 8 MiB batches stay open: all in the tail
        x = x0.clone().requires_grad_()
        (got,) = torch.autograd.grad(fwd(x), x, create_graph=True)
        engine.flush()
        stats = engine.stats()
    assert torch.equal(got, expected)
    assert stats.writes_skipped == 5 and stats.bytes_read == 0  # x itself is a leaf
    assert stats.tensors_offloaded > 0 and stats.kept_in_backward == 0


def test_a_backward_of_placeholders_only_ends_its_step(save_dir: Path) -> None:
    """A step whose saved tensors are all under min_offload_bytes (placeholders) still
    switches the engine into backward: the next forward is a step of its own."""

    def fwd(x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(2 if x.numel() < 4096 else 4):
            h = (h * 1.5).sin()
        return h.sum()

    with engine_with_hooks(save_dir, min_offload_bytes=4096) as engine:
        predicted = []
        for n in [1 << 8, 1 << 14, 1 << 14, 1 << 14]:
            fwd(torch.randn(n, requires_grad=True)).backward()
            predicted.append(engine.stats().predicted_steps)
    assert predicted == [0, 0, 1, 2]


# -- several engines, failed forwards -----------------------------------------------------


def test_nested_contexts_with_backward_across_them(save_dir: Path) -> None:
    """Each saved tensor goes back through the engine that packed it, in any order."""
    model = tiny_model()
    b1, b2 = (make_batch(4, 32, vocab=64, seed=s) for s in (1, 2))
    ref = copy.deepcopy(model)
    l1, l2 = ref(*b1), ref(*b2)
    l1.backward()
    l2.backward(retain_graph=True)
    l2.backward()
    kw: dict[str, Any] = {"min_offload_bytes": 0, "chunk_bytes": 4096}
    with offload_context("disk", save_dir, **kw) as outer:
        l1 = model(*b1)
        with offload_context("disk", save_dir, prefetch_depth=1, **kw) as inner:
            l2 = model(*b2)
            outer.flush()
            inner.flush()
            l1.backward()  # outer's graph, inside inner's hooks
        l2.backward(retain_graph=True)  # inner's graph after inner exited
    l2.backward()
    assert_same_grads(grads_of(model), grads_of(ref))
    assert outer.stats().bytes_read > 0 and inner.stats().bytes_read > 0
    del l1, l2
    gc.collect()
    for engine in (outer, inner):
        stats = engine.stats()
        assert (stats.disk_bytes_in_use, stats.disk_bytes_reserved) == (0, 0)


def test_forward_that_raises_midway_leaves_nothing_pending(save_dir: Path) -> None:
    model = tiny_model()
    b1, b2 = (make_batch(4, 32, vocab=64, seed=s) for s in (1, 2))
    ref = copy.deepcopy(model)
    ref(*b2).backward()

    class Boom(Exception):
        pass

    def boom(*_: Any) -> None:
        raise Boom

    with engine_with_hooks(save_dir, io_workers=1, chunk_bytes=4096) as engine:
        handle = model.blocks[1].register_forward_hook(boom)
        with pytest.raises(Boom):
            model(*b1)  # half a graph, some of it queued, some written
        handle.remove()
        gc.collect()
        model(*b2).backward()
        engine.flush()
        gc.collect()
        stats = engine.stats()
        assert stats.disk_bytes_in_use == 0
        assert engine._writer.pending_bytes == 0 and not engine._dedup
    assert_same_grads(grads_of(model), grads_of(ref))


def _skip_then_resume(engine: OffloadEngine, x: torch.Tensor) -> list[torch.Tensor]:
    """Four records in the open batch; an unpack mid-forward skips them (NOTE [write
    tail]); the caller's next pack writes the three backward has not consumed."""
    ys = [(x * (i + 2)).sin() for i in range(4)]
    torch.autograd.grad(ys[0].sum(), x, retain_graph=True)  # skips the open batch
    stats = engine.stats()  # NOTE [tiers]: the skipped records are back in memory
    assert stats.writes_skipped > 0 and stats.device_tier_bytes > 0
    return ys


def test_requeued_write_with_no_space_is_counted_and_kept(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A skipped record that finds no slab space when forward resumes stays in memory,
    counted as a fallback with the one warning, and its gradient is exact."""
    x = torch.randn(1 << 14, requires_grad=True)
    with engine_with_hooks(save_dir) as engine:
        ys = _skip_then_resume(engine, x)
        assert engine._store is not None
        monkeypatch.setattr(engine._store, "allocate", lambda n: None)
        with pytest.warns(OffloadFallbackWarning, match="no space left"):
            z = (x * 7).sin()  # pack: requeues the skipped records, none fits
        before = engine.stats()
        sum(y.sum() for y in [*ys, z]).backward()
    assert before.fallbacks >= 3  # the three requeued records (and z, kept too)
    ref = x.detach().clone().requires_grad_()
    sum((ref * (i + 2)).sin().sum() for i in [*range(4), 5]).backward()
    assert x.grad is not None and torch.equal(x.grad, ref.grad)


def test_requeued_write_that_cannot_create_a_slab_is_an_offload_io_error(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OSError other than no-space while requeueing reaches the pack hook as the
    library's OffloadIOError with the cause chained, as it does for a fresh record."""
    x = torch.randn(1 << 14, requires_grad=True)
    with engine_with_hooks(save_dir) as engine:
        ys = _skip_then_resume(engine, x)
        assert engine._store is not None

        def denied(n: int) -> None:
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(engine._store, "allocate", denied)
        with pytest.raises(OffloadIOError, match="could not create a slab file") as info:
            (x * 7).sin()
        assert isinstance(info.value.__cause__, PermissionError)
        monkeypatch.undo()
        sum(y.sum() for y in ys).backward()  # the records stayed in memory: still exact
    ref = x.detach().clone().requires_grad_()
    sum((ref * (i + 2)).sin().sum() for i in range(4)).backward()
    assert x.grad is not None and torch.equal(x.grad, ref.grad)


def test_a_slab_larger_than_a_file_can_be_says_to_lower_slab_bytes(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EFBIG from the slab's reservation (slab_bytes past the filesystem's largest
    file): the OffloadIOError names slab_bytes, not the folder's permissions."""
    x = torch.randn(1 << 14, requires_grad=True)
    with engine_with_hooks(save_dir) as engine:
        assert engine._store is not None

        def too_large(n: int) -> None:
            raise OSError(errno.EFBIG, "File too large")

        monkeypatch.setattr(engine._store, "allocate", too_large)
        with pytest.raises(OffloadIOError, match="Lower slab_bytes") as info:
            (x * 7).sin()
        assert info.value.__cause__.errno == errno.EFBIG  # type: ignore[union-attr]


@pytest.mark.parametrize("flush", [False, True], ids=["in-memory", "read-back"])
def test_a_saved_tensor_changed_in_place_during_backward_raises(
    save_dir: Path, flush: bool
) -> None:
    """NOTE [handouts]: the next unpack of the same memory sees the change and raises,
    as autograd without hooks does, whether the span was still in memory or read back."""
    w = torch.randn(4096, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        h = w * 1.5
        (h.cos() + ZeroesItsSaved.apply(h)).sum().backward()  # plain autograd raises
    w.grad = None
    with engine_with_hooks(save_dir, min_offload_bytes=0) as engine:
        h = w * 1.5
        z = h.cos()  # saves h
        y = ZeroesItsSaved.apply(h)  # saves h again: the same record
        del h
        if flush:
            engine.flush()
        with pytest.raises(RuntimeError, match=r"inplace|in place"):
            (z + y).sum().backward()  # the zeroing node runs first


@contextlib.contextmanager
def _hooks_on(kind: str, save_dir: Path, **kw: Any) -> Iterator[OffloadEngine]:
    """Offload hooks on the CPU ("disk") or on the CUDA path's twin ("twin-<target>")."""
    if kind == "disk":
        with engine_with_hooks(save_dir, **kw) as engine:
            yield engine
    else:
        with twin_with_hooks(kind.removeprefix("twin-"), save_dir, **kw) as (engine, _):
            yield engine


@pytest.mark.parametrize("kind", ["disk", "twin-cpu", "twin-disk"])
def test_a_change_in_backward_is_seen_by_a_small_view_kept_before_the_record(
    save_dir: Path, kind: str
) -> None:
    """NOTE [handouts]: a small view of h saved (and kept for its size) before h had a
    record shares h's version counter, not the record's sentinel: the handout of h's
    own memory (a CPU record's, or a device record's kept in the device tier) carries
    h's counter, so the view's unpack sees the backward's change."""
    x = torch.randn(1 << 14, requires_grad=True)
    w = torch.randn(8, requires_grad=True)

    def loss() -> torch.Tensor:
        h = x * 1.5
        a = (h[:8] * w).sum()  # saves the 32-byte view h[:8]: kept for its size
        return a + ZeroesItsSaved.apply(h).sum()  # its backward runs first

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss().backward()  # plain autograd raises at the view's unpack
    with _hooks_on(kind, save_dir, min_offload_bytes=4096, device_budget="1GiB"):
        y = loss()
        with pytest.raises(RuntimeError, match=r"inplace|in place"):
            y.backward()


class _UsesItsSaved(torch.autograd.Function):
    """Saves ``s`` and scales the gradient by its sum in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (s,) = ctx.saved_tensors
        return grad * s.sum(), None


@pytest.mark.parametrize("budget", ["1GiB", 0])
@pytest.mark.parametrize("kind", ["disk", "twin-cpu", "twin-disk"])
def test_a_change_in_backward_is_seen_by_another_record_over_the_same_memory(
    save_dir: Path, kind: str, budget: str | int
) -> None:
    """NOTE [handouts]: two overlapping views of h, neither inside the other and each
    under half of it, are two records over one memory. The first one's handout carries
    h's counter, kept in memory (the device tier on the twin) or read back afresh, so
    the zeroing of its view is seen at the second one's unpack, as autograd sees it
    (kept, the second would read the zeroed overlap into a wrong gradient)."""
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(10000, requires_grad=True)

    def loss() -> torch.Tensor:
        h = x * 1
        a, b = h[0:4000], h[3000:7000]
        out = _UsesItsSaved.apply(w * 1, b)  # b's node runs last
        return out.sum() + ZeroesItsSaved.apply(a).sum()  # zeroes a, and b's overlap

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss().backward()  # plain autograd
    with _hooks_on(kind, save_dir, min_offload_bytes=0, device_budget=budget) as engine:
        y = loss()
        engine.flush()  # (budget 0: both written or copied before the backward reads)
        with pytest.raises(RuntimeError, match=r"inplace|in place"):
            y.backward()


@pytest.mark.parametrize("kind", ["disk", "twin-cpu", "twin-disk"])
def test_a_change_in_backward_read_back_afresh_raises_in_the_next_pass(
    save_dir: Path, kind: str
) -> None:
    """NOTE [handouts]: a record read back from disk or a host copy, changed in place by
    its last user in one pass of a retained graph, raises autograd's error in the next
    pass (the handout carried the saved tensor's counter), as plain autograd does."""
    w = torch.randn(4096, requires_grad=True)
    y = ZeroesItsSaved.apply(w * 1.5)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()  # plain autograd
    with _hooks_on(kind, save_dir, min_offload_bytes=0) as engine:
        y = ZeroesItsSaved.apply(w * 1.5)
        engine.flush()
        y.sum().backward(retain_graph=True)
        with pytest.raises(RuntimeError, match=r"inplace|in place"):
            y.sum().backward()


def test_a_device_span_changed_in_backward_then_demoted_raises_in_the_next_pass(
    save_dir: Path,
) -> None:
    """NOTE [handouts]: a retained graph's device-kept span, changed by its last user in
    one pass and copied to the host before the next pass, taints its record there (plain
    autograd raises in the second pass too)."""
    w = torch.randn(4096, requires_grad=True)
    h = w * 1.5
    y = ZeroesItsSaved.apply(h)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()  # plain autograd: the first pass changed h
    nbytes = 4096 * 4
    with twin_with_hooks("cpu", save_dir, device_budget=nbytes) as (engine, _):
        h = w * 1.5
        y = ZeroesItsSaved.apply(h)  # h kept on the (twin) device within the budget
        del h
        y.sum().backward(retain_graph=True)  # changes the span it unpacked
        assert engine.stats().bytes_demoted_to_host == 0
        z = (w * 3).sin()  # a forward pack past the budget: h's record is copied out
        engine.flush()
        assert engine.stats().bytes_demoted_to_host >= nbytes
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
        del z


def test_a_pack_waiting_at_the_write_cap_submits_another_pack_s_open_batch(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads pack at once (packs inside concurrent backwards): A finds the cap
    full and, between its two looks, B adds a small record to the open batch, below
    the size that submits it. A must not wait for bytes no job will write."""
    from prefetch_offload import writer as writer_module

    real = writer_module.source_buffer
    a_inside, b_done = threading.Event(), threading.Event()

    def widened(*args: Any) -> Any:
        if threading.current_thread().name == "pack-A":
            a_inside.set()
            assert b_done.wait(10)
        return real(*args)

    monkeypatch.setattr(writer_module, "source_buffer", widened)
    page = 4096
    with engine_with_hooks(
        save_dir, io_method="buffered", chunk_bytes=4 * page, max_pending_write_bytes=8 * page
    ) as engine:
        first = torch.randn(page // 4).mul(1)
        kept = {"first": engine.pack(first)}  # one page open: counted as pending
        big, small = torch.randn(7 * page // 4).mul(1), torch.randn(page // 4).mul(1)
        a = threading.Thread(target=lambda: kept.update(big=engine.pack(big)), name="pack-A")

        def b() -> None:
            assert a_inside.wait(10)
            kept["small"] = engine.pack(small)
            b_done.set()

        threads = [a, threading.Thread(target=b, name="pack-B")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        hung = a.is_alive()
        if hung:
            engine._writer.wait()  # let it finish before the test fails
            a.join(10)
        assert not hung, "a pack waited for the open batch that nobody submits"
        engine.flush()
        assert engine.stats().tensors_offloaded == 3
        for name, t in (("first", first), ("big", big), ("small", small)):
            assert torch.equal(engine.unpack(kept[name]), t)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_trains_in_memory_and_refuses_the_parent_s_records(
    save_dir: Path,
) -> None:
    """NOTE [fork]: the child inherits the hooks but no IO threads and the parent's
    files; a pack there must not wait on them, nor an unpack read them."""
    x = torch.randn(1 << 12, requires_grad=True)
    with engine_with_hooks(save_dir, io_workers=1) as engine:
        parent_loss = (x * 2).exp().sum()  # saved in the parent, offloaded
        engine.flush()
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 only if every check holds
            status = 1
            try:
                torch.set_num_threads(1)
                y = torch.randn(64, requires_grad=True)
                (y * 3).sin().sum().backward()  # packs and unpacks in memory
                ok = torch.equal(y.grad, 3 * (3 * y.detach()).cos())
                try:
                    parent_loss.backward()
                except OffloadError as exc:
                    ok = ok and "forked" in str(exc)
                else:
                    ok = False
                engine.close()  # returns: no IO threads to wait for
                status = 0 if ok else 2
            finally:
                os._exit(status)
        deadline = time.monotonic() + 60
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hung")
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(status) == 0
        parent_loss.backward()  # the parent's records are untouched
        assert torch.equal(x.grad, 2 * (2 * x.detach()).exp())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_takes_no_lock_a_parent_thread_held_at_the_fork(save_dir: Path) -> None:
    """NOTE [fork]: an IO thread holds the engine's lock when the main thread forks; in
    the child, the parent's placeholder (a small saved tensor), leaving the context and
    the interpreter's exit must not wait for it."""
    x = torch.randn(64, requires_grad=True)
    ctx = offload_context("disk", str(save_dir), min_offload_bytes=1 << 16)
    engine = ctx.__enter__()
    try:
        loss = (x * 2).exp().sum()  # under min_offload_bytes: a placeholder in the order
        held, release = threading.Event(), threading.Event()

        def holder() -> None:  # an IO thread inside the engine's lock at the fork
            with engine._lock, engine._store._lock, engine._stats._lock:
                held.set()
                release.wait(30)

        thread = threading.Thread(target=holder)
        thread.start()
        assert held.wait(10)
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                torch.set_num_threads(1)
                loss.backward()
                ctx.__exit__(None, None, None)  # the summary reads the stats
                ok = torch.equal(x.grad, 2 * (2 * x.detach()).exp())
                # What interpreter exit would run: nothing that closes the parent's files.
                ok = ok and not any(f.alive for f in engine._finalizers)
                status = 0 if ok else 2
            finally:
                os._exit(status)
        release.set()
        thread.join()
        deadline = time.monotonic() + 60
        while not (done := os.waitpid(pid, os.WNOHANG))[0]:
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the forked child waited for a lock a parent thread held")
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        ctx.__exit__(None, None, None)


@pytest.mark.parametrize("where", ["counted", "batch-taken"])
def test_an_interrupt_that_leaves_write_bytes_counted_does_not_stall_later_packs(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """NOTE [interrupts] in io_pool.py: Ctrl-C lands after a pack counted its write's
    bytes and before the write was queued, or after a full batch was taken and before
    it was submitted: no job will ever write those bytes, so a later pack at the write
    cap must not wait for them (it waited forever), and training goes on exact."""
    from prefetch_offload import writer as writer_module

    def step() -> torch.Tensor:
        x = torch.randn(64, 256, requires_grad=True, generator=torch.Generator().manual_seed(0))
        y = x
        for _ in range(8):
            y = torch.tanh(y * 1.01)
        y.sum().backward()
        assert x.grad is not None
        return x.grad

    ref = step()
    fired: list[bool] = []
    if where == "counted":
        real_set_max = StatsCounter.set_max

        def set_max(self: StatsCounter, name: str, value: int) -> None:
            if name == "peak_pending_write_bytes" and not fired:
                fired.append(True)
                raise KeyboardInterrupt  # right after the pack counted its bytes
            real_set_max(self, name, value)

        monkeypatch.setattr(StatsCounter, "set_max", set_max)
    else:
        real_submit = writer_module.WritePath._submit_batch

        def submit(self: Any, batch: Any) -> None:
            if not fired:
                fired.append(True)
                raise KeyboardInterrupt  # the batch was taken from the open one
            real_submit(self, batch)

        monkeypatch.setattr(writer_module.WritePath, "_submit_batch", submit)
    kw = {"max_pending_write_bytes": 128 << 10, "chunk_bytes": 64 << 10}
    with engine_with_hooks(save_dir, min_offload_bytes=4096, **kw) as engine:
        with pytest.raises(KeyboardInterrupt):
            step()
        assert fired
        with hang_guard(60):
            for _ in range(2):
                assert torch.equal(ref, step())
            engine.flush()
        assert engine._writer.pending_bytes == 0


def test_an_interrupt_while_a_write_is_queued_returns_the_record_to_memory(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [tiers]: Ctrl-C lands while a pack waits at the write cap: the record was
    counted on disk with an extent, but no write will fill it; it goes back to memory,
    its extent freed, and training after the interrupt is exact."""
    x = torch.randn(1 << 14, requires_grad=True)
    with engine_with_hooks(save_dir) as engine:
        real = engine._writer.queue
        calls = [0]

        def interrupted(*args: Any) -> None:
            calls[0] += 1
            if calls[0] == 1:
                raise KeyboardInterrupt
            real(*args)

        monkeypatch.setattr(engine._writer, "queue", interrupted)
        with pytest.raises(KeyboardInterrupt):
            (x * 2).exp()  # exp saves its output: its write is cut short
        assert calls[0] == 1
        assert engine._policy.bytes[DISK] == 0 and engine._store.used_bytes == 0
        y = (x * 3).exp()
        loss = y.sum()
        engine.flush()
        loss.backward()
        assert torch.equal(x.grad, 3 * (3 * x.detach()).exp())
    gc.collect()
    assert engine.stats().disk_bytes_in_use == 0


def test_flush_keeps_the_bytes_of_a_batch_another_thread_is_submitting(save_dir: Path) -> None:
    """NOTE [interrupts] in io_pool.py: flush forgets pending bytes only when no write
    job, open batch or batch on its way to the pool is left; a batch another thread
    has taken and not yet submitted is on its way, and its bytes stay counted (else its
    job would count them off again: below zero, and the cap overshot)."""
    x = torch.randn(1 << 14, requires_grad=True)
    with engine_with_hooks(save_dir, chunk_bytes=1 << 20) as engine:
        writer = engine._writer
        y = (x * 2).sin()  # its write waits in the open batch (the chunk is larger)
        nbytes = writer.pending_bytes
        assert nbytes > 0
        taken, go = threading.Event(), threading.Event()

        def submitter() -> None:
            with engine._lock:
                batch = writer._take_batch()
            taken.set()
            go.wait(10)
            writer._submit_batch(batch)

        thread = threading.Thread(target=submitter)
        thread.start()
        assert taken.wait(10)
        engine.flush()  # the batch is on its way: nothing forgotten
        assert writer.pending_bytes == nbytes
        go.set()
        thread.join()
        engine.flush()
        assert writer.pending_bytes == 0
        y.sum().backward()
    assert torch.equal(x.grad, 2 * (2 * x.detach()).cos())

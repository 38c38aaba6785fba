"""Usage patterns the engine core must survive bit for bit.

Views of one storage saved in random order around flushes, storages freed and reused at
the same address within a step, graphs dropped or backwarded out of order, retained
graphs read by partial ``autograd.grad`` calls, budgets at their edges, threads sharing
one engine, pipeline schedules and random configurations: every workload, on the disk
path and on the CPU twin of the CUDA path, gives the gradients of the same workload
without hooks, and leaves nothing held once its graphs are gone.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import queue
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import (
    Grads,
    assert_same_grads,
    engine_with_hooks,
    grads_of,
    poison_freed_memory,
    run_in_threads,
    tiny_model,
    twin_with_hooks,
)

from prefetch_offload import OffloadEngine, OffloadFallbackWarning
from prefetch_offload.policy import DEVICE, HOST
from prefetch_offload.testing import make_batch

# -- helpers ------------------------------------------------------------------------------


@contextlib.contextmanager
def _engine_on(kind: str, save_dir: Path, **kw: Any) -> Iterator[OffloadEngine]:
    """An engine with its hooks installed: on the CPU ("disk"), or over the CPU twin of
    the CUDA path ("twin-cpu", "twin-disk"); ``delay`` (twin only) slows its copies."""
    if kind == "disk":
        kw.pop("delay", None)
        with engine_with_hooks(save_dir, **kw) as engine:
            yield engine
    else:
        with twin_with_hooks(kind.removeprefix("twin-"), save_dir, **kw) as (engine, _):
            yield engine


def _assert_nothing_held(engine: OffloadEngine) -> None:
    """Once every reference the test dropped is collected: no slab bytes in use, every
    tier empty, no dedup entry left (NOTE [record lifetime] in records.py)."""
    gc.collect()
    engine.flush()
    gc.collect()
    s = engine.stats()
    assert s.disk_bytes_in_use == 0, s
    assert (s.device_tier_bytes, s.host_tier_bytes, s.disk_tier_bytes) == (0, 0, 0), s
    assert not engine._dedup, engine._dedup


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaN payloads included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_bytes = [t.reshape(-1).contiguous().view(torch.uint8) for t in (a, b)]
    return torch.equal(*as_bytes)


# -- views of one storage, saved in random order --------------------------------------------

Seen = tuple[torch.Tensor, torch.Size, tuple[int, ...], torch.dtype]
_STASHED: list[list[Seen]] = []


class _Unpacked(torch.autograd.Function):
    """Saves any tensors; backward hands what it unpacked to ``sink``."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, sink: Callable[[tuple[torch.Tensor, ...]], None], *saved: Any
    ) -> torch.Tensor:
        ctx.save_for_backward(*saved)
        ctx.sink = sink
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ts = ctx.saved_tensors
        ctx.sink(ts)
        return (grad, None) + (None,) * len(ts)


def _stash(ts: tuple[torch.Tensor, ...]) -> None:
    """Appends copies of what a node unpacked to ``_STASHED``."""
    _STASHED.append([(t.clone(), t.shape, t.stride(), t.dtype) for t in ts])


def _view_family(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(97, 131, generator=g)  # odd sizes: views start off the page grid
    d = torch.randn(64, 64, dtype=torch.float64, generator=g)
    h = torch.randn(40, 50, generator=g).to(torch.float16)
    i = torch.randint(-(1 << 40), 1 << 40, (3000,), generator=g)
    return [
        b,
        b.t(),
        b[::3],
        b[:, 1::2],
        b.narrow(0, 5, 40),
        b.narrow(1, 100, 31).t(),
        b[10:20],  # small
        b[0, :4],  # tiny
        b.as_strided((60, 60), (1, 1), 11),  # overlapping elements
        b.as_strided((30, 30), (131, 0), 7),  # stride 0 inside rows
        b[3].unsqueeze(0).expand(50, 131),
        b.view(torch.int32)[1:, :7],
        b.view(torch.uint8)[:, 3::5],
        d,
        d.t()[1:],
        d.view(torch.int64)[2:50:2],
        d.view(torch.float32)[:, 1::2],
        h,
        h[:, 1:].t(),
        i,
        i[7::11],
        i.view(torch.float64)[100:110],
        torch.tensor(3.5),  # 0-dim
        b[0, 0],  # a 0-dim view
        torch.empty(0, 5),
        b[5:5],  # a view of 0 elements
        torch.randn(50, generator=g) > 0,
        torch.randn(30, 20, dtype=torch.complex64, generator=g),
    ]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("min_bytes", [0, 2048])
@pytest.mark.parametrize("inline", [True, False], ids=["inline-pool", "thread-pool"])
def test_views_saved_in_random_order_with_flushes_come_back_exact(
    save_dir: Path, seed: int, min_bytes: int, inline: bool
) -> None:
    """NOTE [dedup], NOTE [whole storage] in records.py: views of a few storages (odd
    strides, overlaps, dtype reinterpretations, 0-dim and empty ones) saved in a
    shuffled order by several nodes, some after a flush froze the records their
    storage already had; each comes back with its shape, strides, dtype and bytes."""
    views = _view_family(seed)
    rng = random.Random(seed)
    order = list(range(len(views)))
    rng.shuffle(order)
    expect = [(views[k].clone(), views[k].shape, views[k].stride(), views[k].dtype) for k in order]
    _STASHED.clear()
    w = torch.ones(4, requires_grad=True)
    with engine_with_hooks(
        save_dir, inline=inline, min_offload_bytes=min_bytes, prefetch_depth=rng.choice([0, 1, 3])
    ) as engine:
        out = w * 1
        cut = rng.randrange(len(order))
        i = 0
        while i < len(order):  # nodes of 1 to 5 views, flushes between some of them
            n = rng.randint(1, 5)
            out = _Unpacked.apply(out, _stash, *(views[k] for k in order[i : i + n]))
            i += n
            if i >= cut and rng.random() < 0.5:
                engine.flush()
        del views
        if rng.random() < 0.5:
            engine.flush()
        out.sum().backward()
        del out
    got = [item for node in reversed(_STASHED) for item in node]
    _STASHED.clear()
    assert len(got) == len(expect)
    for (value, shape, stride, dtype), (g, g_shape, g_stride, g_dtype) in zip(
        expect, got, strict=True
    ):
        assert (g_shape, g_stride, g_dtype) == (shape, stride, dtype)
        assert _bits_equal(g, value)
    _assert_nothing_held(engine)


# -- storages freed and reused at the same address ------------------------------------------


@pytest.mark.parametrize(
    ("inline", "min_bytes"), [(True, 0), (False, 1 << 12)], ids=["inline-pool", "thread-pool"]
)
def test_a_freed_storage_s_address_reused_in_the_same_step(
    save_dir: Path, inline: bool, min_bytes: int
) -> None:
    """NOTE [dedup] in records.py: a saved tensor's storage is freed once its record is
    written; the next storage lands at the same address with other bytes, the same
    shape and the same version, and it, a small view and a strided view of it are
    saved. No stale dedup entry may match them."""
    torch.manual_seed(0)
    xd = torch.randn(1 << 13)
    w = torch.randn(1 << 13, requires_grad=True)
    mem = bytearray(4 * (1 << 13))

    def step(engine: OffloadEngine | None) -> tuple[torch.Tensor, int]:
        losses = []
        addrs: list[int] = []
        for i in range(8):
            if i % 2 or engine is None:  # (the reference: plain autograd would see the
                a = xd.mul(i + 1)  # reused memory's new bytes in the old graph)
            else:  # the same memory every time: a storage at a freed one's address
                a = torch.frombuffer(mem, dtype=torch.float32)
                a.copy_(xd * (i + 1))  # version 1 every time
            addrs.append(a.data_ptr())
            losses.append((a * w).sum())  # saves a
            losses.append((a[:16] * w[:16]).sum())  # a small view: shares or is kept
            losses.append((a[100:4000:3] * w[100:4000:3]).sum())  # a strided view
            del a
            if engine is not None:
                engine.flush()  # written: the record lets go of the storage
            gc.collect()
        sum(losses).backward()
        assert w.grad is not None
        return w.grad.clone(), len(addrs) - len(set(addrs))

    ref, _ = step(None)
    w.grad = None
    with engine_with_hooks(save_dir, min_offload_bytes=min_bytes, inline=inline) as engine:
        got, reused = step(engine)
    assert torch.equal(got, ref)
    assert reused > 0  # not vacuous: the same address came back
    _assert_nothing_held(engine)


def test_a_storage_swapped_with_the_data_setter_is_a_new_tensor(save_dir: Path) -> None:
    """NOTE [dedup] in records.py: ``t.data = other`` keeps ``t`` (a dedup owner) and its
    version counter but swaps the storage, which may take the freed one's address; the
    second save of ``t`` must read the new bytes."""
    w = torch.randn(4096, requires_grad=True)
    with engine_with_hooks(save_dir) as engine:
        for attempt in range(5):
            t = torch.randn(4096) * 1
            old = t.clone()
            y1 = t * w  # saves t
            engine.flush()
            t.data = torch.empty(0)  # frees the old storage (the record let go of it)
            gc.collect()
            t.data = torch.full((4096,), 7.0 + attempt)
            y2 = t * w  # saves t again: other bytes, maybe at the same address
            w.grad = None
            (y1.sum() + y2.sum()).backward()
            assert torch.equal(w.grad, old + (7.0 + attempt))
            del y1, y2, t
    _assert_nothing_held(engine)


# -- graphs dropped, several graphs, backward order -----------------------------------------


@pytest.mark.parametrize("kind", ["disk", "twin-cpu", "twin-disk"])
def test_alternating_backward_order_and_dropped_graphs_over_many_steps(
    save_dir: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [learned order] in plan.py: two graphs a step, backwarded in an order that
    alternates (the learned order is wrong every other step), a third built and dropped
    every third step, batch sizes varying, freed memory poisoned: every gradient exact."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64), torch.nn.GELU()
    )
    ref = copy.deepcopy(model)
    rng = random.Random(7)
    plan = [(s, rng.choice([8, 16, 33]), rng.choice([8, 16, 33])) for s in range(12)]

    def run(m: torch.nn.Module, engine: OffloadEngine | None) -> None:
        for s, n1, n2 in plan:
            g = torch.Generator().manual_seed(s)
            xa, xb, xc = (torch.randn(n, 64, generator=g) for n in (n1, n2, 5))
            la = (m(xa) ** 2).sum()
            lb = m(xb).sin().sum()
            if s % 3 == 0:
                lc = m(xc).sum()  # dropped without backward
                del lc
            if engine is not None and s % 4 == 1:
                engine.flush()
            for loss in (la, lb) if s % 2 == 0 else (lb, la):
                loss.backward()
            del la, lb

    run(ref, None)
    seen = poison_freed_memory(monkeypatch)
    kw: dict[str, Any] = {"prefetch_depth": 2}
    kw.update({"chunk_bytes": 8192} if kind == "disk" else {"delay": 0.0005})
    with _engine_on(kind, save_dir, **kw) as engine:
        run(model, engine)
        _assert_nothing_held(engine)
    assert_same_grads(grads_of(model), grads_of(ref))
    assert seen.buffers + seen.arena_runs + seen.extents > 0


@pytest.mark.parametrize("flush", [False, True], ids=["in-memory", "read-back"])
def test_partial_grads_over_one_retained_graph_read_the_same_values(
    save_dir: Path, flush: bool
) -> None:
    """NOTE [backward passes] in records.py: ``autograd.grad`` over subsets of the inputs,
    four times over one retained graph, then a full backward: each pass reads back what
    forward saved, whichever records an earlier pass consumed."""
    torch.manual_seed(0)
    a = torch.randn(32, 48, requires_grad=True)
    b = torch.randn(48, 40, requires_grad=True)
    c = torch.randn(40, 24, requires_grad=True)

    def graph() -> torch.Tensor:
        h = (a @ b).tanh()
        h2 = (h @ c).sigmoid()
        return (h2 * h2).sum() + h.exp().sum()

    subsets = [[c], [a], [b, c], [a, b, c]]
    ref_loss = graph()
    ref = [g for s in subsets for g in torch.autograd.grad(ref_loss, s, retain_graph=True)]
    with engine_with_hooks(save_dir, prefetch_depth=2, chunk_bytes=4096) as engine:
        loss = graph()
        got: Grads = []
        for i, s in enumerate(subsets):
            if flush and i % 2 == 0:
                engine.flush()
            got += torch.autograd.grad(loss, s, retain_graph=True)
        loss.backward()
        del loss
    assert_same_grads(got, ref)
    assert engine.stats().bytes_read > 0 or not flush
    _assert_nothing_held(engine)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.complex64])
def test_real_ops_save_odd_dtypes_and_return_them_exact(save_dir: Path, dtype: torch.dtype) -> None:
    """Ops that save int64 indices (gather), bool masks (where) and 0-dim results
    (sqrt), around a matmul in a narrow, wide or complex dtype."""
    torch.manual_seed(0)
    w = torch.randn(64, 64, dtype=dtype, requires_grad=True)
    x0 = torch.randn(16, 64, dtype=dtype)
    idx = torch.randint(0, 64, (16, 8))

    def step() -> torch.Tensor:
        h = x0 @ w
        g = h.gather(1, idx)
        mask = g.real > 0 if dtype.is_complex else g > 0
        s = torch.where(mask, g * 2, g * 3).abs().sum()
        (s.sqrt() * s).backward()
        assert w.grad is not None
        return w.grad

    ref = step().clone()
    w.grad = None
    with engine_with_hooks(save_dir, inline=True) as engine:
        got = step()
    assert torch.equal(got, ref)
    assert engine.stats().tensors_offloaded > 0


# -- in place after save ------------------------------------------------------------------


@pytest.mark.parametrize("flush", [False, True], ids=["in-memory", "written"])
@pytest.mark.parametrize("how", ["view", "outside-the-saved-view", "saved-small-view"])
def test_in_place_through_another_view_after_save_raises_like_autograd(
    save_dir: Path, flush: bool, how: str
) -> None:
    """NOTE [version check] in records.py: a write through any view of the base, also
    one outside the saved view's span or over a small view kept for its size, moves
    the counter the saved views share; backward raises as plain autograd does."""
    w = torch.randn(4096, requires_grad=True)

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        base = w * 1.5
        h = base[: 4096 - 16]
        loss = h.sin().sum() + (base[:4] * w[:4]).sum()  # saves h and a small view
        return base, loss

    def mutate(base: torch.Tensor) -> None:
        with torch.no_grad():
            if how == "view":
                base[:10].add_(1)
            elif how == "outside-the-saved-view":
                base[4090:].add_(1)
            else:
                base[:4].zero_()

    base, loss = build()
    mutate(base)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()  # plain autograd
    with engine_with_hooks(save_dir, min_offload_bytes=1024) as engine:
        base, loss = build()
        if flush:
            engine.flush()
        mutate(base)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


@pytest.mark.parametrize("target", ["cpu", "disk"])
@pytest.mark.parametrize("when", ["copy-in-flight", "held-then-demoted", "after-flush"])
@pytest.mark.parametrize("how", ["view", "detached-alias"])
def test_in_place_after_save_on_the_twin_raises_like_autograd(
    save_dir: Path, target: str, when: str, how: str
) -> None:
    """NOTE [version check] in records.py, on the device path: a change through a view or
    a detached alias after the save, while the copy off the device runs, while the
    record is held within device_budget (then copied out), or after it landed."""
    x = torch.randn(1 << 13, requires_grad=True)
    kw: dict[str, Any] = {"delay": 0.05 if when == "copy-in-flight" else 0.0}
    if when == "held-then-demoted":
        kw["device_budget"] = (1 << 13) * 4
    with twin_with_hooks(target, save_dir, **kw) as (engine, _):
        y = (x * 2).exp()  # exp saves its output
        loss = y.sum()
        if when == "after-flush":
            engine.flush()
        with torch.no_grad():
            if how == "view":
                y[5:9].mul_(3)
            else:
                y.detach()[0] = 0.0
        if when == "held-then-demoted":
            z = (x * 3).exp()  # past the budget: y's record is copied out now
            engine.flush()
            st = engine.stats()
            assert st.bytes_demoted_to_host + st.bytes_demoted_to_disk > 0
            del z
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


# -- budgets at their edges ---------------------------------------------------------------


def _budget_step(m: torch.nn.Module, n: int, engine: OffloadEngine | None = None) -> None:
    tokens, targets = make_batch(2, n, vocab=64, seed=n)
    loss = m(tokens, targets)
    if engine is not None:
        engine.flush()  # written before backward: the tiers hold what the budgets say
    loss.backward()


@pytest.mark.parametrize(
    ("target", "device_budget", "host_budget"),
    [
        ("cpu", 0, None),
        ("cpu", 8192, None),
        ("cpu", 1, 8192),
        ("cpu", 1 << 40, 0),
        ("disk", 0, 0),
        ("disk", 1, 8192),
        ("disk", 8192, None),
    ],
)
def test_budget_edges_on_the_twin(
    save_dir: Path, target: str, device_budget: int, host_budget: int | None
) -> None:
    """NOTE [tiers] in policy.py: once a pack returns, the host tier holds at most
    host_budget and the device tier at most device_budget, except the records kept on
    the device because target "cpu" ran out of host budget (fallbacks, with the one
    warning); gradients exact at every budget."""
    model = tiny_model()
    ref = copy.deepcopy(model)
    for n in (16, 9):
        _budget_step(ref, n)
    kw: dict[str, Any] = {"device_budget": device_budget}
    if host_budget is not None:
        kw["host_budget"] = host_budget
    falls_back = target == "cpu" and host_budget is not None and device_budget < 1 << 40
    warned = (
        pytest.warns(OffloadFallbackWarning, match="host_budget")
        if falls_back
        else contextlib.nullcontext()
    )
    with twin_with_hooks(target, save_dir, **kw) as (engine, _):
        device_over: list[int] = []
        host_over: list[int] = []
        real = engine.pack

        def checked(t: torch.Tensor) -> Any:
            out = real(t)
            held = engine._policy.bytes
            if held[DEVICE] > device_budget:
                device_over.append(held[DEVICE])
            if host_budget is not None and held[HOST] > host_budget:
                host_over.append(held[HOST])
            return out

        with warned, torch.autograd.graph.saved_tensors_hooks(checked, engine.unpack):
            for n in (16, 9):
                _budget_step(model, n)
        _assert_nothing_held(engine)
    assert_same_grads(grads_of(model), grads_of(ref))
    stats = engine.stats()
    assert (stats.fallbacks > 0) == falls_back
    assert not host_over, host_over[:3]
    assert bool(device_over) == falls_back, device_over[:3]


@pytest.mark.parametrize("device_budget", [0, 1, 8192, 1 << 40])
def test_device_budget_edges_on_the_disk_path(save_dir: Path, device_budget: int) -> None:
    """NOTE [tiers] in policy.py: CPU tensors under target "disk" stay in memory up to
    device_budget once a pack returns; the rest is written (or, past the newest
    records, left to the write tail), and gradients are exact."""
    model = tiny_model()
    ref = copy.deepcopy(model)
    for n in (16, 9, 16):
        _budget_step(ref, n)
    with engine_with_hooks(save_dir, device_budget=device_budget, chunk_bytes=8192) as engine:
        over: list[int] = []
        real = engine.pack

        def checked(t: torch.Tensor) -> Any:
            out = real(t)
            if engine._policy.bytes[DEVICE] > device_budget:
                over.append(engine._policy.bytes[DEVICE])
            return out

        with torch.autograd.graph.saved_tensors_hooks(checked, engine.unpack):
            for n in (16, 9, 16):
                _budget_step(model, n, engine)
        _assert_nothing_held(engine)
    assert_same_grads(grads_of(model), grads_of(ref))
    assert not over, over[:3]
    stats = engine.stats()
    assert stats.fallbacks == 0
    assert (stats.tensors_offloaded > 0) == (device_budget < 1 << 40)


@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_min_offload_bytes_is_inclusive(save_dir: Path, delta: int) -> None:
    """A tensor of exactly min_offload_bytes is offloaded; one byte more of threshold
    keeps it."""
    x = torch.randn(1024, requires_grad=True)
    nbytes = 1024 * 4
    with engine_with_hooks(save_dir, min_offload_bytes=nbytes + delta, inline=True) as engine:
        (x * 2).exp().sum().backward()
        stats = engine.stats()
    assert x.grad is not None and torch.equal(x.grad, 2 * (2 * x.detach()).exp())
    assert (stats.tensors_offloaded > 0) == (delta <= 0)


# -- a backward that raises, then the same graph again ------------------------------------


class _Boom(Exception):
    pass


@pytest.mark.parametrize("kind", ["disk", "twin-cpu", "twin-disk"])
def test_a_backward_raising_midway_then_the_retained_graph_again(save_dir: Path, kind: str) -> None:
    """A tensor hook raises halfway through a retain_graph backward (some records read,
    some not); the same graph backwarded again, then a new step, are exact and leave
    nothing held."""
    model = tiny_model()
    ref = copy.deepcopy(model)
    tokens, targets = make_batch(2, 16, vocab=64)
    ref(tokens, targets).backward()
    kw: dict[str, Any] = {"prefetch_depth": 2}
    kw.update({"chunk_bytes": 4096} if kind == "disk" else {"device_budget": 20000})
    with _engine_on(kind, save_dir, **kw) as engine:
        x = model.blocks[0](model.embed(tokens))
        calls = [0]

        def hook(g: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            if calls[0] == 1:
                raise _Boom
            return g

        x.register_hook(hook)
        logits = model.head(model.norm(model.blocks[1](x)))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        engine.flush()
        with pytest.raises(_Boom):
            loss.backward(retain_graph=True)
        model.zero_grad(set_to_none=True)
        loss.backward()
        assert_same_grads(grads_of(model), grads_of(ref))
        del loss, logits, x
        model.zero_grad(set_to_none=True)
        model(tokens, targets).backward()
        _assert_nothing_held(engine)
    assert_same_grads(grads_of(model), grads_of(ref))


# -- threads sharing one engine -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["disk", "twin-cpu"])
def test_two_threads_train_through_one_engine(save_dir: Path, kind: str) -> None:
    """NOTE [unpack threads] in engine.py: two threads, each with its own model, pack and
    unpack through one engine at once, in lock step: each model's gradients are what
    it alone would get."""
    models = [tiny_model(seed=s) for s in (0, 1)]
    batches = [
        [make_batch(2, n, vocab=64, seed=10 * s + n) for n in (16, 8, 16, 12)] for s in (0, 1)
    ]
    refs = []
    for m, bs in zip(models, batches, strict=True):
        r = copy.deepcopy(m)
        for b in bs:
            r(*b).backward()
        refs.append(grads_of(r))
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)
    kw: dict[str, Any] = {"prefetch_depth": 2}
    kw.update({"chunk_bytes": 8192} if kind == "disk" else {"delay": 0.0005})
    with _engine_on(kind, save_dir, **kw) as engine:

        def train(i: int) -> None:
            try:
                with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
                    for b in batches[i]:
                        loss = models[i](*b)
                        barrier.wait(timeout=30)
                        loss.backward()
            except BaseException as exc:
                errors.append(exc)
                barrier.abort()

        run_in_threads(train, timeout=60)
        assert not errors, errors
        _assert_nothing_held(engine)
    for m, ref in zip(models, refs, strict=True):
        assert_same_grads(grads_of(m), ref)


@pytest.mark.parametrize("kind", ["disk", "twin-cpu"])
def test_concurrent_backwards_of_graphs_sharing_records(
    save_dir: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [unpack threads] in engine.py, NOTE [dedup] in records.py: two graphs save
    the same tensors (one record each) and are backwarded at once on two threads,
    round after round, with freed memory poisoned."""
    poison_freed_memory(monkeypatch, jitter_s=0.001)
    torch.manual_seed(0)
    w1 = torch.randn(256, 64, requires_grad=True)
    w2 = torch.randn(256, 64, requires_grad=True)
    base = torch.randn(32, 256)

    def graphs() -> tuple[torch.Tensor, torch.Tensor]:
        h = (base * 1.5).tanh()  # tanh saves h; the matmuls save h too
        g = h.sigmoid()
        l1 = ((h @ w1).sin() * g[:, :64]).sum()
        l2 = ((h @ w2).cos() * g[:, 64:128]).sum()
        return l1, l2

    l1, l2 = graphs()
    r1 = torch.autograd.grad(l1, [w1])[0]
    r2 = torch.autograd.grad(l2, [w2])[0]
    errors: list[BaseException] = []

    def back(
        barrier: threading.Barrier,
        res: dict[int, torch.Tensor],
        i: int,
        loss: torch.Tensor,
        w: torch.Tensor,
    ) -> None:
        try:
            barrier.wait(10)
            res[i] = torch.autograd.grad(loss, [w])[0]
        except BaseException as exc:
            errors.append(exc)

    with _engine_on(kind, save_dir, prefetch_depth=2, chunk_bytes=4096) as engine:
        for rnd in range(6):
            l1, l2 = graphs()
            if rnd % 2:
                engine.flush()
            res: dict[int, torch.Tensor] = {}
            barrier = threading.Barrier(2)
            threads = [
                threading.Thread(target=back, args=(barrier, res, 1, l1, w1)),
                threading.Thread(target=back, args=(barrier, res, 2, l2, w2)),
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert not errors, errors
            assert torch.equal(res[1], r1) and torch.equal(res[2], r2)
            del l1, l2
        _assert_nothing_held(engine)


@pytest.mark.parametrize(("kind", "budget"), [("disk", 0), ("twin-disk", 0), ("twin-cpu", 40000)])
def test_forwards_on_one_thread_backwards_on_another(
    save_dir: Path, kind: str, budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [packs inside backward] in engine.py: a producer thread runs forwards under
    the engine's hooks and hands each loss to the main thread, which backwards it while
    the next forward packs; the engine flips between forward and backward on every
    pack and unpack."""
    model = tiny_model()
    ref = copy.deepcopy(model)
    lens = [16, 8, 12, 16, 5, 16, 9, 16]
    batches = [make_batch(2, n, vocab=64, seed=i) for i, n in enumerate(lens)]
    for b in batches:
        ref(*b).backward()
    poison_freed_memory(monkeypatch, jitter_s=0.0005)
    with _engine_on(kind, save_dir, device_budget=budget, prefetch_depth=2) as engine:
        q: queue.Queue[Any] = queue.Queue(maxsize=2)

        def produce() -> None:
            try:
                with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
                    for b in batches:
                        q.put(model(*b))
            except BaseException as exc:
                q.put(exc)
            q.put(None)

        t = threading.Thread(target=produce)
        t.start()
        try:
            while (item := q.get(timeout=60)) is not None:
                if isinstance(item, BaseException):
                    raise item
                item.backward()
                del item
        finally:
            t.join(60)
        _assert_nothing_held(engine)
    assert_same_grads(grads_of(model), grads_of(ref))


# -- tensors handed out and kept by the user ----------------------------------------------

_KEPT: list[torch.Tensor] = []


@pytest.mark.parametrize("kind", ["disk", "twin-cpu", "twin-disk"])
def test_unpacked_tensors_kept_by_the_user_survive_later_steps(
    save_dir: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [memory handed to autograd] in reader.py, NOTE [reads outside backward] in
    engine.py: tensors unpacked in backward, or read through ``_saved_result`` outside
    it, and held by the user keep their values while later steps reuse (and poison)
    freed memory."""
    seen = poison_freed_memory(monkeypatch)
    _KEPT.clear()
    expect: list[torch.Tensor] = []
    outside: list[tuple[torch.Tensor, torch.Tensor]] = []
    with _engine_on(kind, save_dir, prefetch_depth=2, chunk_bytes=8192) as engine:
        for step in range(6):
            w = torch.ones(3, requires_grad=True)
            xs = [torch.randn(1000 + 37 * step + i) * 1 for i in range(4)]
            expect += [x.clone() for x in reversed(xs)]  # nodes run in reverse
            out = w * 1
            for x in xs:
                out = _Unpacked.apply(out, _KEPT.extend, x)
            y = (w.sum() * torch.randn(4096)).exp()  # exp saves its output
            loss = out.sum() + y.sum()
            del xs
            if step % 2:
                engine.flush()
            r = y.grad_fn._saved_result  # a read outside backward, kept
            outside.append((r, r.clone()))
            del y
            loss.backward()
            del loss, out
            gc.collect()
    gc.collect()
    kept = list(_KEPT)
    _KEPT.clear()
    assert len(kept) == len(expect)
    for got, want in zip(kept, expect, strict=True):
        assert torch.equal(got, want)
    for r, want in outside:
        assert torch.equal(r, want)
    assert seen.buffers + seen.arena_runs + seen.extents > 0


# -- create_graph, pipeline schedules, shared records -------------------------------------


@pytest.mark.parametrize("target", ["cpu", "disk"])
@pytest.mark.parametrize("device_budget", [0, 20000])
def test_double_backward_on_the_twin(save_dir: Path, target: str, device_budget: int) -> None:
    """NOTE [packs inside backward] in engine.py, on the device path: a create_graph
    backward's saves are offloaded again, a forward runs between the two backwards,
    and two such steps give the gradients of plain autograd."""
    torch.manual_seed(0)
    x0, w0 = torch.randn(32, 64), torch.randn(64, 64) * 0.1

    def step() -> Grads:
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        h = (x @ w).tanh()
        out = ((h * h).sigmoid() @ w).sum()
        (gx,) = torch.autograd.grad(out, x, create_graph=True)
        z = (x * 3).sin().sum()  # a forward between the two backwards
        (gx.pow(2).sum() + z).backward()
        assert x.grad is not None and w.grad is not None
        return [x.grad, w.grad]

    ref = step()
    with twin_with_hooks(target, save_dir, device_budget=device_budget, prefetch_depth=2) as (
        engine,
        _,
    ):
        got = [step(), step()]
        _assert_nothing_held(engine)
    for grads in got:
        assert_same_grads(grads, ref)


@pytest.mark.parametrize(
    ("kind", "budget"), [("disk", 0), ("twin-cpu", 30000), ("twin-disk", 30000)]
)
def test_a_pipeline_schedule_with_budgets(
    save_dir: Path, kind: str, budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [learned order] in plan.py: the 1F1B schedule F0 F1 B0 F2 B1 F3 B2 B3 with
    micro-batches of varying length, twice, with freed memory poisoned."""
    model = tiny_model()
    ref = copy.deepcopy(model)
    batches = [make_batch(2, n, vocab=64, seed=n) for n in (16, 8, 12, 16)]

    def run(m: torch.nn.Module) -> None:
        losses = {0: m(*batches[0]), 1: m(*batches[1])}
        losses.pop(0).backward()
        losses[2] = m(*batches[2])
        losses.pop(1).backward()
        losses[3] = m(*batches[3])
        losses.pop(2).backward()
        losses.pop(3).backward()

    run(ref)
    run(ref)
    poison_freed_memory(monkeypatch)
    kw: dict[str, Any] = {"device_budget": budget, "prefetch_depth": 3}
    if kind == "twin-disk":
        kw["host_budget"] = budget
    with _engine_on(kind, save_dir, **kw) as engine:
        run(model)
        run(model)
        _assert_nothing_held(engine)
    assert_same_grads(grads_of(model), grads_of(ref))


@pytest.mark.parametrize(
    ("kind", "budget", "flush"),
    [
        ("disk", 0, True),
        ("disk", 16384, False),
        ("twin-cpu", 1, True),
        ("twin-cpu", 1 << 30, False),
        ("twin-disk", 16384, True),
    ],
)
def test_two_graphs_sharing_records_backwarded_in_reverse(
    save_dir: Path, kind: str, budget: int, flush: bool
) -> None:
    """NOTE [dedup] in records.py, NOTE [backward passes] in records.py: graphs A and B
    both save h and views of it (one record, shared by the two graphs); B is
    backwarded first, then A twice (retain_graph), with a third graph built between
    A's two passes."""
    torch.manual_seed(0)
    x = torch.randn(64, 96, requires_grad=True)
    w = torch.randn(96, 96, requires_grad=True)

    def graphs() -> list[torch.Tensor]:
        h = (x @ w).tanh()  # tanh saves h
        a = (h.sin() * h[:, :8].sum()).sum()
        b = (h.t() @ h[:, 10:50]).cos().sum() + h[3].exp().sum()
        return [a, b]

    def run(engine: OffloadEngine | None) -> Grads:
        a, b = graphs()
        if engine is not None and flush:
            engine.flush()
        out = list(torch.autograd.grad(b, [x, w], retain_graph=True))
        out += torch.autograd.grad(a, [x, w], retain_graph=True)
        c = graphs()[0] * 2  # a forward between A's two passes
        out += torch.autograd.grad(a, [w, x])
        out += torch.autograd.grad(c, [x])
        return out

    ref = run(None)
    kw: dict[str, Any] = {"device_budget": budget, "prefetch_depth": 2}
    if kind == "twin-disk":
        kw["host_budget"] = budget
    with _engine_on(kind, save_dir, **kw) as engine:
        got = run(engine)
        _assert_nothing_held(engine)
    assert_same_grads(got, ref)


# -- many steps, many configurations --------------------------------------------------------


def _random_config(seed: int) -> tuple[str, dict[str, Any]]:
    rng = random.Random(seed)
    kind = rng.choice(["disk", "twin-cpu", "twin-disk"])
    kw: dict[str, Any] = {
        "prefetch_depth": rng.choice([0, 1, 2, 8]),
        "io_workers": rng.choice([1, 2, 3]),
        "chunk_bytes": rng.choice([4096, 8192, 65536]),
        "max_pending_write_bytes": rng.choice([4096, 16384, 1 << 20]),
        "min_offload_bytes": rng.choice([0, 1, 512, 4096]),
        "device_budget": rng.choice([0, 1, 4096, 50000]),
        "verify": rng.random() < 0.3,
        "prefetch_bytes": rng.choice([None, 1, 8192]),
    }
    if kind != "twin-cpu":
        kw["io_method"] = rng.choice(["auto", "buffered", "mmap"])
        kw["slab_bytes"] = rng.choice([4096, 65536, 1 << 20])
        kw["disk_bytes_limit"] = rng.choice([None, None, 65536, 1 << 20])
        kw["stage_writes"] = rng.choice(["auto", "always", "never"])
    if kind != "disk":
        host_budget = rng.choice([None, 0, 1, 8192, 60000])
        if host_budget is not None:
            kw["host_budget"] = host_budget
        kw["max_inflight_copy_bytes"] = rng.choice([4096, 1 << 20])
        kw["delay"] = 0.0003
    return kind, kw


@pytest.mark.filterwarnings("ignore::prefetch_offload.OffloadFallbackWarning")
@pytest.mark.parametrize("seed", range(6))
def test_random_configurations_train_exactly(
    save_dir: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Knobs drawn at random (seeded): four steps of varying length, one flushed before
    backward, one backwarded twice, with freed memory poisoned; exact gradients, nothing
    held, and the save folder empty after close."""
    kind, kw = _random_config(seed)
    model = tiny_model()
    ref = copy.deepcopy(model)
    rng = random.Random(seed)
    lens = [rng.choice([5, 8, 16]) for _ in range(4)]

    def run(m: torch.nn.Module, engine: OffloadEngine | None) -> None:
        for i, n in enumerate(lens):
            loss = m(*make_batch(2, n, vocab=64, seed=i))
            if engine is not None and i == 1:
                engine.flush()
            if i == 2:
                loss.backward(retain_graph=True)
                m.zero_grad(set_to_none=False)
            loss.backward()

    run(ref, None)
    poison_freed_memory(monkeypatch, jitter_s=0.0005)
    with _engine_on(kind, save_dir, **kw) as engine:
        run(model, engine)
        _assert_nothing_held(engine)
    assert_same_grads(grads_of(model), grads_of(ref))
    assert os.listdir(save_dir) == [], (kind, kw)


@pytest.mark.filterwarnings("ignore::prefetch_offload.OffloadFallbackWarning")
@pytest.mark.parametrize(
    ("kind", "kw"),
    [
        ("disk", {"slab_bytes": 65536, "chunk_bytes": 8192, "prefetch_depth": 3}),
        ("disk", {"device_budget": 30000, "io_method": "mmap", "verify": True}),
        (
            "disk",
            {"disk_bytes_limit": 200000, "slab_bytes": 65536, "max_pending_write_bytes": 8192},
        ),
        ("twin-disk", {"host_budget": 20000, "device_budget": 10000, "slab_bytes": 65536}),
        ("twin-cpu", {"host_budget": 60000, "device_budget": 4096}),
    ],
    ids=["disk-small-slabs", "disk-budget-mmap-verify", "disk-limit", "twin-disk", "twin-cpu"],
)
def test_forty_steps_of_varying_size(
    save_dir: Path, kind: str, kw: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [slab allocation] in slab.py, NOTE [pinned arena] in arena.py: forty steps
    of batch sizes from 1 to 100 through small slabs, a disk cap, budgets and mmap
    reads, with freed memory poisoned; exact, and nothing held at the end."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(24, 48),
        torch.nn.GELU(),
        torch.nn.Linear(48, 48),
        torch.nn.Tanh(),
        torch.nn.LayerNorm(48),
        torch.nn.Linear(48, 8),
    )
    ref = copy.deepcopy(model)
    rng = random.Random(3)
    sizes = [rng.choice([1, 3, 17, 40, 64, 100]) for _ in range(40)]

    def run(m: torch.nn.Module) -> None:
        for i, n in enumerate(sizes):
            x = torch.randn(n, 24, generator=torch.Generator().manual_seed(i))
            m(x).pow(2).mean().backward()

    run(ref)
    poison_freed_memory(monkeypatch, jitter_s=0.0003)
    with _engine_on(kind, save_dir, **kw) as engine:
        run(model)
        _assert_nothing_held(engine)
    assert_same_grads(grads_of(model), grads_of(ref))


@pytest.mark.parametrize("how", ["storage", "data", "emptied-and-refilled"])
@pytest.mark.parametrize("io_method", ["direct", "buffered", "mmap"])
def test_a_saved_tensor_whose_storage_moves_before_its_write(
    save_dir: Path, how: str, io_method: str
) -> None:
    """NOTE [moved storages] in writer.py: a storage reallocated after the save without
    a new version (``resize_`` of the storage or of ``x.data``) is not written from its
    old address: the record stays in memory and backward reads it through the storage,
    as autograd does, bit-identical to training without offload."""

    def step(engine: OffloadEngine | None) -> torch.Tensor:
        torch.manual_seed(0)
        w = torch.randn(64, 64, requires_grad=True)
        h = torch.randn(64, 64) @ w
        y = h.sin()  # saves h
        st = h.untyped_storage()
        if how == "storage":
            st.resize_(st.nbytes() + 100)
        elif how == "data":
            h.data.resize_(64 * 64 + 1000)
        else:
            keep = h.detach().clone()
            st.resize_(0)
            taken = torch.empty_like(keep)  # takes the memory just freed: it moves
            st.resize_(keep.untyped_storage().nbytes())
            h.data.copy_(keep)
            del taken
        if engine is not None:
            engine.flush()  # the record was in the open batch: its write comes now
        y.sum().backward()
        assert w.grad is not None
        return w.grad

    ref = step(None)
    with engine_with_hooks(save_dir, io_method=io_method) as engine:
        got = step(engine)
        assert engine.stats().writes_skipped >= 1
        _assert_nothing_held(engine)
    assert torch.equal(ref, got)


@pytest.mark.parametrize("how", ["storage", "share_memory"])
@pytest.mark.parametrize("io_method", ["direct", "buffered", "mmap"])
@pytest.mark.parametrize("path", ["requeued", "kept-by-budget"])
def test_a_moved_storage_queued_again_is_written_from_where_it_is_now(
    save_dir: Path, how: str, io_method: str, path: str
) -> None:
    """NOTE [moved storages] in writer.py: a record whose storage moved while it was in
    memory (its write skipped, or kept by ``device_budget``) and which a later save
    queues for writing is written from the storage's new address, whose place in its
    page differs: exact, where reading at the old place crashed (EINVAL, EFAULT, or a
    fault through mmap)."""

    def step(engine: OffloadEngine | None) -> torch.Tensor:
        torch.manual_seed(0)
        x = torch.randn(10000, requires_grad=True)
        h = x * 1.5
        y = h.sin()  # saves h
        if how == "storage":
            st = h.untyped_storage()
            st.resize_(st.nbytes())  # reallocated at another address, same bytes
        else:
            h.share_memory_()  # moved into a shared mapping (page-aligned)
        if engine is not None and path == "requeued":
            engine.flush()  # its write is skipped: it moved
        z = (x * 2).cos()  # a later save queues it (again)
        if engine is not None:
            engine.flush()
        (y.sum() + z.sum()).backward()
        assert x.grad is not None
        return x.grad

    ref = step(None)
    budget = {"device_budget": 45000} if path == "kept-by-budget" else {}
    with engine_with_hooks(save_dir, io_method=io_method, **budget) as engine:
        got = step(engine)
        assert engine.stats().bytes_offloaded > 0
        _assert_nothing_held(engine)
    assert torch.equal(ref, got)


@pytest.mark.parametrize("io_method", ["direct", "buffered"])
def test_a_saved_tensor_whose_storage_moves_while_its_write_reads_it(
    save_dir: Path, io_method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [moved storages] in writer.py: a storage reallocated while its write runs
    leaves the record in memory (what the write read is not the saved bytes), and
    backward reads it through the storage, exact; no in-place error is raised."""
    torch.manual_seed(0)
    x = torch.randn(3000, requires_grad=True)
    ref = 2 * (2 * x.detach()).cos()
    with engine_with_hooks(save_dir, io_method=io_method) as engine:
        h = x * 2
        y = h.sin()  # saves h
        real = engine._store.write

        def moving_write(*args: Any) -> None:
            st = h.untyped_storage()
            st.resize_(st.nbytes())  # moves now, as the write reads it
            real(*args)

        monkeypatch.setattr(engine._store, "write", moving_write)
        engine.flush()
        monkeypatch.setattr(engine._store, "write", real)
        assert engine.stats().writes_skipped == 1
        y.sum().backward()
        _assert_nothing_held(engine)
    assert torch.equal(x.grad, ref)


def test_a_storage_that_moves_while_its_write_reads_it_fails_no_other_record(
    save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [moved storages] in writer.py: a storage over glibc's largest heap request
    (an mmap of its own) that moves while a vectored write reads it makes the write
    fail (EFAULT: its old pages are gone). The write's other records are not written
    either, and stay in memory too: no disk error is reported, and backward is exact."""
    torch.manual_seed(0)
    w = torch.randn(1024, 1024, requires_grad=True)

    def step(engine: OffloadEngine | None) -> torch.Tensor:
        h = w.repeat(10, 1) * 3  # 40 MiB: a mapping of its own, let go when it moves
        a = h.sin()
        b = (w * 5).cos()  # the next extent: the same vectored write
        st = h.untyped_storage()
        if engine is not None:
            real = engine._store.write

            def moving_write(*args: Any) -> None:
                monkeypatch.setattr(engine._store, "write", real)
                st.resize_(st.nbytes() + 4096)  # moves now, as the write reads it
                real(*args)

            monkeypatch.setattr(engine._store, "write", moving_write)
            engine.flush()
        else:
            st.resize_(st.nbytes() + 4096)
        (a.sum() + b.sum()).backward()
        assert w.grad is not None
        grad, w.grad = w.grad, None
        return grad

    ref = step(None)
    kw = {"io_method": "buffered", "chunk_bytes": 64 << 20, "max_pending_write_bytes": 256 << 20}
    with engine_with_hooks(save_dir, **kw) as engine:
        got = step(engine)
        assert engine.stats().fallbacks == 0
        _assert_nothing_held(engine)
    assert torch.equal(ref, got)

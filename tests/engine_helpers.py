"""Helpers the tests share: a tiny model, exact gradient comparison, engines (on the
disk, or over the CPU twin of the CUDA path), a small real filesystem, and freed memory
poisoned on purpose."""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import mmap
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from prefetch_offload import OffloadConfig, OffloadEngine, arena, buffers, slab
from prefetch_offload.device import RoutingDevice, SpanCopyDevice
from prefetch_offload.freelist import FreeRuns
from prefetch_offload.io_pool import InlineIOPool, IOFuture
from prefetch_offload.testing import TinyTransformer

Grads = list[torch.Tensor]


class ZeroesItsSaved(torch.autograd.Function):
    """A backward that changes its saved tensor in place (illegal where another node
    still needs that tensor: autograd without hooks raises at that node's unpack)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        x.zero_()
        return grad * 2


class ReturnsLogits(torch.nn.Module):
    """Returns an op output (the logits) beside its result, which the block computes
    from them: a recompute reads the logits, and code after the block may write them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.a(x)
        z = logits.sum(-1, keepdim=True)  # saves nothing: legal to write logits later
        return logits, x + self.b(torch.tanh(x)) * z


def tiny_model(dtype: torch.dtype = torch.float32, *, seed: int = 0) -> TinyTransformer:
    """A 2-block, width-32 transformer with seeded weights."""
    torch.manual_seed(seed)
    return TinyTransformer(vocab=64, width=32, depth=2, heads=2).to(dtype)


def grads_of(model: torch.nn.Module) -> Grads:
    """Copies of the parameters' gradients (those that have one)."""
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_same_grads(a: Grads, b: Grads) -> None:
    """Bit-identical, and not vacuously: both non-empty and of the same length."""
    assert len(a) == len(b) and a
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x - y).abs().max()


def reference_grads(model: torch.nn.Module, fn: Callable[[torch.nn.Module], None]) -> Grads:
    """The gradients ``fn`` produces on a copy of ``model`` with no hooks installed."""
    ref = copy.deepcopy(model)
    fn(ref)
    return grads_of(ref)


@contextlib.contextmanager
def engine_with_hooks(
    save_dir: Path, *, inline: bool = False, **kw: Any
) -> Iterator[OffloadEngine]:
    """An engine with its hooks installed, built directly (lets tests pick the pool)."""
    kw.setdefault("min_offload_bytes", 0)
    if inline:  # the reference path: each record written as it is packed
        kw.setdefault("chunk_bytes", 4096)
    cfg = OffloadConfig(target="disk", save_dir=str(save_dir), **kw)
    engine = OffloadEngine(cfg, pool=InlineIOPool() if inline else None)
    try:
        with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
            yield engine
    finally:
        engine.close(raise_errors=False)


def slow_store(
    engine: OffloadEngine, monkeypatch: pytest.MonkeyPatch, method: str, sec: float
) -> None:
    """Slow the slab store's ``write`` or ``read`` down (an IO seam for tests)."""
    real = getattr(engine._store, method)

    def slow(*args: Any) -> None:
        time.sleep(sec)
        real(*args)

    monkeypatch.setattr(engine._store, method, slow)


@contextlib.contextmanager
def twin_with_hooks(
    target: str,
    save_dir: Path,
    *,
    delay: float = 0.0,
    layer_kw: dict[str, Any] | None = None,
    **kw: Any,
) -> Iterator[tuple[OffloadEngine, SpanCopyDevice]]:
    """An engine with hooks over the CPU twin; ``layer_kw`` goes to SpanCopyDevice."""
    kw.setdefault("min_offload_bytes", 0)
    if target == "disk":
        kw["save_dir"] = str(save_dir)
        kw.setdefault("chunk_bytes", 16384)  # small write batches: the tiny model's go to disk
    layer = SpanCopyDevice(
        "cpu",
        twin_delay=delay,
        max_inflight_bytes=kw.get("max_pending_write_bytes", 64 << 20),
        **(layer_kw or {}),
    )
    engine = OffloadEngine(OffloadConfig(target=target, **kw), device=RoutingDevice([layer]))
    try:
        with torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack):
            yield engine, layer
    finally:
        engine.close(raise_errors=False)


@contextlib.contextmanager
def mounted_tmpfs(where: Path, size: str, *, read_only: bool = False) -> Iterator[Path]:
    """A real small filesystem at ``where``; skips the test where mounting is not allowed."""
    where.mkdir()
    opts = f"size={size}" + (",ro" if read_only else "")
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
            capture_output=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount tmpfs here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=20)


POISON = 0xFF


class Poisoned:
    """Counts of what was overwritten (a test that poisoned nothing proves nothing)."""

    def __init__(self) -> None:
        self.buffers = 0
        self.arena_runs = 0
        self.extents = 0


def _fill(buffer: Any, lo: int, hi: int) -> None:
    np.frombuffer(buffer, dtype=np.uint8)[lo:hi] = POISON


def poison_freed_memory(monkeypatch: pytest.MonkeyPatch, *, jitter_s: float = 0.002) -> Poisoned:
    """From now on (until ``monkeypatch`` undoes it), every read buffer returned to a
    read pool, every run returned to an arena and every slab extent freed is
    overwritten with 0xFF bytes (NaN in a float) before anything can reuse it, and
    each IO job starts after a random delay of up to ``jitter_s`` (seeded), which
    shuffles which job, and which thread, goes first."""
    seen = Poisoned()
    give_back = buffers.HostBufferPool._give_back

    def poison_block(self: buffers.HostBufferPool, block: buffers.Block) -> None:
        _fill(block.buffer, 0, block.size)
        seen.buffers += 1
        give_back(self, block)

    def poison_run(self: arena._Arena, offset: int, length: int) -> None:
        _fill(self.block.buffer, offset, offset + length)
        seen.arena_runs += 1
        FreeRuns.give(self, offset, length)

    def poison_extent(self: slab._Slab, offset: int, length: int) -> None:
        if self.mm is not None:
            _fill(self.mm, offset, offset + length)
        else:
            junk = mmap.mmap(-1, length)  # page-aligned: fine for O_DIRECT files too
            junk.write(bytes([POISON]) * length)
            try:
                assert os.pwrite(self.fd, junk, offset) == length
            finally:
                junk.close()
        seen.extents += 1
        FreeRuns.give(self, offset, length)

    rng = random.Random(1234)
    run = IOFuture.run

    def late_run(self: IOFuture[Any]) -> None:
        time.sleep(rng.random() * jitter_s)
        run(self)

    monkeypatch.setattr(buffers.HostBufferPool, "_give_back", poison_block)
    monkeypatch.setattr(arena._Arena, "give", poison_run)
    monkeypatch.setattr(slab._Slab, "give", poison_extent)
    monkeypatch.setattr(IOFuture, "run", late_run)
    return seen


def on_ranks(world: int, body: Callable[[Any], Any], store: Any = None) -> list[Any]:
    """``body(agreement)`` on ``world`` threads, each a rank sharing one store (NOTE
    [ranks agree] in agreement.py); what each returned, or the exception it raised."""
    import torch.distributed as dist

    from prefetch_offload.agreement import RankAgreement

    store = dist.HashStore() if store is None else store
    results: list[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            results[rank] = body(RankAgreement(store, rank, world, name="t"))
        except Exception as err:  # (returned, for the test to check)
            results[rank] = err

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return results


def on_two_processes(target: Callable[..., None], *args: Any) -> None:
    """``target(rank, *args)`` in two spawned processes, each a rank of one gloo process
    group (rendezvous through a file); raises what either raised."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        mp.start_processes(
            _gloo_rank, args=(target, store, *args), nprocs=2, join=True, start_method="spawn"
        )


def _gloo_rank(rank: int, target: Callable[..., None], store: str, *args: Any) -> None:
    """One rank of :func:`on_two_processes`: joins the group, runs ``target(rank,
    *args)``, waits for the other rank, and exits the process at once.

    The exit skips tearing gloo down: gloo's teardown in two processes ending together
    aborted a rank now and then ("terminate called without an active exception"),
    with or without offload, after both had passed the barrier and saved their
    results. A fatal signal (SIGABRT, SIGSEGV) prints every thread's Python stack."""
    import torch.distributed as dist

    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    target(rank, *args)
    dist.barrier()  # the other rank is done too
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def hang_guard(seconds: int) -> Iterator[None]:
    """Fail with TimeoutError where the body still runs after ``seconds`` (a wait that
    nothing will end; the main thread's waits on locks are interruptible)."""

    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError(f"still running after {seconds} s: a wait that never ends")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_in_threads(
    target: Callable[[int], None], n: int = 2, *, timeout: float | None = None
) -> None:
    """``target(i)`` on ``n`` threads at once; returns once every one has ended (asserts
    that none is still running after ``timeout``)."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads)

"""The offload engine: the saved-tensor hooks and the state behind them.

One :class:`OffloadEngine` serves one ``offload_context``. Its ``pack`` hook
turns an eligible saved tensor into a small :class:`_Handle` at once and queues
the tensor's bytes for writing; its ``unpack`` hook turns the handle back into a
tensor equal in value, shape, strides, dtype and device.

# NOTE [record lifetime]
# Autograd owns the handles. Every handle of one saved tensor (see NOTE
# [dedup]) points at one _Record, which lives while any handle, or a write job
# still reading its source tensor, references it. The engine and the scheduler
# hold records only weakly. When a record dies, its extent is queued for release
# with a deque append (safe from any thread, including inside the garbage
# collector) and returned to the allocator at the next hook call, ``stats()``
# call, or context exit. So slab space is freed when autograd releases the
# saved tensor, not at unpack, and ``backward(retain_graph=True)`` can read it
# again. Records hold the engine strongly: a graph built inside the context
# stays usable after it exits, and the slab files close when the last record
# and the last user reference to the engine are gone.
#
# NOTE [memory handed to autograd]
# Unpack returns either the original tensor (its write had not finished, or it
# was never written) or a fresh allocation that the read filled. The engine
# never writes into memory it has handed out, and keeps only a weak reference to
# it (so that a second handle of the same record gets the same tensor instead of
# a second read). Buffers are never pooled on this path, so none can be reused
# while autograd still holds a view of it.
#
# NOTE [dedup]
# The same tensor is often saved by several ops (a layer's input feeds q, k and
# v projections). A pack whose (storage, data_ptr, shape, stride, dtype,
# version) matches a live record shares it. Storage identity is checked with a
# weak reference to the storage object, not by address: a freed tensor's
# address is reused by the next allocation, and a dead weak reference can never
# match a new storage. The version counter catches in-place updates between
# two saves.
#
# NOTE [targets]
# Target "disk" writes each record's host bytes to a slab and lets go of them.
# Target "cpu" stops after the device layer: the record keeps the host copy (for
# CUDA tensors, a pinned CPU copy; CPU tensors are not taken at all, they are
# host memory already). Both share the record, dedup and lifetime machinery.
#
# NOTE [errors from workers]
# A write that fails leaves the record's source tensor in memory, so nothing is
# lost. A full disk (ENOSPC/EDQUOT, or ``disk_bytes_limit``) is expected
# operation: one warning, a fallback count, training goes on. Any other write
# error is stored and raised as OffloadIOError at the next pack or unpack call,
# or at context exit. A failed read raises OffloadIOError at the unpack that
# needed it, naming the tensor and chaining the OSError.
"""

from __future__ import annotations

import collections
import errno
import functools
import threading
import time
import warnings
import weakref
from typing import Any

import torch

from .config import OffloadConfig
from .device import DeviceLayer, default_device_layer
from .errors import OffloadError, OffloadFallbackWarning, OffloadIOError
from .io_pool import READ, WRITE, InlineIOPool, IOFuture, IOPool, ThreadIOPool
from .packed import PackedLayout, describe, new_read_buffer, source_buffer
from .scheduler import PrefetchScheduler
from .slab import Extent, SlabStore, prepare_save_dir
from .stats import OffloadStats, StatsCounter

__all__ = ["OffloadEngine"]

_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class _Handle:
    """What autograd stores for an offloaded tensor. Holds its record alive."""

    __slots__ = ("record",)

    def __init__(self, record: _Record) -> None:
        self.record = record

    def __repr__(self) -> str:
        return f"<prefetch_offload handle {self.record.describe()}>"


class _Record:
    """One offloaded tensor: its layout, where its bytes are, and what is in memory."""

    __slots__ = (
        "__weakref__",
        "device",
        "engine",
        "extent",
        "layout",
        "on_disk",
        "pos",
        "prefetch",
        "restored",
        "seq",
        "source",
        "write_error",
        "writes_left",
    )

    def __init__(
        self,
        engine: OffloadEngine,
        layout: PackedLayout,
        extent: Extent | None,
        source: torch.Tensor,
        device: torch.device,
        seq: int,
    ) -> None:
        self.engine = engine
        self.layout = layout
        self.extent: Extent | None = extent
        # The original tensor while its bytes are not safely on disk.
        self.source: torch.Tensor | None = source
        self.device = device
        self.seq = seq
        self.pos = -1
        self.on_disk = False
        self.writes_left = 0
        self.write_error: OSError | None = None
        self.prefetch: IOFuture[torch.Tensor] | None = None
        self.restored: weakref.ref[torch.Tensor] | None = None

    def describe(self) -> str:
        lay = self.layout
        return (
            f"saved tensor #{self.seq} (shape {list(lay.shape)}, {lay.dtype}, "
            f"{lay.span_bytes} bytes)"
        )

    # Scheduler protocol -------------------------------------------------------------

    def needs_read(self) -> bool:
        if not self.on_disk or self.source is not None or self.prefetch is not None:
            return False
        return self.restored is None or self.restored() is None

    def drop_prefetch(self) -> None:
        fut, self.prefetch = self.prefetch, None
        if fut is not None:
            fut.cancel()

    def __del__(self) -> None:
        # NOTE [record lifetime]: never take a lock here.
        try:
            self.engine._dead.append(self.extent)
        except Exception:  # interpreter shutdown
            pass


class _NullEngine:
    """What ``offload_context(None)`` yields: no hooks, all-zero stats."""

    config = None

    def stats(self) -> OffloadStats:
        """All-zero statistics."""
        return OffloadStats()


class OffloadEngine:
    """The state of one offload context; its ``pack``/``unpack`` are the hooks.

    Use it through :func:`prefetch_offload.offload_context`; the object yielded by
    the ``with`` statement is this engine, for ``stats()``.
    """

    def __init__(
        self,
        config: OffloadConfig,
        *,
        device: DeviceLayer | None = None,
        pool: IOPool | None = None,
    ) -> None:
        if config.target not in ("cpu", "disk"):
            raise ValueError(
                "prefetch_offload: OffloadEngine needs target 'cpu' or 'disk', "
                f"got {config.target!r}; use offload_context(None) to disable offloading."
            )
        self.config = config
        # NOTE [targets]: "cpu" keeps host copies in records; "disk" writes them to slabs.
        self._store: SlabStore | None = None
        if config.target == "disk":
            assert config.save_dir is not None  # checked by OffloadConfig
            prepare_save_dir(config.save_dir)
            self._store = SlabStore(
                config.save_dir,
                slab_bytes=config.slab_bytes,
                io_method=config.io_method,
                disk_bytes_limit=config.disk_bytes_limit,
            )
        if self._store is not None:
            self._finalizer = weakref.finalize(self, self._store.close)
        self._device = device or default_device_layer(config.target)
        self._lock = threading.Lock()
        self._writes_idle = threading.Condition(self._lock)
        self._pending_write_bytes = 0
        # Write jobs in submission order (NOTE [record lifetime]: flush waits on them).
        self._write_futs: collections.deque[IOFuture[None]] = collections.deque()
        self._stats = StatsCounter()
        self._scheduler = PrefetchScheduler(config.prefetch_depth)
        self._dedup: dict[tuple[Any, ...], tuple[Any, int, weakref.ref[_Record]]] = {}
        self._dead: collections.deque[Extent | None] = collections.deque()
        self._error: BaseException | None = None
        self._warned_full = False
        self._seq = 0
        self._closed = False
        # ``pool`` lets tests run the inline reference pool instead of threads.
        if pool is None:
            pool = ThreadIOPool(config.io_workers) if self._store is not None else InlineIOPool()
        self._pool: IOPool = pool

    # -- public ---------------------------------------------------------------------------

    @property
    def io_method(self) -> str:
        """The byte mover in use: "direct", "buffered", "mmap", or "none" (target "cpu")."""
        return self._store.io_method if self._store is not None else "none"

    def stats(self) -> OffloadStats:
        """A snapshot of the counters (see :class:`OffloadStats`)."""
        self._drain_dead(blocking=True)
        store = self._store
        if store is not None:
            self._stats.set(
                disk_bytes_reserved=store.reserved_bytes,
                disk_bytes_in_use=store.used_bytes,
                peak_disk_bytes_reserved=store.peak_reserved_bytes,
                peak_disk_bytes_in_use=store.peak_used_bytes,
            )
        return self._stats.snapshot()

    def flush(self) -> None:
        """Block until every queued write has finished; raise a stored worker error."""
        self._wait_writes()
        self._raise_pending()

    def _wait_writes(self) -> None:
        """Wait until every write job has finished and dropped its record."""
        futs = self._write_futs
        while True:
            with self._lock:
                while futs and futs[0].done():
                    futs.popleft()
                if not futs:
                    return
                fut = futs[0]
            fut.wait()

    # -- pack -----------------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Any:
        """Saved-tensor pack hook: a handle for an offloaded tensor, else ``t`` itself."""
        self._raise_pending()
        self._drain_dead(blocking=True)
        if self._closed:
            raise OffloadError(
                "prefetch_offload: pack hook called after its offload_context exited; "
                "create a new context for new forward passes."
            )
        if not self._eligible(t):
            self._stats.add(tensors_kept=1)
            return t
        storage = t.untyped_storage()
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        version = t._version
        with self._lock:
            entry = self._dedup.get(key)
            if entry is not None:
                sref, ver, rref = entry
                rec = rref()
                if rec is not None and ver == version and sref() is storage:
                    self._stats.add(dedup_hits=1)
                    return _Handle(rec)
        host = self._device.to_host(t)
        layout = describe(host)
        store = self._store
        extent = None
        if store is not None:
            try:
                extent = store.allocate(layout.extent_bytes)
            except OSError as exc:
                raise OffloadIOError(
                    f"prefetch_offload: could not create a slab file in "
                    f"{self.config.save_dir!r}: {exc}. Check the folder's permissions and space."
                ) from exc
            if extent is None:
                self._note_no_space("the slab reservation failed")
                return t
        with self._lock:
            rec = _Record(self, layout, extent, host, t.device, self._seq)
            self._seq += 1
            self._scheduler.register(rec)
            self._dedup[key] = (weakref.ref(storage), version, weakref.ref(rec))
        if store is None:  # NOTE [targets]: the host copy is the offloaded tensor
            self._stats.add(tensors_offloaded=1, bytes_offloaded=layout.span_bytes)
        else:
            self._queue_write(rec, host)
        return _Handle(rec)

    def _eligible(self, t: torch.Tensor) -> bool:
        """Whether ``t`` goes to disk. Everything else stays in memory, unchanged."""
        if type(t) is not torch.Tensor or t.layout is not torch.strided:
            return False  # subclasses (incl. Parameter), sparse, mkldnn
        if not self._device.accepts(t) or t.is_quantized or t.is_nested:
            return False
        if t.is_conj() or t.is_neg() or torch.is_inference(t):
            return False
        # Autograd hands over views of parameters (weight.t()), not the Parameter.
        base = t._base if t._base is not None else t
        if isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad):
            return False
        itemsize = t.element_size()
        if itemsize == 0 or t.data_ptr() % itemsize:
            return False
        n = t.numel()
        if n == 0:
            return False
        return n * itemsize >= self.config.min_offload_bytes

    def _queue_write(self, rec: _Record, host: torch.Tensor) -> None:
        layout = rec.layout
        nbytes = layout.extent_bytes
        chunk = self.config.chunk_bytes
        cap = self.config.max_pending_write_bytes
        with self._lock:
            if self._pending_write_bytes and self._pending_write_bytes + nbytes > cap:
                start = time.perf_counter()
                while self._pending_write_bytes and self._pending_write_bytes + nbytes > cap:
                    self._writes_idle.wait()
                self._stats.add(pack_wait_seconds=time.perf_counter() - start)
            self._pending_write_bytes += nbytes
            self._stats.set_max("peak_pending_write_bytes", self._pending_write_bytes)
            rec.writes_left = -(-nbytes // chunk)
        src = source_buffer(host, layout)
        submitted = [
            self._pool.submit(
                functools.partial(self._write, rec, off, src[off : off + chunk]), WRITE
            )
            for off in range(0, nbytes, chunk)
        ]
        with self._lock:
            futs = self._write_futs
            while futs and futs[0].done():
                futs.popleft()
            futs.extend(submitted)

    def _write(self, rec: _Record, off: int, view: memoryview) -> None:
        """IO job: write one chunk; the last chunk of a record publishes the outcome."""
        exc: OSError | None = None
        try:
            assert rec.extent is not None and self._store is not None
            self._store.write(rec.extent, off, view)
        except OSError as e:
            exc = e
        finally:
            view.release()
        with self._lock:
            rec.writes_left -= 1
            if exc is not None and rec.write_error is None:
                rec.write_error = exc
            if rec.writes_left:
                return
            self._pending_write_bytes -= rec.layout.extent_bytes
            self._writes_idle.notify_all()
            failed = rec.write_error
            if failed is None:
                rec.on_disk = True
                rec.source = None  # NOTE [record lifetime]: the activation can go now
                self._stats.add(tensors_offloaded=1, bytes_offloaded=rec.layout.span_bytes)
                return
            extent, rec.extent = rec.extent, None
        if extent is not None:
            self._store.free(extent)  # type: ignore[union-attr]
        self._write_failed(rec, failed)

    def _write_failed(self, rec: _Record, exc: OSError) -> None:
        """NOTE [errors from workers]: the record keeps its source in memory."""
        self._stats.add(fallbacks=1)
        if exc.errno in _SPACE_ERRNOS:
            self._note_no_space(f"a write failed ({exc.strerror})", counted=True)
            return
        err = OffloadIOError(
            f"prefetch_offload: writing {rec.describe()} to {self.config.save_dir!r} failed: "
            f"{exc}. The tensor was kept in memory; check the disk and the folder."
        )
        err.__cause__ = exc
        with self._lock:
            if self._error is None:
                self._error = err

    def _note_no_space(self, what: str, *, counted: bool = False) -> None:
        if not counted:
            self._stats.add(fallbacks=1)
        if self._warned_full:
            return
        self._warned_full = True
        limit = self.config.disk_bytes_limit
        cap = f" or disk_bytes_limit={limit} was reached" if limit is not None else ""
        warnings.warn(
            f"prefetch_offload: no space left for activations in {self.config.save_dir!r}"
            f"{cap} ({what}); tensors that do not fit stay in memory. Free disk space, "
            "raise disk_bytes_limit, or pick another save_dir.",
            OffloadFallbackWarning,
            stacklevel=3,
        )

    # -- unpack ---------------------------------------------------------------------------

    def unpack(self, packed: Any) -> torch.Tensor:
        """Saved-tensor unpack hook: the tensor that ``pack`` was given, restored."""
        if not isinstance(packed, _Handle):
            return packed
        self._raise_pending()
        rec = packed.record
        src = rec.source
        if src is not None:
            self._stats.add(prefetch_hits=1)
            self._prefetch_after(rec)
            out = self._device.to_device(src, rec.device)
            rec.restored = weakref.ref(out)
            return out
        prior = rec.restored() if rec.restored is not None else None
        if prior is not None:
            self._stats.add(prefetch_hits=1)
            self._prefetch_after(rec)
            return prior
        with self._lock:
            fut, rec.prefetch = rec.prefetch, None
            if fut is not None:
                self._scheduler.consumed(rec)
        self._prefetch_after(rec)
        host = self._collect(rec, fut)
        out = self._device.to_device(host, rec.device)
        rec.restored = weakref.ref(out)
        return out

    def _collect(self, rec: _Record, fut: IOFuture[torch.Tensor] | None) -> torch.Tensor:
        """The read's result, counting a hit if it was ready and stall time if not."""
        if fut is not None and fut.done():
            self._stats.add(prefetch_hits=1)
            return self._read_result(rec, fut)
        start = time.perf_counter()
        if fut is None:
            fut = IOFuture(self._read_job(rec))
        if fut.claim():  # NOTE [claiming jobs]: read here rather than queue behind others
            fut.run()
        try:
            return self._read_result(rec, fut)
        finally:
            self._stats.add(prefetch_misses=1, stall_seconds=time.perf_counter() - start)

    def _read_result(self, rec: _Record, fut: IOFuture[torch.Tensor]) -> torch.Tensor:
        try:
            return fut.result()
        except OSError as exc:
            raise OffloadIOError(
                f"prefetch_offload: reading {rec.describe()} back from {self.config.save_dir!r} "
                f"failed: {exc}. The gradient cannot be computed without it."
            ) from exc

    def _read_job(self, rec: _Record) -> Any:
        # The job must not reference the record: the record holds the job's future.
        extent, layout = rec.extent, rec.layout
        store, chunk, stats = self._store, self.config.chunk_bytes, self._stats
        assert extent is not None and store is not None

        def job() -> torch.Tensor:
            out, region = new_read_buffer(layout)
            with region:
                for off in range(0, layout.extent_bytes, chunk):
                    store.read(extent, off, region[off : off + chunk])
            stats.add(bytes_read=layout.span_bytes)
            return out

        return job

    def _prefetch_after(self, rec: _Record) -> None:
        """Issue reads for the lookahead window below ``rec`` (NOTE [lookahead])."""
        if self._closed or self.config.prefetch_depth == 0 or self._store is None:
            return
        with self._lock:
            for cand in self._scheduler.window(rec):
                assert isinstance(cand, _Record)
                cand.prefetch = self._pool.submit(self._read_job(cand), READ)
                self._scheduler.issued(cand, rec)

    # -- lifetime -------------------------------------------------------------------------

    def _drain_dead(self, *, blocking: bool) -> None:
        """Return dead records' extents to the allocator (NOTE [record lifetime])."""
        dead = self._dead
        if not dead:
            return
        if not self._lock.acquire(blocking=blocking):
            return
        try:
            while dead:
                extent = dead.popleft()
                self._scheduler.forget()
                if extent is not None and self._store is not None:
                    self._store.free(extent)
            stale = [k for k, (_, _, rref) in self._dedup.items() if rref() is None]
            for k in stale:
                del self._dedup[k]
        finally:
            self._lock.release()

    def _raise_pending(self) -> None:
        if self._error is not None:
            with self._lock:
                err, self._error = self._error, None
            if err is not None:
                raise err

    def close(self, *, raise_errors: bool = True) -> None:
        """Finish pending writes, stop the IO threads, release unused slabs.

        Later unpacks (a graph used after the context) read synchronously.
        Raises a stored worker error if ``raise_errors``, else warns with it.
        """
        if self._closed:
            return
        self._wait_writes()
        with self._lock:
            self._closed = True
            self._scheduler.clear()
        self._pool.shutdown()
        self._pool = InlineIOPool()
        self._drain_dead(blocking=True)
        if self._store is not None:
            self._store.trim()
        err, self._error = self._error, None
        if err is not None:
            if raise_errors:
                raise err
            warnings.warn(f"{err} (raised while another exception was propagating)", stacklevel=2)

    @property
    def closed(self) -> bool:
        """Whether the owning context has exited."""
        return self._closed

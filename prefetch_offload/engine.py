"""The offload engine: the saved-tensor hooks, tying the engine's parts together.

One :class:`OffloadEngine` serves one ``offload_context``. Its ``pack`` hook
turns an eligible saved tensor into a small handle at once (records.py); the
tier policy (policy.py) decides which records stay where they were made and
which are demoted to host memory or disk, the write path (writer.py) moves
their bytes into slab extents, and its ``unpack`` hook gets them back through
the read path (reader.py), which prefetches in the order the plan (plan.py)
predicts. The engine owns the lock they share, the dedup table, the record
lifetimes and the errors that IO threads report.

# NOTE [unpack threads]
# Autograd runs a backward's nodes on one thread per device, and separate
# backward calls may run on threads of their own, so unpack can run on several
# threads at once. Everything unpack changes that is shared goes under the
# engine lock: the switch into backward (exactly one thread skips the write
# tail and sizes the window), the graph tasks whose ends are awaited, the pass
# numbers (NOTE [backward passes]), the plan (each step's prediction starts at
# its first unpack) and prefetch state. The
# record's span is then materialized outside the lock; two threads asking for
# one record at once both get a correct span (at worst read twice).
#
# NOTE [packs inside backward]
# A tensor saved while a backward runs (the pack hook called inside a graph
# task) that does not keep its graph, or by a reentrant checkpoint's node,
# stays where it is, counted as kept (``kept_in_backward``). That is reentrant
# checkpointing: it recomputes a segment there and its inner backward unpacks
# the segment's tensors at once, so moving them would cost a write and a read
# each for nothing (on
# bench/step.py's transformer at 6 blocks, every block checkpointed, about what
# forward saves without checkpointing, 248.6 MiB per step, against the 15-17 MB
# forward saves with it: docs/results/step-checkpoint.json). With
# non-reentrant checkpointing the recompute never reaches these hooks, so it
# stays in memory there too. A backward that keeps its graph (``create_graph``,
# ``retain_graph=True``) saves for a later backward, the next derivative's
# tensors: those are offloaded like forward's, in no step of the plan (reverse
# pack order), and without switching the engine to forward (no step starts, no
# budget is enforced on older records, until packs come from outside a
# backward): such a record is demoted itself when its tier is over budget, not
# the oldest records, which the write tail kept for the backward now using them.
# A reentrant checkpoint's recompute under ``retain_graph=True`` is told apart by
# the node running (``CheckpointFunctionBackward``, as torch.utils.checkpoint and
# DeepSpeed name theirs) and stays in memory too.
#
# NOTE [errors from workers]
# A write that fails leaves the record's source tensor in memory, so nothing is
# lost. A full disk (ENOSPC/EDQUOT, or ``disk_bytes_limit``) is expected
# operation: one warning, a fallback count, training goes on. Any other write
# error is stored and raised as OffloadIOError at the next pack or unpack call,
# or at context exit. A failed read raises OffloadIOError at the unpack that
# needed it, naming the tensor and chaining the OSError.
#
# NOTE [fork]
# A process forked while an engine is active (a DataLoader worker started with
# "fork") inherits the hooks in its main thread, but none of the engine's
# threads, and the slab files and free lists it shares with the parent. So in
# the child every engine keeps what it is given in memory, an unpack of a
# tensor the parent offloaded raises OffloadError instead of waiting for IO
# threads that do not exist, and close only marks the engine closed. Nothing
# there takes an engine lock (a parent thread may have held one at the fork,
# held in the child for good): no stats (all zero) and no learned order, and
# the finalizers that would close the parent's files at exit are detached.
#
# NOTE [reads outside backward]
# A saved tensor read outside any backward (``grad_fn._saved_self`` during
# forward, a graph drawn by torchviz) is restored for the caller and changes
# nothing else: the engine does not switch into backward (which would drop the
# write tail mid-forward and cut the step in two for the learned order), no
# backward pass is stamped, the plan learns nothing, and nothing is prefetched
# or kept among the recent spans.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .checkpointing import CheckpointStats, as_policy, graph_kept, selective_contexts
from .config import OffloadConfig
from .device import DeviceLayer, default_device_layer
from .errors import ErrorSlot, OffloadError, OffloadFallbackWarning
from .heap import AUTO_TRIM_MIN_BYTES, AUTO_TRIM_STEP_SHARE, HeapTrimmer
from .io_pool import InlineAfterShutdown, InlineIOPool, IOPool, ThreadIOPool
from .packed import ALIGN, Span, ViewMeta, is_dense, make_view, view_span
from .plan import PrefetchPlan, current_group_key
from .policy import DEVICE, DISK, HOST, TierPolicy
from .profiling import profiler_range
from .reader import AUTO_WINDOW_MAX, AUTO_WINDOW_START, ReadPath
from .recompute_plan import RecomputePlan, RecordingDecider, StepDecider
from .records import DedupEntry, Handle, Kept, Record, Resident, Wrapped, is_dtensor
from .slab import Extent, SlabStore, prepare_save_dir
from .stats import OffloadStats, StatsCounter
from .streams import Fence, capture_isolated, capturing, joined_fence
from .writer import WritePath

__all__ = ["OffloadEngine"]

logger = logging.getLogger("prefetch_offload")

# The running backward's graph task id (-1 outside backward; -2 if torch lacks it).
_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -2)
_current_node: Callable[[], Any] = getattr(torch._C, "_current_autograd_node", lambda: None)


def _recomputing() -> bool:
    """Whether a reentrant checkpoint's backward runs now (NOTE [packs inside backward])."""
    node = _current_node()
    return node is not None and node.name() == "CheckpointFunctionBackward"


# NOTE [fork]: every engine alive, to mark in a forked child.
_ENGINES: weakref.WeakSet[OffloadEngine] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for engine in list(_ENGINES):
        engine._forked = True
        for finalizer in engine._finalizers:  # at exit they would take the parent's locks
            finalizer.detach()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class OffloadEngine:
    """The state of one offload context; its ``pack``/``unpack`` are the hooks.

    Use it through :func:`prefetch_offload.offload_context`; the object yielded by
    the ``with`` statement is this engine, for ``stats()`` and ``flush()``.

    Example:
        >>> with offload_context("disk", save_dir="/tmp/acts") as engine:  # doctest: +SKIP
        ...     loss = model(batch)
        ...     engine.flush()        # every saved tensor is on disk now
        ...     loss.backward()
        >>> engine.stats().prefetch_hits  # doctest: +SKIP
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
        self._forked = False  # NOTE [fork]
        self._finalizers: list[weakref.finalize[Any, Any]] = []
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
            self._finalizers.append(weakref.finalize(self, self._store.close))
        self._device = device or default_device_layer(
            config.target, max_inflight_bytes=config.max_inflight_copy_bytes
        )
        if config.host_budget is not None:  # NOTE [tiers]: the pinned arena's cap
            window = config.prefetch_bytes or AUTO_WINDOW_MAX
            self._device.set_host_budget(
                config.host_budget
                + config.max_pending_write_bytes
                + config.max_inflight_copy_bytes
                + 2 * window
            )
        store = self._store
        verdict: bool | None = True
        if (
            store is not None
            and store.io_method == "direct"
            and config.io_method == "auto"
            and torch.cuda.is_available()
        ):
            verdict = self._device.direct_io_ok(store.directory)
        # NOTE [direct IO from pinned memory]: None asks again at the first CUDA tensor.
        self._direct_pending = verdict is None
        self._direct_lock = threading.Lock()
        if verdict is False:
            assert store is not None
            store.use_buffered()  # NOTE [direct IO from pinned memory]: the page cache
        # Per device, records whose device-to-host copy may still run, oldest first (NOTE
        # [version check]): copies on one device's stream end in order, across devices not.
        self._copying: dict[
            torch.device | None, collections.deque[tuple[Fence, weakref.ref[Record]]]
        ] = {}
        self._lock = threading.Lock()
        self._stats = StatsCounter()
        self._plan = PrefetchPlan(
            config.prefetch_depth, window_bytes=config.prefetch_bytes or AUTO_WINDOW_START
        )
        self._policy = TierPolicy(config.device_budget, config.host_budget)
        # Storage address -> spans of live records in it (NOTE [dedup]).
        self._dedup: dict[int, list[DedupEntry]] = {}
        # Dead records' extents, dedup keys, tiers, bytes and seqs (NOTE [record lifetime]).
        self._dead: collections.deque[tuple[Extent | None, int, int, int, int]] = (
            collections.deque()
        )
        self._errors = ErrorSlot()  # NOTE [errors from workers]
        self._warned_host = False  # NOTE [tiers]: host budget exhausted with no disk
        self._warned_cpu_budget = False
        self._seq = 0
        self._pass_no = 0  # NOTE [backward passes]
        self._closer: threading.Thread | None = None  # an interrupted close, finishing
        self._closed = False
        self._in_backward = False
        # NOTE [recently restored]: the graph tasks whose ends final callbacks await,
        # and the thread each one unpacked on first.
        self._end_tasks: dict[int, int] = {}
        # NOTE [learned order]: the signatures records are given, each one tuple.
        self._signatures: dict[tuple[torch.dtype, int], tuple[torch.dtype, int]] = {}
        # ``pool`` lets tests run the inline reference pool instead of threads.
        if pool is None:
            pool = ThreadIOPool(config.io_workers) if self._store is not None else InlineIOPool()
        # An engine dropped without close() (built directly) still stops its threads.
        self._finalizers.append(weakref.finalize(self, pool.shutdown, wait=False))
        # Later unpacks of a graph used after exit read synchronously.
        pool = self._pool = InlineAfterShutdown(pool)
        self._writer: WritePath | None = None
        if self._store is not None:
            self._writer = WritePath(
                config,
                self._store,
                pool,
                self._stats,
                self._lock,
                self._policy,
                self._errors.report,
            )
        self._reader = ReadPath(
            config, self._store, self._device, pool, self._stats, self._lock, self._plan
        )
        # NOTE [heap trim]: glibc's free heap pages go back when they have built up.
        read_pool = self._reader.read_pool
        auto_trim = config.heap_trim_bytes == "auto"
        self._heap = HeapTrimmer(
            AUTO_TRIM_MIN_BYTES if auto_trim else config.heap_trim_bytes,  # type: ignore[arg-type]
            self._stats,
            own_bytes=lambda: read_pool.mapped_bytes,
            # The budget's unfilled share may be slack (read without the lock: a stale
            # value moves a trim by a hook; no reference back to the engine).
            allowance=functools.partial(self._policy.headroom, DEVICE),
            step_share=AUTO_TRIM_STEP_SHARE if auto_trim else None,
        )
        self._moved_before_step = 0  # policy.demoted[DISK] when this step began
        # NOTE [keep, offload, recompute] in recompute.py: what selective checkpoints
        # kept, offloaded and recomputed, and the decider recompute= installed (if any).
        self._ckpt_stats = CheckpointStats()
        self._decider: StepDecider | None = None
        _ENGINES.add(self)  # NOTE [fork]

    # -- public -----------------------------------------------------------------------------

    @property
    def io_method(self) -> str:
        """The byte mover in use: "direct", "buffered", "mmap", or "none" (target "cpu")."""
        return self._store.io_method if self._store is not None else "none"

    @property
    def closed(self) -> bool:
        """Whether the owning context has exited."""
        return self._closed

    def stats(self) -> OffloadStats:
        """A snapshot of the counters (see :class:`OffloadStats`); all zero in a forked
        child (NOTE [fork])."""
        if self._forked:
            return OffloadStats()
        self._drain_dead()
        store = self._store
        if store is not None:
            self._stats.set(
                disk_bytes_reserved=store.reserved_bytes,
                disk_bytes_in_use=store.used_bytes,
                peak_disk_bytes_reserved=store.peak_reserved_bytes,
                peak_disk_bytes_in_use=store.peak_used_bytes,
            )
        self._stats.set(
            copy_wait_seconds=self._device.copy_wait_seconds(),
            pageable_fallbacks=self._device.pageable_fallbacks(),
        )
        with self._lock:
            policy = self._policy
            self._stats.set(
                device_tier_bytes=policy.bytes[DEVICE],
                host_tier_bytes=policy.bytes[HOST],
                disk_tier_bytes=policy.bytes[DISK],
                peak_device_tier_bytes=policy.peak[DEVICE],
                peak_host_tier_bytes=policy.peak[HOST],
                peak_disk_tier_bytes=policy.peak[DISK],
                bytes_demoted_to_host=policy.demoted[HOST],
                bytes_demoted_to_disk=policy.demoted[DISK],
                bytes_packed=policy.admitted,
                predicted_steps=self._plan.predicted_steps,
            )
        kept, offloaded, recomputed = self._ckpt_stats.last_step()
        self._stats.set(
            step_bytes_kept=kept, step_bytes_offloaded=offloaded, step_bytes_recomputed=recomputed
        )
        return self._stats.snapshot()

    def flush(self) -> None:
        """Block until every copy off the device and every queued write has finished (what
        the tiers hold is then in host memory or on disk); raise a stored worker error.

        Under a CUDA graph capture it returns at once: waiting would query events, which
        invalidates the capture (NOTE [capture mode])."""
        self._wait_offloads()
        self._raise_pending()

    async def aflush(self) -> None:
        """:meth:`flush` for event loops: waits in a worker thread, not in the loop."""
        await asyncio.get_running_loop().run_in_executor(None, self._wait_offloads)
        self._raise_pending()

    def _wait_offloads(self) -> None:
        if capturing():  # NOTE [capture mode]: any wait would query events; none here
            return
        with capture_isolated():  # aflush waits in a borrowed thread
            self._wait_writes()
            if self._copying:
                self._settle_copies(wait=True)
            self._device.poll()  # finished copies' tensors go now, not at the next copy

    # -- pack -------------------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Any:
        """Saved-tensor pack hook: a handle for an offloaded tensor, or ``t`` kept as it is."""
        with profiler_range("prefetch_offload::pack"):
            return self._pack(t)

    def _pack(self, t: torch.Tensor) -> Any:
        if self._forked:  # NOTE [fork]
            return Kept(t)
        if capturing():
            # Before anything else, for every tensor (NOTE [capture mode]): settling
            # copies queries events and enforcing budgets issues copies, either of
            # which invalidates the capture. Saved under capture, a tensor stays.
            self._stats.add(tensors_kept=1)
            return Kept(t)
        self._raise_pending()
        self._drain_dead()
        if self._copying:
            self._settle_copies()
        if self._closed:
            raise OffloadError(
                "prefetch_offload: pack hook called after its offload_context exited; "
                "create a new context for new forward passes."
            )
        in_backward = _graph_task_id() >= 0  # NOTE [packs inside backward]
        if in_backward and (not graph_kept() or _recomputing()):
            self._stats.add(tensors_kept=1, kept_in_backward=1)
            return Kept(t)
        if self._in_backward and not in_backward:  # forward again
            self._in_backward = False
            with self._lock:
                self._end_tasks.clear()  # in case a backward raised (no final callback)
                self._plan.begin_forward()  # NOTE [learned order]
            self._enforce_budgets()  # NOTE [tiers]: what the write tail kept
            # What the end of backward does, for a backward that raised (no final
            # callback ran): no restored span kept into forward (NOTE [recently
            # restored]), and staging off until forward waits on writes again.
            self._reader.end_backward()
            if self._writer is not None:
                self._writer.end_backward()
            self._reader.read_pool.new_period()  # NOTE [read buffer pool]
            moved = self._policy.demoted[DISK]  # NOTE [heap trim]: the bound follows it
            basis = moved - self._moved_before_step
            if self._decider is not None:  # NOTE [profiling under trims] in recompute.py
                basis = self._decider.trim_basis(basis)
            self._heap.step_moved(basis)
            self._moved_before_step = moved
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return self._pack_subclass(t)  # NOTE [wrapper subclasses]
        movable = self._movable(t)
        if not movable or t.numel() * t.element_size() < self.config.min_offload_bytes:
            storage = t.untyped_storage() if movable else None
            if storage is not None and self._dedup.get(storage.data_ptr()):
                # NOTE [dedup]: a small view of a storage with a live record shares it;
                # kept, it would hold the whole storage in memory beside the record.
                shared = self._shared(t, storage, *view_span(t))
                if shared is not None:
                    return shared
            self._stats.add(tensors_kept=1)
            if not self._warned_cpu_budget and self.config.target == "cpu":
                self._note_cpu_budget(t)
            kept = Kept(t)
            if movable and not in_backward:
                # NOTE [learned order]: kept for its size only, which may change with the
                # sequence length: a placeholder keeps the step's structure the same.
                key = (t.untyped_storage().data_ptr(), t._version)  # its memory, as dedup
                with self._lock:
                    self._plan.placeholder(kept, self._signature(t), key)
            return kept
        if self._direct_pending and not self._device.identity(t.device):
            self._check_direct(t.device)  # NOTE [direct IO from pinned memory]
        storage = t.untyped_storage()
        vstart, vbytes = view_span(t)
        shared = self._shared(t, storage, vstart, vbytes)
        if shared is not None:
            return shared
        key = storage.data_ptr()
        version = t._version
        shape, stride = tuple(t.shape), t.stride()
        owner_t = t._base if t._base is not None else t
        dense = t.is_contiguous() or is_dense(shape, stride)  # (as _shared says)
        start, nbytes = vstart, vbytes
        whole = storage.nbytes()
        if nbytes < whole <= 2 * nbytes:  # NOTE [whole storage]
            start, nbytes = 0, whole
        # Host memory is the storage itself, or a page-aligned host block (pad 0).
        identity = self._device.identity(storage.device)
        span = Span(nbytes, (key + start) % 4096 if identity else 0)
        view = ViewMeta(t.dtype, shape, stride, vstart - start)
        owner = weakref.ref(owner_t)
        here: Resident = (storage, start, None)
        # NOTE [version check]: the bytes are read from t's own memory until they are
        # copied or written; NOTE [no cycles]: a detached alias.
        saved = t.detach()
        with self._lock:
            rec = Record(
                self,
                span,
                None,
                here if identity else None,
                t.device,
                self._seq,
                view,
                saved,
                version,
            )
            if not identity:  # NOTE [tiers]: resident on its device until demoted
                # NOTE [copy streams]: what the copy to the host, now or later, waits for.
                rec.held = (storage, start, self._device.mark(storage))
                rec.restored = (weakref.ref(storage), start, None)
            self._seq += 1
            rec.align = (key + start) % 512
            # NOTE [checksums]: bytes no saved view holds, read from the tensor's memory.
            rec.exposed = rec.host_only and not (dense and (start, nbytes) == (vstart, vbytes))
            self._plan.register(rec, self._signature(t), in_step=not in_backward)
            entry = DedupEntry(storage, owner, version, start, start + nbytes, rec)
            if dense:
                entry.cover(vstart, vstart + vbytes)
            rec.key = key
            self._dedup.setdefault(rec.key, []).append(entry)
            self._policy.admit(rec)
        if in_backward:  # NOTE [packs inside backward]: the write tail's records stay
            self._demote_own(rec)
        else:
            self._enforce_budgets()
        if rec.host_only:
            self._heap.saved()  # NOTE [heap trim]
        self._heap.check()
        return Handle(rec, view)

    # -- tiers ------------------------------------------------------------------------------

    def _enforce_budgets(self) -> None:
        """Demote the oldest records of each tier over its budget (NOTE [tiers])."""
        for tier in (DEVICE, HOST):
            with self._lock:
                recs = self._policy.over(tier)
            done = 0
            try:
                for rec in recs:
                    if tier == DEVICE:
                        self._demote_from_device(rec)
                    else:
                        self._demote_to_disk(rec, HOST)
                    done += 1
            finally:
                if done < len(recs):  # a demotion raised: the rest stay, to be tried again
                    with self._lock:
                        self._policy.release(recs[done:])

    def _demote_own(self, rec: Record, *, force: bool = False) -> None:
        """Demote ``rec`` itself, not the oldest records, if its tier is over budget: a
        record saved during a backward, which may be using the oldest ones now. With
        ``force``, whatever the budget (a ``MUST_CPU_OFFLOAD`` output)."""
        with self._lock:
            taken = rec.tier == DEVICE and self._policy.take(rec, force=force)
        if not taken:
            return
        try:
            self._demote_from_device(rec)
        except BaseException:
            with self._lock:
                self._policy.release([rec])
            raise

    def _unskip(self, rec: Record) -> None:
        """A write the write tail dropped is queued again (NOTE [write tail])."""
        if rec.skipped:
            rec.skipped = False
            self._stats.add(writes_skipped=-1)

    def _demote_from_device(self, rec: Record) -> None:
        """Move a DEVICE record to the next tier: disk for CPU tensors, else a host copy."""
        if rec.host_only:  # host memory already: nothing to copy (NOTE [targets])
            self._demote_to_disk(rec, DEVICE)
            return
        store = self._store
        nbytes = rec.span.nbytes
        host_budget = self._policy.budgets[HOST]
        keep_host = host_budget is None or host_budget > 0
        if store is None and host_budget is not None:
            with self._lock:
                full = self._policy.bytes[HOST] + nbytes > host_budget
                if full:
                    self._policy.keep(rec, DEVICE)
            if full:
                self._note_host_full()
                return
        # Straight to disk: slab space first, so that a full disk costs no copy.
        extent = None
        if not keep_host:
            assert store is not None
            extent = self._allocate(store, rec.span.extent_bytes)
            if extent is None:
                with self._lock:
                    self._policy.keep(rec, DEVICE)
                return
        with self._lock:  # NOTE [dedup]: what shares added to the fence; none from here
            held = rec.held
            rec.frozen = True
        assert held is not None
        try:
            host, base, fence = self._device.to_host(held[0], held[1], nbytes, held[2])
        except BaseException:
            with self._lock:
                rec.frozen = False
            if extent is not None:  # the record may be tried again: no space held meanwhile
                assert store is not None
                store.free(extent)
            raise
        pad = (host.data_ptr() + base) % 4096
        if pad != rec.span.pad:  # a host block that is not page-aligned
            rec.span = Span(nbytes, pad)
            if extent is not None:
                assert store is not None
                store.free(extent)
                extent = self._allocate(store, rec.span.extent_bytes)
        with self._lock:
            if rec.handout_changed(held[0]):  # NOTE [handouts]: changed in a backward since
                rec.tainted = True
            rec.source = (host, base, fence)
            rec.held = rec.restored = None
            rec.frozen = False  # NOTE [dedup]: issued: later shares are not checked
            if fence is not None:
                queue = self._copying.setdefault(fence.device, collections.deque())
                queue.append((fence, weakref.ref(rec)))
            if keep_host:
                self._policy.demote(rec, HOST)
            elif extent is None:  # the re-reservation failed: the host copy is kept
                self._policy.keep(rec, HOST)
            else:
                rec.extent = extent
                self._policy.demote(rec, DISK)
        if store is None:  # NOTE [targets]: the host copy is the offloaded tensor
            self._stats.add(tensors_offloaded=1, bytes_offloaded=nbytes)
        elif rec.extent is not None:
            self._unskip(rec)
            self._queue_write(rec, host, base, fence)

    def _demote_to_disk(self, rec: Record, tier: int) -> None:
        """Write a memory-tier record's host bytes to a slab (a full disk keeps it)."""
        store = self._store
        source = rec.source
        if store is None or source is None:
            with self._lock:
                self._policy.keep(rec, tier)
            return
        if rec.host_only:  # NOTE [moved storages] in writer.py: written from where it is
            address = source[0].data_ptr() + source[1]
            if address % ALIGN != rec.span.pad:
                rec.span = Span(rec.span.nbytes, address % ALIGN)
                rec.align = address % 512
        extent = self._allocate(store, rec.span.extent_bytes)
        with self._lock:
            if extent is None:  # no space: it stays in memory (counted, warned)
                self._policy.keep(rec, tier)
                return
            rec.extent = extent
            self._policy.demote(rec, DISK)
        self._unskip(rec)
        self._queue_write(rec, *source)

    def _queue_write(self, rec: Record, *source: Any) -> None:
        """Queue ``rec``'s write. If that raises before it is queued (an interrupt while
        it waits at the write cap), the record returns to its memory tier (NOTE [tiers])
        and its extent is freed: nothing counts it on disk that no write will fill."""
        assert self._writer is not None and self._store is not None
        try:
            self._writer.queue(rec, *source)
        except BaseException:
            if not rec.writes_left:
                with self._lock:
                    extent, rec.extent = rec.extent, None
                    self._policy.readmit([rec], DEVICE if rec.host_only else HOST)
                if extent is not None:
                    self._store.free(extent)
            raise

    def _note_host_full(self) -> None:
        """Target "cpu" with host_budget exhausted: the tensor stays on its device."""
        self._stats.add(fallbacks=1)
        with self._lock:
            if self._warned_host:
                return
            self._warned_host = True
        warnings.warn(
            f"prefetch_offload: host_budget={self.config.host_budget} bytes of host copies "
            "are in use, so newer saved tensors stay on their device. Raise host_budget, "
            "or use target 'disk' with host_budget to spill the oldest copies to disk.",
            OffloadFallbackWarning,
            stacklevel=4,
        )

    def _note_cpu_budget(self, t: torch.Tensor) -> None:
        """Say once that target "cpu" leaves a CPU tensor large enough to move where it
        is, if budgets were asked for: they apply to what the device layer moves (CUDA
        tensors; CPU ones only on the CPU twin)."""
        cfg = self.config
        if not cfg.device_budget and cfg.host_budget is None:
            self._warned_cpu_budget = True  # no budget asked for: never anything to say
            return
        if t.device.type != "cpu" or self._device.accepts(t):
            return
        if t.numel() * t.element_size() < cfg.min_offload_bytes:
            return  # kept for its size: the same under any target
        self._warned_cpu_budget = True
        logger.warning(
            "prefetch_offload: target 'cpu' leaves CPU tensors where they are (they are "
            "host memory already), so device_budget=%s and host_budget=%s have nothing to "
            "do for them (they apply to CUDA tensors); use target 'disk' to move saved CPU "
            "tensors out of RAM.",
            cfg.device_budget,
            cfg.host_budget,
        )

    def _settle_copies(self, *, wait: bool = False) -> None:
        """Finish the version check of records whose device-to-host copy has ended.

        NOTE [version check]: until its copy has run, a record keeps the saved
        tensor (to compare versions, and so the device memory cannot be reused);
        after it, the host copy holds the saved value and the device memory can go.
        """
        with self._lock:
            for device, copying in list(self._copying.items()):
                while copying:  # one device's copies end in order: stop at a running one
                    fence, ref = copying[0]
                    if not fence.done():
                        if not wait:
                            break
                        with contextlib.suppress(Exception):
                            fence.wait()  # a failed copy is raised where its bytes are used
                    copying.popleft()
                    rec = ref()
                    if rec is None or rec.saved is None:
                        continue
                    if rec.saved._version != rec.version:
                        rec.tainted = True
                    rec.saved = None
                if not copying:
                    del self._copying[device]

    def _signature(self, t: torch.Tensor) -> tuple[torch.dtype, int]:
        """``t``'s entry in its step's signature: dtype and rank, one shared tuple for
        each (NOTE [learned order])."""
        sig = (t.dtype, t.dim())
        return self._signatures.setdefault(sig, sig)

    def _movable(self, t: torch.Tensor) -> bool:
        """Whether ``t`` may be offloaded, whatever its size (``min_offload_bytes``
        decides then). Everything else stays in memory, unchanged."""
        if type(t) is not torch.Tensor or t.layout is not torch.strided:
            return False  # subclasses (incl. Parameter), sparse, mkldnn
        if not self._device.accepts(t) or t.is_quantized or t.is_nested:
            return False
        if t.is_cuda and capturing(t.device):
            return False  # side-stream copies and event queries are illegal in a capture
        if t.is_conj() or t.is_neg() or torch.is_inference(t) or t._is_zerotensor():
            return False  # (a zero tensor, which forward-mode AD saves, has no memory)
        # Autograd hands over views of parameters (weight.t()), not the Parameter.
        base = t._base if t._base is not None else t
        if isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad):
            return False
        itemsize = t.element_size()
        if itemsize == 0 or t.data_ptr() % itemsize:
            return False
        return t.numel() > 0

    def _allocate(self, store: SlabStore, nbytes: int) -> Extent | None:
        """Slab space for a record, or None (counted and warned) where none is left."""
        assert self._writer is not None
        return self._writer.allocate(nbytes)

    def _wait_writes(self) -> None:
        """Submit the open write batch; wait until every write job has finished."""
        if self._writer is not None:
            self._writer.wait()

    # -- unpack -----------------------------------------------------------------------------

    def unpack(self, packed: Any) -> torch.Tensor:
        """Saved-tensor unpack hook: the tensor that ``pack`` was given, restored."""
        if self._forked:  # NOTE [fork]: no bookkeeping (its locks may be held for good)
            if isinstance(packed, Kept):
                return packed.unpack()
            raise OffloadError(
                "prefetch_offload: this process was forked from the one that offloaded this "
                "saved tensor, and the offloaded bytes belong to the parent; run the "
                "backward in the process that ran the forward (tensors saved in this "
                "process stay in memory here)."
            )
        with profiler_range("prefetch_offload::unpack"):
            return self._unpack(packed)

    def _check_direct(self, device: torch.device) -> None:
        """The O_DIRECT probe the constructor left for the first tensor that needs host
        buffers, on ``device``, which has a context now (NOTE [direct IO from pinned
        memory]). Other packs wait for it; the flag drops once the store is settled."""
        with self._direct_lock:
            if not self._direct_pending:
                return  # another thread's pack probed
            store = self._store
            assert store is not None
            cuda = device.type == "cuda"
            with torch.cuda.device(device) if cuda else contextlib.nullcontext():
                ok = self._device.direct_io_ok(store.directory, now=True)
            if ok is False:
                store.use_buffered()
            self._direct_pending = False

    def _shared(self, t: torch.Tensor, storage: Any, vstart: int, vbytes: int) -> Handle | None:
        """A handle to the live record whose span holds ``t``'s, where one may serve it
        (NOTE [dedup]); None where none does."""
        if not self._dedup.get(storage.data_ptr()):  # (most saves: nothing to compare)
            return None
        version = t._version
        itemsize = t.element_size()
        shape, stride = tuple(t.shape), t.stride()
        owner_t = t._base if t._base is not None else t
        # Every spanned byte an element, and only once (is_dense sorts the dims: most
        # saved tensors are contiguous, which answers in C).
        dense = t.is_contiguous() or is_dense(shape, stride)
        with self._lock:
            for entry in self._dedup.get(storage.data_ptr(), ()):
                rec = entry.record()
                if (
                    rec is not None
                    and entry.storage() is storage
                    and entry.owner() is owner_t
                    and entry.version == version
                    and entry.start <= vstart
                    and vstart + vbytes <= entry.end
                    and (vstart - entry.start) % itemsize == 0
                    and (not rec.frozen or entry.is_covered(vstart, vstart + vbytes))
                ):
                    if dense:  # NOTE [dedup]: its bytes are saved elements now
                        entry.cover(vstart, vstart + vbytes)
                    if rec.held is not None and not rec.frozen:  # NOTE [dedup]: its copy
                        # waits for this save too (frozen: that copy is being issued)
                        held = rec.held
                        fence = joined_fence(held[2], self._device.mark(held[0]))
                        rec.held = (held[0], held[1], fence)
                    self._stats.add(dedup_hits=1)
                    rec.shares += 1  # NOTE [recently restored]
                    view = ViewMeta(t.dtype, shape, stride, vstart - entry.start)
                    return Handle(rec, view)
        return None

    def _pack_subclass(self, t: torch.Tensor) -> Any:
        """NOTE [wrapper subclasses]: a DTensor's local tensor is packed; others are kept."""
        if is_dtensor(t) and not (t.is_leaf and t.requires_grad):
            return Wrapped(t, self._pack(t._local_tensor))  # type: ignore[attr-defined]
        self._stats.add(tensors_kept=1, subclasses_kept=1)
        return Kept(t)

    def _unpack(self, packed: Any) -> torch.Tensor:
        task = _graph_task_id()
        outside = task == -1  # NOTE [reads outside backward]
        if isinstance(packed, Kept):
            if packed.spos >= 0 and not outside:  # a placeholder (NOTE [learned order])
                self._enter_backward(task)
                if self.config.prefetch_depth:
                    with self._lock:  # its place in the order
                        self._plan.unpacked(packed, current_group_key())
            return packed.unpack()
        if isinstance(packed, Wrapped):
            packed.check_version()
            return packed.rebuild(self._unpack(packed.inner))
        if capturing(packed.record.device):
            # NOTE [capture mode]: a span still where autograd wants it, with no copy to
            # wait for, is handed out as it is; restoring one would query events,
            # allocate and copy, each of which would invalidate the capture with a CUDA
            # error that names nothing.
            placed = packed.record.resident()
            if placed is not None and placed[2] is None:
                packed.check_version()
                return make_view(placed[0], placed[1], packed.view)
            raise OffloadError(
                "prefetch_offload: a tensor saved for backward outside a CUDA graph "
                "capture was unpacked inside one, and it is not on its device with no "
                "copy to wait for (it was offloaded, or brought back by a copy). Capture "
                "the forward that saves it too (a tensor saved under capture stays on the "
                "device), or run that forward outside offload_context."
            )
        if not outside:
            self._enter_backward(task)
        if self._dead:
            self._drain_dead()
        if self._copying:
            self._settle_copies()
        self._raise_pending()
        self._heap.check()  # NOTE [heap trim]
        packed.check_version()
        rec = packed.record
        if outside:  # NOTE [reads outside backward]
            return self._hand_out(packed, *self._reader.materialize(rec, recent=False))
        with self._lock:
            if packed.pass_no == self._pass_no:  # NOTE [backward passes]: a new pass
                self._pass_no += 1
            packed.pass_no = rec.pass_no = self._pass_no
            more = False  # NOTE [recently restored]: other saves of it unpack later
            if rec.shares:
                if rec.unpack_pass != self._pass_no:
                    rec.unpack_pass, rec.unpacks = self._pass_no, 0
                rec.unpacks += 1
                more = rec.unpacks <= rec.shares
        if self._reader.copy_first(rec):  # NOTE [head of line]
            storage, base, built = self._reader.materialize(rec)
            self._reader.prefetch_after(rec)
        else:
            self._reader.prefetch_after(rec)
            storage, base, built = self._reader.materialize(rec)
        if rec.shares:
            self._reader.keep_shared(rec, storage, more)
        return self._hand_out(packed, storage, base, built)

    @staticmethod
    def _hand_out(
        packed: Handle,
        storage: torch.UntypedStorage,
        base: int,
        built: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """The unpack's result over the materialized span (NOTE [handouts])."""
        rec = packed.record
        if built is not None and packed.view is rec.view0:  # NOTE [views built by the reader]
            return rec.hand_out(storage, None, built)
        return rec.hand_out(storage, make_view(storage, base, packed.view))

    def _enter_backward(self, task: int) -> None:
        """An unpack in the backward of graph task ``task``: the switch into backward at
        the first one after packs (the write tail is skipped, the window sized), and the
        task's end awaited."""
        # NOTE [unpack threads]
        with self._lock:
            starting, self._in_backward = not self._in_backward, True
            new_task = task not in self._end_tasks  # (never -1: NOTE [reads outside backward])
            if new_task:
                me = threading.get_ident()
                if not starting:
                    # A backward that starts with no packs before it, on a thread that
                    # ran another: that one ended, and if no callback ended it, it
                    # raised. (Or it runs this one from a backward node: it then
                    # cleans up once more when it ends, which costs little.)
                    for old in [t for t, th in self._end_tasks.items() if th == me]:
                        del self._end_tasks[old]
                self._end_tasks[task] = me
        if starting:
            if self._writer is not None:
                self._writer.skip_tail()
            self._reader.begin_backward()
        if new_task:
            self._queue_end_of_backward(task)

    def _queue_end_of_backward(self, task: int) -> None:
        """Let the recently restored spans go when this backward pass ends.

        Keyed by graph task (``_unpack`` notes each one): the cleanup runs when the
        last backward running ends, not when one of several concurrent ones does.
        Autograd runs no final callbacks for a backward that raised; the next forward
        forgets its task, and so does a backward that starts on its thread with no packs
        before it. That one may also be a backward run from inside a backward node
        (``torch.autograd.grad`` in a custom Function's backward), or a second
        concurrent backward whose nodes run on the same device thread: the outer or
        first one then loses its recent spans early, and reads them again if it needs
        them (never a wrong value: the spans are still on disk or in host memory).
        """
        try:
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(self._end_of_backward, task)
            )
        except RuntimeError:  # not in a backward after all: nothing will end
            with self._lock:
                self._end_tasks.pop(task, None)

    def _end_of_backward(self, task: int) -> None:
        with self._lock:
            self._end_tasks.pop(task, None)
            if self._end_tasks:
                return  # another backward is still running
        self._reader.end_backward()
        if self._writer is not None:
            self._writer.end_backward()
        if self._closed:  # a graph used after exit: no later pack or stats() gives back
            self._drain_dead()  # the slab space its records held

    # -- lifetime ---------------------------------------------------------------------------

    def _drain_dead(self) -> None:
        """Return dead records' extents to the allocator (NOTE [record lifetime])."""
        if not self._dead:
            return
        store = self._store
        with self._lock:
            self._drain_locked(store.free if store is not None else None)
        if self._closed and store is not None:
            store.trim()  # a graph used after exit: give its space back as it goes

    def drain_now(self) -> None:
        """From a record's death after close (NOTE [record lifetime]): return the dead
        records' space and close emptied slabs now, if no thread holds the engine's or
        the store's lock (never waits for one: it may run inside any code, as a
        ``__del__``); else the next drain does."""
        store = self._store
        if store is None or not self._lock.acquire(blocking=False):
            return
        try:
            if not store.lock.acquire(blocking=False):
                return
            try:
                self._drain_locked(store.free_locked)
                store.trim_locked()
            finally:
                store.lock.release()
        finally:
            self._lock.release()

    def _drain_locked(self, free: Callable[[Extent], None] | None) -> None:
        """Under the engine's lock: forget the dead records; ``free`` their extents."""
        dead = self._dead
        keys, gone = set(), set()
        while dead:
            extent, key, tier, nbytes, seq = dead.popleft()
            self._plan.forget()
            self._policy.died(tier, nbytes, seq)
            keys.add(key)
            gone.add(seq)
            if extent is not None and free is not None:
                free(extent)
        for key in keys:
            # (A record draining from its own __del__ is still there to its weakref.)
            live = [e for e in self._dedup.get(key, ()) if (r := e.record()) and r.seq not in gone]
            if live:
                self._dedup[key] = live
            else:
                self._dedup.pop(key, None)

    # -- selective checkpointing (checkpointing.py, recompute.py) ---------------------------

    def checkpoint_context_fn(
        self,
        policy: Callable[..., Any] | list[Any],
        *,
        allow_cache_entry_mutation: bool = False,
    ) -> tuple[Any, Any]:
        """The pair of contexts for ``torch.utils.checkpoint(..., context_fn=...)``.

        As ``torch.utils.checkpoint.create_selective_checkpoint_contexts``, with
        ``*_CPU_OFFLOAD`` outputs packed by this engine (its target and budgets
        decide where they live; ``PREFER_*`` may stay within ``device_budget``) and
        unpacked for the recompute. ``policy`` has PyTorch's signature
        ``policy(ctx, op, *args, **kwargs) -> CheckpointPolicy``, or is a list of
        op overloads to save (the others are recomputed). Call it once per
        checkpoint call, e.g. ``context_fn=functools.partial(engine.checkpoint_context_fn,
        policy)``.
        """
        policy = as_policy(policy)
        recorder = self._decider
        if recorder is None:
            recorder = self._decider = RecordingDecider("policy")
        decider = recorder.for_policy(policy) if isinstance(recorder, RecordingDecider) else None
        if decider is None:  # recompute="auto" runs beside: the policy is still the user's
            decider = RecordingDecider("policy").for_policy(policy)
        return selective_contexts(
            decider, self, self._ckpt_stats, allow_cache_entry_mutation=allow_cache_entry_mutation
        )

    def recompute_plan(self) -> RecomputePlan | None:
        """What ``recompute=`` decided per op kind, and why; None without ``recompute``
        or with ``recompute="full"``.

        ``print(engine.recompute_plan())`` shows a table (NOTE [keep, offload, recompute]).
        """
        decider = self._decider
        return None if decider is None else decider.plan()

    def pack_output(self, t: torch.Tensor, *, must: bool, checked: bool = True) -> Any:
        """Pack a checkpointed op's output (checkpointing.OffloadHooks); with ``must``
        it leaves the device whatever ``device_budget`` allows (``MUST_CPU_OFFLOAD``);
        unless ``checked``, its unpack skips the version check (the checkpoint's
        ``allow_cache_entry_mutation=True``: NOTE [cache entry mutation])."""
        packed = self.pack(t)
        if must and isinstance(packed, Handle):
            self._demote_own(packed.record, force=True)
        if not checked:
            packed.unchecked()
        return packed

    def unpack_output(self, packed: Any) -> torch.Tensor:
        """Unpack what :meth:`pack_output` returned, for the recompute."""
        return self.unpack(packed)

    def _raise_pending(self) -> None:
        err = self._errors.take()
        if err is not None:
            raise err

    def close(self, *, raise_errors: bool = True) -> None:
        """Finish pending writes, stop the IO threads, release unused slabs.

        Later unpacks (a graph used after the context) read synchronously.
        Raises a stored worker error if ``raise_errors``, else warns with it.
        """
        closer = self._closer
        if closer is not None:  # an interrupted close finishing: wait for it
            if closer is not threading.current_thread():
                closer.join()
            return
        if self._closed:
            return
        if self._forked:  # NOTE [fork]: no IO threads here, and the files are the parent's
            self._closed = True
            return
        try:
            self._wait_writes()
        except BaseException:
            # Interrupted (Ctrl-C) while writes finish: the close goes on in a thread of
            # its own (the IO threads finish what is queued and stop, the slab files
            # close), its errors come as warnings, and the interrupt goes on to the
            # caller. Not a daemon: the interpreter's exit waits for it before the
            # finalizers that close the files run.
            closer = threading.Thread(
                target=self._finish_close,
                kwargs={"raise_errors": False},
                name="prefetch_offload-close",
            )
            self._closer = closer
            closer.start()
            raise
        self._finish_close(raise_errors=raise_errors)

    def _finish_close(self, *, raise_errors: bool) -> None:
        """Close with the writes submitted: stop the IO threads (after what they have
        queued), release the buffers and slabs, report a stored error."""
        if self._decider is not None:
            self._decider.close()  # NOTE [plans within the noise]: auto's sampling thread
        with self._lock:
            self._closed = self._reader.closed = True
            self._plan.clear()
            self._reader.end_backward()
        self._settle_copies(wait=True)
        self._device.close()
        self._pool.shutdown()
        self._heap.close()
        # After the IO threads stopped: a prefetch still reading at close returns its
        # block when it ends, and a read for a backward after exit leases one (NOTE [read
        # buffer pool]: nothing idle is kept after exit; a late return is released).
        self._reader.read_pool.close()
        if self._writer is not None:
            # A batch an interrupt left open (close() above): its records stay in memory.
            self._writer.skip_tail()
            self._writer.close()
        self._drain_dead()
        if self._store is not None:
            self._store.trim()
        err = self._errors.take()
        if err is not None:
            if raise_errors:
                raise err
            warnings.warn(f"{err} (raised while another exception was propagating)", stacklevel=2)

"""Copy streams: asynchronous copies between a device and host memory, and their fences.

A :class:`CopyStreams` serves one device. It runs device-to-host copies (pack)
and host-to-device copies (prefetch and unpack) on two side streams of their
own, so that neither waits behind the other or behind compute, and answers
each copy with a :class:`Fence` that says when it has finished.

- :class:`CudaStreams`: two CUDA streams of the process's own (NOTE [side
  streams]) and CUDA events.
- :class:`ThreadStreams`: the CPU twin. Each side stream is a worker thread
  that runs its copies in order, optionally after a delay; fences are
  thread events. The hook thread plays the compute stream: its work is done
  when it is issued, so "the compute stream waits on a fence" is a host wait.
  CI runs the whole device path through it, with delays that make a copy
  that was read too early, or a buffer reused too early, show up as wrong
  gradients.

# NOTE [copy streams]
# Ordering. A device-to-host copy must see the tensor as the compute stream
# left it when the pack hook ran. The pack hook records an event on the
# current stream (``mark``) and the D2H stream waits on it before the copy:
# a record a budget keeps on the device is copied at a later pack, or at the
# next forward, when the current stream may be another one (FSDP and
# checkpoint recompute switch streams), and an event also lets the copy start
# as soon as the tensor is made rather than after everything queued since. A
# copy with no mark waits on the current stream (``wait_stream``), read at
# every call, never cached.
# A host-to-device copy may depend on a D2H copy that is still running (a
# record whose host copy is not finished yet is unpacked, or prefetched): the
# H2D stream waits on that copy's event. The compute stream waits on an H2D
# copy's event (``use``) before the tensor is handed to autograd, and the
# tensor is marked used by the compute stream (``record_stream``), because it
# was allocated on the H2D stream: without that mark the caching allocator
# could give its block to the next H2D copy while backward still reads it.
#
# NOTE [copies keep their buffers]
# Every copy keeps the tensors it reads, and a D2H copy also the pinned block it
# writes, alive until its fence is seen to be done (an H2D copy's destination
# is allocated on the H2D stream, whose later work the caching allocator waits
# for before reusing its block, and is marked used by the compute stream at
# ``use``): the in-flight list holds them, oldest first, and ``poll`` (called at
# each copy, and by ``synchronize`` and ``close``) drops the finished ones; so
# the last copies of a pass keep their buffers until the next copy or close,
# a few blocks at most. So a source
# activation cannot be freed and its block reused by the compute stream while
# the D2H copy still reads it, and a pinned block cannot go back to its pool
# (which happens when its storage dies, NOTE [read buffer pool]) while a copy
# still reads or writes it. Nothing else has to reason about copy lifetimes.
# The CPU twin's copy jobs hold those tensors only weakly and fail if one is
# gone when they run, so a copy the in-flight list stopped holding fails in CI
# as it would corrupt bytes on a GPU.
# D2H bytes in flight are capped (``max_inflight_bytes``): past it, the next
# D2H waits for the oldest one on the host, which bounds how far the host runs
# ahead of the link (and the device memory copies hold on to) when the link is
# slower than compute.
#
# NOTE [copy chunks]
# The cap bounds bytes, not tensors: a D2H copy larger than a chunk (a quarter
# of the cap, at least min(cap, 4 MiB)) is issued as several copies of at most
# a chunk each, and each one waits only for room for itself. A whole tensor at
# or above the cap would otherwise wait until every earlier copy had finished
# (the copy stream runs dry and the host stops queueing compute), and then put
# more than the cap in flight at once. The chunks run in order on one stream,
# so the last one's fence says the whole copy is done; the CPU twin's fence
# waits for every chunk, so a failed middle chunk still fails the copy. (The
# source storage stays alive until its last chunk is done: chunking bounds
# bytes in flight, not the device memory of one large tensor.)
#
# No host synchronisation on the hot path: packs and unpacks only queue work
# and query events. The host waits on a fence only in an IO thread (a write
# needs the host copy), at the cap above, at close, and in the CPU twin's
# ``use`` (where the hook thread is the compute stream).
#
# NOTE [capture mode]
# A CUDA graph capture (``torch.cuda.graph``, ``make_graphed_callables``) runs
# in the "global" mode by default: while it runs, an event query or
# synchronize, a ``cudaMalloc`` or a pinned allocation from any thread still in
# the default (global) mode fails and invalidates the capture, and so does one
# from the capturing thread itself (bench/gpu_preflight.py's ``capture``
# section measures each case). The engine keeps out of a capture's way twice:
# - The hooks and ``flush`` ask ``capturing()`` before anything else: a tensor
#   saved under capture stays where it is, whatever its device, and ``flush``
#   under capture returns at once (settling copies queries events, enforcing a
#   budget issues copies). A tensor saved before the capture began and
#   unpacked under it is handed out as it is if its span is still on its device
#   with no copy to wait for (a budget kept it); any other is an
#   ``OffloadError`` that says so: restoring it, or waiting for the copy that
#   brought it back, would query events, allocate or copy. A tensor on another
#   device than the current one asks that device's current stream.
# - The IO threads, which wait on copy events (a write needs its host copy),
#   copy host bytes to the device (a read job's ``to_device``: events, a
#   device allocation, the copy) and pin host blocks, run in thread-local
#   capture mode (``isolate_from_captures``: ``cudaThreadExchangeStreamCaptureMode``,
#   as c10d's NCCL watchdog thread does). A thread in that mode is stopped only
#   by a capture of its own, never by another thread's, and its calls leave
#   other threads' captures intact. ``flush`` and ``aflush`` wait in that mode
#   too (``capture_isolated``), since ``aflush`` waits in a thread it borrows.
# - The exchange is a CUDA runtime call, and a new thread's current device is
#   0: made there, it would create GPU 0's primary context (about half a GiB)
#   in every rank of a multi-GPU job. So it runs with a device current that
#   already has its context (the thread's own if it has one); where no device
#   has one yet, no capture can be running, and the thread is asked again at
#   its next job (``_context_device``).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import os
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .config import DEFAULT_INFLIGHT_COPY_BYTES
from .errors import OffloadError, OffloadFallbackWarning

__all__ = [
    "CopyStreams",
    "CudaStreams",
    "Fence",
    "ThreadStreams",
    "capture_isolated",
    "capturing",
    "chunk_bytes",
    "devices_with_context",
    "isolate_from_captures",
    "joined_fence",
]

# cudaStreamNonBlocking: a stream that never waits for the legacy default stream.
_STREAM_NON_BLOCKING = 0x01
# cudaStreamCaptureModeThreadLocal (NOTE [capture mode]).
_CAPTURE_MODE_THREAD_LOCAL = 1


@functools.cache
def _cudart() -> Any | None:
    """The CUDA runtime library torch loaded into this process, or None (a CPU build,
    or none found): the two calls torch does not expose (NOTE [side streams], [capture
    mode]) go to it."""
    if not torch.backends.cuda.is_built():
        return None
    candidates = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and os.path.basename(parts[5]).startswith("libcudart"):
                    candidates.append(parts[5].strip())
    except OSError:
        pass
    major = (torch.version.cuda or "").split(".")[0]
    candidates += [f"libcudart.so.{major}", "libcudart.so"]
    for name in dict.fromkeys(candidates):
        try:
            lib = ctypes.CDLL(name)
            create = lib.cudaStreamCreateWithFlags
            exchange = lib.cudaThreadExchangeStreamCaptureMode
        except (OSError, AttributeError):
            continue
        create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        create.restype = ctypes.c_int
        exchange.argtypes = [ctypes.POINTER(ctypes.c_int)]
        exchange.restype = ctypes.c_int
        return lib
    return None


def _cuda_ready() -> bool:
    """Whether this process has initialized CUDA (no capture can run before it has)."""
    return torch.cuda.is_initialized()


def capturing(device: torch.device | None = None) -> bool:
    """Whether the calling thread's current CUDA stream is capturing a graph (NOTE
    [capture mode]), or, with a CUDA ``device`` other than the current one, its current
    stream on that device. Never initializes CUDA."""
    if not _cuda_ready():
        return False
    if torch.cuda.is_current_stream_capturing():
        return True
    if device is None or device.type != "cuda" or device.index is None:
        return False
    if device.index == torch.cuda.current_device():
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def joined_fence(first: Fence | None, then: Fence | None) -> Fence | None:
    """A fence done when both are (None where neither waits for anything): a copy
    after it waits for the work each one marks, on whichever streams."""
    if first is None or then is None:
        return then if first is None else first
    return _Joined([*_parts(first), *_parts(then)])


def _parts(fence: Fence) -> list[Fence]:
    return list(fence._fences) if isinstance(fence, _Joined) else [fence]


# NOTE [lean CUDA calls]
# The hooks run once per saved tensor, and a small model's step on a fast GPU
# is bound by the host: on an H200, the 8-layer bf16 Llama of
# ``bench/recompute.py --gpu`` (SDPA attention) runs 31 ms a step without
# offload, of which the GPU is busy 17. With the copy streams switching
# devices and streams through ``torch.cuda.device(d)``, ``torch.cuda.stream(s)``
# and ``torch.cuda.current_stream(d)``, each pack hook took 174 us of host time
# under the profiler and each unpack 114 us, for 333 saved tensors a step; those
# calls parse their argument (1680 ``_get_device_index`` calls a step) and
# build a ``Stream`` object per call. So the copy streams switch with a device
# index (``_OnDevice``: what ``torch.cuda.device`` does once its argument is an
# index), read the current stream once per copy, and set the side stream and
# back themselves (``_OnStream``), on the device the thread is already on.
# With them, on the same model with eager attention (317 saved tensors, larger
# ones): 155 us a pack and 161 us an unpack (more of the unpacks wait for their
# copy), and ``_get_device_index`` is no longer among the step's costliest
# calls. The rest is the engine's own bookkeeping per tensor.
class _OnDevice:
    """``with torch.cuda.device(index)`` for an int ``index``, without its argument
    parsing (NOTE [lean CUDA calls]). One use per instance."""

    __slots__ = ("_index", "_prev")

    def __init__(self, index: int) -> None:
        self._index = index
        self._prev = -1

    def __enter__(self) -> None:
        self._prev = torch.cuda._exchange_device(self._index)

    def __exit__(self, *exc: object) -> None:
        torch.cuda._maybe_exchange_device(self._prev)


class _OnStream:
    """Make ``stream`` current on its device, which the thread is on and whose current
    stream is ``current``, and ``current`` again after (NOTE [lean CUDA calls]); a class,
    not a generator, as it runs once per copy."""

    __slots__ = ("_current", "_stream")

    def __init__(self, stream: Any, current: Any) -> None:
        self._stream, self._current = stream, current

    def __enter__(self) -> None:
        torch.cuda.set_stream(self._stream)

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_stream(self._current)


def devices_with_context() -> list[int] | None:
    """The CUDA devices that have their primary context; None where torch cannot tell
    (no query in this build, or the driver would not say)."""
    has = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has is None:
        return None
    try:
        return [i for i in range(torch.cuda.device_count()) if has(i)]
    except RuntimeError:
        return None


@contextlib.contextmanager
def _context_device() -> Iterator[bool]:
    """For a raw CUDA runtime call in this thread: make current a device that already
    has its primary context, the current one if it has (NOTE [capture mode]). Yields
    False, changing nothing, where no device has one. The thread stays on that device
    afterwards (torch restores a device only if it has a context)."""
    current = torch.cuda.current_device()
    ready = devices_with_context()
    if ready is not None and current not in ready:  # (cannot tell: as the current one)
        if not ready:
            yield False
            return
        current = ready[0]
    with torch.cuda.device(current):
        yield True


def _exchange_capture_mode(mode: int) -> int | None:
    """Set the calling thread's capture mode; the previous one (None: no CUDA runtime,
    or no device has a context yet, so nothing can be capturing)."""
    lib = _cudart()
    if lib is None:
        return None
    value = ctypes.c_int(mode)
    with _context_device() as ready:
        if not ready or lib.cudaThreadExchangeStreamCaptureMode(ctypes.byref(value)) != 0:
            return None
    return value.value


_thread = threading.local()


def isolate_from_captures() -> bool:
    """Put the calling thread in thread-local capture mode for good, once (NOTE
    [capture mode]): for threads the library owns, before their CUDA work.

    Returns:
        False while that cannot be done yet (CUDA is built but not initialized, no
        device has a context yet, or the runtime refused: call again before the next
        job); True once done, or where no CUDA will come.
    """
    if getattr(_thread, "isolated", False):
        return True
    if _cudart() is None:
        return True  # no CUDA runtime in this process: nothing can capture
    if not _cuda_ready() or _exchange_capture_mode(_CAPTURE_MODE_THREAD_LOCAL) is None:
        return False
    _thread.isolated = True
    return True


@contextlib.contextmanager
def capture_isolated() -> Iterator[None]:
    """Thread-local capture mode for the ``with`` body, then the thread's own mode
    again: for waits on copies in a thread the library does not own (NOTE [capture
    mode])."""
    if getattr(_thread, "isolated", False) or not _cuda_ready():
        yield
        return
    before = _exchange_capture_mode(_CAPTURE_MODE_THREAD_LOCAL)
    try:
        yield
    finally:
        if before is not None:
            _exchange_capture_mode(before)


class Fence:
    """The end of one asynchronous copy."""

    #: The device whose copy stream runs the copy: fences of one device end in order.
    device: torch.device | None = None

    def done(self) -> bool:
        """Whether the copy has finished (never blocks)."""
        raise NotImplementedError

    def wait(self) -> None:
        """Block the calling thread until the copy has finished; raise if it failed."""
        raise NotImplementedError


class _CudaFence(Fence):
    __slots__ = ("_done", "device", "event")

    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self.event = event
        self.device = device  # (with its index: CudaStreams names it)
        self._done = False

    def done(self) -> bool:
        if not self._done:
            # flush() may run in any thread: name the device (as wait() does below).
            with _OnDevice(self.device.index):
                self._done = self.event.query()
        return self._done

    def wait(self) -> None:
        if not self._done:
            # Often on an IO thread: name the device, or CUDA makes a context on device 0.
            with _OnDevice(self.device.index):
                self.event.synchronize()
            self._done = True


class _ThreadFence(Fence):
    __slots__ = ("_error", "_event", "device")

    def __init__(self, device: torch.device | None = None) -> None:
        self._event = threading.Event()
        self._error: BaseException | None = None
        self.device = device

    def set(self, error: BaseException | None = None) -> None:
        self._error = error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self) -> None:
        self._event.wait()
        if isinstance(self._error, OffloadError):
            raise self._error  # a copy this one waited for failed
        if self._error is not None:
            raise OffloadError(
                f"prefetch_offload: an asynchronous copy failed: {self._error}"
            ) from self._error


class _Inflight:
    """Copies not yet seen to be done, oldest first, with the tensors they use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: collections.deque[tuple[Fence, int, tuple[Any, ...]]] = collections.deque()
        self.bytes = 0

    def add(self, fence: Fence, nbytes: int, *keep: Any) -> None:
        with self._lock:
            self._items.append((fence, nbytes, keep))
            self.bytes += nbytes

    def poll(self) -> None:
        """Drop the finished copies at the front (copies on one stream end in order)."""
        finished = []
        with self._lock:
            items = self._items
            while items and items[0][0].done():
                finished.append(items.popleft())
                self.bytes -= finished[-1][1]
        del finished  # released outside the lock: dropping a block may run a finalizer

    def wait_oldest(self) -> None:
        with self._lock:
            if not self._items:
                return
            fence = self._items[0][0]
        fence.wait()
        self.poll()

    def drain(self) -> None:
        """Wait for every copy and drop them all (a failure is raised where it is used).

        Oldest first: copies issued from several threads may sit here in another order
        than their stream runs them, so waiting on the newest and polling could spin
        while an older one still runs."""
        while True:
            with self._lock:
                if not self._items:
                    return
                fence = self._items[0][0]
            with contextlib.suppress(Exception):
                fence.wait()
            self.poll()


class _Joined(Fence):
    """The end of a copy issued in chunks: done when every chunk is (NOTE [copy chunks])."""

    __slots__ = ("_fences", "device")

    def __init__(self, fences: list[Fence]) -> None:
        self._fences = fences
        self.device = fences[-1].device

    def done(self) -> bool:
        return all(f.done() for f in reversed(self._fences))

    def wait(self) -> None:
        for f in self._fences:
            f.wait()


_MIN_CHUNK = 4 << 20
_CHUNK_GRAIN = 64 << 10


def chunk_bytes(max_inflight_bytes: int) -> int:
    """The largest single D2H copy under a cap of ``max_inflight_bytes`` (NOTE [copy chunks])."""
    chunk = max(max_inflight_bytes // 4, min(max_inflight_bytes, _MIN_CHUNK))
    return chunk // _CHUNK_GRAIN * _CHUNK_GRAIN if chunk >= _CHUNK_GRAIN else chunk


class CopyStreams:
    """Side-stream copies for one device (NOTE [copy streams])."""

    def __init__(self, *, max_inflight_bytes: int) -> None:
        self.max_inflight_bytes = max_inflight_bytes
        self._chunk = chunk_bytes(max_inflight_bytes)
        self._d2h_inflight = _Inflight()
        self._h2d_inflight = _Inflight()
        #: Seconds the host waited because D2H bytes in flight were at the cap.
        self.throttle_seconds = 0.0
        #: The most D2H bytes that were in flight at once (never above the cap).
        self.peak_inflight_bytes = 0

    def mark(self) -> Fence | None:
        """A fence for the work the current stream has queued so far (NOTE [copy
        streams]): pass it to a later :meth:`d2h`. None where that work is done
        already (the CPU twin: the hook thread is its compute stream)."""
        return None

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, after: Fence | None = None) -> Fence:
        """Copy device bytes ``src`` into host bytes ``dst`` once ``after`` (a
        :meth:`mark`) is done, or else after the current stream's work so far.

        Copies larger than a chunk are issued chunk by chunk, each waiting only for
        room under the cap (NOTE [copy chunks]). Both tensors stay alive until the
        copy is done (NOTE [copies keep their buffers]).
        """
        self.poll()
        n = src.numel()
        fences = []
        for lo in range(0, n, self._chunk) if n else [0]:
            hi = min(n, lo + self._chunk)
            fences.append(self._d2h_chunk(dst[lo:hi], src[lo:hi], after))
        return fences[0] if len(fences) == 1 else self._joined(fences)

    def _d2h_chunk(self, dst: torch.Tensor, src: torch.Tensor, after: Fence | None) -> Fence:
        n = src.numel()
        inflight, cap = self._d2h_inflight, self.max_inflight_bytes
        if inflight.bytes and inflight.bytes + n > cap:
            start = time.perf_counter()
            while inflight.bytes and inflight.bytes + n > cap:
                inflight.wait_oldest()
            self.throttle_seconds += time.perf_counter() - start
        fence = self._d2h(dst, src, after)
        inflight.add(fence, n, dst, src)
        self.peak_inflight_bytes = max(self.peak_inflight_bytes, inflight.bytes)
        return fence

    def _joined(self, fences: list[Fence]) -> Fence:
        """One fence for a copy issued as ``fences`` (chunks, in stream order)."""
        return _Joined(fences)

    def h2d(
        self, src: torch.Tensor, after: Fence | None, pad: int = 0
    ) -> tuple[torch.Tensor, Fence]:
        """A new device tensor whose bytes from ``pad`` on are host bytes ``src``,
        filled once ``after`` is done.

        ``src`` stays alive until the copy is done. Pass the result to :meth:`use`
        before the compute stream reads it.
        """
        self.poll()
        out, fence = self._h2d(src, after, pad)
        self._h2d_inflight.add(fence, src.numel(), src)
        return out, fence

    def use(self, t: torch.Tensor, fence: Fence | None) -> None:
        """Make the current (compute) stream wait for ``fence`` before it reads ``t``."""
        raise NotImplementedError

    def poll(self) -> None:
        """Release the tensors of finished copies."""
        self._d2h_inflight.poll()
        self._h2d_inflight.poll()

    def synchronize(self) -> None:
        """Wait for every copy issued so far and release its tensors."""
        self._d2h_inflight.drain()
        self._h2d_inflight.drain()

    def close(self) -> None:
        """Wait for every copy; the streams stay usable (a graph may outlive its context)."""
        self.synchronize()

    def _d2h(self, dst: torch.Tensor, src: torch.Tensor, after: Fence | None) -> Fence:
        raise NotImplementedError

    def _h2d(self, src: torch.Tensor, after: Fence | None, pad: int) -> tuple[torch.Tensor, Fence]:
        raise NotImplementedError


# NOTE [side streams]
# ``torch.cuda.Stream()`` hands out PyTorch's pooled streams in turn (32 per
# device and priority), and NCCL process groups, FSDP and users' own side
# streams come from the same pool. Copies on a pooled stream could share it
# with collectives or user work, chunk by chunk behind them: still correct
# (every wait is an event), but the overlap with compute would be lost. So the
# copy streams are the process's own: one D2H and one H2D stream per device,
# made once with ``cudaStreamCreateWithFlags(cudaStreamNonBlocking)`` (as the
# pool makes its streams: they never wait for the legacy default stream),
# wrapped in ``torch.cuda.ExternalStream`` and never destroyed. No other
# library is handed them; engines alive at once share them (their copies only
# queue behind each other's). Where the CUDA runtime cannot be reached through
# ctypes, the pair comes from the pool instead, with a warning.
_SIDE_STREAMS: dict[torch.device, tuple[Any, Any]] = {}
_SIDE_STREAMS_LOCK = threading.Lock()


def _dedicated_stream(device: torch.device) -> Any:
    """A new non-blocking CUDA stream on ``device`` that is in no pool (NOTE [side streams])."""
    lib = _cudart()
    if lib is None:
        raise OSError("the CUDA runtime library (libcudart) was not found in this process")
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        err = lib.cudaStreamCreateWithFlags(ctypes.byref(handle), _STREAM_NON_BLOCKING)
    if err != 0 or not handle.value:
        raise OSError(f"cudaStreamCreateWithFlags failed with CUDA error {err}")
    return torch.cuda.ExternalStream(handle.value, device=device)


def _side_streams(device: torch.device) -> tuple[Any, Any]:
    """The process's D2H and H2D streams for ``device`` (NOTE [side streams])."""
    with _SIDE_STREAMS_LOCK:
        pair = _SIDE_STREAMS.get(device)
        if pair is None:
            try:
                pair = (_dedicated_stream(device), _dedicated_stream(device))
            except OSError as exc:
                warnings.warn(
                    f"prefetch_offload: could not create dedicated copy streams on {device} "
                    f"({exc}); the copies use two of PyTorch's pooled streams, which NCCL, "
                    "FSDP or other side streams may share, so they can queue behind that "
                    "work. Check that this torch build's libcudart is loadable.",
                    OffloadFallbackWarning,
                    stacklevel=4,
                )
                pair = (torch.cuda.Stream(device), torch.cuda.Stream(device))
            _SIDE_STREAMS[device] = pair
        return pair


class CudaStreams(CopyStreams):
    """CUDA side streams and events for one device."""

    def __init__(self, device: torch.device, *, max_inflight_bytes: int) -> None:
        super().__init__(max_inflight_bytes=max_inflight_bytes)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._index: int = device.index  # type: ignore[assignment]
        self._d2h_stream, self._h2d_stream = _side_streams(device)

    # IO threads call these too: every CUDA call runs with the device named, or
    # CUDA would make a context on device 0 for that thread (by index: NOTE [lean
    # CUDA calls]).

    def mark(self) -> Fence | None:
        with _OnDevice(self._index):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._index))
        return _CudaFence(event, self.device)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, after: Fence | None = None) -> Fence:
        with _OnDevice(self._index):
            return super().d2h(dst, src, after)

    def h2d(
        self, src: torch.Tensor, after: Fence | None, pad: int = 0
    ) -> tuple[torch.Tensor, Fence]:
        with _OnDevice(self._index):
            return super().h2d(src, after, pad)

    def poll(self) -> None:
        with _OnDevice(self._index):
            super().poll()

    def _joined(self, fences: list[Fence]) -> Fence:
        # One stream runs the chunks in order: the last event is the whole copy's, and
        # it stays a CUDA event, which an H2D copy can wait on without the host.
        return fences[-1]

    def _d2h(self, dst: torch.Tensor, src: torch.Tensor, after: Fence | None) -> Fence:
        side = self._d2h_stream
        current = torch.cuda.current_stream(self._index)  # read at every call
        if after is None:
            side.wait_stream(current)
        else:  # the stream that made the tensor (NOTE [copy streams]); no query: a wait
            for part in _parts(after):  # on a finished event costs the GPU nothing
                assert isinstance(part, _CudaFence)
                side.wait_event(part.event)
        with _OnStream(side, current):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event(blocking=True)  # host waits sleep, not spin
            event.record(side)
        return _CudaFence(event, self.device)

    def _h2d(self, src: torch.Tensor, after: Fence | None, pad: int) -> tuple[torch.Tensor, Fence]:
        side = self._h2d_stream
        # allocated on the side stream (NOTE [copy streams])
        with _OnStream(side, torch.cuda.current_stream(self._index)):
            if after is not None and not after.done():
                if isinstance(after, _CudaFence):
                    side.wait_event(after.event)
                else:
                    after.wait()
            out = torch.empty((pad + src.numel(),), dtype=torch.uint8, device=self.device)
            out[pad:].copy_(src, non_blocking=True)
            event = torch.cuda.Event(blocking=True)
            event.record(side)
        return out, _CudaFence(event, self.device)

    def use(self, t: torch.Tensor, fence: Fence | None) -> None:
        current = torch.cuda.current_stream(t.device.index)
        if fence is not None and not fence.done():
            assert isinstance(fence, _CudaFence)
            current.wait_event(fence.event)
        t.record_stream(current)  # NOTE [copy streams]: allocated on the H2D stream


class _Worker:
    """One CPU-twin side stream: a thread that runs jobs in order."""

    def __init__(self, name: str, delay: float) -> None:
        self.name = name
        self.delay = delay
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def put(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:  # after close: run in the caller, like a synchronous copy
                job()
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self.delay:
                time.sleep(self.delay)
            job()
            del job  # the job holds the copy's tensors: keep them no longer than it runs

    def close(self, *, wait: bool = True) -> None:
        """Stop the thread after the jobs queued so far; later jobs run in the caller.

        ``wait=False`` does not join, so a finalizer may call it from any thread.
        """
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            if wait:
                thread.join()


def _copy_job(
    dst: torch.Tensor | weakref.ref[torch.Tensor],
    src: weakref.ref[torch.Tensor],
    fence: _ThreadFence,
    after: Fence | None,
) -> Callable[[], None]:
    """A twin copy. It holds its source (and a D2H copy's destination) only weakly:
    on CUDA nothing but the in-flight list keeps them alive until the copy ran (NOTE
    [copies keep their buffers]), so a tensor already gone when the copy runs is a
    bug the twin must show, not hide by holding it itself."""

    def job() -> None:
        try:
            if after is not None:
                after.wait()
            out = dst() if isinstance(dst, weakref.ref) else dst
            inp = src()
            if out is None or inp is None:
                raise OffloadError(
                    "prefetch_offload: a copy's tensor was freed before the copy ran "
                    "(NOTE [copies keep their buffers])"
                )
            out.copy_(inp)
        except BaseException as exc:  # reaches whoever waits on the fence
            fence.set(exc)
        else:
            fence.set()

    return job


class ThreadStreams(CopyStreams):
    """The CPU twin of :class:`CudaStreams`: side streams are worker threads.

    Args:
        delay: seconds each copy waits before it runs, to make races visible in tests.
        max_inflight_bytes: cap on D2H bytes in flight (NOTE [copies keep their buffers]).
        device: the device its fences name (:attr:`Fence.device`).
    """

    def __init__(
        self,
        *,
        delay: float = 0.0,
        max_inflight_bytes: int = DEFAULT_INFLIGHT_COPY_BYTES,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(max_inflight_bytes=max_inflight_bytes)
        self.device = device if device is not None else torch.device("cpu")
        self._d2h_worker = _Worker("prefetch_offload-twin-d2h", delay)
        self._h2d_worker = _Worker("prefetch_offload-twin-h2d", delay)
        # Streams dropped without close() (an engine built directly) still stop their
        # threads, which hold the workers but not this object.
        for worker in (self._d2h_worker, self._h2d_worker):
            weakref.finalize(self, worker.close, wait=False)

    def _d2h(self, dst: torch.Tensor, src: torch.Tensor, after: Fence | None) -> Fence:
        fence = _ThreadFence(self.device)
        self._d2h_worker.put(_copy_job(weakref.ref(dst), weakref.ref(src), fence, after))
        return fence

    def _h2d(self, src: torch.Tensor, after: Fence | None, pad: int) -> tuple[torch.Tensor, Fence]:
        # Placed like the CUDA caching allocator places blocks: 512-byte aligned.
        raw = torch.empty((pad + src.numel() + 512,), dtype=torch.uint8)
        lead = (-raw.data_ptr()) % 512
        out = raw[lead : lead + pad + src.numel()]
        fence = _ThreadFence(self.device)
        # The destination is the caller's new tensor (stream-ordered on CUDA): held.
        self._h2d_worker.put(_copy_job(out[pad:], weakref.ref(src), fence, after))
        return out, fence

    def use(self, t: torch.Tensor, fence: Fence | None) -> None:
        if fence is not None:
            fence.wait()  # the hook thread is the twin's compute stream

    def close(self) -> None:
        self.synchronize()
        self._d2h_worker.close()
        self._h2d_worker.close()

"""The device layer: which tensors the engine may take, and how they reach host memory.

The engine only ever writes host (CPU) memory to slabs. A device layer turns a
saved tensor's storage span (NOTE [packed layout]) into host bytes at pack
time, and host bytes back into a span on the original device at unpack time.
Both directions may be asynchronous: each returns the bytes' location and a
:class:`~prefetch_offload.streams.Fence` (None when they are there already).

- :class:`HostDevice`: CPU tensors are host memory already; both directions
  are the identity. This is the whole path for CPU training.
- :class:`SpanCopyDevice`: copies spans through a pinned arena (NOTE [pinned
  arena] in arena.py) on side streams (NOTE [copy streams]). For ``"cuda"``
  it uses CUDA streams and events; built for ``"cpu"`` it is the CPU twin
  that CI runs: the same code over worker-thread streams.
- :class:`RoutingDevice`: sends each span to the layer for its device type.

# NOTE [direct IO from pinned memory]
# The disk target writes the host copies of CUDA tensors to the slabs straight
# from the pinned arena with O_DIRECT, and reads them back into it. The kernel
# pins the pages of every O_DIRECT request itself; memory the CUDA driver has
# page-locked normally allows that, but some sandboxes (gVisor) and some
# driver and kernel pairs refuse it (EFAULT, EINVAL) although the same folder
# takes O_DIRECT from ordinary memory. A refusal would surface as an IO error
# at the first write. So ``direct_io_ok`` tries a round trip (write, read back,
# compare) through one arena lease, once per folder, before the engine uses
# O_DIRECT there; if the kernel refuses it, it warns and the engine moves those
# bytes through the page cache. bench/gpu_preflight.py measures the same round
# trip at size, on the GPU machine, before the rest of the suite runs.
#
# Pinning memory needs a CUDA context: PyTorch's host allocator uses a device
# that has one, and where none has, it makes one on the current device, which
# is GPU 0 in every rank of a job that enters the context before
# ``torch.cuda.set_device`` or before its model reaches its GPU. So where no
# device has a context when the engine is built, ``direct_io_ok`` answers None
# (not known yet) and the engine probes at the first CUDA tensor it saves,
# under that tensor's device, before its first pinned copy; another thread's
# pack waits for it. If the kernel refuses then, the store switches to the
# page cache as the constructor's probe would have had it, and the slabs that
# CPU tensors' bytes opened meanwhile drop O_DIRECT (``SlabStore.use_buffered``).
"""

from __future__ import annotations

import errno
import os
import time
import warnings
import zlib
from collections.abc import Callable

import numpy as np
import torch

from .arena import PinnedArena, pin_block
from .buffers import Block, mapped_block
from .config import DEFAULT_INFLIGHT_COPY_BYTES
from .errors import OffloadFallbackWarning, OffloadIOError
from .slab import direct_io_supported, open_scratch_file
from .streams import CopyStreams, CudaStreams, Fence, ThreadStreams, devices_with_context

__all__ = [
    "DeviceLayer",
    "HostDevice",
    "Lease",
    "Placed",
    "RoutingDevice",
    "SpanCopyDevice",
    "default_device_layer",
    "direct_io_roundtrip",
]

# Bytes [base, base + nbytes) of a storage, ready once the fence (if any) is done.
Placed = tuple[torch.UntypedStorage, int, Fence | None]
# Returns a page-aligned uint8 host tensor of at least n bytes, and a buffer over them.
Lease = Callable[[int], tuple[torch.Tensor, memoryview]]

# The first pinned arena's size (NOTE [pinned arena]).
_ARENA_STEP_BYTES = 64 << 20
# Bytes of the O_DIRECT round trip that ``direct_io_ok`` tries, and its request size.
_DIRECT_PROBE_BYTES = 1 << 20
_DIRECT_REQUEST_BYTES = 8 << 20


def _bytes(storage: torch.UntypedStorage, base: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` bytes of ``storage`` from ``base``."""
    out = torch.empty((0,), dtype=torch.uint8, device=storage.device)
    return out.set_(storage, base, (nbytes,), (1,))


class DeviceLayer:
    """Moves byte spans of one device type's storages to host memory and back."""

    #: The ``torch.device.type`` this layer handles.
    device_type: str = ""

    def accepts(self, t: torch.Tensor) -> bool:
        """Whether ``t`` can be offloaded by this layer."""
        return t.device.type == self.device_type

    def identity(self, device: torch.device) -> bool:
        """Whether ``device``'s memory is host memory (no copies at all)."""
        raise NotImplementedError

    def mark(self, storage: torch.UntypedStorage) -> Fence | None:
        """A fence for the work queued so far on the current stream of ``storage``'s
        device, for a later :meth:`to_host` (NOTE [copy streams]); None where that
        work is already done."""
        return None

    def to_host(
        self, storage: torch.UntypedStorage, base: int, nbytes: int, after: Fence | None = None
    ) -> Placed:
        """The span's bytes in host memory, as the work before ``after`` (a
        :meth:`mark`) leaves them, or else as the current stream leaves them now."""
        raise NotImplementedError

    def to_device(
        self,
        storage: torch.UntypedStorage,
        base: int,
        nbytes: int,
        device: torch.device,
        after: Fence | None = None,
        align: int = 0,
    ) -> Placed:
        """Host bytes (complete once ``after`` is done) as a span on ``device``.

        The span starts at an address that is ``align`` modulo 512, where the
        original did (kernels pick code paths by alignment: bit-identical results
        need the same one). Safe to call from an IO thread. Call :meth:`use` on
        the thread that hands the result to autograd, before it does.
        """
        raise NotImplementedError

    def use(self, storage: torch.UntypedStorage, fence: Fence | None) -> None:
        """Make the current stream wait for ``fence`` before it reads ``storage``."""

    def lease_for(self, device: torch.device) -> Lease | None:
        """Host buffers to read ``device``'s spans into (None: the engine's own pool)."""
        return None

    def copy_wait_seconds(self) -> float:
        """Seconds packs waited at the cap on device-to-host bytes in flight."""
        return 0.0

    def pageable_fallbacks(self) -> int:
        """Host buffers served from pageable memory because pinning failed or the pinned
        limit was reached (NOTE [pinned arena]): copies to and from them are synchronous."""
        return 0

    def set_host_budget(self, nbytes: int | None) -> None:
        """Cap the pinned host bytes this layer holds (None: its default limit)."""

    def direct_io_ok(self, directory: str, *, now: bool = False) -> bool | None:
        """Whether O_DIRECT requests from this layer's host buffers work in ``directory``
        (NOTE [direct IO from pinned memory]); False also where the folder takes no
        O_DIRECT at all; None where asking would make a CUDA context, unless ``now``
        (ask again under the device of the first tensor that needs the buffers)."""
        return direct_io_supported(directory)

    def poll(self) -> None:
        """Release the tensors and host buffers of copies that have ended (it waits for
        none); the engine calls it when it has waited for its copies."""

    def close(self) -> None:
        """Wait for every copy in flight and release idle host buffers.

        The layer stays usable: a graph may be unpacked after its context exits.
        """


class HostDevice(DeviceLayer):
    """CPU storages: host memory already, so both directions are the identity."""

    device_type = "cpu"

    def identity(self, device: torch.device) -> bool:
        return True

    def to_host(
        self, storage: torch.UntypedStorage, base: int, nbytes: int, after: Fence | None = None
    ) -> Placed:
        return storage, base, None

    def to_device(
        self,
        storage: torch.UntypedStorage,
        base: int,
        nbytes: int,
        device: torch.device,
        after: Fence | None = None,
        align: int = 0,
    ) -> Placed:
        return storage, base, after


class SpanCopyDevice(DeviceLayer):
    """Copies spans of ``device_type`` storages to pinned host memory and back.

    Args:
        device_type: ``"cuda"``, or ``"cpu"`` for the CPU twin (NOTE [copy streams]).
        max_inflight_bytes: cap on device-to-host bytes in flight.
        twin_delay: the twin's delay before each copy (tests use it to provoke races).
        host_budget: cap on pinned host bytes (None: half the RAM or cgroup limit,
            shared among the node's ranks).
        arena_step_bytes: the first pinned arena's size (NOTE [pinned arena]).
        pin: makes one pinned block, raising when it cannot (default: PyTorch's
            pinned allocator for ``"cuda"``, anonymous mappings for the twin).
    """

    def __init__(
        self,
        device_type: str,
        *,
        max_inflight_bytes: int = DEFAULT_INFLIGHT_COPY_BYTES,
        twin_delay: float = 0.0,
        host_budget: int | None = None,
        arena_step_bytes: int = _ARENA_STEP_BYTES,
        pin: Callable[[int], Block] | None = None,
    ) -> None:
        self.device_type = device_type
        self.max_inflight_bytes = max_inflight_bytes
        self.twin_delay = twin_delay
        if pin is None:
            pin = pin_block if device_type == "cuda" else mapped_block
        #: The pinned host memory every copy goes through (NOTE [pinned arena]).
        self.pool = PinnedArena(pin, step_bytes=arena_step_bytes, limit_bytes=host_budget)
        self._streams: dict[torch.device, CopyStreams] = {}
        # NOTE [direct IO from pinned memory]: the round trip's outcome per folder.
        self._direct: dict[str, bool] = {}

    def streams(self, device: torch.device) -> CopyStreams:
        """The copy streams of ``device`` (created at first use)."""
        streams = self._streams.get(device)
        if streams is None:
            if self.device_type == "cuda":
                streams = CudaStreams(device, max_inflight_bytes=self.max_inflight_bytes)
            else:
                streams = ThreadStreams(
                    delay=self.twin_delay,
                    max_inflight_bytes=self.max_inflight_bytes,
                    device=device,
                )
            streams = self._streams.setdefault(device, streams)
        return streams

    def identity(self, device: torch.device) -> bool:
        return False

    def mark(self, storage: torch.UntypedStorage) -> Fence | None:
        return self.streams(storage.device).mark()

    def to_host(
        self, storage: torch.UntypedStorage, base: int, nbytes: int, after: Fence | None = None
    ) -> Placed:
        host, region = self.pool.lease(nbytes)
        region.release()
        src = _bytes(storage, base, nbytes)
        fence = self.streams(storage.device).d2h(host[:nbytes], src, after)
        return host.untyped_storage(), 0, fence

    def to_device(
        self,
        storage: torch.UntypedStorage,
        base: int,
        nbytes: int,
        device: torch.device,
        after: Fence | None = None,
        align: int = 0,
    ) -> Placed:
        out, fence = self.streams(device).h2d(_bytes(storage, base, nbytes), after, align)
        return out.untyped_storage(), out.storage_offset() + align, fence

    def use(self, storage: torch.UntypedStorage, fence: Fence | None) -> None:
        self.streams(storage.device).use(_bytes(storage, 0, storage.nbytes()), fence)

    def lease_for(self, device: torch.device) -> Lease | None:
        return self.pool.lease

    def copy_wait_seconds(self) -> float:
        return sum(s.throttle_seconds for s in list(self._streams.values()))

    def pageable_fallbacks(self) -> int:
        return self.pool.pageable_fallbacks

    def set_host_budget(self, nbytes: int | None) -> None:
        self.pool.set_limit(nbytes)

    def direct_io_ok(self, directory: str, *, now: bool = False) -> bool | None:
        ok = self._direct.get(directory)
        if ok is not None:
            return ok
        ok = direct_io_supported(directory)
        if self.device_type == "cuda" and not torch.cuda.is_available():
            return ok  # no CUDA tensor will come: nothing to pin, nothing to probe
        if ok and self.device_type == "cuda" and not now and not cuda_context_exists():
            return None  # NOTE [direct IO from pinned memory]: pinning now makes one
        if ok:  # the folder takes O_DIRECT from ordinary pages: now from ours
            host, region = self.pool.lease(_DIRECT_PROBE_BYTES)
            try:
                direct_io_roundtrip(directory, region)
            except (OSError, OffloadIOError) as exc:
                ok = False
                warnings.warn(
                    f"prefetch_offload: {directory!r} takes O_DIRECT, but not from pinned "
                    f"host memory ({exc}); the host copies of CUDA tensors go to and from "
                    "the disk through the page cache there instead, which costs a memory "
                    "copy per byte. Pick a save_dir on a local disk, or pass "
                    "io_method='buffered' to choose that path knowingly.",
                    OffloadFallbackWarning,
                    stacklevel=2,
                )
            finally:
                region.release()
                del host
        self._direct[directory] = ok
        return ok

    def poll(self) -> None:
        for streams in list(self._streams.values()):
            streams.poll()

    def close(self) -> None:
        for streams in list(self._streams.values()):
            streams.close()
        self.pool.close()


class RoutingDevice(DeviceLayer):
    """Dispatches each span to the layer for its device type."""

    def __init__(self, layers: list[DeviceLayer]) -> None:
        self.layers = layers
        self._by_type = {layer.device_type: layer for layer in layers}

    def accepts(self, t: torch.Tensor) -> bool:
        return t.device.type in self._by_type

    def identity(self, device: torch.device) -> bool:
        return self._by_type[device.type].identity(device)

    def mark(self, storage: torch.UntypedStorage) -> Fence | None:
        return self._by_type[storage.device.type].mark(storage)

    def to_host(
        self, storage: torch.UntypedStorage, base: int, nbytes: int, after: Fence | None = None
    ) -> Placed:
        return self._by_type[storage.device.type].to_host(storage, base, nbytes, after)

    def to_device(
        self,
        storage: torch.UntypedStorage,
        base: int,
        nbytes: int,
        device: torch.device,
        after: Fence | None = None,
        align: int = 0,
    ) -> Placed:
        return self._by_type[device.type].to_device(storage, base, nbytes, device, after, align)

    def use(self, storage: torch.UntypedStorage, fence: Fence | None) -> None:
        self._by_type[storage.device.type].use(storage, fence)

    def lease_for(self, device: torch.device) -> Lease | None:
        return self._by_type[device.type].lease_for(device)

    def copy_wait_seconds(self) -> float:
        return sum(layer.copy_wait_seconds() for layer in self.layers)

    def pageable_fallbacks(self) -> int:
        return sum(layer.pageable_fallbacks() for layer in self.layers)

    def set_host_budget(self, nbytes: int | None) -> None:
        for layer in self.layers:
            layer.set_host_budget(nbytes)

    def direct_io_ok(self, directory: str, *, now: bool = False) -> bool | None:
        verdicts = [layer.direct_io_ok(directory, now=now) for layer in self.layers]
        if False in verdicts:
            return False
        return None if None in verdicts else True

    def poll(self) -> None:
        for layer in self.layers:
            layer.poll()

    def close(self) -> None:
        for layer in self.layers:
            layer.close()


def cuda_context_exists() -> bool:
    """Whether any CUDA device has its primary context (True where this torch cannot
    tell): pinning host memory then makes none (NOTE [direct IO from pinned memory])."""
    ready = devices_with_context()
    return ready is None or bool(ready)  # cannot tell: probe now, as without the check


def default_device_layer(
    target: str, *, max_inflight_bytes: int = DEFAULT_INFLIGHT_COPY_BYTES
) -> DeviceLayer:
    """The layer an engine uses for ``target``: "cpu" moves only CUDA tensors (CPU
    tensors are host memory already); "disk" takes CPU and CUDA tensors."""
    layers: list[DeviceLayer] = [SpanCopyDevice("cuda", max_inflight_bytes=max_inflight_bytes)]
    if target == "disk":
        layers.append(HostDevice())
    return RoutingDevice(layers)


def direct_io_roundtrip(
    directory: str, buf: memoryview, *, request: int = _DIRECT_REQUEST_BYTES
) -> tuple[float, float]:
    """Write ``buf`` to a new O_DIRECT scratch file in ``directory``, read it back into
    ``buf`` and check the bytes (NOTE [direct IO from pinned memory]).

    ``buf`` must start a page and be whole pages long; it is overwritten with a
    pattern. Requests are at most ``request`` bytes.

    Returns:
        Seconds the write and the read took.

    Raises:
        OSError: the folder or the kernel refused (EINVAL where the folder takes no
            O_DIRECT; EFAULT or EINVAL where the memory cannot be used for it).
        OffloadIOError: the bytes read back differ from those written.
    """
    n = len(buf)
    data = np.frombuffer(buf, dtype=np.uint8)
    data[:] = np.resize(np.frombuffer(os.urandom(4096), dtype=np.uint8), n)
    crc = zlib.crc32(buf)
    try:
        fd = open_scratch_file(directory, direct=True)
    except BaseException:
        del data  # the caller releases ``buf``: nothing may still export it
        raise
    try:
        try:
            os.posix_fallocate(fd, 0, n)
        except OSError as exc:  # as SlabStore does: some filesystems cannot reserve
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, n)
        start = time.perf_counter()
        _whole(lambda view, pos: os.pwrite(fd, view, pos), buf, request, "write")
        wrote = time.perf_counter() - start
        data[:] = 0
        start = time.perf_counter()
        _whole(lambda view, pos: os.preadv(fd, [view], pos), buf, request, "read")
        read = time.perf_counter() - start
    finally:
        os.close(fd)
        del data
    if zlib.crc32(buf) != crc:
        raise OffloadIOError(
            f"prefetch_offload: an O_DIRECT round trip through {directory!r} read back other "
            "bytes than it wrote; do not use O_DIRECT in this folder (io_method='buffered')."
        )
    return wrote, read


def _whole(op: Callable[[memoryview, int], int], buf: memoryview, request: int, what: str) -> None:
    """Run ``op(view, position)`` over all of ``buf``, ``request`` bytes at most at a time."""
    pos, n = 0, len(buf)
    while pos < n:
        done = op(buf[pos : min(n, pos + request)], pos)
        if done <= 0:
            raise OSError(errno.EIO, f"short O_DIRECT {what} at offset {pos}")
        pos += done

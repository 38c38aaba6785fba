"""Shared pieces of the benchmarks: memory and CPU readings, the machine, scratch folders,
the balanced round order, and the bare-IO reference (``IOReplay``).

Nothing here is part of ``prefetch_offload``.
"""

from __future__ import annotations

import contextlib
import os
import platform
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

import torch

# Bytes malloc has handed out and not had back: live heap memory, without what glibc
# keeps for reuse (None without glibc's mallinfo2).
from prefetch_offload.heap import malloc_in_use_bytes as heap_in_use_bytes
from prefetch_offload.heap import resident_bytes as read_rss_bytes

__all__ = [
    "MB",
    "TORCH_THREADS",
    "IOReplay",
    "filesystem_type",
    "heap_in_use_bytes",
    "machine_info",
    "ordinary_pages",
    "peak_rss_bytes",
    "read_rss_bytes",
    "reset_peak_rss",
    "round_order",
    "scratch_folder",
    "steal_seconds",
]

T = TypeVar("T")

MB = float(1 << 20)  # the tables say MiB
TORCH_THREADS = 2  # intra-op threads of every benchmark that trains
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def round_order(items: Sequence[T], r: int) -> list[T]:
    """The order to run ``items`` in round ``r``: a balanced (Williams) Latin square.

    Over every ``len(items)`` rounds (twice that for an odd count) each item runs
    once in each position and follows each other item equally often, so neither
    a slot in the round nor the item run just before (whose cache, page cache or
    IO backlog the next one inherits) favours any of them.
    """
    n = len(items)
    if n <= 2:
        k = r % n if n else 0
        return list(items[k:]) + list(items[:k])
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(j + i) % n for j in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [items[j] for j in rows[r % len(rows)]]


def _proc_kib(path: str, key: str) -> int | None:
    """The "``key`` N kB" line of a /proc file, in bytes; None where it is missing."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS; False where unsupported.

    Writing "5" to ``/proc/self/clear_refs`` (Linux 4.0+) does it; with
    :func:`peak_rss_bytes` read afterwards, the kernel's own high-water mark
    catches peaks too short for any sampler.
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int | None:
    """Peak RSS since the process started or since :func:`reset_peak_rss` (VmHWM)."""
    return _proc_kib("/proc/self/status", "VmHWM:")


@contextlib.contextmanager
def scratch_folder(save_dir: str | None, prefix: str = "bench-") -> Iterator[str]:
    """A fresh folder inside ``save_dir`` (default ``./.scratch``, not /tmp, which
    may be tmpfs) for one run's scratch files; removed with its contents at the end."""
    parent = save_dir or ".scratch"
    os.makedirs(parent, exist_ok=True)
    folder = tempfile.mkdtemp(dir=parent, prefix=prefix)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding ``path`` (e.g. "ext4", "tmpfs"), or "unknown"."""
    real = os.path.realpath(path)
    best, fstype = "", "unknown"
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, fstype = mount, fields[2]
    except OSError:
        pass
    return fstype


def machine_info() -> dict[str, Any]:
    """Host, core counts and versions, for the report."""
    cores = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    memory = _proc_kib("/proc/meminfo", "MemTotal:")
    cpu = None
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    return {
        "host": platform.node(),
        "cores": cores,
        "usable_cores": usable,
        "cpu": cpu,
        "memory_gib": None if memory is None else round(memory / (1 << 30), 1),
        "system": f"{platform.system()} {platform.release()} {platform.machine()}",
        "torch": torch.__version__,
        "torch_threads": TORCH_THREADS,
        "python": platform.python_version(),
        # Runnable threads over the last minute when the run started (a shared machine's
        # other work slows every lane alike, but every step too).
        "load_average": round(os.getloadavg()[0], 1),
    }


def steal_seconds() -> float | None:
    """CPU time the hypervisor took from this machine's CPUs so far (all CPUs, seconds).

    The ``steal`` field of ``/proc/stat``'s ``cpu`` line: time a virtual CPU was
    ready to run but the host ran something else, such as its own side of this
    guest's disk IO. None where the kernel does not report it.
    """
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def ordinary_pages(nbytes: int) -> memoryview:
    """``nbytes`` page-aligned writable bytes from malloc: ordinary 4 KiB pages, as
    activations are (the view keeps its memory alive)."""
    raw = torch.full((nbytes + _PAGE_SIZE,), 7, dtype=torch.uint8)
    lead = (-raw.data_ptr()) % _PAGE_SIZE
    return memoryview(raw[lead : lead + nbytes].numpy())


class IOReplay:
    """The disk mode's bytes moved with no hooks and no engine: what the IO alone costs.

    A reference for ``bench/step.py``: training runs exactly as without offload
    while one side thread writes ``nbytes`` per step, in ``chunk``-byte requests
    from ordinary page-aligned memory (4 KiB pages, like activations), during
    forward, then reads them back into huge-page blocks (the engine's read
    buffers, NOTE [huge pages]) in ``read_chunk``-byte requests during backward.
    Requests use O_DIRECT where the folder allows it, as the engine does. The
    step calls :meth:`forward_started`, :meth:`backward_started` and
    :meth:`wait`; the step time includes the replay's reads that outlast
    backward. On a machine whose cores compute fills, the ratio of this mode to
    ``none`` is what moving these bytes this way costs a step (the kernel's
    and, on a VM, the hypervisor's share of the IO), before any engine work;
    ``disk`` divided by it is what the engine adds.

    The requests are paced evenly over the previous step's forward
    (writes) and backward (reads), the way an offload engine's IO lands while
    compute runs; the first step, with nothing to go by, is a burst.
    """

    def __init__(
        self,
        folder: str,
        nbytes: int,
        *,
        chunk: int,
        read_chunk: int = 4 << 20,
    ) -> None:
        if nbytes < 0 or chunk < _PAGE_SIZE or read_chunk < _PAGE_SIZE:
            raise ValueError("IOReplay needs nbytes >= 0 and requests of at least one page")
        self.folder = folder
        self.chunk = chunk - chunk % _PAGE_SIZE
        self.read_chunk = read_chunk - read_chunk % _PAGE_SIZE
        self.nbytes = -(-nbytes // _PAGE_SIZE) * _PAGE_SIZE
        self.bytes_written = 0
        self.bytes_read = 0
        # Seconds the last forward and backward took (the next step paces over them).
        self._phase_s = [0.0, 0.0]
        self._phase_start = 0.0
        self._fd = -1
        self._cmds: queue.Queue[tuple[str, float] | None] = queue.Queue()
        self._done: queue.Queue[BaseException | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._source: memoryview | None = None
        self._blocks: list[Any] = []

    def __enter__(self) -> IOReplay:
        from prefetch_offload.buffers import mapped_block
        from prefetch_offload.slab import direct_io_supported, open_scratch_file

        os.makedirs(self.folder, exist_ok=True)
        self._fd = open_scratch_file(self.folder, direct=direct_io_supported(self.folder))
        os.posix_fallocate(self._fd, 0, max(self.nbytes, _PAGE_SIZE))
        self._source = ordinary_pages(self.nbytes)
        self._blocks = [mapped_block(self.read_chunk) for _ in range(2)]
        self._thread = threading.Thread(target=self._main, name="bench-ioreplay", daemon=True)
        self._thread.start()
        return self

    def forward_started(self) -> None:
        """Queue this step's writes."""
        self._phase_start = time.perf_counter()
        self._cmds.put(("write", self._phase_s[0]))

    def backward_started(self) -> None:
        """Queue this step's reads (they start once the writes are done)."""
        now = time.perf_counter()
        self._phase_s[0], self._phase_start = now - self._phase_start, now
        self._cmds.put(("read", self._phase_s[1]))

    def wait(self) -> None:
        """Wait until this step's writes and reads are done; re-raise the first error.

        Call it when backward has returned: the time since :meth:`backward_started`
        is the backward that the next step's reads are spread over.
        """
        self._phase_s[1] = time.perf_counter() - self._phase_start
        errors = [err for err in (self._done.get(), self._done.get()) if err is not None]
        if errors:
            raise errors[0]

    def _main(self) -> None:
        while (cmd := self._cmds.get()) is not None:
            op, over = cmd
            try:
                if op == "write":
                    self._write(over)
                else:
                    self._read(over)
                self._done.put(None)
            except BaseException as exc:
                self._done.put(exc)

    @staticmethod
    def _pace(start: float, over: float, k: int, n: int) -> None:
        """Sleep until request ``k`` of ``n``'s share of ``over`` seconds from ``start``."""
        if over > 0 and k:
            time.sleep(max(0.0, start + over * k / n - time.perf_counter()))

    def _write(self, over: float) -> None:
        assert self._source is not None
        start, n = time.perf_counter(), -(-self.nbytes // self.chunk)
        for k, off in enumerate(range(0, self.nbytes, self.chunk)):
            self._pace(start, over, k, n)
            piece = self._source[off : off + self.chunk]
            if os.pwritev(self._fd, [piece], off) != len(piece):
                raise OSError(f"IOReplay: short write at offset {off}")
            self.bytes_written += len(piece)

    def _read(self, over: float) -> None:
        start, count = time.perf_counter(), -(-self.nbytes // self.read_chunk)
        for i, off in enumerate(range(0, self.nbytes, self.read_chunk)):
            self._pace(start, over, i, count)
            n = min(self.read_chunk, self.nbytes - off)
            region = memoryview(self._blocks[i % 2].buffer)[:n]
            if os.preadv(self._fd, [region], off) != n:
                raise OSError(f"IOReplay: short read at offset {off}")
            self.bytes_read += n

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._thread is not None:
            self._cmds.put(None)
            self._thread.join()
            self._thread = None
        for block in self._blocks:
            block.release()
        self._blocks, self._source = [], None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

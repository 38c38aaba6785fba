"""Shared pieces of the benchmarks: the result row, RSS sampling, the machine, and the
seed baseline.

Nothing here is part of ``prefetch_offload``; the seed's per-tensor disk hooks
live here (not in the package) only so the benchmark can compare against them.
"""

from __future__ import annotations

import contextlib
import os
import platform
import queue
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any, TypeVar

import torch

# Bytes malloc has handed out and not had back: live heap memory, without what glibc
# keeps for reuse (None without glibc's mallinfo2).
from prefetch_offload.heap import malloc_in_use_bytes as heap_in_use_bytes
from prefetch_offload.heap import resident_bytes

__all__ = [
    "MB",
    "TORCH_THREADS",
    "IOReplay",
    "RssSampler",
    "SeedDiskHooks",
    "StepResult",
    "filesystem_type",
    "heap_in_use_bytes",
    "machine_info",
    "ordinary_pages",
    "page_cache_bytes",
    "peak_rss_bytes",
    "read_rss_bytes",
    "reset_peak_rss",
    "round_order",
    "scratch_folder",
    "steal_seconds",
]

T = TypeVar("T")

MB = float(1 << 20)  # bench output calls this MiB; the name is kept for its importers
TORCH_THREADS = 2  # intra-op threads of every benchmark that trains
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


# -- resident memory ---------------------------------------------------------------------


def read_rss_bytes() -> int:
    """This process's resident memory in bytes (``/proc/self/statm`` field 2)."""
    return resident_bytes()


def round_order(items: Sequence[T], r: int) -> list[T]:
    """The order to run ``items`` in round ``r``: a balanced (Williams) Latin square.

    Over every ``len(items)`` rounds (twice that for an odd count) each item runs
    once in each position and follows each other item equally often, so neither
    a slot in the round nor the item run just before (whose cache, page cache or
    IO backlog the next one inherits) favours any of them. A plain rotation
    keeps every item behind the same predecessor.
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


def page_cache_bytes() -> int | None:
    """The machine's page cache (``Cached`` in ``/proc/meminfo``), or None.

    Memory that buffered file writes leave in RAM: not in any process's RSS, but
    still held until the kernel writes it back and drops it.
    """
    return _proc_kib("/proc/meminfo", "Cached:")


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


class RssSampler:
    """Samples RSS every ``interval`` seconds on a background thread; keeps the maximum.

    Use as a context manager around the region to watch; ``peak_bytes`` holds
    the largest sample, including one taken at exit (none at entry, so that the
    caller can read its own starting value after the thread exists). With
    ``record=True`` every sample is also kept in ``trace`` as ``(perf_counter
    seconds, rss bytes)``: a timeline of memory over the region. ``read``
    replaces RSS with another counter (``torch.cuda.memory_allocated``).
    """

    def __init__(
        self,
        interval: float = 0.002,
        *,
        record: bool = False,
        read: Callable[[], int] = read_rss_bytes,
    ) -> None:
        self.interval = interval
        self._read = read
        self.peak_bytes = 0
        self.samples = 0
        self.record = record
        self.trace: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        rss = self._read()
        self.samples += 1
        if self.record:
            self.trace.append((time.perf_counter(), rss))
        if rss > self.peak_bytes:
            self.peak_bytes = rss

    def peak_between(self, start: float, end: float) -> int | None:
        """The largest recorded sample taken in ``[start, end]`` (None if none was)."""
        inside = [rss for t, rss in self.trace if start <= t <= end]
        return max(inside) if inside else None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> RssSampler:
        self._thread = threading.Thread(target=self._run, name="bench-rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()


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


# -- the machine -------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """Host, core counts and versions, for the report."""
    cores = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    memory = _proc_kib("/proc/meminfo", "MemTotal:")
    return {
        "host": platform.node(),
        "cores": cores,
        "usable_cores": usable,
        "cpu": _cpu_model(),
        "memory_gib": None if memory is None else round(memory / (1 << 30), 1),
        "system": f"{platform.system()} {platform.release()} {platform.machine()}",
        "torch": torch.__version__,
        "torch_threads": TORCH_THREADS,
        "python": platform.python_version(),
    }


def _cpu_model() -> str | None:
    """The first "model name" of /proc/cpuinfo, or None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return None


# -- the seed baseline -------------------------------------------------------------------


class SeedDiskHooks:
    """The seed's per-tensor disk hooks, applied to CPU tensors.

    Mirrors ``_make_disk_hooks`` in the seed's ``activation_offload.py``: pack
    creates one ``mkstemp`` file per saved tensor and ``torch.save``s it; unpack
    ``torch.load``s it and unlinks the file. The seed only took CUDA tensors; here
    every CPU tensor of at least ``min_bytes`` bytes goes to disk (parameters
    too: the seed had no parameter check). Like the seed, ``torch.save`` of a
    view writes its whole storage. Files left at exit are removed.
    Hooks are thread-local: enter it in the thread that runs forward.
    """

    def __init__(self, save_dir: str, min_bytes: int) -> None:
        os.makedirs(save_dir, exist_ok=True)
        self.save_dir = save_dir
        self.min_bytes = min_bytes
        self.files_written = 0
        self.bytes_written = 0
        self._lock = threading.Lock()
        self._created: set[str] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> tuple[str, Any]:
        """Write ``tensor`` to its own file; small and non-CPU tensors stay in memory."""
        if tensor.device.type != "cpu" or tensor.numel() * tensor.element_size() < self.min_bytes:
            return ("keep", tensor)
        fd, path = tempfile.mkstemp(dir=self.save_dir, suffix=".pt")
        with self._lock:
            self._created.add(path)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(tensor.detach().cpu(), f)
                f.flush()
                size = os.fstat(f.fileno()).st_size
        except Exception:
            self._remove(path)
            return ("keep", tensor)
        with self._lock:
            self.files_written += 1
            self.bytes_written += size
        return ("disk", path)

    def unpack(self, packed: tuple[str, Any]) -> torch.Tensor:
        """Load the tensor back and delete its file."""
        kind, payload = packed
        if kind != "disk":
            return payload
        try:
            return torch.load(payload, map_location="cpu", weights_only=True)
        finally:
            self._remove(payload)

    def _remove(self, path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass
        with self._lock:
            self._created.discard(path)

    def __enter__(self) -> SeedDiskHooks:
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._hooks.__exit__(exc_type, exc, tb)
        with self._lock:
            left = list(self._created)
        for path in left:
            self._remove(path)


# -- the cost of the IO alone -------------------------------------------------------------


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

    A control for ``bench/step.py``: training runs exactly as without offload
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

    By default the requests go out back to back (a burst: the cheapest timing).
    With ``spread=True`` they are paced evenly over the previous step's forward
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
        spread: bool = False,
    ) -> None:
        if nbytes < 0 or chunk < _PAGE_SIZE or read_chunk < _PAGE_SIZE:
            raise ValueError("IOReplay needs nbytes >= 0 and requests of at least one page")
        self.folder = folder
        self.chunk = chunk - chunk % _PAGE_SIZE
        self.read_chunk = read_chunk - read_chunk % _PAGE_SIZE
        self.nbytes = -(-nbytes // _PAGE_SIZE) * _PAGE_SIZE
        self.bytes_written = 0
        self.bytes_read = 0
        self.spread = spread
        # Seconds the last forward and backward took (spread=True paces over them).
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
        self._cmds.put(("write", self._phase_s[0] if self.spread else 0.0))

    def backward_started(self) -> None:
        """Queue this step's reads (they start once the writes are done)."""
        now = time.perf_counter()
        self._phase_s[0], self._phase_start = now - self._phase_start, now
        self._cmds.put(("read", self._phase_s[1] if self.spread else 0.0))

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


# -- the result row ----------------------------------------------------------------------


def _median_of(name: str, doc: str) -> Any:
    """A property: the median of tuple field ``name``, None where it is empty."""
    return property(lambda self: _median(getattr(self, name)), doc=doc)


def _mean_of(name: str, doc: str) -> Any:
    """A property: the mean of tuple field ``name``, None where it is empty."""

    def get(self: StepResult) -> float | None:
        values = getattr(self, name)
        return statistics.fmean(values) if values else None

    return property(get, doc=doc)


def _per_step_of(name: str, doc: str) -> Any:
    """A property: counter field ``name`` per timed step, None where it was not counted."""

    def get(self: StepResult) -> float | None:
        total = getattr(self, name)
        return None if total is None or not self.steps else total / self.steps

    return property(get, doc=doc)


def _median(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


@dataclass(frozen=True)
class StepResult:
    """One mode's measurements: timed rounds and memory probes.

    Raw samples and cumulative counter deltas are stored; everything shown in
    the tables is a property computed from them. ``baseline_*`` are the ``none``
    mode's values (None when ``none`` did not run or was not probed). Memory
    tuples hold one value per probe process: the largest over its measured
    steps, in bytes above the process's RSS before its first step.
    """

    mode: str
    label: str
    # Wall seconds of forward + backward + optimizer step, one per timed round.
    step_seconds: tuple[float, ...]
    # Memory probes, glibc's default allocator: peak RSS (VmHWM) over whole training
    # steps, and its forward and backward (+ optimizer step) parts.
    peak_bytes: tuple[int, ...] = ()
    forward_peak_bytes: tuple[int, ...] = ()
    backward_peak_bytes: tuple[int, ...] = ()
    # The same peak under the tuned allocator (MALLOC_MMAP_THRESHOLD_=65536).
    tuned_peak_bytes: tuple[int, ...] = ()
    # Default-allocator probes: malloc bytes in use at the end of the last step's forward
    # (mallinfo2; empty where unavailable), and the page cache added over a step.
    heap_bytes: tuple[int, ...] = ()
    cache_bytes: tuple[int, ...] = ()
    # Saved activations of one step (distinct storages, parameters excluded): the
    # same for every mode, since every mode trains the same model on the same data.
    saved_bytes: int | None = None
    # The engine's device_budget in bytes (engine modes only).
    device_budget: int | None = None
    # Hypervisor steal (all CPUs, from /proc/stat) during each timed step, in seconds.
    steal_seconds: tuple[float, ...] = ()
    # The process's minor page faults (getrusage, every thread) during each timed step.
    minor_faults: tuple[int, ...] = ()
    # Engine counter deltas over the timed rounds (engine modes and replays only).
    bytes_offloaded: int | None = None
    bytes_demoted_to_disk: int | None = None
    prefetch_hits: int | None = None
    prefetch_misses: int | None = None
    stall_seconds: float | None = None
    pack_wait_seconds: float | None = None
    baseline_step_s: float | None = None
    baseline_peak_bytes: float | None = None
    baseline_tuned_peak_bytes: float | None = None

    @property
    def steps(self) -> int:
        """Number of timed steps."""
        return len(self.step_seconds)

    @property
    def median_step_s(self) -> float:
        """Median step time in seconds."""
        return statistics.median(self.step_seconds)

    @property
    def min_step_s(self) -> float:
        """Fastest step in seconds."""
        return min(self.step_seconds)

    @property
    def ratio(self) -> float | None:
        """Median step time over the ``none`` median (None without a baseline)."""
        if not self.baseline_step_s:
            return None
        return self.median_step_s / self.baseline_step_s

    # Medians over the probes (None where none was made).
    peak = _median_of("peak_bytes", "Whole-step peak RSS above the RSS before training.")
    forward_peak = _median_of("forward_peak_bytes", "Like ``peak``, over forward only.")
    backward_peak = _median_of(
        "backward_peak_bytes", "Like ``peak``, over backward and the optimizer step only."
    )
    tuned_peak = _median_of(
        "tuned_peak_bytes", "``peak`` under the tuned allocator (MALLOC_MMAP_THRESHOLD_=65536)."
    )

    @property
    def act_mem(self) -> float | None:
        """Activation memory: ``peak`` minus what ``none`` holds beside its activations
        (its peak minus the saved bytes). For ``none`` itself this is the saved bytes."""
        return _activation_memory(self.peak, self.baseline_peak_bytes, self.saved_bytes)

    @property
    def act_cut(self) -> float | None:
        """Fraction of ``none``'s activation memory (the saved bytes) this mode cut."""
        return _cut(self.act_mem, self.saved_bytes)

    @property
    def tuned_act_mem(self) -> float | None:
        """``act_mem`` under the tuned allocator, against ``none``'s tuned peak."""
        return _activation_memory(self.tuned_peak, self.baseline_tuned_peak_bytes, self.saved_bytes)

    @property
    def tuned_act_cut(self) -> float | None:
        """``act_cut`` under the tuned allocator."""
        return _cut(self.tuned_act_mem, self.saved_bytes)

    heap = _median_of(
        "heap_bytes", "Malloc bytes in use at the end of the last forward above those before."
    )
    cache = _median_of("cache_bytes", "Page cache a step added (the machine's, not the process's).")
    # Engine counters per timed step (None where not counted).
    offloaded_per_step = _per_step_of("bytes_offloaded", "Bytes the engine wrote.")
    demoted_per_step = _per_step_of("bytes_demoted_to_disk", "Bytes handed to the disk tier.")

    @property
    def move_target(self) -> float | None:
        """The bytes a step should move: saved bytes minus the device budget."""
        if self.device_budget is None or self.saved_bytes is None:
            return None
        return float(max(self.saved_bytes - self.device_budget, 0))

    @property
    def moved_ratio(self) -> float | None:
        """Bytes written per step over ``move_target`` (1.0: exactly what the budget
        leaves over)."""
        moved, target = self.offloaded_per_step, self.move_target
        if moved is None or not target:
            return None
        return moved / target

    @property
    def hit_rate(self) -> float | None:
        """Unpacks served without waiting, as a fraction (None if nothing was unpacked)."""
        if self.prefetch_hits is None or self.prefetch_misses is None:
            return None
        total = self.prefetch_hits + self.prefetch_misses
        return self.prefetch_hits / total if total else None

    stall_per_step = _per_step_of("stall_seconds", "Seconds backward waited for reads.")
    # Means over the timed steps (None where unknown).
    steal_per_step = _mean_of("steal_seconds", "CPU seconds the hypervisor took per step.")
    faults_per_step = _mean_of("minor_faults", "Minor page faults of the process per step.")
    pack_wait_per_step = _per_step_of(
        "pack_wait_seconds", "Seconds forward waited at the pending-write cap."
    )

    def to_json(self) -> dict[str, Any]:
        """Raw fields, then every computed property in the order defined, JSON-ready."""
        out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}
        for name, attr in vars(StepResult).items():
            if isinstance(attr, property):
                out[name] = getattr(self, name)
        return out


def _activation_memory(
    peak: float | None, baseline_peak: float | None, saved: int | None
) -> float | None:
    if peak is None or baseline_peak is None or saved is None:
        return None
    return peak - (baseline_peak - saved)


def _cut(value: float | None, baseline: float | None) -> float | None:
    if value is None or not baseline:
        return None
    return 1.0 - value / baseline

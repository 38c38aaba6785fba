"""Measure a folder's raw write and read bandwidth, and suggest offload knobs from it.

The measurement is the one DeepSpeed's NVMe tuner makes, done with this
library's own scratch files: for each request size and worker count, one
unlinked file is reserved with ``posix_fallocate``, ``workers`` threads each
write their stripe of it with ``pwrite`` from a reused, page-aligned buffer,
then read it back with ``preadv`` into the same buffer. The file is opened with
O_DIRECT where the folder allows it (as ``io_method="auto"`` does), so the
numbers are the device's, not the page cache's. Nothing is ever visible in the
folder: the files are unlinked from birth (NOTE [scratch files] in ``slab.py``).

Example::

    >>> results = probe_bandwidth("/scratch", total_bytes=64 << 20)  # doctest: +SKIP
    >>> offload_context("disk", save_dir="/scratch", **recommend(results))  # doctest: +SKIP

``python -m prefetch_offload probe --save-dir DIR`` runs the same from a shell.
"""

from __future__ import annotations

import errno
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .buffers import Block, mapped_block
from .packed import ALIGN
from .slab import check_writable, direct_io_supported, open_scratch_file

__all__ = [
    "DEFAULT_PREFETCH_DEPTH",
    "LOW_READ_GBPS",
    "TOLERANCE",
    "ProbeResult",
    "combined_gbps",
    "probe_bandwidth",
    "raw_bandwidth",
    "recommend",
]

MiB = 1 << 20

# recommend(): the prefetch depth it keeps, the read bandwidth under which it
# doubles it, and how close to the best a larger request or fewer workers must come.
DEFAULT_PREFETCH_DEPTH = 4
LOW_READ_GBPS = 0.5
TOLERANCE = 0.05

# progress(done, total, label): see probe_bandwidth.
ProgressFn = Callable[[int, int, str], None]


@dataclass(frozen=True)
class ProbeResult:
    """Throughput of one (request size, worker count) cell, median over the repeats."""

    request_bytes: int
    workers: int
    write_gbps: float
    read_gbps: float


def combined_gbps(write_gbps: float, read_gbps: float) -> float:
    """GB/s of moving bytes out and back in: ``2 / (1/write + 1/read)``.

    Offload writes every byte once and reads it once, so this (the harmonic mean)
    is the rate that sets the IO time of a step; a zero on either side gives 0.
    """
    if write_gbps <= 0 or read_gbps <= 0:
        return 0.0
    return 2.0 / (1.0 / write_gbps + 1.0 / read_gbps)


def _striped(workers: int, total: int, request: int, fn: Callable[[int, int], None]) -> float:
    """Run ``fn(worker, offset)`` over ``total`` bytes in ``request`` steps; seconds taken.

    Worker ``i`` takes requests ``i, i + workers, ...``. The first error raised in
    a worker is raised here once all of them have stopped. An interrupt here stops
    the workers after the request each has in flight, and is raised once they have:
    the caller's file is not closed under them (its number could be reused).
    """
    errors: list[BaseException] = []
    stop = threading.Event()

    def work(i: int) -> None:
        try:
            for off in range(i * request, total, workers * request):
                if stop.is_set():
                    return
                fn(i, off)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(workers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except BaseException:
        stop.set()
        for t in threads:
            t.join()
        raise
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return elapsed


def _pwrite_all(fd: int, buf: Any, offset: int) -> None:
    view = memoryview(buf)
    try:
        while view:
            n = os.pwrite(fd, view, offset)
            view = view[n:]
            offset += n
    finally:
        view.release()


def _pread_all(fd: int, buf: Any, offset: int) -> None:
    view = memoryview(buf)
    try:
        while view:
            n = os.preadv(fd, [view], offset)
            if n == 0:
                raise OSError(errno.EIO, f"short read at offset {offset} of a probe file")
            view = view[n:]
            offset += n
    finally:
        view.release()


def raw_bandwidth(folder: str, total: int, request: int, workers: int) -> tuple[float, float]:
    """GB/s written and read in ``folder``: one measurement, no validation.

    ``total`` is rounded down to whole requests (at least one). Uses O_DIRECT
    where the folder supports it, buffered IO (page cache included) otherwise.

    Returns:
        ``(write_gbps, read_gbps)``, in 1e9 bytes per second.
    """
    nbytes = max(1, total // request) * request
    fd = open_scratch_file(folder, direct=direct_io_supported(folder))
    blocks: list[Block] = []
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            # As SlabStore does: some filesystems cannot reserve, only extend.
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, nbytes)
        # The engine's own read blocks (page-aligned, huge pages where the kernel
        # gives them, NOTE [huge pages]): the device's rate, not the page pinning's.
        blocks = [mapped_block(request) for _ in range(workers)]
        bufs = [b.buffer for b in blocks]
        for b in bufs:
            b[:] = os.urandom(64) * (request // 64)
        wt = _striped(workers, nbytes, request, lambda i, off: _pwrite_all(fd, bufs[i], off))
        rt = _striped(workers, nbytes, request, lambda i, off: _pread_all(fd, bufs[i], off))
    finally:
        for block in blocks:
            block.release()
        os.close(fd)
    return nbytes / wt / 1e9, nbytes / rt / 1e9


def _positive_ints(name: str, values: Sequence[int], *, align: int = 1) -> list[int]:
    values = list(values)
    if not values:
        raise ValueError(f"prefetch_offload: {name} is empty; give at least one value.")
    for v in values:
        _positive_int(f"each of {name}", v)
        if v % align:
            raise ValueError(
                f"prefetch_offload: {name} must be multiples of {align} bytes "
                f"(O_DIRECT needs whole pages), got {v}."
            )
    return list(dict.fromkeys(values))  # drop repeats, keep the order


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"prefetch_offload: {name} must be an int, got {value!r}.")
    if value <= 0:
        raise ValueError(f"prefetch_offload: {name} must be positive, got {value}.")


def _check_folder(save_dir: str | os.PathLike[str]) -> str:
    if not os.fspath(save_dir):  # Path("") would be the current folder
        raise ValueError(
            "prefetch_offload: save_dir is empty; pass the folder you will give offload_context."
        )
    path = Path(os.path.expanduser(os.fspath(save_dir)))  # as OffloadConfig does
    if str(path).startswith("~"):
        raise ValueError(
            f"prefetch_offload: save_dir {str(save_dir)!r} names a user's home folder "
            "that does not exist here; pass the folder's full path."
        )
    try:
        exists, is_dir = path.exists(), path.is_dir()
    except OSError as exc:  # a parent folder that cannot be searched
        raise ValueError(
            f"prefetch_offload: save_dir {str(save_dir)!r} cannot be reached ({exc}); "
            "pass a folder you can write to."
        ) from exc
    if not exists:
        raise ValueError(
            f"prefetch_offload: save_dir {str(save_dir)!r} does not exist; "
            "create it, or pass the folder you will give offload_context."
        )
    if not is_dir:
        raise ValueError(
            f"prefetch_offload: save_dir {str(save_dir)!r} is not a folder; "
            "pass the folder you will give offload_context."
        )
    check_writable(str(path))
    return str(path)


def probe_bandwidth(
    save_dir: str | os.PathLike[str],
    *,
    total_bytes: int = 256 * MiB,
    request_sizes: Sequence[int] = (1 * MiB, 8 * MiB),
    worker_counts: Sequence[int] = (1, 2, 4),
    repeats: int = 1,
    progress: ProgressFn | None = None,
) -> list[ProbeResult]:
    """Measure raw write and read throughput of ``save_dir`` for each request size and workers.

    Each measurement moves ``total_bytes`` (rounded down to whole requests) out
    and back through one fresh unlinked scratch file (module docstring). With
    ``repeats > 1`` the whole grid is run that many times, cells interleaved so
    drift hits all of them alike, and each result is the median.

    Args:
        save_dir: an existing folder (it is not created); nothing is left in it.
        total_bytes: bytes written and read per measurement; the disk needs this
            much free space. It must cover at least one request per worker.
        request_sizes: bytes per ``pwrite``/``preadv``, multiples of 4096.
        worker_counts: threads moving bytes at once, each owning a stripe.
        repeats: times each cell is measured.
        progress: called as ``progress(done, total, label)`` before each
            measurement (``label`` says which) and once more with
            ``done == total`` and label ``"done"``.

    Returns:
        One :class:`ProbeResult` per cell, request sizes outer, workers inner,
        in the order given.

    Raises:
        ValueError: ``save_dir`` is missing, unreachable, not a folder or not
            writable; a size, count or ``repeats`` is not positive; ``total_bytes``
            is too small for a request per worker; the disk (or a file there) has no
            room for ``total_bytes``.
        TypeError: a size, count or ``repeats`` is not an int.
        OSError: a read or write failed during the measurement.
    """
    folder = _check_folder(save_dir)
    requests = _positive_ints("request_sizes", request_sizes, align=ALIGN)
    workers_list = _positive_ints("worker_counts", worker_counts)
    _positive_int("total_bytes", total_bytes)
    _positive_int("repeats", repeats)
    need = max(requests) * max(workers_list)
    if total_bytes < need:
        raise ValueError(
            f"prefetch_offload: total_bytes ({total_bytes}) must be at least the largest "
            f"request times the most workers ({need}) so that every worker has a request; "
            "raise total_bytes or lower the request sizes or worker counts."
        )

    cells = [(r, w) for r in requests for w in workers_list]
    samples: dict[tuple[int, int], list[tuple[float, float]]] = {c: [] for c in cells}
    steps = len(cells) * repeats
    done = 0
    for _ in range(repeats):
        for request, workers in cells:
            if progress is not None:
                plural = "s" if workers > 1 else ""
                progress(done, steps, f"probe {_fmt_bytes(request)} x {workers} worker{plural}")
            try:
                samples[(request, workers)].append(
                    raw_bandwidth(folder, total_bytes, request, workers)
                )
            except OverflowError as exc:  # past what a file offset holds
                raise ValueError(
                    f"prefetch_offload: total_bytes ({total_bytes}) is larger than a file "
                    "can be; lower total_bytes."
                ) from exc
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise ValueError(
                        f"prefetch_offload: no room for {total_bytes} bytes in save_dir "
                        f"{folder!r} ({exc.strerror}); lower total_bytes or free space."
                    ) from exc
                raise
            done += 1
    if progress is not None:
        progress(steps, steps, "done")
    return [
        ProbeResult(
            request_bytes=r,
            workers=w,
            write_gbps=statistics.median(s[0] for s in samples[(r, w)]),
            read_gbps=statistics.median(s[1] for s in samples[(r, w)]),
        )
        for r, w in cells
    ]


def recommend(results: Sequence[ProbeResult]) -> dict[str, int]:
    """Suggest ``chunk_bytes``, ``io_workers`` and ``prefetch_depth`` from probe results.

    This is a heuristic read of a raw-device measurement, not a model of your
    training step; the engine's own numbers (``engine.stats()``, see
    docs/tuning.md) are what to check afterwards. The rules:

    1. ``chunk_bytes``: the request size with the best :func:`combined_gbps`
       (each size scored by its best cell over worker counts), i.e. the shortest
       time to write a byte and read it back; but the largest size within 5% of
       that best wins. Raw syscalls favour no size much, while the engine pays a
       per-request cost in Python that larger requests spread thinner
       (``bench/io.py`` compares the engine with raw writes per request size).
    2. ``io_workers``: among that request size's cells, the smallest worker count
       whose combined throughput is within 5% of the best one (more threads cost
       CPU and buy nothing the disk cannot deliver).
    3. ``prefetch_depth``: the default 4, or 8 when that cell reads slower than
       0.5 GB/s, so that more reads are in flight ahead of backward.

    Measurements on shared or virtual disks swing by tens of percent between
    runs; probe with ``repeats >= 3`` before trusting a difference of a few percent.

    Returns:
        ``{"chunk_bytes": ..., "io_workers": ..., "prefetch_depth": ...}``, ready
        for ``offload_context("disk", save_dir=..., **recommend(results))``.

    Raises:
        ValueError: ``results`` is empty.

    Example:
        >>> recommend([ProbeResult(1 << 20, 1, 2.0, 1.5), ProbeResult(1 << 20, 2, 2.05, 1.52)])
        {'chunk_bytes': 1048576, 'io_workers': 1, 'prefetch_depth': 4}
    """
    if not results:
        raise ValueError("prefetch_offload: recommend() needs at least one ProbeResult.")

    def score(r: ProbeResult) -> float:
        return combined_gbps(r.write_gbps, r.read_gbps)

    by_request: dict[int, list[ProbeResult]] = {}
    for r in results:
        by_request.setdefault(r.request_bytes, []).append(r)
    per_request = {req: max(score(r) for r in cells) for req, cells in by_request.items()}
    top = max(per_request.values())
    chunk = max(req for req, s in per_request.items() if s >= (1.0 - TOLERANCE) * top)
    cells = sorted(by_request[chunk], key=lambda r: r.workers)
    best = max(score(r) for r in cells)
    chosen = next(r for r in cells if score(r) >= (1.0 - TOLERANCE) * best)
    depth = (
        DEFAULT_PREFETCH_DEPTH * 2 if chosen.read_gbps < LOW_READ_GBPS else DEFAULT_PREFETCH_DEPTH
    )
    return {"chunk_bytes": chunk, "io_workers": chosen.workers, "prefetch_depth": depth}


def _fmt_bytes(n: int) -> str:
    if n % MiB == 0:
        return f"{n // MiB} MiB"
    if n % 1024 == 0:
        return f"{n // 1024} KiB"
    return f"{n} B"

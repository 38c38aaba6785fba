"""Slab-store and engine IO throughput against the raw device bandwidth, in one run.

For each request size and worker count, on the same folder and in the same run:

- ``raw``: O_DIRECT pwrite/pread of page-aligned, reused buffers into one
  preallocated unlinked file, ``workers`` threads each owning a stripe: the
  best the device does with plain syscalls from Python
  (``prefetch_offload.probe.raw_bandwidth``, what ``python -m prefetch_offload
  probe`` measures).
- ``engine``: the real path. ``pack`` of N fresh CPU tensors (zero-copy
  O_DIRECT from their own pages through the IO pool), ``flush``; then
  ``unpack`` in reverse order with lookahead prefetch into fresh buffers.
  Its "request size" is ``chunk_bytes``: a write batch holds whole tensors
  (at least one), so with 4 MiB tensors a 1 MiB row writes 4 MiB requests;
  reads go per tensor, in requests of at most ``chunk_bytes``. So the engine
  and raw requests match only where the request size equals the tensor size.
  The slab is reserved before the clock starts, and the engine's byte counters
  must equal the bytes timed (else the script fails).

Rows are interleaved (raw, engine, raw, engine, ...) and repeated; the table
shows medians and the engine/raw ratio. Example::

    python bench/io.py --total-mib 512 --tensor-mib 4 --requests 1,8 --workers 1,2,4

``--cost`` measures instead what a disk request costs the machine in CPU: for
O_DIRECT writes and reads of ``--total-mib`` in 8 MiB requests, GB/s, the
guest CPU (user + system) this process spends per GB, and the CPU the
hypervisor takes per GB (``steal`` in ``/proc/stat``, all CPUs, less its rate
with the same load and no IO); from two buffer kinds, ``4k`` (ordinary pages,
as activations are) and ``huge`` (2 MiB-aligned mappings asking for huge pages,
the engine's read and staging buffers: NOTE [huge pages]); once with the other
CPUs idle and once with one busy-looping process per CPU (``loaded``: what a
training step sees). On a VM the host does its side of every disk request on
physical CPUs: while the guest idles that costs it nothing, while training
keeps every CPU busy it is taken from the guest. Example::

    python bench/io.py --cost --total-mib 1024 --json docs/results/hostcost.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from prefetch_offload import OffloadConfig, OffloadEngine
from prefetch_offload.buffers import mapped_block
from prefetch_offload.probe import raw_bandwidth
from prefetch_offload.slab import direct_io_supported, open_scratch_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ is not a package
from _common import machine_info, ordinary_pages, scratch_folder, steal_seconds
from _text import format_table, json_header

MiB = 1 << 20


@dataclass(frozen=True)
class IORow:
    """Median throughput of one (kind, request size, workers) cell."""

    kind: str
    request_mib: int
    workers: int
    write_gbps: float
    read_gbps: float
    raw_write_gbps: float
    raw_read_gbps: float

    @property
    def write_ratio(self) -> float:
        """Throughput as a fraction of the raw device's in the same cell."""
        return self.write_gbps / self.raw_write_gbps

    @property
    def read_ratio(self) -> float:
        return self.read_gbps / self.raw_read_gbps


def engine_bandwidth(
    folder: str, total: int, request: int, workers: int, tensor_bytes: int, depth: int
) -> tuple[float, float]:
    """GB/s through pack+flush and through unpack (reverse order, prefetching)."""
    cfg = OffloadConfig(
        target="disk",
        save_dir=folder,
        io_workers=workers,
        chunk_bytes=request,
        prefetch_depth=depth,
        min_offload_bytes=0,
        max_pending_write_bytes=max(total, request),
        slab_bytes=max(256 * MiB, tensor_bytes),
    )
    engine = OffloadEngine(cfg)
    try:
        n = max(1, total // tensor_bytes)
        # Untimed: the first pack reserves the slab and starts the IO threads.
        warm = engine.pack(torch.randn(tensor_bytes // 4))
        engine.flush()
        engine.unpack(warm)
        del warm
        tensors = [torch.randn(tensor_bytes // 4) for _ in range(n)]
        before = engine.stats()
        start = time.perf_counter()
        handles = [engine.pack(t) for t in tensors]
        engine.flush()
        wt = time.perf_counter() - start
        del tensors
        start = time.perf_counter()
        for h in reversed(handles):
            engine.unpack(h)
        rt = time.perf_counter() - start
        del handles
        after = engine.stats()
    finally:
        engine.close()
    nbytes = n * tensor_bytes
    wrote = after.bytes_offloaded - before.bytes_offloaded
    read = after.bytes_read - before.bytes_read
    if wrote != nbytes or read != nbytes:  # a fallback or a kept tensor would inflate GB/s
        raise RuntimeError(
            f"engine moved {wrote} bytes out and {read} back, expected {nbytes} each"
        )
    return nbytes / wt / 1e9, nbytes / rt / 1e9


def host_cost(
    folder: str, total: int, loaded: bool, request: int = 8 * MiB
) -> list[dict[str, Any]]:
    """``--cost``: write then read ``total`` bytes per buffer kind; one row per
    (kind, op): GB/s, guest CPU ms per GB, steal ms per GB (None without steal)."""
    nbytes = max(1, total // request) * request
    fd = open_scratch_file(folder, direct=direct_io_supported(folder))
    spin = [sys.executable, "-c", "while True: pass"]
    spinners = [subprocess.Popen(spin) for _ in range(os.cpu_count() or 1)] if loaded else []
    rows = []
    try:
        os.posix_fallocate(fd, 0, nbytes)
        time.sleep(0.5 if loaded else 0.0)  # let the spinners reach their loops
        b0, bt = steal_seconds(), time.perf_counter()
        time.sleep(1.0)  # the steal that comes with no IO (other tenants, the spinners)
        b1 = steal_seconds()
        base = 0.0 if b0 is None or b1 is None else (b1 - b0) / (time.perf_counter() - bt)
        for kind in ("4k", "huge"):
            block = mapped_block(request) if kind == "huge" else None
            buf = memoryview(block.buffer)[:request] if block else ordinary_pages(request)
            for op in ("write", "read"):
                r0, s0, t0 = (
                    resource.getrusage(resource.RUSAGE_SELF),
                    steal_seconds(),
                    time.perf_counter(),
                )
                for off in range(0, nbytes, request):
                    n = os.pwritev(fd, [buf], off) if op == "write" else os.preadv(fd, [buf], off)
                    if n != request:
                        raise OSError(f"short {op} at offset {off}")
                dt, gb = time.perf_counter() - t0, nbytes / 1e9
                r1, s1 = resource.getrusage(resource.RUSAGE_SELF), steal_seconds()
                cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
                steal = None if s0 is None or s1 is None else (s1 - s0 - base * dt) / gb * 1e3
                rows.append(
                    {
                        "load": "loaded" if loaded else "idle",
                        "buffer": kind,
                        "op": op,
                        "gbps": gb / dt,
                        "cpu_ms_per_gb": cpu / gb * 1e3,
                        "steal_ms_per_gb": steal,
                    }
                )
            del buf
            if block is not None:
                block.release()
    finally:
        for s in spinners:
            s.kill()
            s.wait()
        os.close(fd)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--save-dir", help="folder to test, in a temp subfolder (default: .scratch/)")
    p.add_argument("--total-mib", type=int, default=512, help="bytes moved per measurement")
    p.add_argument("--tensor-mib", type=int, default=4, help="size of each packed tensor")
    p.add_argument("--requests", default="1,8", help="request sizes in MiB, comma separated")
    p.add_argument("--workers", default="1,2,4", help="IO worker counts, comma separated")
    p.add_argument("--prefetch-depth", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cost", action="store_true", help="CPU and steal per GB instead (above)")
    p.add_argument("--json", help="write the rows to this file")
    words = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(words)
    header = json_header("io.py", words, machine_info())
    total = args.total_mib * MiB
    if args.cost:
        with scratch_folder(args.save_dir, "io-") as folder:
            cost = host_cost(folder, total, False) + host_cost(folder, total, True)
        keys = ("load", "buffer", "op", "gbps", "cpu_ms_per_gb", "steal_ms_per_gb")
        cells = [
            [str(c[k]) if isinstance(c[k], str) else f"{c[k] or 0:.2f}" for k in keys] for c in cost
        ]
        print(format_table(keys, cells, left=3))
        print(header["machine_line"])
        if args.json:
            Path(args.json).write_text(json.dumps({**header, "cost": cost}, indent=1) + "\n")
        return 0
    requests = [int(x) * MiB for x in args.requests.split(",")]
    worker_counts = [int(x) for x in args.workers.split(",")]
    rows: list[IORow] = []
    with scratch_folder(args.save_dir, "io-") as folder:
        direct = direct_io_supported(folder)
        for request in requests:
            for workers in worker_counts:
                raw: list[tuple[float, float]] = []
                eng: list[tuple[float, float]] = []
                for _ in range(args.repeats):
                    raw.append(raw_bandwidth(folder, total, request, workers))
                    eng.append(
                        engine_bandwidth(
                            folder,
                            total,
                            request,
                            workers,
                            args.tensor_mib * MiB,
                            args.prefetch_depth,
                        )
                    )
                rw = statistics.median(w for w, _ in raw)
                rr = statistics.median(r for _, r in raw)
                for kind, samples in (("raw", raw), ("engine", eng)):
                    rows.append(
                        IORow(
                            kind=kind,
                            request_mib=request // MiB,
                            workers=workers,
                            write_gbps=statistics.median(w for w, _ in samples),
                            read_gbps=statistics.median(r for _, r in samples),
                            raw_write_gbps=rw,
                            raw_read_gbps=rr,
                        )
                    )

    print(
        f"# {header['machine_line']}; folder {'O_DIRECT' if direct else 'buffered'}, "
        f"{args.total_mib} MiB per measurement, {args.tensor_mib} MiB tensors, "
        f"median of {args.repeats}"
    )
    cols = f"{'kind':<7} {'req MiB':>7} {'workers':>7} {'write GB/s':>10} {'read GB/s':>9} "
    print(cols + f"{'write/raw':>9} {'read/raw':>8}")
    for r in rows:
        print(
            f"{r.kind:<7} {r.request_mib:>7} {r.workers:>7} {r.write_gbps:>10.2f} "
            f"{r.read_gbps:>9.2f} {r.write_ratio:>9.2f} {r.read_ratio:>8.2f}"
        )
    if args.json:
        out = [asdict(r) | {"write_ratio": r.write_ratio, "read_ratio": r.read_ratio} for r in rows]
        Path(args.json).write_text(json.dumps({**header, "rows": out}, indent=1) + "\n")
    bad = [r for r in rows if not (r.write_gbps > 0 and r.read_gbps > 0)]
    if bad:
        print(f"error: non-positive throughput in {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

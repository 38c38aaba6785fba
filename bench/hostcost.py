"""What this machine's disk IO costs in CPU, including the share the hypervisor takes.

On a virtual machine the host does its side of every disk request (the
virtual disk's emulation, its own page cache) on physical CPUs. While the
guest's CPUs idle, that work fills the idle time and costs the guest nothing;
while training keeps every guest CPU busy, the host takes the time from them
(``steal`` in ``/proc/stat``), and a step that moves bytes to disk pays for it
even though no guest thread shows it. This script measures, for writes and
reads of one preallocated O_DIRECT file in ``--save-dir``:

- GB/s, the guest CPU (user + system) this process spends per GB, and the steal
  per GB, all CPUs together, less the steal rate measured for one second with
  the same load and no IO (the host's other tenants);
- from two buffer kinds: ``4k`` (ordinary pages, as activations are) and
  ``huge`` (private 2 MiB-aligned mappings asking for huge pages, the engine's
  read buffers: NOTE [huge pages]);
- once with the other CPUs idle (``idle``) and once with one busy-looping
  process per CPU (``loaded``: what a training step sees).

With ``--buffered``, a third kind, ``cache``: the same 4 KiB-page buffer moved
through the page cache (``io_method="buffered"``) on a second file, with
``fdatasync`` and ``POSIX_FADV_DONTNEED`` every ``--sync-mib`` so that the
bytes really reach the device and the reads really come from it (without the
drop, a step's bytes stay in RAM and the read is a copy from memory).

The ``loaded`` steal per GB times the bytes a step moves is what the IO costs a
step on this machine before any engine overhead (``bench/step.py``'s ``ioreplay``
and ``iospread`` modes measure the same in a real training step).

Example:
    .venv/bin/python bench/hostcost.py --total-mib 1024 --json docs/results/hostcost.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ is not a package

from _common import machine_info, ordinary_pages, scratch_folder, steal_seconds
from _text import json_header

from prefetch_offload.buffers import Block, mapped_block
from prefetch_offload.slab import direct_io_supported, open_scratch_file

MiB = 1 << 20


@dataclass(frozen=True)
class CostRow:
    """One (load, buffer kind, direction) measurement."""

    load: str  # "idle" or "loaded"
    buffer: str  # "4k", "huge", or "cache" (4k through the page cache)
    op: str  # "write" or "read"
    gbps: float
    cpu_ms_per_gb: float  # this process, user + system
    # All CPUs, less the steal rate measured with no IO just before; None where
    # /proc/stat has no steal.
    steal_ms_per_gb: float | None


def _buffer(kind: str, size: int) -> tuple[memoryview, Block | None]:
    """A page-aligned writable buffer of ``size`` bytes of the given kind, and the
    block to release after it (huge pages only)."""
    if kind == "huge":
        block = mapped_block(size)
        return memoryview(block.buffer)[:size], block
    return ordinary_pages(size), None


def _move(fd: int, buf: memoryview, op: str, nbytes: int, request: int, sync: int) -> None:
    """``op`` ``nbytes`` at offset 0 in ``request``-byte requests; with ``sync`` > 0
    (page-cache IO), flush and drop the cached pages every ``sync`` bytes."""
    done = 0
    for off in range(0, nbytes, request):
        n = os.pwritev(fd, [buf], off) if op == "write" else os.preadv(fd, [buf], off)
        if n != request:
            raise OSError(f"short {op} at offset {off}")
        if sync and (off + request - done >= sync or off + request == nbytes):
            if op == "write":
                os.fdatasync(fd)
            os.posix_fadvise(fd, done, off + request - done, os.POSIX_FADV_DONTNEED)
            done = off + request


def measure(
    folder: str, total: int, request: int, kinds: list[str], loaded: bool, sync: int = 64 * MiB
) -> list[CostRow]:
    """Write then read ``total`` bytes in ``request``-byte requests, per buffer kind."""
    nbytes = max(1, total // request) * request
    fd = open_scratch_file(folder, direct=direct_io_supported(folder))
    cache_fd = open_scratch_file(folder, direct=False) if "cache" in kinds else None
    spinners: list[subprocess.Popen[bytes]] = []
    rows: list[CostRow] = []
    try:
        os.posix_fallocate(fd, 0, nbytes)
        if cache_fd is not None:
            os.posix_fallocate(cache_fd, 0, nbytes)
            os.fdatasync(cache_fd)
            os.posix_fadvise(cache_fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
        if loaded:
            spin = [sys.executable, "-c", "while True: pass"]
            spinners = [subprocess.Popen(spin) for _ in range(os.cpu_count() or 1)]
            time.sleep(0.5)  # let them reach their loops
        # Steal that comes with no IO at all (the host's other tenants, and the
        # spinners themselves): its rate is taken out of every row's steal.
        b0, bt = steal_seconds(), time.perf_counter()
        time.sleep(1.0)
        b1 = steal_seconds()
        base_rate = 0.0 if b0 is None or b1 is None else (b1 - b0) / (time.perf_counter() - bt)
        for kind in kinds:
            buf, owner = _buffer("4k" if kind == "cache" else kind, request)
            target, every = (cache_fd, sync) if kind == "cache" else (fd, 0)
            assert target is not None
            for op in ("write", "read"):
                r0, s0, t0 = (
                    resource.getrusage(resource.RUSAGE_SELF),
                    steal_seconds(),
                    time.perf_counter(),
                )
                _move(target, buf, op, nbytes, request, every)
                dt = time.perf_counter() - t0
                r1, s1 = resource.getrusage(resource.RUSAGE_SELF), steal_seconds()
                gb = nbytes / 1e9
                cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
                steal = None if s0 is None or s1 is None else (s1 - s0 - base_rate * dt) / gb * 1e3
                rows.append(
                    CostRow(
                        "loaded" if loaded else "idle", kind, op, gb / dt, cpu / gb * 1e3, steal
                    )
                )
            del buf
            if owner is not None:
                owner.release()
    finally:
        for s in spinners:
            s.kill()
        for s in spinners:
            s.wait()
        os.close(fd)
        if cache_fd is not None:
            os.close(cache_fd)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--save-dir", help="folder to test, in a temp subfolder (default: .scratch/)")
    p.add_argument("--total-mib", type=int, default=1024, help="bytes per measurement (MiB)")
    p.add_argument("--request-mib", type=int, default=8, help="request size (MiB)")
    p.add_argument("--no-load", action="store_true", help="skip the loaded measurement")
    p.add_argument(
        "--buffered",
        action="store_true",
        help="also measure page-cache IO from 4 KiB pages, flushed and dropped (kind 'cache')",
    )
    p.add_argument(
        "--sync-mib", type=int, default=64, help="with --buffered: flush and drop every N MiB"
    )
    p.add_argument("--json", help="also write the rows here")
    words = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(words)
    if args.total_mib < 1 or args.request_mib < 1 or args.sync_mib < 1:
        p.error("--total-mib, --request-mib and --sync-mib must be >= 1")
    kinds = ["4k", "huge"] + (["cache"] if args.buffered else [])
    rows: list[CostRow] = []
    with scratch_folder(args.save_dir, prefix="hostcost-") as folder:
        total, request = args.total_mib * MiB, args.request_mib * MiB
        for loaded in (False,) if args.no_load else (False, True):
            rows += measure(folder, total, request, kinds, loaded, args.sync_mib * MiB)
    print(
        f"# {os.cpu_count()} CPUs; {args.total_mib} MiB per row in {args.request_mib} MiB requests"
    )
    print(f"{'load':<7} {'buffer':<6} {'op':<6} {'GB/s':>6} {'cpu ms/GB':>10} {'steal ms/GB':>12}")
    for r in rows:
        steal = "n/a" if r.steal_ms_per_gb is None else f"{r.steal_ms_per_gb:.0f}"
        print(
            f"{r.load:<7} {r.buffer:<6} {r.op:<6} {r.gbps:6.2f} {r.cpu_ms_per_gb:10.1f} {steal:>12}"
        )
    if args.json:
        doc = {
            **json_header("hostcost.py", words, machine_info()),
            "total_mib": args.total_mib,
            "request_mib": args.request_mib,
            "rows": [asdict(r) for r in rows],
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

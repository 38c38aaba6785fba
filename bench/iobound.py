"""An IO-bound training step against the bound the device's bandwidth sets.

The model is a chain of ReLUs over one large tensor: each layer saves a
``--tensor-mib`` output for backward and computes almost nothing, so the step
is all IO. In the same run, on the same folder, the raw O_DIRECT bandwidth is
measured (``prefetch_offload.probe.raw_bandwidth``), and the step time is compared with

    bound = bytes written / write bandwidth + bytes read / read bandwidth

Rows alternate (raw measurement, offloaded steps, no-offload steps) so drift
hits all of them. Example::

    python bench/iobound.py --tensor-mib 16 --layers 32 --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from prefetch_offload import offload_context
from prefetch_offload.config import DEFAULT_CHUNK_BYTES
from prefetch_offload.probe import raw_bandwidth

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ is not a package
from _common import scratch_folder

MiB = 1 << 20


@dataclass(frozen=True)
class IOBoundResult:
    """Medians over the timed steps, and the bandwidth bound from the same run."""

    tensor_mib: int
    layers: int
    step_seconds: float
    no_offload_seconds: float
    bytes_written: int
    bytes_read: int
    write_gbps: float
    read_gbps: float
    stall_seconds: float

    @property
    def bound_seconds(self) -> float:
        """Bytes written / write bandwidth + bytes read / read bandwidth."""
        return self.bytes_written / (self.write_gbps * 1e9) + self.bytes_read / (
            self.read_gbps * 1e9
        )

    @property
    def ratio_to_bound(self) -> float:
        """Step time over the bound (inf when nothing reached the disk)."""
        bound = self.bound_seconds
        return self.step_seconds / bound if bound > 0 else float("inf")


def _step(x: torch.Tensor, layers: int) -> None:
    y = x * 1.0  # not a leaf, so the first ReLU's input chain is offloadable
    for _ in range(layers):
        y = torch.relu(y)  # saves its output: one tensor-sized save per layer
    y.sum().backward()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tensor-mib", type=int, default=16)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--save-dir", help="folder to test, in a temp subfolder (default: .scratch/)")
    p.add_argument("--prefetch-depth", type=int, default=4)
    p.add_argument("--io-workers", type=int, default=2)
    p.add_argument("--max-pending-write-bytes", type=int, default=64 * MiB)
    p.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    p.add_argument("--json", help="write the result to this file")
    args = p.parse_args(argv)

    n = args.tensor_mib * MiB // 4
    torch.manual_seed(0)
    x = torch.randn(n, requires_grad=True)
    steps, plain, writes, reads, stalls = [], [], [], [], []
    raw_w, raw_r = [], []
    total = args.tensor_mib * args.layers * MiB
    with scratch_folder(args.save_dir, "iobound-") as folder:
        with offload_context(
            "disk",
            folder,
            prefetch_depth=args.prefetch_depth,
            io_workers=args.io_workers,
            max_pending_write_bytes=args.max_pending_write_bytes,
            chunk_bytes=args.chunk_bytes,
        ) as engine:
            for i in range(args.steps + 1):
                w, r = raw_bandwidth(folder, min(total, 512 * MiB), 8 * MiB, 2)
                before = engine.stats()
                start = time.perf_counter()
                _step(x, args.layers)
                engine.flush()
                elapsed = time.perf_counter() - start
                after = engine.stats()
                if i == 0:
                    continue  # warm-up: slab creation
                steps.append(elapsed)
                raw_w.append(w)
                raw_r.append(r)
                writes.append(after.bytes_offloaded - before.bytes_offloaded)
                reads.append(after.bytes_read - before.bytes_read)
                stalls.append(after.stall_seconds - before.stall_seconds)
        for i in range(args.steps + 1):
            start = time.perf_counter()
            _step(x, args.layers)
            if i:
                plain.append(time.perf_counter() - start)

    res = IOBoundResult(
        tensor_mib=args.tensor_mib,
        layers=args.layers,
        step_seconds=statistics.median(steps),
        no_offload_seconds=statistics.median(plain),
        bytes_written=int(statistics.median(writes)),
        bytes_read=int(statistics.median(reads)),
        write_gbps=statistics.median(raw_w),
        read_gbps=statistics.median(raw_r),
        stall_seconds=statistics.median(stalls),
    )
    print(
        f"# {os.cpu_count()} cores, torch {torch.__version__}; {args.layers} ReLUs saving "
        f"{args.tensor_mib} MiB each; depth {args.prefetch_depth}, {args.io_workers} workers"
    )
    print(
        f"raw O_DIRECT bandwidth (same folder, same run): write {res.write_gbps:.2f} GB/s, "
        f"read {res.read_gbps:.2f} GB/s"
    )
    print(
        f"per step: wrote {res.bytes_written / MiB:.0f} MiB, read {res.bytes_read / MiB:.0f} MiB; "
        f"bound {res.bound_seconds:.3f} s"
    )
    print(
        f"step (disk) {res.step_seconds:.3f} s = {res.ratio_to_bound:.2f}x the bound; "
        f"no offload {res.no_offload_seconds:.3f} s; stall {res.stall_seconds:.3f} s/step"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                asdict(res)
                | {"bound_seconds": res.bound_seconds, "ratio_to_bound": res.ratio_to_bound},
                indent=2,
            )
        )
    # The last tensors of forward may skip the disk (NOTE [write tail] in engine.py),
    # so only require that most of the step went through it.
    if res.bytes_written < total * 0.5 or res.bytes_read <= 0:
        print("error: the engine did not move the expected bytes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

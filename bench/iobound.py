"""An IO-bound training step against the bound the device's bandwidth sets.

The model is a chain of ReLUs over one large tensor: each layer saves a
``--tensor-mib`` output for backward and computes almost nothing, so the step
is all IO. In the same run, on the same folder, the raw O_DIRECT bandwidth is
measured (``prefetch_offload.probe.raw_bandwidth``), and the step time is compared with

    bound = bytes written / write bandwidth + bytes read / read bandwidth

The bound's bandwidth is measured with nothing else running, from huge-page
buffers. A second reference shows what the same bytes cost in this workload:
the no-offload step while one bare thread writes the disk mode's bytes from
ordinary 4 KiB pages (as activations are) during forward and reads them back
during backward (``ioreplay``, as in ``bench/step.py``: no hooks, no engine, one
thread where the engine has ``--io-workers``, and reads that no compute waits
for). Each round measures the raw bandwidth, then runs one step of each
mode (disk, none, ioreplay) in an order from a balanced Latin square over the rounds, so drift hits
all of them. Example::

    python bench/iobound.py --tensor-mib 16 --layers 32 --steps 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from prefetch_offload import OffloadConfig, OffloadEngine
from prefetch_offload.config import DEFAULT_CHUNK_BYTES, STAGE_WRITES
from prefetch_offload.probe import raw_bandwidth
from prefetch_offload.slab import direct_io_supported

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ is not a package
from _common import IOReplay, round_order, scratch_folder, steal_seconds

MiB = 1 << 20


@dataclass(frozen=True)
class IOBoundResult:
    """Medians over the timed steps, and the bandwidth bound from the same run."""

    tensor_mib: int
    layers: int
    step_seconds: float
    no_offload_seconds: float
    #: no offload while a bare thread moves the disk mode's bytes (bench/step.py's ioreplay)
    replay_seconds: float
    bytes_written: int
    bytes_read: int
    #: bytes the replay writes, and reads back, per step (what disk did in its last warm-up step)
    replay_bytes: int
    replay_read_bytes: int
    write_gbps: float
    read_gbps: float
    stall_seconds: float
    #: CPU time the hypervisor took per step (all CPUs; None where /proc/stat has none)
    steal_seconds: float | None
    replay_steal_seconds: float | None
    stage_writes: str
    #: bytes the disk engine wrote through its staging buffers (NOTE [write staging])
    bytes_staged_per_step: float
    #: a second disk engine with stage_writes="never", timed in the same rounds
    unstaged_seconds: float | None = None
    #: median forward seconds per mode (the part of the step that writes)
    forward_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    #: how the raw bandwidth was measured: "direct" (O_DIRECT) or "buffered"
    io_method: str = "direct"

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

    @property
    def ratio_to_replay(self) -> float:
        """Step time over the replay's: what the engine adds to moving its bytes."""
        return self.step_seconds / self.replay_seconds


def _step(x: torch.Tensor, layers: int, replay: IOReplay | None = None) -> float:
    """One training step; with ``replay``, its bytes move while forward and backward run.

    Returns the seconds forward took.
    """
    start = time.perf_counter()
    if replay is not None:
        replay.forward_started()
    y = x * 1.0  # not a leaf, so the first ReLU's input chain is offloadable
    for _ in range(layers):
        y = torch.relu(y)  # saves its output: one tensor-sized save per layer
    loss = y.sum()
    forward = time.perf_counter() - start
    if replay is not None:
        replay.backward_started()
    loss.backward()
    if replay is not None:
        replay.wait()
    return forward


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
    p.add_argument("--stage-writes", choices=STAGE_WRITES, default="auto")
    p.add_argument(
        "--compare-unstaged",
        action="store_true",
        help="also time a second disk engine with stage_writes='never' in the same rounds",
    )
    p.add_argument("--json", help="write the result to this file")
    args = p.parse_args(argv)

    n = args.tensor_mib * MiB // 4
    torch.manual_seed(0)
    x = torch.randn(n, requires_grad=True)
    total = args.tensor_mib * args.layers * MiB
    order = ["disk", "none", "ioreplay"] + (["unstaged"] if args.compare_unstaged else [])
    samples: dict[str, list[float]] = {k: [] for k in order}
    steal: dict[str, list[float]] = {k: [] for k in order}
    forward: dict[str, list[float]] = {k: [] for k in order}
    writes, reads, stalls, raw_w, raw_r = [], [], [], [], []
    with scratch_folder(args.save_dir, "iobound-") as folder:
        method = "direct" if direct_io_supported(folder) else "buffered"  # as raw_bandwidth
        config = OffloadConfig(
            target="disk",
            save_dir=folder,
            prefetch_depth=args.prefetch_depth,
            io_workers=args.io_workers,
            max_pending_write_bytes=args.max_pending_write_bytes,
            chunk_bytes=args.chunk_bytes,
            stage_writes=args.stage_writes,
        )
        engines = {"disk": OffloadEngine(config)}
        if args.compare_unstaged:
            unstaged = dataclasses.replace(config, stage_writes="never")
            engines["unstaged"] = OffloadEngine(unstaged)
        engine = engines["disk"]
        try:
            # Warm-up: slab creation (first step), then the bytes the replay must move
            # per step (second step: the steady state, with the write tail skipped).
            for eng in reversed(engines.values()):  # "disk" last: its bytes are measured
                for _ in range(2):
                    before = eng.stats()
                    with torch.autograd.graph.saved_tensors_hooks(eng.pack, eng.unpack):
                        _step(x, args.layers)
                    eng.flush()
            after = engine.stats()
            replay_bytes = after.bytes_offloaded - before.bytes_offloaded
            replay_read = min(after.bytes_read - before.bytes_read, replay_bytes)
            with IOReplay(
                str(Path(folder) / "replay"),
                replay_bytes,
                chunk=args.chunk_bytes,
                read_chunk=args.chunk_bytes,
                read_bytes=replay_read,
            ) as replay:
                _step(x, args.layers, replay)  # the replay's own warm-up
                staged0 = engine.stats().bytes_staged
                for i in range(args.steps):
                    w, r = raw_bandwidth(folder, min(total, 512 * MiB), 8 * MiB, 2)
                    raw_w.append(w)
                    raw_r.append(r)
                    for mode in round_order(order, i):
                        before = engine.stats()
                        s0 = steal_seconds()
                        start = time.perf_counter()
                        if mode in engines:
                            eng = engines[mode]
                            with torch.autograd.graph.saved_tensors_hooks(eng.pack, eng.unpack):
                                fwd = _step(x, args.layers)
                            eng.flush()
                        else:
                            fwd = _step(x, args.layers, replay if mode == "ioreplay" else None)
                        samples[mode].append(time.perf_counter() - start)
                        forward[mode].append(fwd)
                        s1 = steal_seconds()
                        if s0 is not None and s1 is not None:
                            steal[mode].append(s1 - s0)
                        if mode == "disk":
                            after = engine.stats()
                            writes.append(after.bytes_offloaded - before.bytes_offloaded)
                            reads.append(after.bytes_read - before.bytes_read)
                            stalls.append(after.stall_seconds - before.stall_seconds)
        finally:
            for eng in engines.values():
                eng.close()

    def _steal(mode: str) -> float | None:
        return statistics.fmean(steal[mode]) if steal[mode] else None

    res = IOBoundResult(
        tensor_mib=args.tensor_mib,
        layers=args.layers,
        step_seconds=statistics.median(samples["disk"]),
        no_offload_seconds=statistics.median(samples["none"]),
        replay_seconds=statistics.median(samples["ioreplay"]),
        bytes_written=int(statistics.median(writes)),
        bytes_read=int(statistics.median(reads)),
        replay_bytes=replay_bytes,
        replay_read_bytes=replay_read,
        write_gbps=statistics.median(raw_w),
        read_gbps=statistics.median(raw_r),
        stall_seconds=statistics.median(stalls),
        steal_seconds=_steal("disk"),
        replay_steal_seconds=_steal("ioreplay"),
        stage_writes=args.stage_writes,
        bytes_staged_per_step=(engine.stats().bytes_staged - staged0) / args.steps,
        unstaged_seconds=statistics.median(samples["unstaged"]) if args.compare_unstaged else None,
        forward_seconds={k: statistics.median(v) for k, v in forward.items()},
        io_method=method,
    )
    print(
        f"# {os.cpu_count()} cores, torch {torch.__version__}; {args.layers} ReLUs saving "
        f"{args.tensor_mib} MiB each; depth {args.prefetch_depth}, {args.io_workers} workers"
    )
    how = "O_DIRECT" if res.io_method == "direct" else f"{res.io_method} (no O_DIRECT here)"
    print(
        f"raw {how} bandwidth, 8 MiB requests, 2 workers (same folder, same run): "
        f"write {res.write_gbps:.2f} GB/s, read {res.read_gbps:.2f} GB/s"
    )
    print(
        f"per step: wrote {res.bytes_written / MiB:.0f} MiB, read {res.bytes_read / MiB:.0f} MiB; "
        f"bound {res.bound_seconds:.3f} s"
    )
    print(
        f"step (disk) {res.step_seconds:.3f} s = {res.ratio_to_bound:.2f}x the bound; "
        f"no offload {res.no_offload_seconds:.3f} s; stall {res.stall_seconds:.3f} s/step"
    )
    print(
        f"ioreplay (no offload; a bare thread writes {res.replay_bytes / MiB:.0f} MiB and reads "
        f"{res.replay_read_bytes / MiB:.0f} MiB) {res.replay_seconds:.3f} s = "
        f"{res.replay_seconds / res.bound_seconds:.2f}x the bound; "
        f"disk = {res.ratio_to_replay:.2f}x ioreplay"
    )
    print(
        f"stage_writes={res.stage_writes!r}: {res.bytes_staged_per_step / MiB:.0f} MiB/step "
        "written through the staging buffers"
        + (
            f"; unstaged engine {res.unstaged_seconds:.3f} s "
            f"(staged/unstaged {res.step_seconds / res.unstaged_seconds:.2f}x)"
            if res.unstaged_seconds
            else ""
        )
    )
    print(
        "forward s (median): " + ", ".join(f"{k} {v:.3f}" for k, v in res.forward_seconds.items())
    )
    if res.steal_seconds is not None and res.replay_steal_seconds is not None:
        print(
            f"steal s/step (hypervisor, all CPUs): disk {res.steal_seconds:.3f}, "
            f"ioreplay {res.replay_steal_seconds:.3f}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                asdict(res)
                | {
                    "bound_seconds": res.bound_seconds,
                    "ratio_to_bound": res.ratio_to_bound,
                    "ratio_to_replay": res.ratio_to_replay,
                },
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

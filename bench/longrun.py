"""A long run under one offload context: disk use, resident memory and threads stay flat.

Trains the small transformer for ``--steps`` SGD steps with disk offload and, in
the same loop, a twin without offload; samples slab space, RSS and the thread
count every ``--every`` steps; and checks at the end that the parameters of the
two are bit-identical and that nothing grew. Example::

    python bench/longrun.py --steps 1000 --every 100
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from prefetch_offload import offload_context
from prefetch_offload.testing import TinyTransformer, make_batch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ is not a package
from _common import scratch_folder

MiB = 1 << 20


@dataclass(frozen=True)
class Sample:
    """One sample after ``step`` steps (writes flushed, garbage collected)."""

    step: int
    seconds: float
    disk_reserved: int
    disk_in_use: int
    rss: int
    threads: int


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--save-dir", help="folder for the scratch folder (default: ./.scratch)")
    p.add_argument("--rss-slack-mib", type=float, default=32.0, help="allowed RSS growth")
    p.add_argument("--json", help="write the samples here")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    model = TinyTransformer(vocab=128, width=args.width, depth=args.depth, heads=2)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.01)
    batches = [make_batch(args.batch, args.seq, vocab=128, seed=s) for s in range(8)]
    samples: list[Sample] = []
    start = time.perf_counter()
    with scratch_folder(args.save_dir, "longrun-") as folder:
        with offload_context("disk", folder, min_offload_bytes=0, slab_bytes=4 * MiB) as engine:
            for step in range(1, args.steps + 1):
                x, y = batches[step % len(batches)]
                opt.zero_grad(set_to_none=True)
                model(x, y).backward()
                opt.step()
                twin_opt.zero_grad(set_to_none=True)
                with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                    twin(x, y).backward()  # identity hooks shadow the engine's
                twin_opt.step()
                if step % args.every == 0:
                    engine.flush()
                    gc.collect()
                    s = engine.stats()
                    samples.append(
                        Sample(
                            step,
                            time.perf_counter() - start,
                            s.disk_bytes_reserved,
                            s.disk_bytes_in_use,
                            _rss(),
                            threading.active_count(),
                        )
                    )
                    last = samples[-1]
                    print(
                        f"step {last.step:>6}  {last.seconds:7.1f} s  slabs "
                        f"{last.disk_reserved / MiB:6.1f} MiB  in use {last.disk_in_use / MiB:5.1f}"
                        f" MiB  rss {last.rss / MiB:7.1f} MiB  threads {last.threads}",
                        flush=True,
                    )

    problems = []
    if any(
        not torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True)
    ):
        problems.append("parameters differ from the run without offload")
    if samples:
        if len({s.disk_reserved for s in samples}) > 1:
            problems.append("slab space changed")
        if any(s.disk_in_use for s in samples):
            problems.append("slab space still in use after a step")
        if len({s.threads for s in samples}) > 1:
            problems.append("thread count changed")
        rss = [s.rss for s in samples[1:]] or [samples[0].rss]
        if max(rss) - rss[0] > args.rss_slack_mib * MiB:
            problems.append(f"RSS grew by {(max(rss) - rss[0]) / MiB:.1f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(s) for s in samples], indent=2))
    for msg in problems:
        print(f"FAIL: {msg}", file=sys.stderr)
    if not problems:
        print(f"check: {args.steps} steps, parameters bit-identical, disk/RSS/threads flat")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

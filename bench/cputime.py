"""Where the CPU goes: per-thread user and system time per step, with and without offload.

Trains the benchmark transformer in this process under one mode (``none`` or
``disk``) and reads ``/proc/self/task/<tid>/stat`` before and after the timed
steps. Threads are named from Python's ``threading`` table where it knows them
(the IO workers), else by their kernel id (the OpenMP workers). Run it once per
mode, back to back: on a machine whose cores compute already fills, every
millisecond of extra CPU shows up in the step time.

Linux only.

Example:
    .venv/bin/python bench/cputime.py --mode none && .venv/bin/python bench/cputime.py --mode disk
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import step as step_bench
from _common import scratch_folder

from prefetch_offload import offload_context
from prefetch_offload.testing import TinyTransformer, make_batch


def thread_times() -> dict[int, tuple[float, float]]:
    """Kernel thread id -> (user s, system s) for every thread of this process."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (int(fields[11]) / tick, int(fields[12]) / tick)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("none", "disk"), default="disk")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    step_bench.add_shape_args(p, step_bench.Shape())  # the benchmark transformer of bench/step.py
    p.add_argument("--save-dir", default=None, help="parent of the run's scratch folder")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    if not os.path.isdir("/proc/self/task"):
        print("bench/cputime.py needs Linux /proc", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    shape = step_bench.Shape.from_args(args)
    model = TinyTransformer(width=shape.width, depth=shape.depth, heads=shape.heads)
    tokens, targets = make_batch(shape.batch, shape.seq)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with scratch_folder(args.save_dir, prefix="cputime-") as folder:
        target = None if args.mode == "none" else "disk"
        with offload_context(target, save_dir=folder if target else None):
            for i in range(args.warmup + args.steps):
                if i == args.warmup:
                    before, start = thread_times(), time.perf_counter()
                model(tokens, targets).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            step = (time.perf_counter() - start) / args.steps
            after = thread_times()
            names = {t.native_id: t.name for t in threading.enumerate()}
    rows = []
    for tid, (user, system) in sorted(after.items()):
        u0, s0 = before.get(tid, (0.0, 0.0))
        du, ds = (user - u0) / args.steps, (system - s0) / args.steps
        if du + ds >= 0.0005:
            rows.append({"thread": names.get(tid, f"tid {tid}"), "user_s": du, "sys_s": ds})
    print(f"mode {args.mode}: step {step * 1e3:.0f} ms (mean of {args.steps})")
    for r in rows:
        user, system = r["user_s"] * 1e3, r["sys_s"] * 1e3
        print(f"  {r['thread']:<24} user {user:6.1f} ms  sys {system:6.1f} ms")
    total = sum(r["user_s"] + r["sys_s"] for r in rows)
    print(f"  {'all threads':<24} {total * 1e3:6.1f} ms of CPU per step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": args.mode, "step_s": step, "threads": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Compare engine settings side by side: none and several disk configurations, interleaved.

One process trains one copy of the benchmark transformer per configuration
(same weights, same batch) and runs one step of each per round, in an order
given by a balanced Latin square over the rounds, so that drift and the
previous step's leftovers hit all alike. Each engine lives for the
whole run (its hooks are installed around each of its steps). Per
configuration: median step time, its ratio to ``none``, MB offloaded, writes
skipped and hit rate per step, and the process's CPU time per step (user and
system, from ``getrusage`` around each step: the cost the IO adds on a machine
whose cores compute keeps busy), the process's minor page faults per step
(memory given back to the kernel and touched again: NOTE [heap trim]), and the
CPU time the hypervisor took from the machine's CPUs during the step (``steal``
in ``/proc/stat``, all CPUs: on a VM, the host's side of the disk IO). One
process shares one heap, so pages one engine's heap trim gives back may be
faulted in again by the next configuration's step: ``--isolate`` gives each
configuration (none included) a process of its own, still stepped one round at
a time in the same order, so that each one's CPU time and page faults are its
own (the heap trim's cost: NOTE [heap trim]; a trim still running on an IO
thread when a step returns is counted in that lane's next step, or in none).
A lane that fails in its process raises ``LaneFailed`` with the child's
traceback. ``--json`` writes the rows with
the command and the machine (``bench/report.py`` makes a table of them).

A configuration may also give ``"noop_io"``: ``"write"``, ``"read"`` or
``"both"`` (not an engine knob): that engine's slab store then skips those
requests, to split the engine's cost between its writes, its reads and the rest
(its training is then wrong by design, so its parameters are not checked).
On ext4 a read of a never-written (fallocated) extent returns zeros without
touching the device, so ``"write"`` also removes the device reads.

Example (the chunk_bytes comparison in docs/tuning.md):
    .venv/bin/python bench/ab.py --config 'c8:{"chunk_bytes": 8388608}' \\
        --config 'c32:{"chunk_bytes": 33554432}' --rounds 16
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import multiprocessing
import os
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Iterable
from multiprocessing.connection import Connection
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import TORCH_THREADS, machine_info, round_order, scratch_folder, steal_seconds
from _harness import LEARNING_RATE, Shape, add_args, build
from _text import json_header

from prefetch_offload import OffloadConfig, OffloadEngine, OffloadStats
from prefetch_offload.testing import warm_up_unary_ops


def _config(spec: str) -> tuple[str, dict[str, Any]]:
    name, sep, body = spec.partition(":")
    if not name or name == "none":
        raise argparse.ArgumentTypeError(f"--config needs NAME:JSON with NAME not 'none': {spec!r}")
    try:
        knobs = json.loads(body) if sep and body else {}
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--config {name}: bad JSON ({exc})") from exc
    if not isinstance(knobs, dict):
        raise argparse.ArgumentTypeError(f"--config {name}: JSON must be an object")
    if knobs.get("noop_io", "write") not in _NOOP_IO:
        raise argparse.ArgumentTypeError(
            f"--config {name}: noop_io must be one of {_NOOP_IO}, got {knobs['noop_io']!r}"
        )
    return name, knobs


_NOOP_IO = ("write", "read", "both")


def _skip_io(engine: OffloadEngine, which: str) -> None:
    """Make the engine's slab store skip its writes, its reads, or both (see above)."""
    store = engine._store
    assert store is not None
    if which in ("write", "both"):
        store.write = lambda extent, offset, data: None  # type: ignore[method-assign]
    if which in ("read", "both"):
        store.read = lambda extent, offset, out: None  # type: ignore[method-assign]


class Lane:
    """One configuration's training: its model copy, optimizer and engine (None: no
    offload). ``step`` runs one training step and returns its wall, user and system
    seconds and minor page faults (``getrusage`` of this process)."""

    def __init__(self, knobs: dict[str, Any] | None, shape: Shape, folder: str, name: str) -> None:
        self.model, (self.batch,) = build(shape, 1)  # every lane: the same weights and batch
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LEARNING_RATE)
        self.engine: OffloadEngine | None = None
        if knobs is not None:
            knobs = dict(knobs)
            noop = knobs.pop("noop_io", None)
            cfg = OffloadConfig(target="disk", save_dir=os.path.join(folder, name), **knobs)
            self.engine = OffloadEngine(cfg)
            if noop is not None:
                _skip_io(self.engine, noop)

    def step(self) -> tuple[float, float, float, int]:
        u0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        if self.engine is None:
            self.model(*self.batch).backward()
        else:
            with torch.autograd.graph.saved_tensors_hooks(self.engine.pack, self.engine.unpack):
                self.model(*self.batch).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        dt, u1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        return dt, u1.ru_utime - u0.ru_utime, u1.ru_stime - u0.ru_stime, u1.ru_minflt - u0.ru_minflt

    def stats(self) -> OffloadStats | None:
        return None if self.engine is None else self.engine.stats()

    def params(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.model.parameters()]

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


class LaneFailed(RuntimeError):
    """An isolated lane's process raised or died; the message names the lane."""


def _serve(
    conn: Connection, knobs: dict[str, Any] | None, shape: Shape, folder: str, name: str
) -> None:
    """An isolated lane's process: builds its Lane, says "ready", then runs the parent's
    calls until "close". Every answer is ``(True, value)``, or ``(False, traceback)``
    when the call raised (the process then ends)."""
    torch.set_num_threads(TORCH_THREADS)  # as the parent's: spawned children start anew
    warm_up_unary_ops()  # NOTE [first unary call]: modes are compared bit for bit
    lane = None
    try:
        lane = Lane(knobs, shape, folder, name)
        conn.send((True, "ready"))
        while True:
            call = conn.recv()
            if call == "close":
                lane, closing = None, lane
                closing.close()
                conn.send((True, None))
                return
            conn.send((True, getattr(lane, call)()))
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send((False, traceback.format_exc()))
    finally:
        if lane is not None:
            with contextlib.suppress(Exception):
                lane.close()


class ProcessLane:
    """A Lane in a process of its own (``--isolate``): its own heap, so one
    configuration's heap trims and page faults are not paid by the next one's step.
    A failure in the child raises :class:`LaneFailed` here, with its traceback."""

    def __init__(self, knobs: dict[str, Any] | None, shape: Shape, folder: str, name: str) -> None:
        self.name = name
        self._failed = False  # the child reported an error or died: nothing to close
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # The child imports _serve by its module's name: this file's, as "ab", with bench/
        # on the sys.path the child starts with (whatever name it was loaded under here).
        here = os.path.dirname(os.path.abspath(__file__))
        saved = list(sys.path)
        sys.path.insert(0, here)
        try:
            serve = importlib.import_module("ab")._serve
            self._proc = ctx.Process(
                target=serve, args=(child, knobs, shape, folder, name), daemon=True
            )
            self._proc.start()
        finally:
            sys.path[:] = saved
        child.close()

    def wait_ready(self) -> None:
        """Wait until the child has built its lane (or raise what it raised)."""
        self._answer()

    def _answer(self) -> Any:
        try:
            ok, value = self._conn.recv()
        except EOFError:
            self._failed = True
            self._proc.join(timeout=5)
            raise LaneFailed(
                f"lane {self.name!r}: its process ended (exit code {self._proc.exitcode})"
            ) from None
        if not ok:
            self._failed = True  # the child ends after reporting an error
            raise LaneFailed(f"lane {self.name!r} failed in its process:\n{value}")
        return value

    def _call(self, name: str) -> Any:
        try:
            self._conn.send(name)
        except (BrokenPipeError, OSError):
            raise LaneFailed(f"lane {self.name!r}: its process is gone") from None
        return self._answer()

    def step(self) -> tuple[float, float, float, int]:
        return self._call("step")

    def stats(self) -> OffloadStats | None:
        return self._call("stats")

    def params(self) -> list[torch.Tensor]:
        return self._call("params")

    def close(self) -> None:
        """Close the child's engine (raising what that raised) and end the process."""
        try:
            if not self._failed and self._proc.is_alive():
                self._call("close")
        finally:
            self._proc.join(timeout=60)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
            self._conn.close()


def _close_all(lanes: Iterable[Lane | ProcessLane]) -> None:
    """Close every lane, then raise the first error one of them raised."""
    first: BaseException | None = None
    for lane in lanes:
        try:
            lane.close()
        except BaseException as exc:
            first = first or exc
    if first is not None:
        raise first


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config",
        type=_config,
        action="append",
        default=[],
        metavar="NAME:JSON",
        help="a disk configuration: OffloadConfig keywords as JSON (repeatable)",
    )
    p.add_argument("--rounds", type=int, default=12, help="timed rounds (default 12)")
    p.add_argument("--warmup", type=int, default=2, help="uncounted rounds first (default 2)")
    p.add_argument(
        "--isolate",
        action="store_true",
        help="run each configuration (none included) in a process of its own, still one "
        "step of each per round: CPU time and page faults are then each one's own",
    )
    add_args(p, Shape())  # the benchmark transformer of bench/step.py
    p.add_argument("--save-dir", default=None, help="parent of the run's scratch folder")
    p.add_argument("--json", default=None, help="also write the rows here")
    words = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(words)
    torch.set_num_threads(TORCH_THREADS)  # as bench/step.py: the figures are comparable
    warm_up_unary_ops()  # NOTE [first unary call]: modes are compared bit for bit
    configs: dict[str, dict[str, Any] | None] = {"none": None}
    for name, knobs in args.config or [("disk", {})]:
        configs[name] = knobs
    shape = Shape.from_args(args)
    names = list(configs)
    unchecked = {n for n, k in configs.items() if k is not None and "noop_io" in k}
    rows = []
    make = ProcessLane if args.isolate else Lane
    with scratch_folder(args.save_dir, prefix="ab-") as folder:
        lanes: dict[str, Lane | ProcessLane] = {}
        try:
            for name, knobs in configs.items():
                lanes[name] = make(knobs, shape, folder, name)
            for lane in lanes.values():  # every child imported torch before round 0
                if isinstance(lane, ProcessLane):
                    lane.wait_ready()
            # (wall, user, system, hypervisor steal) seconds and minor page faults per step
            samples: dict[str, list[tuple[float, float, float, float, int]]] = {
                n: [] for n in names
            }
            before: dict[str, OffloadStats | None] = {}
            for r in range(args.warmup + args.rounds):
                if r == args.warmup:
                    before = {n: lane.stats() for n, lane in lanes.items()}
                for n in round_order(names, r):
                    s0 = steal_seconds()
                    dt, user, system, faults = lanes[n].step()
                    s1 = steal_seconds()
                    if r >= args.warmup:
                        steal = s1 - s0 if s0 is not None and s1 is not None else 0.0
                        samples[n].append((dt, user, system, steal, faults))
            ref = statistics.median(s[0] for s in samples["none"])
            for n in names:
                step = statistics.median(s[0] for s in samples[n])
                row: dict[str, Any] = {
                    "name": n,
                    "knobs": configs[n],
                    "step_s": step,
                    "ratio": step / ref,
                    "user_s": statistics.fmean(s[1] for s in samples[n]),
                    "sys_s": statistics.fmean(s[2] for s in samples[n]),
                    "steal_s": statistics.fmean(s[3] for s in samples[n]),
                    "faults_per_step": statistics.fmean(s[4] for s in samples[n]),
                }
                a, b = before[n], lanes[n].stats()
                if a is not None and b is not None:
                    hits = b.prefetch_hits - a.prefetch_hits
                    total = hits + b.prefetch_misses - a.prefetch_misses
                    row |= {
                        "mb_per_step": (b.bytes_offloaded - a.bytes_offloaded) / 1e6 / args.rounds,
                        "read_mb_per_step": (b.bytes_read - a.bytes_read) / 1e6 / args.rounds,
                        "kept_in_backward_per_step": (b.kept_in_backward - a.kept_in_backward)
                        / args.rounds,
                        "skipped_per_step": (b.writes_skipped - a.writes_skipped) / args.rounds,
                        "staged_mb_per_step": (b.bytes_staged - a.bytes_staged) / 1e6 / args.rounds,
                        "hit_rate": hits / total if total else 0.0,
                    }
                rows.append(row)
            params = {n: lanes[n].params() for n in names}
        except BaseException:
            with contextlib.suppress(Exception):  # the first error is the one to see
                _close_all(lanes.values())
            raise
        _close_all(lanes.values())
    differ = [
        n
        for n in names[1:]
        if n not in unchecked
        and not all(torch.equal(a, b) for a, b in zip(params[n], params["none"], strict=True))
    ]
    print(
        f"{'config':<10} {'step ms':>8} {'ratio':>6} {'user ms':>8} {'sys ms':>7} "
        f"{'steal ms':>8} {'faults':>7} {'MB/step':>8} {'skipped':>7} {'hit':>5} "
        f"{'staged MB':>9}"
    )
    for row in rows:
        extra = (
            f"{row['mb_per_step']:8.0f} {row['skipped_per_step']:7.1f} {row['hit_rate']:5.2f} "
            f"{row['staged_mb_per_step']:9.0f}"
            if "mb_per_step" in row
            else ""
        )
        print(
            f"{row['name']:<10} {row['step_s'] * 1e3:8.1f} {row['ratio']:6.3f} "
            f"{row['user_s'] * 1e3:8.0f} {row['sys_s'] * 1e3:7.0f} "
            f"{row['steal_s'] * 1e3:8.0f} {row['faults_per_step']:7.0f} {extra}"
        )
    if args.json:
        doc = {
            **json_header("ab.py", words, machine_info()),
            "shape": dataclasses.asdict(shape),
            "rounds": args.rounds,
            "warmup": args.warmup,
            "isolate": args.isolate,
            "rows": rows,
            "unchecked": sorted(unchecked),
            "check": {"ok": not differ, "differ": differ},
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if differ:
        print(f"NOT bit-identical to none: {', '.join(differ)}", file=sys.stderr)
        return 1
    skipped = f" (not checked, IO skipped: {', '.join(sorted(unchecked))})" if unchecked else ""
    print(f"check: final parameters of every configuration are bit-identical to 'none'{skipped}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Step time and backward stall of ``disk`` against ``none`` over a grid of engine knobs.

Cells:

- the grid ``--prefetch-depths`` x ``--io-workers`` at the default
  ``max_pending_write_bytes``;
- ``--pending-mib`` values of ``max_pending_write_bytes`` at the default
  ``prefetch_depth`` and ``io_workers`` (a value the grid already measured is
  reused, not run twice).

Each cell trains a fresh ``none`` and a fresh ``disk`` copy of the same model on
the same batches with ``bench/step.py``'s harness (``bench/_harness.py``): both
on one thread, the engine set up once per cell and its hooks installed around
each disk step, interleaved round by round (the order alternates), so the
cell's ratio compares two medians measured side by side. Every cell also
checks that both copies end bit-identical.

``max_pending_write_bytes`` is the knob that trades memory for speed (pack waits
when that many bytes are queued for writing), so for the ``--pending-mib`` cells
the activation memory is measured too, with ``bench/_probe.py``'s memory probe
(a fresh process per point with ``MALLOC_MMAP_THRESHOLD_=65536``; see its
docstring). ``--no-mem-probe`` skips it.

The default grid (5 depths x 3 worker counts + 2 pending values, 6 timed steps
each at step.py's default shape) takes about 3-5 minutes on 2 cores. Example::

    .venv/bin/python bench/sweep.py --json sweep.json --plot sweep.png
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# bench/ is not a package: import its modules from this file's folder.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness
from _common import MB, TORCH_THREADS, filesystem_type, machine_info, scratch_folder
from _plot import sweep_grid
from _probe import MMAP_THRESHOLD, ProbeError, probe_many
from _text import fmt, format_table, json_args, log, machine_line

from prefetch_offload.testing import warm_up_unary_ops

_DEFAULTS = harness.Knobs()


@dataclass(frozen=True)
class Cell:
    """One knob setting: ``none`` and ``disk`` step times side by side, disk's counters."""

    group: str  # "grid" (depth x workers) or "pending" (max_pending_write_bytes)
    prefetch_depth: int
    io_workers: int
    max_pending_write_bytes: int
    none_seconds: tuple[float, ...]
    disk_seconds: tuple[float, ...]
    # Engine counter deltas over the timed rounds.
    stall_seconds: float
    pack_wait_seconds: float
    prefetch_hits: int
    prefetch_misses: int
    bytes_offloaded: int
    peak_pending_write_bytes: int
    # None when the final parameters were bit-identical, else what differs.
    mismatch: str | None = None
    # Memory probe (pending cells): disk's and none's largest RSS rise during forward.
    act_mem_bytes: int | None = None
    baseline_act_bytes: int | None = None

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.prefetch_depth, self.io_workers, self.max_pending_write_bytes)

    @property
    def none_s(self) -> float:
        """Median ``none`` step time, seconds."""
        return statistics.median(self.none_seconds)

    @property
    def disk_s(self) -> float:
        """Median ``disk`` step time, seconds."""
        return statistics.median(self.disk_seconds)

    @property
    def ratio(self) -> float:
        """Median disk step time over median none step time, same cell."""
        return self.disk_s / self.none_s

    @property
    def stall_per_step(self) -> float:
        """Seconds backward waited for reads, per timed step."""
        return self.stall_seconds / len(self.disk_seconds)

    @property
    def pack_wait_per_step(self) -> float:
        """Seconds forward waited at the pending-write cap, per timed step."""
        return self.pack_wait_seconds / len(self.disk_seconds)

    @property
    def hit_rate(self) -> float | None:
        """Unpacks served without waiting, as a fraction."""
        total = self.prefetch_hits + self.prefetch_misses
        return self.prefetch_hits / total if total else None

    @property
    def act_cut(self) -> float | None:
        """Fraction of none's activation memory that disk saved (probe), if measured."""
        if self.act_mem_bytes is None or not self.baseline_act_bytes:
            return None
        return 1.0 - self.act_mem_bytes / self.baseline_act_bytes

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["none_seconds"] = list(self.none_seconds)
        out["disk_seconds"] = list(self.disk_seconds)
        for name in (
            "none_s",
            "disk_s",
            "ratio",
            "stall_per_step",
            "pack_wait_per_step",
            "hit_rate",
            "act_cut",
        ):
            out[name] = getattr(self, name)
        return out


# -- arguments ---------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None
    return list(dict.fromkeys(values))


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/sweep.py",
        description="disk vs none step time and stall over prefetch_depth x io_workers "
        "and max_pending_write_bytes.",
    )
    p.add_argument(
        "--prefetch-depths",
        type=_int_list,
        default=[0, 1, 2, 4, 8],
        metavar="N,...",
        help="grid rows (default 0,1,2,4,8)",
    )
    p.add_argument(
        "--io-workers",
        type=_int_list,
        default=[1, 2, 4],
        metavar="N,...",
        help="grid columns (default 1,2,4)",
    )
    p.add_argument(
        "--pending-mib",
        type=harness.parse_mib_list,
        default=harness.parse_mib_list("16,64,256"),
        metavar="MIB,...",
        help="max_pending_write_bytes values at default depth/workers "
        "(default 16,64,256; empty: none)",
    )
    p.add_argument("--steps", type=int, default=6, help="timed rounds per cell (default 6)")
    p.add_argument("--warmup", type=int, default=1, help="uncounted rounds first (default 1)")
    harness.add_args(p, harness.Shape())
    p.add_argument(
        "--min-offload-bytes",
        type=int,
        default=_DEFAULTS.min_offload_bytes,
        help="smallest saved tensor sent to disk",
    )
    p.add_argument(
        "--chunk-bytes",
        type=int,
        default=_DEFAULTS.chunk_bytes,
        help="write batch and read request size",
    )
    p.add_argument(
        "--no-mem-probe",
        dest="mem_probe",
        action="store_false",
        help="skip the activation-memory probes of the --pending-mib cells",
    )
    p.add_argument(
        "--probe-jobs",
        type=int,
        default=1,
        metavar="N",
        help="memory probes run at once (default 1; see bench/step.py --probe-jobs)",
    )
    p.add_argument(
        "--save-dir",
        default=None,
        help="folder to create the run's scratch folder in (default: ./.scratch); removed at end",
    )
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write JSON here")
    p.add_argument(
        "--plot", type=Path, default=None, metavar="PATH", help="write a PNG (needs matplotlib)"
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.probe_jobs < 1:
        p.error("--steps and --probe-jobs must be >= 1, --warmup >= 0")
    if any(d < 0 for d in args.prefetch_depths) or any(w < 1 for w in args.io_workers):
        p.error("prefetch depths must be >= 0 and io worker counts >= 1")
    return args


# -- running cells -----------------------------------------------------------------------


def _plan(args: argparse.Namespace) -> list[tuple[str, harness.Knobs]]:
    """(group, knobs) for every cell, grid first; pending points the grid has are dropped."""
    base = harness.Knobs(min_offload_bytes=args.min_offload_bytes, chunk_bytes=args.chunk_bytes)
    cells = [
        ("grid", dataclasses.replace(base, prefetch_depth=d, io_workers=w))
        for d in args.prefetch_depths
        for w in args.io_workers
    ]
    have = {k for _, k in cells}
    for value in args.pending_mib:
        knobs = dataclasses.replace(base, max_pending_write_bytes=value)
        if knobs not in have:
            cells.append(("pending", knobs))
            have.add(knobs)
    return cells


def _run_cell(
    group: str,
    knobs: harness.Knobs,
    model: torch.nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    phases: Sequence[str],
    cell_dir: Path,
) -> Cell:
    workers = {
        mode: harness.ModeWorker(
            mode, copy.deepcopy(model), batches, harness.make_mode(mode, cell_dir, knobs)
        )
        for mode in ("none", "disk")
    }
    rounds = harness.run_rounds(workers, phases)
    delta = harness.timed_delta(workers["disk"])
    mismatch = harness.compare_params(workers["none"].model, workers["disk"].model, "none", "disk")
    return Cell(
        group=group,
        prefetch_depth=knobs.prefetch_depth,
        io_workers=knobs.io_workers,
        max_pending_write_bytes=knobs.max_pending_write_bytes,
        none_seconds=tuple(rounds.times["none"]),
        disk_seconds=tuple(rounds.times["disk"]),
        stall_seconds=float(delta.get("stall_seconds", 0.0)),
        pack_wait_seconds=float(delta.get("pack_wait_seconds", 0.0)),
        prefetch_hits=int(delta.get("prefetch_hits", 0)),
        prefetch_misses=int(delta.get("prefetch_misses", 0)),
        bytes_offloaded=int(delta.get("bytes_offloaded", 0)),
        peak_pending_write_bytes=int(delta.get("peak_pending_write_bytes", 0)),
        mismatch=mismatch,
    )


def _pending_cells(cells: Sequence[Cell], args: argparse.Namespace) -> list[Cell]:
    """The --pending-mib points in the given order (grid cells relabelled where reused)."""
    by_key = {c.key: c for c in cells}
    out = []
    for value in args.pending_mib:
        key = (_DEFAULTS.prefetch_depth, _DEFAULTS.io_workers, value)
        if key in by_key:
            out.append(dataclasses.replace(by_key[key], group="pending"))
    return out


def _probe(
    pending: list[Cell], shape: harness.Shape, args: argparse.Namespace, run_dir: Path
) -> tuple[list[Cell], dict[str, Any]]:
    """Add probed activation memory to the pending cells; also return the raw probes."""
    base = harness.Knobs(min_offload_bytes=args.min_offload_bytes, chunk_bytes=args.chunk_bytes)
    requests = [("none", base)] + [
        ("disk", dataclasses.replace(base, max_pending_write_bytes=c.max_pending_write_bytes))
        for c in pending
    ]
    none, *disk = probe_many(requests, shape, run_dir, jobs=args.probe_jobs)
    baseline = max(none["act_mem_bytes"]) if none["act_mem_bytes"] else None
    out = [
        dataclasses.replace(
            cell,
            act_mem_bytes=max(probe["act_mem_bytes"]) if probe["act_mem_bytes"] else None,
            baseline_act_bytes=baseline,
        )
        for cell, probe in zip(pending, disk, strict=True)
    ]
    return out, {"none": none, "disk": disk}


# -- output ------------------------------------------------------------------------------


def _table(cells: Sequence[Cell]) -> str:
    header = (
        "knob",
        "depth",
        "workers",
        "pending MiB",
        "none s",
        "disk s",
        "disk/none",
        "stall s/step",
        "hit rate",
        "pack wait s/step",
        "act MiB",
        "act cut",
        "exact",
    )
    body = [
        (
            "grid" if c.group == "grid" else "pending",
            str(c.prefetch_depth),
            str(c.io_workers),
            fmt(c.max_pending_write_bytes, "g", 1 / MB),
            fmt(c.none_s, ".3f"),
            fmt(c.disk_s, ".3f"),
            fmt(c.ratio, ".2f", suffix="x"),
            fmt(c.stall_per_step, ".4f"),
            fmt(c.hit_rate, ".1f", 100, "%"),
            fmt(c.pack_wait_per_step, ".4f"),
            fmt(c.act_mem_bytes, ".1f", 1 / MB),
            fmt(c.act_cut, ".0f", 100, "%"),
            "yes" if c.mismatch is None else "NO",
        )
        for c in cells
    ]
    return format_table(header, body, left=1)


def _pivot(cells: Sequence[Cell], depths: Sequence[int], workers: Sequence[int]) -> str:
    """disk/none ratio with prefetch_depth down and io_workers across."""
    by_key = {(c.prefetch_depth, c.io_workers): c for c in cells if c.group == "grid"}
    header = ("depth \\ workers", *(str(w) for w in workers))
    body = [
        (
            str(d),
            *(
                fmt(by_key[(d, w)].ratio if (d, w) in by_key else None, ".2f", suffix="x")
                for w in workers
            ),
        )
        for d in depths
    ]
    return format_table(header, body, left=1)


# -- main --------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep; returns 0, 1 (disk and none ended different) or 2 (a run failed)."""
    args = _parse_args(argv)
    torch.set_num_threads(TORCH_THREADS)
    warm_up_unary_ops()  # NOTE [first unary call]: modes are compared bit for bit
    with scratch_folder(args.save_dir, prefix="bench-sweep-") as folder:
        return _run(args, Path(folder).absolute())


def _run(args: argparse.Namespace, run_dir: Path) -> int:
    shape = harness.Shape.from_args(args)
    phases = ["warmup"] * args.warmup + ["timed"] * args.steps
    model, batches = harness.build(shape, len(phases))
    plan = _plan(args)
    cells: list[Cell] = []
    start = time.perf_counter()
    for n, (group, knobs) in enumerate(plan):
        cell_dir = run_dir / f"cell{n}"
        try:
            cell = _run_cell(group, knobs, model, batches, phases, cell_dir)
        except harness.ModeFailed as exc:
            log(f"error: cell {knobs}: {exc.where} failed:")
            traceback.print_exception(exc.__cause__ or exc)
            return 2
        finally:
            shutil.rmtree(cell_dir, ignore_errors=True)
        cells.append(cell)
        log(
            f"cell {n + 1}/{len(plan)} depth {knobs.prefetch_depth} workers {knobs.io_workers} "
            f"pending {knobs.max_pending_write_bytes / MB:g} MiB: none {cell.none_s:.3f}s "
            f"disk {cell.disk_s:.3f}s ({cell.ratio:.2f}x) stall {cell.stall_per_step:.4f}s/step"
            f" [{time.perf_counter() - start:.0f}s]"
        )

    grid = [c for c in cells if c.group == "grid"]
    pending = _pending_cells(cells, args)
    probes: dict[str, Any] = {}
    if args.mem_probe and pending:
        try:
            pending, probes = _probe(pending, shape, args, run_dir)
        except (ProbeError, subprocess.TimeoutExpired) as exc:
            log(f"error: {exc}")
            return 2
    shown = grid + pending

    machine = machine_info()
    fstype = filesystem_type(str(run_dir))
    print(machine_line("bench/sweep.py", machine))
    print(
        f"shape: {shape}; {args.warmup} warmup + {args.steps} timed rounds per cell, none and "
        f"disk interleaved; scratch on {fstype}; min_offload_bytes {args.min_offload_bytes}"
    )
    print("none s / disk s: median step (forward + backward + SGD); disk/none: their ratio")
    print("stall: backward waiting for reads; pack wait: forward waiting at the write cap")
    if probes:
        print(
            "act MiB / act cut: disk's activation memory (bench/step.py memory probe, "
            f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}) and its cut vs none"
        )
    print()
    print(_table(shown))
    if grid:
        print()
        print("disk/none step-time ratio:")
        print(_pivot(grid, args.prefetch_depths, args.io_workers))
    bad = [c for c in cells if c.mismatch is not None]
    print()
    if bad:
        for c in bad:
            print(f"FAIL: depth {c.prefetch_depth} workers {c.io_workers}: {c.mismatch}")
    else:
        print(f"check: in all {len(cells)} cells disk's final parameters equal none's bit for bit")

    if args.json is not None:
        doc = {
            "machine": machine,
            "shape": dataclasses.asdict(shape),
            "args": json_args(args),
            "scratch_fs": fstype,
            "cells": [c.to_json() for c in shown],
            "memory_probes": probes,
            "check": {"ok": not bad, "problems": [c.mismatch for c in bad]},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    if args.plot is not None:
        title = (
            f"bench/sweep.py: {shape}; {args.steps} timed steps/cell; "
            f"{machine['cores']} cores, torch {machine['torch']}"
        )
        sweep_grid(shown, args.plot, title)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

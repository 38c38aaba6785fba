"""Step time, stall and memory of ``disk`` against ``none`` over a grid of engine knobs.

Cells: ``--prefetch-depths`` x ``--io-workers`` at the default
``max_pending_write_bytes``, then each ``--pending-mib`` value at the default
depth and workers (a value the grid has measured is not run twice). Each cell
is one run of the step benchmark's harness (``bench/step.py``'s ``run_lanes``)
with two lanes, ``none`` and ``disk`` with the cell's knobs, each in a process
of its own (``--shared``: both in this one), stepped round by round; the
cell's ratio compares two medians measured side by side, its peak is disk's
(``bench/step.py`` says how it is measured), and both lanes must end
bit-identical. ``--knobs`` sets other OffloadConfig keywords for every cell.

Example (4 x 3 grid + 2 caps at the benchmark shape: about 10 minutes on 2 cores)::

    python bench/sweep.py --json sweep.json --plot sweep.png
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
from _common import MB, TORCH_THREADS, machine_info, scratch_folder
from _harness import LaneSpec, Shape, add_shape_args, build
from _plot import sweep_grid
from _text import format_table, json_header, log, progress
from step import run_lanes, summarize

from prefetch_offload import OffloadConfig
from prefetch_offload.testing import saved_storage_bytes, warm_up_unary_ops

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(OffloadConfig)}


def _ints(text: str) -> list[int]:
    try:
        return list(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None


def _plan(args: argparse.Namespace) -> list[dict[str, int]]:
    """The cells' knobs: the grid, then the write caps it did not already measure."""
    pending = _DEFAULTS["max_pending_write_bytes"]
    grid = [
        {"prefetch_depth": d, "io_workers": w, "max_pending_write_bytes": pending}
        for d in args.prefetch_depths
        for w in args.io_workers
    ]
    caps = [
        {
            "prefetch_depth": _DEFAULTS["prefetch_depth"],
            "io_workers": _DEFAULTS["io_workers"],
            "max_pending_write_bytes": mib << 20,
        }
        for mib in args.pending_mib
    ]
    return grid + [c for c in caps if c not in grid]


def main(argv: Sequence[str] | None = None) -> int:
    """Run every cell; 0, or 1 if a cell's lanes trained differently."""
    p = argparse.ArgumentParser(prog="bench/sweep.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefetch-depths", type=_ints, default=[1, 2, 4, 8])
    p.add_argument("--io-workers", type=_ints, default=[1, 2, 4])
    p.add_argument("--pending-mib", type=_ints, default=[16, 256], help="write caps, MiB")
    p.add_argument("--knobs", type=json.loads, default={}, metavar="JSON")
    p.add_argument("--steps", type=int, default=6, help="timed rounds per cell (default 6)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--shared", action="store_true", help="both lanes in this process")
    add_shape_args(p)
    p.add_argument("--save-dir", default=None)
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    p.add_argument("--plot", type=Path, default=None, metavar="PATH")
    words = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(words)
    torch.set_num_threads(TORCH_THREADS)
    warm_up_unary_ops()  # NOTE [first unary call]: lanes are compared bit for bit
    shape = Shape(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Shape)})
    model, (batch,) = build(shape, 1)
    saved = sum(saved_storage_bytes(model, functools.partial(model, *batch)))
    del model, batch
    cells: list[dict[str, Any]] = []
    with scratch_folder(args.save_dir, prefix="bench-sweep-") as folder:
        for knobs in _plan(args):
            progress(f"cell {len(cells) + 1}: {knobs}")
            specs = [LaneSpec("none", "none"), LaneSpec("disk", "disk", {**args.knobs, **knobs})]
            doc = run_lanes(
                specs,
                shape,
                device="cpu",
                warmup=args.warmup,
                steps=args.steps,
                shared=args.shared,
                folder=folder,
            )
            doc.update(saved_bytes=saved, device="cpu")
            disk = summarize(doc)[1]
            cells.append({**knobs, **disk, "exact": doc["check"]["ok"]})
    header = ["depth", "workers", "pending MiB", "ratio", "stall s", "hit", "peak MiB", "exact"]
    body = [
        [
            str(c["prefetch_depth"]),
            str(c["io_workers"]),
            f"{c['max_pending_write_bytes'] / MB:.0f}",
            f"{c['ratio']:.2f}x",
            f"{c['stall']:.3f}",
            "" if c["hit_rate"] is None else f"{c['hit_rate']:.0%}",
            "" if c["peak"] is None else f"{c['peak'] / MB:.1f}",
            "yes" if c["exact"] else "NO",
        ]
        for c in cells
    ]
    print(format_table(header, body, left=0))
    doc = {**json_header("sweep.py", words, machine_info()), "shape": dataclasses.asdict(shape)}
    print(doc["machine_line"])
    print(f"{shape}; saved {saved / MB:.1f} MiB/step; ratio: disk's median step over none's")
    if args.json is not None:
        args.json.write_text(json.dumps({**doc, "cells": cells}, indent=1) + "\n")
    if args.plot is not None:
        try:
            grid = [
                c
                for c in cells
                if c["max_pending_write_bytes"] == _DEFAULTS["max_pending_write_bytes"]
            ]
            sweep_grid(grid, args.plot, doc["machine_line"])
        except ImportError:
            log("--plot: matplotlib is not installed; no plot")
    return 0 if all(c["exact"] for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())

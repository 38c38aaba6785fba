"""Prefetch under torch.compile: hit rate, IO and exactness of disk offload per compile mode.

Backward does not always unpack saved tensors in the reverse of the order forward
packed them, which is what the engine's lookahead assumes. In eager mode each
autograd node unpacks its own tensors as backward reaches it, so the order is
close to the reverse. A compiled region runs its backward as one node, which
unpacks every tensor the region saved at once, in the order the region saved
them (forward order); across regions the order is still reversed. This script
measures what that costs the prefetcher, per mode:

- ``eager``: no compilation;
- ``regional``: each transformer block compiled on its own (``block.compile()``),
  the form PyTorch recommends for repeated blocks;
- ``whole``: the whole model compiled (``model.compile()``): one region.

Each mode trains two copies of one model (same weights, same batches), one after
the other: a reference without offload, then the same compiled form under
``target="disk"`` (an ``OffloadContext``, i.e. ``offload_context``, around all of
its steps: one engine for the run, as a user wraps ``trainer.train()``). The
dynamo cache is reset before each compiled copy, so each traces on its own
first step (inductor's on-disk caches may still serve the kernels). After
``--warmup`` + ``--steps`` steps the offloaded copy's final parameters must be
bit-identical to its own mode's reference (compiled against compiled: eager and
compiled kernels need not agree in the last bit; that gap is shown, not
checked); if they are not, or the engine took nothing, or a compiled mode compiled
no graph, the script says so and exits with status 1 (2: a mode raised).

Per offloaded step the engine's counters are read before and after the step:
prefetch hit rate (``prefetch_hits / (prefetch_hits + prefetch_misses)``), bytes
offloaded and read, writes skipped, stall seconds. The table shows the steps
after the warm-up (the first step compiles; its row is in the JSON). Every unpack
of an offloaded tensor is logged with its record's sequence number (the order of
packing); the table shows, for the last step, the fraction of consecutive unpacks
that go backwards in pack order (``rev``: 1.0 is the order the lookahead assumes)
and the unpack order as runs of consecutive records (``a..b``).

``--seq-lengths 256,192,224`` gives the steps those sequence lengths in turn
(dynamic padding): every saved shape changes from one step to the next while the
graph stays the same (NOTE [learned order]: the prefetch order is kept). A
compiled block compiles again for the first length it has not seen, with dynamic
shapes, and may save other tensors then; later lengths reuse that compile.

``--prefetch-bytes`` is passed to the engine only where the installed
``OffloadConfig`` has that field.

Example (the shape of the compile issue: 6 blocks, width 256, batch 8 x 256):
    .venv/bin/python bench/compiled.py --modes eager,regional,whole \\
        --json docs/results/compiled.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import gc
import itertools
import json
import os
import statistics
import sys
import textwrap
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ is not a package
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import MB, TORCH_THREADS, filesystem_type, machine_info, scratch_folder
from _harness import (
    LEARNING_RATE,
    Flags,
    Shape,
    add_args,
    build,
    compare_params,
    counter_delta,
    parse_modes,
)
from _text import fmt, format_table, json_args, json_header, log

from prefetch_offload import OffloadConfig, OffloadContext, OffloadEngine
from prefetch_offload.testing import make_batch, warm_up_unary_ops

__all__ = [
    "LABELS",
    "MODES",
    "Knobs",
    "ModeResult",
    "StepSample",
    "compile_model",
    "main",
    "order_runs",
    "order_summary",
]

MODES: tuple[str, ...] = ("eager", "regional", "whole")
LABELS: dict[str, str] = {
    "eager": "no compilation",
    "regional": "each block compiled (block.compile())",
    "whole": "whole model compiled (model.compile())",
}
DEFAULT_MODES = "eager,regional"
_FIELDS = {f.name: f for f in dataclasses.fields(OffloadConfig)}
_DEFAULTS = {name: f.default for name, f in _FIELDS.items()}
HAS_PREFETCH_BYTES = "prefetch_bytes" in _FIELDS
_MAX_RUNS_SHOWN = 12


@dataclass(frozen=True)
class Knobs(Flags):
    """The engine settings under test. ``prefetch_bytes`` None: the engine's own default
    (or an engine that has no such knob)."""

    HELP: ClassVar[dict[str, str]] = {
        "prefetch_bytes": "the engine's prefetch_bytes (only where OffloadConfig has it; "
        "default: its own)"
    }

    prefetch_depth: int = _DEFAULTS["prefetch_depth"]
    prefetch_bytes: int | None = None
    io_workers: int = _DEFAULTS["io_workers"]
    min_offload_bytes: int = _DEFAULTS["min_offload_bytes"]
    chunk_bytes: int = _DEFAULTS["chunk_bytes"]

    def config(self, save_dir: str) -> OffloadConfig:
        """The disk target's config with these knobs."""
        kwargs = dataclasses.asdict(self)
        if kwargs["prefetch_bytes"] is None:
            del kwargs["prefetch_bytes"]
        return OffloadConfig(target="disk", save_dir=save_dir, **kwargs)


def compile_model(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """Compile ``model`` in place as ``mode`` says; its state_dict keys stay the same."""
    if mode == "regional":
        for block in model.blocks:  # type: ignore[union-attr]
            block.compile()
    elif mode == "whole":
        model.compile()
    elif mode != "eager":
        raise ValueError(mode)
    return model


# -- the unpack order --------------------------------------------------------------------


@contextlib.contextmanager
def _trace_unpacks(log: list[int | None]) -> Iterator[None]:
    """Append the record sequence number of every unpack (None: kept in memory) to ``log``.

    Patches the class, so it must be entered before the context that installs the
    engine's bound ``unpack`` as a hook.
    """
    real = OffloadEngine.unpack

    def traced(self: OffloadEngine, packed: Any) -> torch.Tensor:
        log.append(getattr(getattr(packed, "record", None), "seq", None))
        return real(self, packed)

    with mock.patch.object(OffloadEngine, "unpack", traced):
        yield


def order_runs(seqs: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive numbers, ascending or descending: ``[5, 4, 3, 7, 8]``
    is ``[(5, 3), (7, 8)]``. A repeated number starts no new run."""
    runs: list[tuple[int, int]] = []
    step = 0
    for s in seqs:
        if runs:
            first, last = runs[-1]
            if s == last:
                continue
            d = s - last
            if abs(d) == 1 and (step == 0 or d == step):
                runs[-1] = (first, s)
                step = d
                continue
        runs.append((s, s))
        step = 0
    return runs


def order_summary(seqs: Sequence[int | None]) -> dict[str, Any]:
    """One step's unpack order: record numbers relative to the lowest unpacked,
    the fraction of changes that go backwards in pack order, and the runs."""
    offloaded = [s for s in seqs if s is not None]
    if not offloaded:
        return {
            "unpacks": 0,
            "kept": len(seqs),
            "reverse_fraction": None,
            "runs": [],
            "relative_seqs": [],
        }
    low = min(offloaded)
    rel = [s - low for s in offloaded]
    changes = [b - a for a, b in itertools.pairwise(rel) if b != a]
    reverse = sum(1 for d in changes if d < 0) / len(changes) if changes else None
    return {
        "unpacks": len(rel),
        "kept": len(seqs) - len(rel),
        "reverse_fraction": reverse,
        "runs": [list(r) for r in order_runs(rel)],
        "relative_seqs": rel,
    }


def _runs_text(runs: Sequence[Sequence[int]]) -> str:
    parts = [str(a) if a == b else f"{a}..{b}" for a, b in runs]
    if len(parts) > _MAX_RUNS_SHOWN:
        parts = [*parts[:_MAX_RUNS_SHOWN], f"... ({len(parts)} runs)"]
    return " ".join(parts)


# -- one training run --------------------------------------------------------------------


@dataclass
class StepSample:
    """One training step: wall seconds, loss, and (offloaded runs) the engine's counter
    changes over the step and the unpack order."""

    seconds: float
    loss: float
    counters: dict[str, float] = field(default_factory=dict)
    order: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float | None:
        hits = self.counters.get("prefetch_hits", 0)
        total = hits + self.counters.get("prefetch_misses", 0)
        return hits / total if total else None


@dataclass
class RunResult:
    """One model copy's run: its steps, final parameters and what dynamo compiled."""

    steps: list[StepSample]
    state: dict[str, torch.Tensor]
    graphs: int  # graphs dynamo compiled during the run
    graph_breaks: int
    io_method: str | None = None


def _dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _train(
    mode: str,
    base: torch.nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    knobs: Knobs | None,
    save_dir: str,
) -> RunResult:
    """Train a copy of ``base`` compiled as ``mode``, offloaded to disk if ``knobs``."""
    if mode != "eager":
        torch._dynamo.reset()  # compile this copy from scratch
    graphs0, breaks0 = _dynamo_counts()
    model = compile_model(copy.deepcopy(base), mode)
    opt = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    order: list[int | None] = []
    steps: list[StepSample] = []
    io_method = None
    with contextlib.ExitStack() as stack:
        engine: OffloadEngine | None = None
        if knobs is not None:
            stack.enter_context(_trace_unpacks(order))
            entered = stack.enter_context(OffloadContext(knobs.config(save_dir)))
            assert isinstance(entered, OffloadEngine)  # target "disk" always has one
            engine = entered
            io_method = getattr(engine, "io_method", None)
        for tokens, targets in batches:
            gc.collect()
            before = dataclasses.asdict(engine.stats()) if engine is not None else {}
            order.clear()
            t0 = time.perf_counter()
            loss = model(tokens, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - t0
            sample = StepSample(seconds=seconds, loss=loss.item())
            if engine is not None:
                after = dataclasses.asdict(engine.stats())
                sample.counters = counter_delta(before, after)
                sample.order = order_summary(order)
            steps.append(sample)
    graphs1, breaks1 = _dynamo_counts()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return RunResult(steps, state, graphs1 - graphs0, breaks1 - breaks0, io_method)


# -- results -----------------------------------------------------------------------------


@dataclass
class ModeResult:
    """One mode: its reference run, its offloaded run, and the check between them."""

    mode: str
    warmup: int
    ref: RunResult
    disk: RunResult
    mismatch: str | None
    vs_eager: float | None = None  # max |param difference| of the reference run vs eager's

    @property
    def timed(self) -> list[StepSample]:
        """The offloaded run's steps after the warm-up."""
        return self.disk.steps[self.warmup :]

    def total(self, name: str) -> float:
        """Sum of one engine counter over the timed steps."""
        return sum(s.counters.get(name, 0) for s in self.timed)

    @property
    def hit_rate(self) -> float | None:
        hits = self.total("prefetch_hits")
        total = hits + self.total("prefetch_misses")
        return hits / total if total else None

    def per_step(self, name: str) -> float:
        return self.total(name) / max(1, len(self.timed))

    def median_s(self, run: RunResult) -> float:
        return statistics.median(s.seconds for s in run.steps[self.warmup :])

    def to_json(self) -> dict[str, Any]:
        def steps(run: RunResult) -> list[dict[str, Any]]:
            return [
                {
                    "step": i + 1,
                    "warmup": i < self.warmup,
                    "seconds": s.seconds,
                    "loss": s.loss,
                    "hit_rate": s.hit_rate,
                    "counters": s.counters,
                    "unpack_order": s.order,
                }
                if s.counters or s.order
                else {
                    "step": i + 1,
                    "warmup": i < self.warmup,
                    "seconds": s.seconds,
                    "loss": s.loss,
                }
                for i, s in enumerate(run.steps)
            ]

        return {
            "mode": self.mode,
            "label": LABELS[self.mode],
            "hit_rate": self.hit_rate,
            "hit_rate_per_step": [s.hit_rate for s in self.timed],
            "bytes_offloaded_per_step": self.per_step("bytes_offloaded"),
            "bytes_read_per_step": self.per_step("bytes_read"),
            "writes_skipped_per_step": self.per_step("writes_skipped"),
            "stall_seconds_per_step": self.per_step("stall_seconds"),
            "pack_wait_seconds_per_step": self.per_step("pack_wait_seconds"),
            "median_step_s": self.median_s(self.disk),
            "ref_median_step_s": self.median_s(self.ref),
            "first_step_s": self.disk.steps[0].seconds,
            "ref_first_step_s": self.ref.steps[0].seconds,
            "graphs": self.disk.graphs,
            "ref_graphs": self.ref.graphs,
            "graph_breaks": self.disk.graph_breaks,
            "io_method": self.disk.io_method,
            "exact": self.mismatch is None,
            "mismatch": self.mismatch,
            "ref_max_abs_diff_vs_eager": self.vs_eager,
            "steps": steps(self.disk),
            "ref_steps": steps(self.ref),
        }


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _table(results: Sequence[ModeResult]) -> str:
    header = (
        "mode",
        "ref s",
        "disk s",
        "vs ref",
        "hit rate",
        "per step",
        "offl MiB",
        "read MiB",
        "skipped",
        "stall s",
        "pack wait s",
        "rev",
        "graphs",
        "exact",
    )
    body = []
    for r in results:
        last = r.disk.steps[-1].order
        body.append(
            (
                r.mode,
                fmt(r.median_s(r.ref), ".3f"),
                fmt(r.median_s(r.disk), ".3f"),
                fmt(r.median_s(r.disk) / r.median_s(r.ref), ".2f", suffix="x"),
                fmt(r.hit_rate, ".0f", 100, "%"),
                " ".join(fmt(s.hit_rate, ".0f", 100, "%") for s in r.timed),
                fmt(r.per_step("bytes_offloaded"), ".1f", 1 / MB),
                fmt(r.per_step("bytes_read"), ".1f", 1 / MB),
                fmt(r.per_step("writes_skipped"), ".1f"),
                fmt(r.per_step("stall_seconds"), ".4f"),
                fmt(r.per_step("pack_wait_seconds"), ".4f"),
                fmt(last.get("reverse_fraction"), ".2f"),
                f"{r.ref.graphs}/{r.disk.graphs}",
                "yes" if r.mismatch is None else "NO",
            )
        )
    return format_table(header, body)


def _mode_line(r: ModeResult) -> str:
    """First-step times, the gap to eager, and the last step's unpack order."""
    line = f"{r.mode}: first step {r.ref.steps[0].seconds:.1f} s / {r.disk.steps[0].seconds:.1f} s"
    if r.vs_eager is not None:
        line += f"; params vs eager max |diff| {r.vs_eager:.3g}"
    last = r.disk.steps[-1].order
    if not last.get("unpacks") and not last.get("kept"):
        # Nothing logged: the hook autograd calls is not OffloadEngine.unpack.
        return line + "; unpack order not traced"
    return (
        f"{line}; last step unpacked {last['unpacks']} offloaded ({last['kept']} kept) "
        f"in the order: {_runs_text(last['runs'])}"
    )


def _check(results: Sequence[ModeResult]) -> list[str]:
    problems = [r.mismatch for r in results if r.mismatch is not None]
    for r in results:
        # Written, or queued and then kept by the write tail (a step smaller than a
        # write batch can be kept whole: NOTE [write tail]); either way the engine took it.
        if r.total("bytes_offloaded") <= 0 and r.total("writes_skipped") <= 0:
            problems.append(
                f"mode {r.mode!r}: the engine took no saved tensor in the timed steps, so its "
                "hit rate means nothing; lower --min-offload-bytes"
            )
        if r.mode != "eager" and (r.ref.graphs <= 0 or r.disk.graphs <= 0):
            problems.append(
                f"mode {r.mode!r}: dynamo compiled {r.ref.graphs} graphs without offload and "
                f"{r.disk.graphs} with it; a compiled mode that compiles nothing runs eagerly"
            )
    return problems


# -- arguments and main ------------------------------------------------------------------


def _lengths(text: str) -> list[int]:
    """``--seq-lengths``: a comma list of positive ints."""
    try:
        lengths = [int(part) for part in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 256,192; got {text!r}")
    return lengths


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/compiled.py",
        description="Disk offload's prefetch hit rate, IO and exactness under torch.compile.",
    )
    p.add_argument(
        "--modes",
        type=functools.partial(parse_modes, choices=MODES),
        default=parse_modes(DEFAULT_MODES, MODES),
        help=f"comma list of {', '.join(MODES)} (default {DEFAULT_MODES})",
    )
    p.add_argument("--steps", type=int, default=3, help="steps after the warm-up (default 3)")
    p.add_argument(
        "--warmup", type=int, default=1, help="first steps, not in the table (default 1)"
    )
    add_args(p, Shape())
    p.add_argument(
        "--tiny",
        action="store_true",
        help="a tiny model and batch (depth 2, width 32, 2 heads, batch 2, seq 16; every "
        "saved tensor offloaded) for a quick check; overrides the shape flags, "
        "--min-offload-bytes and --chunk-bytes",
    )
    add_args(p, Knobs())
    p.add_argument(
        "--save-dir",
        default=None,
        help="folder to create the run's scratch folder in (default ./.scratch); removed after",
    )
    p.add_argument(
        "--seq-lengths",
        type=_lengths,
        default=None,
        metavar="L1,L2,...",
        help="sequence length of each step in turn (overrides --seq for the batches)",
    )
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write JSON here")
    args = p.parse_args(argv)
    if args.tiny:
        args.depth, args.width, args.heads, args.batch, args.seq = 2, 32, 2, 2, 16
        args.min_offload_bytes, args.chunk_bytes = 0, 16384
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.prefetch_bytes is not None and not HAS_PREFETCH_BYTES:
        p.error("--prefetch-bytes: this prefetch_offload's OffloadConfig has no prefetch_bytes")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 0, 1 (a check failed) or 2 (a mode raised)."""
    words = list(sys.argv[1:] if argv is None else argv)
    args = _parse_args(words)
    torch.set_num_threads(TORCH_THREADS)
    warm_up_unary_ops()  # NOTE [first unary call]: modes are compared bit for bit
    shape, knobs = Shape.from_args(args), Knobs.from_args(args)
    knobs.config(".")  # bad knobs fail here, before any training
    steps = args.warmup + args.steps
    base, batches = build(shape, steps)
    seqs = [shape.seq] * steps
    if args.seq_lengths:
        seqs = [args.seq_lengths[r % len(args.seq_lengths)] for r in range(steps)]
        batches = [make_batch(shape.batch, seq, seed=r) for r, seq in enumerate(seqs)]
    results: list[ModeResult] = []
    with scratch_folder(args.save_dir, prefix="compiled-") as folder:
        fstype = filesystem_type(folder)
        if fstype in ("tmpfs", "ramfs"):
            log(f"warning: {folder} is on {fstype}: 'disk' writes to RAM there")
        for mode in args.modes:
            try:
                log(f"{mode}: without offload")
                ref = _train(mode, base, batches, None, folder)
                log(f"{mode}: disk")
                disk = _train(mode, base, batches, knobs, os.path.join(folder, mode))
            except Exception:
                log(f"error: mode {mode!r} failed:")
                traceback.print_exc()
                return 2
            mismatch = compare_params(ref.state, disk.state, f"{mode} without offload", mode)
            results.append(ModeResult(mode, args.warmup, ref, disk, mismatch))
    eager = next((r for r in results if r.mode == "eager"), None)
    for r in results:
        if eager is not None and r is not eager:
            r.vs_eager = _max_diff(eager.ref.state, r.ref.state)

    header = json_header("compiled.py", words, machine_info())
    print(header["machine_line"])
    print(f"shape: {shape}; {args.warmup} warm-up + {args.steps} steps; scratch on {fstype}")
    if args.seq_lengths:
        print(f"sequence length per step: {', '.join(map(str, seqs))}")
    print(f"knobs: {knobs} (prefetch_bytes knob {'present' if HAS_PREFETCH_BYTES else 'absent'})")
    legend = (
        "ref s / disk s: median step time without / with offload (same compile mode, run one "
        "after the other); hit rate: over the timed steps, then per step; MiB, skipped (writes "
        "skipped), stall s and pack wait s: per step; rev: fraction of unpacks in the last "
        "step that go backwards in pack order; graphs: dynamo graphs compiled (ref/disk)"
    )
    print(textwrap.fill(legend, width=90, subsequent_indent="  "))
    print()
    print(_table(results))
    print()
    for r in results:
        print(_mode_line(r))
    problems = _check(results)
    print()
    for msg in problems:
        print(f"FAIL: {msg}")
    if not problems:
        print("check: every mode's final parameters with offload are bit-identical to the same")
        print("  mode's without offload")
    if args.json is not None:
        doc = {
            **header,
            "shape": dataclasses.asdict(shape),
            "knobs": dataclasses.asdict(knobs),
            "has_prefetch_bytes": HAS_PREFETCH_BYTES,
            "args": json_args(args),
            "scratch_fs": fstype,
            "seq_lengths": seqs,
            "rows": [r.to_json() for r in results],
            "check": {"ok": not problems, "problems": problems},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

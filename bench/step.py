"""Train the small transformer under each offload mode and compare step time and memory.

Every mode trains its own copy of one model (same initial weights, same
batches) on its own thread, and the threads are driven in lockstep: round ``r``
runs one step of every mode, in an order rotated by ``r``, and only one step
runs at any moment, so machine drift hits all modes alike. Each thread enters
its mode's context once and keeps it open for the whole run, the way a user
wraps ``trainer.train()`` (saved-tensor hooks are thread-local, so the open
contexts do not see each other's steps).

Rounds come in three phases: ``--warmup`` rounds (not counted), ``--steps``
timed rounds (step times and engine counters), then ``--mem-rounds`` memory
rounds. A memory round returns freed heap pages to the OS (``malloc_trim``)
before each step and measures the resident memory that forward adds: glibc
otherwise reuses memory freed by the previous step without touching RSS, so an
RSS delta would read near 0. Trimming makes the next step fault its pages in
again, which would cost ``none`` more than the offloading modes, so timed
rounds never trim.

After the run the final parameters of every mode must be bit-identical to those
of ``none``; if they are not, the script says which and exits with status 1.

Example:
    .venv/bin/python bench/step.py --modes none,disk --json bench/results/step.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import os
import platform
import queue
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, NamedTuple

import torch

from prefetch_offload import OffloadConfig, offload_context
from prefetch_offload.testing import TinyTransformer, make_batch

if __package__:
    from ._common import (
        MB,
        RssSampler,
        SeedDiskHooks,
        StepResult,
        filesystem_type,
        heap_in_use_bytes,
        malloc_trim,
        read_rss_bytes,
    )
else:  # run as a script: bench/ is not a package
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import (  # type: ignore[no-redef]
        MB,
        RssSampler,
        SeedDiskHooks,
        StepResult,
        filesystem_type,
        heap_in_use_bytes,
        malloc_trim,
        read_rss_bytes,
    )

MODES: tuple[str, ...] = ("none", "disk", "seed", "save_on_cpu")
LABELS: dict[str, str] = {
    "none": "no offload",
    "disk": "prefetch_offload, disk",
    "seed": "seed: torch.save per tensor",
    "save_on_cpu": "torch save_on_cpu (CPU: no copy)",
}
TORCH_THREADS = 2
LEARNING_RATE = 1e-3
SAMPLE_INTERVAL_S = 0.002
# Engine counters that are levels, not running totals: reported as-is, not as deltas.
_GAUGES = frozenset(
    {
        "peak_pending_write_bytes",
        "disk_bytes_reserved",
        "peak_disk_bytes_reserved",
        "disk_bytes_in_use",
        "peak_disk_bytes_in_use",
    }
)
_CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(OffloadConfig)}


# -- arguments ---------------------------------------------------------------------------


def _parse_modes(text: str) -> list[str]:
    modes: list[str] = []
    for name in (m.strip() for m in text.split(",")):
        if not name:
            continue
        if name not in MODES:
            raise argparse.ArgumentTypeError(
                f"unknown mode {name!r}; choose from {', '.join(MODES)}"
            )
        if name not in modes:
            modes.append(name)
    if not modes:
        raise argparse.ArgumentTypeError("no modes given")
    return modes


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/step.py",
        description="Step time and activation memory of TinyTransformer training per offload mode.",
    )
    p.add_argument(
        "--modes", type=_parse_modes, default=list(MODES), help="comma list (default: all)"
    )
    p.add_argument("--steps", type=int, default=10, help="timed rounds (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="uncounted rounds first (default 2)")
    p.add_argument(
        "--mem-rounds",
        type=int,
        default=2,
        help="rounds after the timed ones that measure activation memory (default 2; 0: skip)",
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument(
        "--save-dir",
        default=None,
        help="folder to create the run's scratch folder in (default: ./.scratch); "
        "the scratch folder is removed at the end",
    )
    p.add_argument("--prefetch-depth", type=int, default=_CONFIG_DEFAULTS["prefetch_depth"])
    p.add_argument("--io-workers", type=int, default=_CONFIG_DEFAULTS["io_workers"])
    p.add_argument(
        "--max-pending-write-bytes",
        type=int,
        default=_CONFIG_DEFAULTS["max_pending_write_bytes"],
    )
    p.add_argument(
        "--min-offload-bytes",
        type=int,
        default=_CONFIG_DEFAULTS["min_offload_bytes"],
        help="smallest saved tensor sent to disk, for both disk and seed",
    )
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write JSON here")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.warmup < 0 or args.mem_rounds < 0:
        p.error("--warmup and --mem-rounds must be >= 0")
    return args


# -- one mode's thread -------------------------------------------------------------------


class _StepOut(NamedTuple):
    seconds: float
    loss: float
    forward_mem: int | None
    forward_heap: int | None


# What a worker's thread reports besides step results and exceptions.
_READY = "context entered"
_EXITED = "context exited"


class _ModeWorker:
    """One mode: a thread holding its context open, its model copy and its optimizer.

    ``step`` hands the thread one step and waits for it, so the caller decides
    which mode runs when. Counters (engine stats, seed file counts) are
    snapshotted at the first step of each phase and after the context exits.
    """

    def __init__(
        self,
        mode: str,
        model: torch.nn.Module,
        batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        context: AbstractContextManager[Any],
    ) -> None:
        self.mode = mode
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        self.batches = batches
        self.context = context
        self.handle: Any = None  # what the context's __enter__ returned
        self.snapshots: dict[str, dict[str, float]] = {}
        self._phase = ""
        self._cmd: queue.Queue[tuple[int, str] | None] = queue.Queue()
        self._out: queue.Queue[_StepOut | str | BaseException] = queue.Queue()
        self._alive = False
        self._thread = threading.Thread(target=self._main, name=f"bench-{mode}", daemon=True)

    def start(self) -> None:
        """Start the thread and wait until its context is open."""
        self._thread.start()
        self._alive = True
        got = self._out.get()
        if isinstance(got, BaseException):
            self._alive = False
            self._thread.join()
            raise got

    def step(self, round_index: int, phase: str) -> _StepOut:
        """Run one training step on the thread; re-raises the step's exception."""
        self._cmd.put((round_index, phase))
        got = self._out.get()
        if isinstance(got, BaseException):
            self._alive = False
            self._thread.join()
            raise got
        assert isinstance(got, _StepOut)
        return got

    def finish(self) -> None:
        """Exit the context on the thread and join it; re-raises an error from exit."""
        if not self._alive:
            return
        self._alive = False
        self._cmd.put(None)
        got = self._out.get()
        self._thread.join()
        if isinstance(got, BaseException):
            raise got

    def counters(self) -> dict[str, float]:
        """The mode's cumulative counters now (empty for modes without any)."""
        h = self.handle
        if isinstance(h, SeedDiskHooks):
            return {"files_written": h.files_written, "bytes_written": h.bytes_written}
        if h is not None and hasattr(h, "stats"):
            return dict(dataclasses.asdict(h.stats()))
        return {}

    def _main(self) -> None:
        try:
            with self.context as handle:
                self.handle = handle
                self._out.put(_READY)
                while (cmd := self._cmd.get()) is not None:
                    self._out.put(self._step(*cmd))
            self.snapshots["end"] = self.counters()
            self._out.put(_EXITED)
        except BaseException as exc:
            self._out.put(exc)

    def _step(self, round_index: int, phase: str) -> _StepOut:
        if phase != self._phase:
            self.snapshots[phase] = self.counters()
            self._phase = phase
        tokens, targets = self.batches[round_index]
        gc.collect()
        forward_mem: int | None = None
        forward_heap: int | None = None
        if phase == "memory":
            malloc_trim()
            t0 = time.perf_counter()
            with RssSampler(SAMPLE_INTERVAL_S) as sampler:
                rss_start, heap_start = read_rss_bytes(), heap_in_use_bytes()
                loss = self.model(tokens, targets)
                rss_end, heap_end = read_rss_bytes(), heap_in_use_bytes()
            forward_mem = max(rss_end, sampler.peak_bytes) - rss_start
            if heap_start is not None and heap_end is not None:
                forward_heap = heap_end - heap_start
        else:
            t0 = time.perf_counter()
            loss = self.model(tokens, targets)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        return _StepOut(
            seconds=seconds, loss=loss.item(), forward_mem=forward_mem, forward_heap=forward_heap
        )


# -- helpers -----------------------------------------------------------------------------


def _make_context(
    mode: str, run_dir: Path, args: argparse.Namespace
) -> AbstractContextManager[Any]:
    if mode == "none":
        return contextlib.nullcontext()
    if mode == "disk":
        return offload_context(
            "disk",
            save_dir=str(run_dir / "disk"),
            prefetch_depth=args.prefetch_depth,
            io_workers=args.io_workers,
            min_offload_bytes=args.min_offload_bytes,
            max_pending_write_bytes=args.max_pending_write_bytes,
        )
    if mode == "seed":
        return SeedDiskHooks(str(run_dir / "seed"), args.min_offload_bytes)
    if mode == "save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=False)
    raise ValueError(mode)


def _saved_activation_bytes(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> int:
    """Bytes of the distinct storages one forward saves for backward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*batch)
    del loss
    return sum(storages.values())


def _phase_of(round_index: int, args: argparse.Namespace) -> str:
    if round_index < args.warmup:
        return "warmup"
    if round_index < args.warmup + args.steps:
        return "timed"
    return "memory"


def _timed_delta(worker: _ModeWorker) -> dict[str, float]:
    """Counter changes over the timed phase (gauges: their level at its end)."""
    start = worker.snapshots.get("timed", {})
    end = worker.snapshots.get("memory") or worker.snapshots.get("end", {})
    return {k: (v if k in _GAUGES else v - start.get(k, 0)) for k, v in end.items()}


def _compare_params(
    ref: torch.nn.Module, other: torch.nn.Module, ref_name: str, name: str
) -> str | None:
    """A message naming the parameters that differ, or None if all are bit-identical."""
    ref_state, state = ref.state_dict(), other.state_dict()
    bad: list[str] = []
    for key, want in ref_state.items():
        got = state[key]
        if not torch.equal(want, got):
            diff = (got.double() - want.double()).abs().max().item()
            bad.append(f"{key} (max abs diff {diff:.3g})")
    if not bad:
        return None
    shown = ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else "")
    return (
        f"mode {name!r}: final parameters differ from {ref_name!r} in {len(bad)} of "
        f"{len(ref_state)} tensors: {shown}"
    )


def _first_loss_divergence(ref: list[float], other: list[float]) -> int | None:
    for i, (a, b) in enumerate(zip(ref, other, strict=True)):
        if a != b:
            return i
    return None


def _fmt(value: float | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "n/a" if value is None else format(value * scale, spec) + suffix


def _table(rows: Sequence[StepResult]) -> str:
    """The results as aligned text columns."""
    header = (
        "mode",
        "what",
        "step s",
        "vs none",
        "act MB",
        "act cut",
        "heap MB",
        "offl MB/step",
        "hit rate",
        "stall s/step",
    )
    lines: list[tuple[str, ...]] = [header]
    for r in rows:
        lines.append(
            (
                r.mode,
                r.label,
                _fmt(r.median_step_s, ".3f"),
                _fmt(r.ratio, ".2f", suffix="x"),
                _fmt(r.forward_mem, ".1f", 1 / MB),
                _fmt(r.mem_cut, ".0f", 100, "%"),
                _fmt(r.forward_heap, ".1f", 1 / MB),
                _fmt(r.offloaded_per_step, ".1f", 1 / MB),
                _fmt(r.hit_rate, ".1f", 100, "%"),
                _fmt(r.stall_per_step, ".4f"),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for n, line in enumerate(lines):
        cells = [
            cell.ljust(w) if i < 2 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- main --------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 0, 1 (results differ between modes) or 2 (a mode failed)."""
    args = _parse_args(argv)
    modes: list[str] = args.modes
    torch.set_num_threads(TORCH_THREADS)

    base = Path(args.save_dir) if args.save_dir is not None else Path.cwd() / ".scratch"
    base.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-step-", dir=base))
    fstype = filesystem_type(str(run_dir))
    if fstype in ("tmpfs", "ramfs"):
        _log(
            f"warning: {run_dir} is on {fstype}: 'disk' and 'seed' write to RAM there; "
            "pass --save-dir on a real disk"
        )
    try:
        return _run(args, modes, run_dir, fstype)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _run(args: argparse.Namespace, modes: list[str], run_dir: Path, fstype: str) -> int:
    rounds = args.warmup + args.steps + args.mem_rounds
    batches = [make_batch(args.batch, args.seq, seed=r) for r in range(rounds)]
    torch.manual_seed(0)
    model = TinyTransformer(width=args.width, depth=args.depth, heads=args.heads)
    copies = {mode: copy.deepcopy(model) for mode in modes}
    saved_bytes = _saved_activation_bytes(model, batches[0])
    del model

    workers = {
        m: _ModeWorker(m, copies[m], batches, _make_context(m, run_dir, args)) for m in modes
    }
    times: dict[str, list[float]] = {m: [] for m in modes}
    mems: dict[str, list[int]] = {m: [] for m in modes}
    heaps: dict[str, list[int]] = {m: [] for m in modes}
    losses: dict[str, list[float]] = {m: [] for m in modes}
    failed: list[str] = []  # "mode 'x' in round n"
    try:
        for mode in modes:
            workers[mode].start()
        for r in range(rounds):
            phase = _phase_of(r, args)
            k = r % len(modes)
            order = modes[k:] + modes[:k]
            for mode in order:
                try:
                    out = workers[mode].step(r, phase)
                except Exception:
                    failed.append(f"mode {mode!r} in round {r + 1} ({phase})")
                    raise
                losses[mode].append(out.loss)
                if phase == "timed":
                    times[mode].append(out.seconds)
                if out.forward_mem is not None:
                    mems[mode].append(out.forward_mem)
                if out.forward_heap is not None:
                    heaps[mode].append(out.forward_heap)
            done = "  ".join(
                f"{m} {(times[m] or [0.0])[-1]:.3f}s" for m in order if phase == "timed"
            )
            _log(f"round {r + 1}/{rounds} ({phase}) {done}".rstrip())
    except Exception:
        _log(f"error: {failed[-1] if failed else 'starting a mode'} failed:")
        traceback.print_exc()
        for w in workers.values():
            with contextlib.suppress(Exception):
                w.finish()
        return 2
    for mode in modes:
        try:
            workers[mode].finish()
        except Exception:
            _log(f"error: mode {mode!r} failed when its context exited:")
            traceback.print_exc()
            return 2

    rows = _results(modes, workers, times, mems, heaps)
    disk_handle = workers["disk"].handle if "disk" in workers else None
    io_method = getattr(disk_handle, "io_method", None)
    cores = os.cpu_count()
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    print(
        f"bench/step.py on {platform.node()}: {cores} cores ({affinity} usable), "
        f"torch {torch.__version__} ({TORCH_THREADS} threads), python {platform.python_version()}"
    )
    print(
        f"shape: depth {args.depth}, width {args.width}, heads {args.heads}, batch {args.batch}, "
        f"seq {args.seq}; saved activations {saved_bytes / MB:.1f} MB/step "
        "(distinct storages, parameters excluded)"
    )
    print(
        f"rounds: {args.warmup} warmup, {args.steps} timed, {args.mem_rounds} memory; "
        f"scratch on {fstype}"
        + (f", disk io_method {io_method}" if io_method else "")
        + f"; knobs: prefetch_depth {args.prefetch_depth}, io_workers {args.io_workers}, "
        f"max_pending_write_bytes {args.max_pending_write_bytes}, "
        f"min_offload_bytes {args.min_offload_bytes}"
    )
    print("step s: median of forward + backward + SGD step over the timed rounds")
    print("act MB: peak RSS added by forward (median of memory rounds); act cut: vs none")
    print("heap MB: live malloc bytes added by forward, at its end (RSS also counts freed")
    print("  memory that glibc keeps mapped for reuse, so it overstates what offload holds)")
    print()
    print(_table(rows))

    problems = _check(modes, workers, losses)
    print()
    if problems:
        for msg in problems:
            print(f"FAIL: {msg}")
    else:
        ref = "none" if "none" in modes else modes[0]
        print(f"check: final parameters of every mode are bit-identical to {ref!r}")

    if args.json is not None:
        doc = {
            "machine": {
                "host": platform.node(),
                "cores": cores,
                "usable_cores": affinity,
                "torch": torch.__version__,
                "torch_threads": TORCH_THREADS,
                "python": platform.python_version(),
            },
            "shape": {k: getattr(args, k) for k in ("depth", "width", "heads", "batch", "seq")},
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "saved_activation_bytes": saved_bytes,
            "scratch_fs": fstype,
            "disk_io_method": io_method,
            "rows": [row.to_json() for row in rows],
            "timed_counter_deltas": {m: _timed_delta(workers[m]) for m in modes},
            "losses": losses,
            "check": {"ok": not problems, "problems": problems},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 1 if problems else 0


def _results(
    modes: list[str],
    workers: dict[str, _ModeWorker],
    times: dict[str, list[float]],
    mems: dict[str, list[int]],
    heaps: dict[str, list[int]],
) -> list[StepResult]:
    rows: list[StepResult] = []
    for mode in modes:
        delta = _timed_delta(workers[mode]) if mode == "disk" else {}
        rows.append(
            StepResult(
                mode=mode,
                label=LABELS[mode],
                step_seconds=tuple(times[mode]),
                forward_mem_bytes=tuple(mems[mode]),
                forward_heap_bytes=tuple(heaps[mode]),
                bytes_offloaded=_int_or_none(delta.get("bytes_offloaded")),
                prefetch_hits=_int_or_none(delta.get("prefetch_hits")),
                prefetch_misses=_int_or_none(delta.get("prefetch_misses")),
                stall_seconds=delta.get("stall_seconds"),
            )
        )
    if "none" in modes:
        ref = rows[modes.index("none")]
        rows = [
            dataclasses.replace(
                r, baseline_step_s=ref.median_step_s, baseline_mem_bytes=ref.forward_mem
            )
            for r in rows
        ]
    return rows


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


def _check(
    modes: list[str], workers: dict[str, _ModeWorker], losses: dict[str, list[float]]
) -> list[str]:
    """Messages for every mode whose final parameters differ from the reference mode's."""
    ref = "none" if "none" in modes else modes[0]
    problems: list[str] = []
    for mode in modes:
        if mode == ref:
            continue
        msg = _compare_params(workers[ref].model, workers[mode].model, ref, mode)
        if msg is not None:
            first = _first_loss_divergence(losses[ref], losses[mode])
            if first is not None:
                msg += f"; losses first differ at round {first + 1}"
            problems.append(msg)
    return problems


if __name__ == "__main__":
    sys.exit(main())

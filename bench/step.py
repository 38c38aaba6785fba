"""Train the small transformer under each offload mode and compare step time and memory.

Every mode trains its own copy of one model (same initial weights, same
batches), all on the calling thread: round ``r`` runs one step of every mode,
in the order ``round_order`` gives round ``r`` (a balanced Latin square), so
machine drift hits all modes alike. Each mode
sets up what lives for the whole run once (the engine and its IO threads, the
seed's folder, ioreplay's file and thread) and installs its saved-tensor hooks
around each of its own steps: exactly what ``offload_context`` does for a user
who wraps ``trainer.train()`` (one engine, its hooks on the training thread),
but with one training thread for every mode. (A thread per mode would give each
its own OpenMP team, whose workers spin while another mode's step runs: the same
computation then measures up to 10% apart between ``none`` and ``save_on_cpu``,
which on the CPU are one thing.)
``--warmup`` rounds come first (not counted), then ``--steps`` timed rounds
(step times and engine counters). Sharing one process has one cost: heap memory
that a mode gives back to the kernel (an engine that trims glibc's heap) is
faulted in again by whichever mode allocates it next, so such a mode's page
faults spread over every mode's step time; compare trimming against not
trimming in separate processes.

``budget`` is ``disk`` with ``device_budget`` set to ``--budget-fraction``
(default 0.5) of the step's saved activation bytes, measured before the run:
the newest saved tensors up to the budget stay in memory, the rest go to disk.
Its bytes moved per step are reported against ``saved - budget``.

Memory is measured in separate processes, one per mode (this script with the
hidden ``--memory-probe MODE`` flag), where nothing else shares the heap. A
probe builds the same model and batches, sets up the mode, reads its RSS, and
runs ``PROBE_STEPS`` whole training steps (forward, backward, optimizer step)
from there; no warm-up comes first, because memory that the allocator keeps
after a first step is memory the user's process holds. ``peak MiB`` is the
largest RSS over those steps minus the RSS before the first one: what training
added to the process at its worst moment. The peak is the kernel's own
high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` before the
first step and at each phase boundary, all against the same starting RSS), so
no peak is too short to catch; a 1 ms RSS sampler runs beside it (the measure
where the reset is not allowed) and its samples over the last step are kept in
the JSON (``timelines``); ``--plot`` draws them for none, disk and budget. ``fwd``/``bwd`` split
the peak into forward and backward (with the optimizer step).

The primary probes run with glibc's default allocator, which is what users run:
freed tensors go back to malloc's free lists and stay resident until reused or
trimmed, so the peak counts memory that glibc keeps as well as memory that is
live. A second set of probes runs with ``MALLOC_MMAP_THRESHOLD_=65536`` (every
allocation of 64 KiB or more gets its own mapping and leaves RSS when freed:
RSS then tracks live memory); its columns are labelled ``tuned``, and stand
beside the default figures, never instead of them.

Activation memory (``act MiB``) is a mode's peak minus what ``none`` holds
beside its activations (``none``'s peak minus the saved bytes), and ``act cut``
is the share of the saved bytes that a mode took out of the peak. The targets
are judged on these, default allocator: ``disk`` (``device_budget=0``) must cut
at least 80%; ``budget`` must peak at most at its budget plus what ``none``
holds beside its activations plus 10% of the saved bytes, and write within 10%
of ``saved - budget`` per step. ``heap MiB`` (default-allocator probe) is
malloc's bytes in use at the end of forward over those before the first step:
what is live, without what glibc keeps. ``cache MiB`` is the growth of the
machine's page cache over a step: the seed's ``torch.save`` files are buffered
writes, so its RSS cut does not mean the bytes left RAM; the engine's O_DIRECT
writes add none. Sizes are MiB (2^20 bytes) throughout.

After the run the final parameters of every mode must be bit-identical to those
of ``none``; if they are not, the script says which and exits with status 1.

``--pending-sweep`` probes the ``disk`` mode's memory at other values of
``max_pending_write_bytes`` (the engine's cap on bytes queued for writing,
which trades memory for speed: pack waits at the cap). ``bench/sweep.py``
measures the speed side.

Tables and the plot for the docs (``bench/report.py`` turns the JSON into markdown):
    .venv/bin/python bench/step.py --json docs/results/step.json --plot docs/memory.png
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import dataclasses
import gc
import json
import os
import platform
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from prefetch_offload import OffloadConfig, OffloadEngine
from prefetch_offload.testing import TinyTransformer, make_batch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ is not a package
from _common import (
    MB,
    IOReplay,
    RssSampler,
    SeedDiskHooks,
    StepResult,
    filesystem_type,
    heap_in_use_bytes,
    page_cache_bytes,
    peak_rss_bytes,
    read_rss_bytes,
    reset_peak_rss,
    round_order,
    steal_seconds,
)

__all__ = [
    "LABELS",
    "MODES",
    "Knobs",
    "ModeFailed",
    "ModeSetup",
    "ModeWorker",
    "ProbeError",
    "RoundLog",
    "Shape",
    "StepOut",
    "add_shape_args",
    "budget_knobs",
    "build",
    "compare_params",
    "counter_delta",
    "fmt",
    "format_table",
    "headline",
    "machine_info",
    "machine_line",
    "main",
    "make_mode",
    "parse_mib_list",
    "plot_memory",
    "probe_many",
    "probe_memory",
    "run_rounds",
    "timed_delta",
]

MODES: tuple[str, ...] = (
    "none",
    "disk",
    "budget",
    "ioreplay",
    "iospread",
    "seed",
    "save_on_cpu",
)
LABELS: dict[str, str] = {
    "none": "no offload",
    "disk": "prefetch_offload, disk",
    "budget": "disk, device_budget a share of saved",
    "ioreplay": "no hooks; disk's bytes by a bare thread",
    "iospread": "ioreplay, paced over forward and backward",
    "seed": "seed: torch.save per tensor",
    "save_on_cpu": "torch save_on_cpu (CPU: no copy)",
}
# Modes that train as none does while a side thread moves disk's bytes (IOReplay).
REPLAY_MODES = frozenset({"ioreplay", "iospread"})
# Modes that run the engine (target disk); "budget" with device_budget > 0.
ENGINE_MODES = frozenset({"disk", "budget"})
TORCH_THREADS = 2
LEARNING_RATE = 1e-3
# The memory probe's RSS sampler: its samples over one step are the JSON's timeline.
SAMPLE_INTERVAL_S = 0.001
# The tuned allocator's setting: every malloc of >= 64 KiB gets its own mapping.
MMAP_THRESHOLD = 65536
# Probe allocators: glibc's defaults (the primary figure) and the tuned one.
ALLOCATORS: tuple[str, ...] = ("default", "tuned")
# Whole training steps per memory probe, all measured (RSS before the first is the base).
PROBE_STEPS = 3
# The budget mode's device_budget as a share of the saved bytes, by default.
BUDGET_FRACTION = 0.5
STEP_SCRIPT = os.path.abspath(__file__)
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
_MiB = 1 << 20


# -- what is measured: shape and knobs ---------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """The TinyTransformer and batch size trained."""

    depth: int = 6
    width: int = 256
    heads: int = 4
    batch: int = 8
    seq: int = 256

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Shape:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def argv(self) -> list[str]:
        """The command-line flags that select this shape."""
        return [
            x for f in dataclasses.fields(self) for x in (f"--{f.name}", str(getattr(self, f.name)))
        ]

    def __str__(self) -> str:
        return ", ".join(f"{f.name} {getattr(self, f.name)}" for f in dataclasses.fields(self))


@dataclass(frozen=True)
class Knobs:
    """The offload settings under test (``min_offload_bytes`` applies to ``seed`` too)."""

    prefetch_depth: int = _CONFIG_DEFAULTS["prefetch_depth"]
    io_workers: int = _CONFIG_DEFAULTS["io_workers"]
    max_pending_write_bytes: int = _CONFIG_DEFAULTS["max_pending_write_bytes"]
    min_offload_bytes: int = _CONFIG_DEFAULTS["min_offload_bytes"]
    chunk_bytes: int = _CONFIG_DEFAULTS["chunk_bytes"]
    # Bytes of saved activations that may stay in memory (engine modes; "budget" mode
    # sets its own from --budget-fraction).
    device_budget: int = _CONFIG_DEFAULTS["device_budget"]
    # Bytes of progress between heap trims (NOTE [heap trim]); 0: never trim.
    heap_trim_bytes: int = _CONFIG_DEFAULTS["heap_trim_bytes"] or 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Knobs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def argv(self) -> list[str]:
        """The command-line flags that select these knobs."""
        return [
            x
            for f in dataclasses.fields(self)
            for x in ("--" + f.name.replace("_", "-"), str(getattr(self, f.name)))
        ]

    @property
    def is_default(self) -> bool:
        """Whether every knob has OffloadConfig's default value."""
        return self == Knobs()

    def __str__(self) -> str:
        return ", ".join(f"{f.name} {getattr(self, f.name)}" for f in dataclasses.fields(self))


def build(
    shape: Shape, rounds: int
) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The model (seeded, so every process builds the same weights) and one batch per round."""
    batches = [make_batch(shape.batch, shape.seq, seed=r) for r in range(rounds)]
    torch.manual_seed(0)
    model = TinyTransformer(width=shape.width, depth=shape.depth, heads=shape.heads)
    return model, batches


def _no_hooks(handle: Any) -> AbstractContextManager[Any]:
    return contextlib.nullcontext(handle)


def _engine_hooks(engine: OffloadEngine) -> AbstractContextManager[Any]:
    return torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack)


def _own_hooks(hooks: SeedDiskHooks) -> AbstractContextManager[Any]:
    return hooks


def _save_on_cpu(handle: Any) -> AbstractContextManager[Any]:
    return torch.autograd.graph.save_on_cpu(pin_memory=False)


@dataclass(frozen=True)
class ModeSetup:
    """How a mode runs: ``run`` is entered once for the whole run and gives a handle
    (the engine, the seed hooks, the replay, or None); ``step_hooks(handle)`` is
    entered around each of the mode's steps, on the training thread."""

    run: AbstractContextManager[Any]
    step_hooks: Callable[[Any], AbstractContextManager[Any]] = _no_hooks


@contextlib.contextmanager
def _engine_run(config: OffloadConfig) -> Iterator[OffloadEngine]:
    """One engine for the run, closed at its end (``offload_context`` minus the hooks):
    a stored worker error is raised, unless another error is already propagating."""
    engine = OffloadEngine(config)
    try:
        yield engine
    except BaseException:
        engine.close(raise_errors=False)
        raise
    engine.close()


def make_mode(mode: str, save_dir: Path, knobs: Knobs, *, replay_bytes: int = 0) -> ModeSetup:
    """What turns ``mode`` on; ``disk``, ``budget``, ``ioreplay`` and ``seed`` write under
    ``save_dir``. ``replay_bytes``: what ``ioreplay`` writes and reads per step. The
    engine modes take ``knobs.device_budget`` as it is (``budget``'s is set by the
    caller: see :func:`budget_knobs`)."""
    if mode == "none":
        return ModeSetup(contextlib.nullcontext())
    if mode in REPLAY_MODES:
        replay = IOReplay(
            str(save_dir / mode), replay_bytes, chunk=knobs.chunk_bytes, spread=mode == "iospread"
        )
        return ModeSetup(replay)
    if mode in ENGINE_MODES:
        config = OffloadConfig(
            target="disk",
            save_dir=str(save_dir / mode),
            prefetch_depth=knobs.prefetch_depth,
            io_workers=knobs.io_workers,
            min_offload_bytes=knobs.min_offload_bytes,
            max_pending_write_bytes=knobs.max_pending_write_bytes,
            chunk_bytes=knobs.chunk_bytes,
            device_budget=knobs.device_budget,
            heap_trim_bytes=knobs.heap_trim_bytes or None,
        )
        return ModeSetup(_engine_run(config), _engine_hooks)
    if mode == "seed":
        hooks = SeedDiskHooks(str(save_dir / "seed"), knobs.min_offload_bytes)
        return ModeSetup(contextlib.nullcontext(hooks), _own_hooks)
    if mode == "save_on_cpu":
        return ModeSetup(contextlib.nullcontext(), _save_on_cpu)
    raise ValueError(mode)


def budget_knobs(knobs: Knobs, saved_bytes: int, fraction: float) -> Knobs:
    """``knobs`` for the ``budget`` mode: device_budget = ``fraction`` of ``saved_bytes``."""
    return dataclasses.replace(knobs, device_budget=round(saved_bytes * fraction))


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


def parse_mib_list(text: str) -> list[int]:
    """``"16,64,256"`` -> byte counts; empty text -> []."""
    out: list[int] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        try:
            value = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of MiB: {item!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"MiB values must be > 0, got {item!r}")
        out.append(int(value * _MiB))
    return out


def add_shape_args(p: argparse.ArgumentParser, shape: Shape) -> None:
    """``--depth``, ``--width``, ... with ``shape``'s values as defaults."""
    for f in dataclasses.fields(shape):
        p.add_argument(f"--{f.name}", type=int, default=getattr(shape, f.name))


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
        "--budget-fraction",
        type=_fraction,
        default=BUDGET_FRACTION,
        metavar="F",
        help="the budget mode's device_budget as a share of the step's saved activation "
        f"bytes (default {BUDGET_FRACTION})",
    )
    # Removed: the probe measures whole steps with the default allocator now. Accepted so
    # that older command lines still run.
    p.add_argument("--mem-rounds", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument(
        "--no-mem-probe",
        dest="mem_probe",
        action="store_false",
        help="skip the per-mode memory probe processes (peak, act MiB, act cut, ...)",
    )
    p.add_argument(
        "--probe-repeats",
        type=int,
        default=1,
        metavar="N",
        help="memory probes per mode and allocator; tables show the median (default 1)",
    )
    p.add_argument(
        "--pending-sweep",
        type=parse_mib_list,
        default=parse_mib_list("16,64,256"),
        metavar="MIB,...",
        help="also probe disk's activation memory at these max_pending_write_bytes values, "
        "in MiB (default 16,64,256; empty: skip)",
    )
    p.add_argument(
        "--probe-jobs",
        type=int,
        default=1,
        metavar="N",
        help="memory probes run at once (default 1; more is faster, but they compete "
        "for cores, which can change disk's number)",
    )
    add_shape_args(p, Shape())
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
    p.add_argument(
        "--chunk-bytes",
        type=int,
        default=_CONFIG_DEFAULTS["chunk_bytes"],
        help="write batch and read request size",
    )
    p.add_argument(
        "--device-budget",
        type=int,
        default=_CONFIG_DEFAULTS["device_budget"],
        help="disk mode's device_budget in bytes (default 0: offload everything)",
    )
    p.add_argument(
        "--heap-trim-bytes",
        type=int,
        default=_CONFIG_DEFAULTS["heap_trim_bytes"] or 0,
        help="the engine modes' heap_trim_bytes (0: never give glibc's free heap pages back)",
    )
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write JSON here")
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="PATH",
        help="draw memory over one training step of none, disk and budget (the probes' RSS "
        "timelines) into this PNG; needs matplotlib (the bench extra)",
    )
    # Internal: run one mode's memory probe in this process and print its JSON.
    p.add_argument("--memory-probe", choices=MODES, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.probe_jobs < 1 or args.probe_repeats < 1:
        p.error("--probe-jobs and --probe-repeats must be >= 1")
    if args.device_budget < 0 or args.heap_trim_bytes < 0:
        p.error("--device-budget and --heap-trim-bytes must be >= 0")
    if args.mem_rounds:
        _log("note: --mem-rounds is ignored; the memory probes measure whole steps")
    return args


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"the budget fraction must be > 0, got {text!r}")
    return value


# -- one mode's thread -------------------------------------------------------------------


class StepOut(NamedTuple):
    """What one training step reports."""

    seconds: float
    loss: float
    # Hypervisor steal during the step, all CPUs (None where /proc/stat lacks it).
    steal: float | None = None
    # Minor page faults of the whole process during the step.
    faults: int = 0


class ModeWorker:
    """One mode: its model copy, its optimizer, its run-long setup and its step hooks.

    ``start`` enters the mode's run context, ``step`` runs one training step on
    the calling thread inside the mode's step hooks, ``finish`` leaves the run
    context (re-raising an error from it). Counters (engine stats, seed file
    counts) are snapshotted at the first step of each phase and after the run
    context exits. Steps are timed; memory is the probes' (:func:`probe_memory`).
    """

    def __init__(
        self,
        mode: str,
        model: torch.nn.Module,
        batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        setup: ModeSetup,
    ) -> None:
        self.mode = mode
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        self.batches = batches
        self.setup = setup
        self.handle: Any = None  # what the run context's __enter__ returned
        self.snapshots: dict[str, dict[str, float]] = {}
        self._phase = ""
        self._alive = False

    def start(self) -> None:
        """Enter the mode's run context."""
        self.handle = self.setup.run.__enter__()
        self._alive = True

    def step(self, round_index: int, phase: str) -> StepOut:
        """Run one training step; an exception leaves the run context and propagates."""
        try:
            return self._step(round_index, phase)
        except BaseException as exc:
            self._leave(exc)
            raise

    def finish(self) -> None:
        """Leave the run context; re-raises an error from its exit."""
        self._leave(None)

    def _leave(self, exc: BaseException | None) -> None:
        if not self._alive:
            return
        self._alive = False
        run = self.setup.run
        if exc is None:
            run.__exit__(None, None, None)
        else:
            with contextlib.suppress(Exception):
                run.__exit__(type(exc), exc, exc.__traceback__)
        self.snapshots["end"] = self.counters()

    def counters(self) -> dict[str, float]:
        """The mode's cumulative counters now (empty for modes without any)."""
        return _counters(self.handle)

    def _step(self, round_index: int, phase: str) -> StepOut:
        if phase != self._phase:
            self.snapshots[phase] = self.counters()
            self._phase = phase
        tokens, targets = self.batches[round_index]
        gc.collect()
        io = self.handle if isinstance(self.handle, IOReplay) else None
        steal0 = steal_seconds()
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with self.setup.step_hooks(self.handle):
            t0 = time.perf_counter()
            if io is not None:
                io.forward_started()
            loss = self.model(tokens, targets)
            if io is not None:
                io.backward_started()
            loss.backward()
            if io is not None:
                io.wait()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
        steal1 = steal_seconds()
        steal = None if steal0 is None or steal1 is None else steal1 - steal0
        return StepOut(seconds=seconds, loss=loss.item(), steal=steal, faults=faults)


def _counters(handle: Any) -> dict[str, float]:
    if isinstance(handle, IOReplay):  # what the bare thread really moved
        return {"bytes_offloaded": handle.bytes_written, "bytes_read": handle.bytes_read}
    if isinstance(handle, SeedDiskHooks):
        return {"files_written": handle.files_written, "bytes_written": handle.bytes_written}
    if handle is not None and hasattr(handle, "stats"):
        return dict(dataclasses.asdict(handle.stats()))
    return {}


class ModeFailed(Exception):
    """A mode raised; the original exception is the ``__cause__``. ``where`` says when."""

    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where


@dataclass
class RoundLog:
    """Per-mode results of :func:`run_rounds`, in round order."""

    times: dict[str, list[float]]  # timed rounds only
    steal: dict[str, list[float]]  # timed rounds only, where the kernel reports steal
    losses: dict[str, list[float]]  # every round
    faults: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # timed rounds


def run_rounds(
    workers: dict[str, ModeWorker],
    phases: Sequence[str],
    log: Callable[[str], None] | None = None,
) -> RoundLog:
    """Start the workers, run round ``r`` in phase ``phases[r]`` for every mode, finish them.

    Modes run one at a time, in the order :func:`round_order` gives round ``r``
    (a balanced Latin square over the modes). On any error every worker is
    finished and :class:`ModeFailed` is raised from the original exception.
    """
    modes = list(workers)
    out = RoundLog(
        times={m: [] for m in modes},
        steal={m: [] for m in modes},
        losses={m: [] for m in modes},
        faults={m: [] for m in modes},
    )
    where = "starting a mode"
    try:
        for mode in modes:
            where = f"mode {mode!r} entering its context"
            workers[mode].start()
        for r, phase in enumerate(phases):
            order = round_order(modes, r)
            for mode in order:
                where = f"mode {mode!r} in round {r + 1} ({phase})"
                step = workers[mode].step(r, phase)
                out.losses[mode].append(step.loss)
                if phase == "timed":
                    out.times[mode].append(step.seconds)
                    out.faults[mode].append(step.faults)
                    if step.steal is not None:
                        out.steal[mode].append(step.steal)
            if log is not None:
                done = "  ".join(f"{m} {out.times[m][-1]:.3f}s" for m in order if phase == "timed")
                log(f"round {r + 1}/{len(phases)} ({phase}) {done}".rstrip())
    except Exception as exc:
        for w in workers.values():
            with contextlib.suppress(Exception):
                w.finish()
        raise ModeFailed(where) from exc
    first: ModeFailed | None = None
    for mode in modes:
        try:
            workers[mode].finish()
        except Exception as exc:
            if first is None:
                first = ModeFailed(f"mode {mode!r} when its context exited")
                first.__cause__ = exc
    if first is not None:
        raise first
    return out


def counter_delta(start: dict[str, float], end: dict[str, float]) -> dict[str, float]:
    """Running totals: their change from ``start`` to ``end``; gauges: their level at end."""
    return {k: (v if k in _GAUGES else v - start.get(k, 0)) for k, v in end.items()}


def timed_delta(worker: ModeWorker) -> dict[str, float]:
    """Counter changes over the timed phase (gauges: their level at its end)."""
    start = worker.snapshots.get("timed", {})
    return counter_delta(start, worker.snapshots.get("end", {}))


def compare_params(
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


# -- the memory probe --------------------------------------------------------------------


class ProbeError(RuntimeError):
    """A memory probe process failed; the message holds the end of its stderr."""


def probe_memory(
    mode: str,
    shape: Shape,
    knobs: Knobs,
    save_dir: Path,
    *,
    timeout_s: float = 900.0,
    allocator: str = "tuned",
) -> dict[str, Any]:
    """Run ``mode``'s memory probe in a fresh process; its JSON.

    ``allocator`` is ``"default"`` (glibc's defaults: ``MALLOC_MMAP_THRESHOLD_`` is
    removed from the probe's environment; the figure this script reports first) or
    ``"tuned"`` (``MALLOC_MMAP_THRESHOLD_=65536``; this function's default, which
    bench/sweep.py relies on). glibc
    reads the variable at startup, hence the subprocess. ``save_dir`` must exist;
    the probe makes and removes its own folder in it.
    """
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {ALLOCATORS}, got {allocator!r}")
    cmd = [
        sys.executable,
        STEP_SCRIPT,
        "--memory-probe",
        mode,
        *shape.argv(),
        *knobs.argv(),
        "--save-dir",
        str(save_dir),
    ]
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if allocator == "tuned":
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=timeout_s, check=False
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise ProbeError(
            f"memory probe for mode {mode!r} ({allocator} allocator) exited with status "
            f"{proc.returncode}:\n$ {' '.join(cmd)}\n{proc.stderr.strip()[-8000:]}"
        )
    result: dict[str, Any] = json.loads(lines[-1])
    result["allocator"] = allocator
    return result


def _sgd_step(params: Sequence[torch.nn.Parameter]) -> None:
    """Plain SGD, then drop the gradients: what ``torch.optim.SGD`` + ``zero_grad`` do.

    The probe avoids ``torch.optim`` only because constructing an optimizer
    imports ``torch._dynamo``, which costs the short-lived probe process ~1.5 s.
    """
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-LEARNING_RATE)
                p.grad = None


def probe_many(
    requests: Sequence[tuple[str, Knobs]],
    shape: Shape,
    save_dir: Path,
    *,
    jobs: int = 1,
    allocator: str = "tuned",
) -> list[dict[str, Any]]:
    """:func:`probe_memory` for each ``(mode, knobs)``, ``jobs`` processes at a time.

    Each probe measures its own process's RSS, so running several at once does
    not mix their numbers, but they compete for cores, which can let disk's
    write queue (and so its memory) grow: keep ``jobs`` at 1 for numbers to report.
    """

    def one(request: tuple[str, Knobs]) -> dict[str, Any]:
        mode, knobs = request
        extra = ""
        if mode in ENGINE_MODES:
            extra = f", max_pending_write_bytes {knobs.max_pending_write_bytes}"
            extra += f", device_budget {knobs.device_budget}"
        _progress(f"memory probe ({allocator} allocator): {mode}{extra}")
        return probe_memory(mode, shape, knobs, save_dir, allocator=allocator)

    if jobs <= 1:
        return [one(r) for r in requests]
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, requests))


class _Peaks:
    """The probe's peak RSS per phase, all above one base: the RSS before the first step.

    :meth:`phase` resets the kernel's high-water mark (where allowed) and, at the
    phase's end, returns the larger of it and the sampler's peak in the phase.
    """

    def __init__(self, sampler: RssSampler, base: int) -> None:
        self.sampler = sampler
        self.base = base
        self.exact = reset_peak_rss()

    def reset(self) -> float:
        self.exact = reset_peak_rss() and self.exact
        return time.perf_counter()

    def since(self, start: float) -> tuple[int, int]:
        """(peak, sampled peak) since ``start`` (a :meth:`reset`), above the base."""
        now = read_rss_bytes()
        sampled = max(self.sampler.peak_between(start, time.perf_counter()) or 0, now)
        hwm = peak_rss_bytes() if self.exact else None
        return max(sampled, hwm or 0) - self.base, sampled - self.base


def _memory_probe(args: argparse.Namespace) -> int:
    """The probe process: print one JSON line with the memory of one mode's whole steps."""
    mode: str = args.memory_probe
    torch.set_num_threads(TORCH_THREADS)
    base_dir = Path(args.save_dir) if args.save_dir is not None else Path.cwd() / ".scratch"
    base_dir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-probe-{mode}-", dir=base_dir))
    fwd: list[int] = []
    bwd: list[int] = []
    sampled: list[int] = []
    heap: list[int] = []
    cache: list[int] = []
    marks: list[tuple[float, float, float]] = []
    try:
        model, batches = build(Shape.from_args(args), PROBE_STEPS)
        params = list(model.parameters())
        setup = make_mode(mode, run_dir, Knobs.from_args(args))
        with setup.run as handle:
            start_counters = _counters(handle)
            gc.collect()
            with RssSampler(SAMPLE_INTERVAL_S, record=True) as sampler:
                base, heap0 = read_rss_bytes(), heap_in_use_bytes()
                peaks = _Peaks(sampler, base)
                for tokens, targets in batches:
                    gc.collect()
                    c0 = page_cache_bytes()
                    t0 = peaks.reset()
                    with setup.step_hooks(handle):
                        loss = model(tokens, targets)
                        heap1 = heap_in_use_bytes()
                        f_peak, f_sampled = peaks.since(t0)
                        tb = peaks.reset()
                        loss.backward()
                    _sgd_step(params)
                    del loss
                    b_peak, b_sampled = peaks.since(tb)
                    t1 = time.perf_counter()
                    c1 = page_cache_bytes()
                    fwd.append(f_peak)
                    bwd.append(b_peak)
                    sampled.append(max(f_sampled, b_sampled))
                    marks.append((t0, tb, t1))
                    if heap0 is not None and heap1 is not None:
                        heap.append(heap1 - heap0)
                    if c0 is not None and c1 is not None:
                        cache.append(c1 - c0)
            stats = counter_delta(start_counters, _counters(handle))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    t0, tb, t1 = marks[-1]
    trace = [(t - t0, rss - base) for t, rss in sampler.trace if t0 <= t <= t1]
    peak = [max(f, b) for f, b in zip(fwd, bwd, strict=True)]
    doc = {
        "mode": mode,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "shape": dataclasses.asdict(Shape.from_args(args)),
        "knobs": dataclasses.asdict(Knobs.from_args(args)),
        "probed_steps": PROBE_STEPS,
        "rss_base_bytes": base,
        # Per step, above rss_base_bytes: peak RSS over the whole step (the kernel's
        # VmHWM where clear_refs resets it: "peak_exact"), its forward and backward parts,
        # and the 1 ms sampler's peak alone.
        "step_peak_bytes": peak,
        "forward_peak_bytes": fwd,
        "backward_peak_bytes": bwd,
        "sampled_peak_bytes": sampled,
        "peak_exact": peaks.exact,
        # The step peaks again, under the name bench/sweep.py reads.
        "act_mem_bytes": peak,
        "heap_bytes": heap,
        "cache_bytes": cache,
        # RSS over the last step: seconds from its start, bytes above rss_base_bytes.
        "timeline": {
            "t_s": [round(t, 6) for t, _ in trace],
            "rss_bytes": [rss for _, rss in trace],
            "backward_s": tb - t0,
            "end_s": t1 - t0,
            "interval_s": SAMPLE_INTERVAL_S,
        },
        "counters": stats,
    }
    print(json.dumps(doc), flush=True)
    return 0


# -- helpers -----------------------------------------------------------------------------


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


def _phases(args: argparse.Namespace) -> list[str]:
    return ["warmup"] * args.warmup + ["timed"] * args.steps


def _first_loss_divergence(ref: list[float], other: list[float]) -> int | None:
    for i, (a, b) in enumerate(zip(ref, other, strict=True)):
        if a != b:
            return i
    return None


def fmt(value: float | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    """``value * scale`` formatted with ``spec`` plus ``suffix``; "n/a" for None."""
    if value is None:
        return "n/a"
    text = format(value * scale, spec)
    if text.startswith("-") and float(text) == 0:  # "-0%" reads like a loss
        text = text[1:]
    return text + suffix


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Aligned text columns; the first ``left`` columns are left-aligned, the rest right."""
    lines = [tuple(header), *(tuple(r) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for n, line in enumerate(lines):
        cells = [
            cell.ljust(w) if i < left else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _table(rows: Sequence[StepResult]) -> str:
    """Timing and bytes moved, one line per mode."""
    header = (
        "mode",
        "what",
        "step s",
        "vs none",
        "offl MiB/step",
        "vs saved-budget",
        "hit rate",
        "stall s/step",
        "steal s/step",
        "faults/step",
    )
    body = [
        (
            r.mode,
            r.label,
            fmt(r.median_step_s, ".3f"),
            fmt(r.ratio, ".2f", suffix="x"),
            fmt(r.offloaded_per_step, ".1f", 1 / MB),
            fmt(r.moved_ratio, ".2f", suffix="x"),
            fmt(r.hit_rate, ".1f", 100, "%"),
            fmt(r.stall_per_step, ".4f"),
            fmt(r.steal_per_step, ".3f"),
            fmt(r.faults_per_step, ".0f"),
        )
        for r in rows
    ]
    return format_table(header, body, left=2)


def _memory_table(rows: Sequence[StepResult]) -> str:
    """Memory over whole steps, one line per probed mode: default allocator, then tuned."""
    header = (
        "mode",
        "budget MiB",
        "peak MiB",
        "fwd MiB",
        "bwd MiB",
        "act MiB",
        "act cut",
        "heap MiB",
        "cache MiB",
        "tuned peak",
        "tuned act",
        "tuned cut",
    )
    body = [
        (
            r.mode,
            fmt(r.device_budget, ".1f", 1 / MB),
            fmt(r.peak, ".1f", 1 / MB),
            fmt(r.forward_peak, ".1f", 1 / MB),
            fmt(r.backward_peak, ".1f", 1 / MB),
            fmt(r.act_mem, ".1f", 1 / MB),
            fmt(r.act_cut, ".0f", 100, "%"),
            fmt(r.heap, ".1f", 1 / MB),
            fmt(r.cache, ".1f", 1 / MB),
            fmt(r.tuned_peak, ".1f", 1 / MB),
            fmt(r.tuned_act_mem, ".1f", 1 / MB),
            fmt(r.tuned_act_cut, ".0f", 100, "%"),
        )
        for r in rows
        if r.peak_bytes or r.tuned_peak_bytes
    ]
    return format_table(header, body, left=1)


def headline(rows: Sequence[StepResult], problems: Sequence[str], steps: int) -> list[str]:
    """Two or three plain lines a user reads first: what disk offload saved in memory,
    what it cost in step time, and whether training stayed exact. The offload mode
    reported is ``disk`` (else ``budget``); lines whose figures were not measured
    are left out."""
    by_mode = {r.mode: r for r in rows}
    mode = next((m for m in ("disk", "budget") if m in by_mode), None)
    lines: list[str] = []
    if mode is not None:
        r = by_mode[mode]
        what = "Offload to disk" if mode == "disk" else "Offload to disk with a device_budget"
        if r.act_mem is not None and r.act_cut is not None and r.saved_bytes:
            change = (
                f"cut the activation memory a training step holds by {r.act_cut * 100:.0f}%"
                if r.act_cut > 0
                else "did not cut the activation memory a training step holds"
            )
            lines.append(
                f"{what} {change}: {r.saved_bytes / MB:.1f} MiB -> {r.act_mem / MB:.1f} "
                "MiB at the step's peak (peak RSS, default allocator)."
            )
        elif r.saved_bytes:
            lines.append(
                f"{what}: memory not measured (--no-mem-probe); a step saves "
                f"{r.saved_bytes / MB:.1f} MiB of activations."
            )
        if r.ratio is not None and r.baseline_step_s is not None:
            lines.append(
                f"It cost {r.ratio:.2f}x in step time: {r.baseline_step_s:.3f} s -> "
                f"{r.median_step_s:.3f} s per training step (median of {r.steps}, "
                "modes interleaved)."
            )
    if problems:
        lines.append(f"FAILED: {len(problems)} mode(s) trained differently; see FAIL below.")
    elif len(by_mode) > 1:
        ref = "no offload" if "none" in by_mode else f"mode {rows[0].mode!r}"
        lines.append(
            f"Training stayed exact: after {steps} steps every mode's parameters are "
            f"bit-identical to {ref}'s."
        )
    return lines


def _legend(modes: Sequence[str], saved_bytes: int, probe_repeats: int) -> list[str]:
    """What the columns of the tables mean (printed after them)."""
    lines = [
        "step s: median of forward + backward + SGD step over the timed rounds",
        "offl MiB/step: bytes the engine wrote per timed step; vs saved-budget: that over "
        "saved bytes minus device_budget",
        "steal s/step: CPU time the hypervisor took from this VM's CPUs per step (/proc/stat); "
        "faults/step: the process's minor page faults per step",
    ]
    if REPLAY_MODES.intersection(modes):
        lines += [
            f"ioreplay: none's training while a side thread writes {saved_bytes / MB:.1f} MiB "
            "per step during forward and reads it back during backward (O_DIRECT);",
            "  iospread: the same, paced evenly over the previous step's forward and backward",
        ]
    if probe_repeats:
        lines += [
            f"memory: a fresh process per mode runs {PROBE_STEPS} whole training steps "
            "(forward, backward, SGD step); peak MiB: its peak RSS (VmHWM) over them minus "
            f"its RSS before the first (median of {probe_repeats} probe"
            f"{'s' if probe_repeats > 1 else ''}); fwd/bwd: the same over forward / "
            "backward + SGD step; glibc's default allocator",
            "act MiB: peak minus what none holds beside its activations (none's peak minus "
            "the saved bytes); act cut: the share of the saved bytes a mode took out",
            "heap MiB: malloc bytes in use at the end of the last step's forward, above those "
            "before the first step (live memory, without what glibc keeps)",
            "cache MiB: page cache added over a step (the machine's): bytes that buffered "
            "writes left in RAM, outside every RSS",
            f"tuned: the same peak, act MiB and cut with MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD} "
            "(freed blocks of 64 KiB or more leave RSS at once)",
        ]
    return lines


# The modes the memory plot draws, in this order (the others' lines would crowd it).
PLOT_MODES: tuple[str, ...] = ("none", "disk", "budget")


def plot_memory(
    timelines: dict[str, dict[str, Any]],
    path: Path,
    *,
    saved_bytes: int,
    shape: Shape,
    rows: Sequence[StepResult] = (),
) -> bool:
    """Draw RSS over one training step per mode (the probes' timelines) into a PNG.

    x: seconds from the step's start (each mode's backward start marked); y: RSS above
    the process's RSS before training, i.e. the memory training holds. Returns False,
    with a message, where matplotlib is missing or no timeline was recorded.
    """
    modes = [m for m in PLOT_MODES if timelines.get(m, {}).get("t_s")]
    if not modes:
        _log(f"--plot: no memory timeline of {', '.join(PLOT_MODES)} (probes off?); no plot")
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("--plot: matplotlib is not installed (pip install -e '.[bench]'); no plot drawn")
        return False
    budgets = {r.mode: r.device_budget for r in rows}
    names = {
        "none": "no offload",
        "disk": "disk (device_budget 0)",
        "budget": "disk, device_budget "
        + (f"{budgets['budget'] / MB:.0f} MiB" if budgets.get("budget") else "a share"),
    }
    colors = {"none": "tab:gray", "disk": "tab:blue", "budget": "tab:orange"}
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    for mode in modes:
        line = timelines[mode]
        x = line["t_s"]
        y = [b / MB for b in line["rss_bytes"]]
        color = colors.get(mode)
        ax.plot(x, y, label=names.get(mode, mode), color=color, linewidth=1.6)
        ax.axvline(line["backward_s"], color=color, linestyle=":", linewidth=1)
    ax.axhline(saved_bytes / MB, color="black", linestyle="--", linewidth=0.8)
    ax.annotate(
        f"saved for backward per step: {saved_bytes / MB:.0f} MiB",
        xy=(0, saved_bytes / MB),
        xytext=(2, 3),
        textcoords="offset points",
        fontsize=8,
    )
    ax.set_xlabel("seconds into the training step (dotted: backward starts)")
    ax.set_ylabel("memory held by training, MiB\n(RSS above RSS before training)")
    ax.set_title(
        f"Memory over one training step: TinyTransformer, {shape.depth} blocks, width "
        f"{shape.width}, batch {shape.batch} x {shape.seq}",
        fontsize=10,
    )
    ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def machine_info() -> dict[str, Any]:
    """Host, core counts and versions, for the report."""
    cores = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    return {
        "host": platform.node(),
        "cores": cores,
        "usable_cores": usable,
        "cpu": _proc_field("/proc/cpuinfo", "model name"),
        "memory_gib": _memory_gib(),
        "system": f"{platform.system()} {platform.release()} {platform.machine()}",
        "torch": torch.__version__,
        "torch_threads": TORCH_THREADS,
        "python": platform.python_version(),
    }


def _proc_field(path: str, name: str) -> str | None:
    """The value of the first ``name: value`` line of a /proc file, or None."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def _memory_gib() -> float | None:
    text = _proc_field("/proc/meminfo", "MemTotal")  # "24576000 kB"
    if text is None or not text.split()[0].isdigit():
        return None
    return round(int(text.split()[0]) * 1024 / (1 << 30), 1)


def machine_line(prog: str, machine: dict[str, Any]) -> str:
    """One line naming the machine a report was measured on."""
    parts = [f"{machine['cores']} cores ({machine['usable_cores']} usable)"]
    if machine.get("cpu"):
        parts.append(str(machine["cpu"]))
    if machine.get("memory_gib"):
        parts.append(f"{machine['memory_gib']:g} GiB RAM")
    if machine.get("system"):
        parts.append(str(machine["system"]))
    parts.append(f"torch {machine['torch']} ({machine['torch_threads']} threads)")
    parts.append(f"python {machine['python']}")
    return f"{prog} on {machine['host']}: " + ", ".join(parts)


def _log(msg: str) -> None:
    _end_progress()
    print(msg, file=sys.stderr, flush=True)


def _progress(msg: str) -> None:
    """A progress line on stderr: on a terminal, one line rewritten in place (cleared
    before the report, which then leads the output); elsewhere, a line per call."""
    if not sys.stderr.isatty():
        print(msg, file=sys.stderr, flush=True)
        return
    width = shutil.get_terminal_size().columns - 1
    sys.stderr.write("\r\033[K" + msg[:width])
    sys.stderr.flush()


def _end_progress() -> None:
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()


# -- main --------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 0, 1 (results differ between modes) or 2 (a mode failed)."""
    words = list(sys.argv[1:] if argv is None else argv)
    args = _parse_args(words)
    if args.memory_probe is not None:
        return _memory_probe(args)
    args.command = shlex.join(["python", "bench/step.py", *words])
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
    shape, knobs = Shape.from_args(args), Knobs.from_args(args)
    phases = _phases(args)
    model, batches = build(shape, len(phases))
    saved_bytes = _saved_activation_bytes(model, batches[0])
    mode_knobs = {
        m: budget_knobs(knobs, saved_bytes, args.budget_fraction) if m == "budget" else knobs
        for m in modes
    }
    workers = {
        m: ModeWorker(
            m,
            copy.deepcopy(model),
            batches,
            make_mode(m, run_dir, mode_knobs[m], replay_bytes=saved_bytes),
        )
        for m in modes
    }
    del model
    try:
        log = run_rounds(workers, phases, _progress)
    except ModeFailed as exc:
        _log(f"error: {exc.where} failed:")
        traceback.print_exception(exc.__cause__ or exc)
        return 2

    probes: dict[str, dict[str, list[dict[str, Any]]]] = {}
    pending: list[dict[str, Any]] = []
    if args.mem_probe:
        try:
            probes = _probe_modes(modes, mode_knobs, shape, run_dir, args)
            if "disk" in modes:
                pending = _pending_probes(knobs, shape, run_dir, args, probes["default"]["disk"])
        except (ProbeError, subprocess.TimeoutExpired) as exc:
            _log(f"error: {exc}")
            return 2

    rows = _results(modes, workers, log, probes, saved_bytes, mode_knobs)
    disk_handle = next((workers[m].handle for m in modes if m in ENGINE_MODES), None)
    io_method = getattr(disk_handle, "io_method", None)
    machine = machine_info()
    target = _target(rows)
    bound = _io_bound(rows)
    problems = _check(modes, workers, log.losses)

    # What a user wants to know first; the tables and what their columns mean follow.
    _end_progress()
    for line in headline(rows, problems, len(phases)):
        print(line)
    print()
    print(_table(rows))
    if probes:
        print()
        print(_memory_table(rows))
    if pending:
        print()
        print(
            "disk memory by max_pending_write_bytes (default allocator, one probe each; "
            "other knobs as above):"
        )
        print(_pending_table(pending, rows, saved_bytes))
    if target is not None:
        print()
        for line in target["lines"]:
            print(line)
    if bound is not None:
        print(bound["line"])
    print()
    if problems:
        for msg in problems:
            print(f"FAIL: {msg}")
    else:
        ref = "none" if "none" in modes else modes[0]
        print(f"check: final parameters of every mode are bit-identical to {ref!r}")

    print()
    print(machine_line("bench/step.py", machine))
    print(
        f"shape: {shape}; saved activations {saved_bytes / MB:.1f} MiB/step "
        "(distinct storages, parameters excluded)"
    )
    print(
        f"rounds: {args.warmup} warmup, {args.steps} timed; scratch on {fstype}"
        + (f", disk io_method {io_method}" if io_method else "")
        + f"; knobs: {knobs}"
    )
    if "budget" in modes:
        budget = mode_knobs["budget"].device_budget
        print(
            f"budget: disk with device_budget {budget / MB:.1f} MiB "
            f"({args.budget_fraction:g} x saved)"
        )
    for line in _legend(modes, saved_bytes, args.probe_repeats if probes else 0):
        print(line)

    plot_path = None
    if args.plot is not None:
        default = probes.get("default", {})
        timelines = {m: docs[0]["timeline"] for m, docs in default.items() if docs}
        if plot_memory(timelines, args.plot, saved_bytes=saved_bytes, shape=shape, rows=rows):
            plot_path = args.plot
            print(f"plot: memory over one training step per mode in {args.plot}")

    if args.json is not None:
        default = probes.get("default", {})
        doc = {
            "bench": "step.py",
            "command": args.command,
            "machine": machine,
            "machine_line": machine_line("bench/step.py", machine),
            "shape": dataclasses.asdict(shape),
            "knobs": dataclasses.asdict(knobs),
            "mode_knobs": {m: dataclasses.asdict(k) for m, k in mode_knobs.items()},
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "saved_activation_bytes": saved_bytes,
            "scratch_fs": fstype,
            "disk_io_method": io_method,
            "rows": [row.to_json() for row in rows],
            "timed_counter_deltas": {m: timed_delta(workers[m]) for m in modes},
            # allocator -> mode -> one probe document per repeat
            "memory_probes": probes,
            # RSS over one whole step per mode (the first default-allocator probe's last
            # step): t_s seconds from the step's start, rss_bytes above the RSS before
            # training, backward_s and end_s the phase marks.
            "timelines": {m: docs[0]["timeline"] for m, docs in default.items() if docs},
            "pending_sweep": pending,
            "target": target,
            "io_bound": bound,
            "losses": log.losses,
            "check": {"ok": not problems, "problems": problems},
            "plot": None if plot_path is None else str(plot_path),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(dumps(doc), encoding="utf-8")
    return 1 if problems else 0


_NUMBERS = re.compile(r"\[\n\s+((?:-?[0-9.eE+-]+,\n\s+)*-?[0-9.eE+-]+)\n\s+\]")


def dumps(doc: Any) -> str:
    """``doc`` as indented JSON, each list of numbers on one line (the RSS timelines and
    per-step samples would otherwise take a line per number)."""
    text = json.dumps(doc, indent=2)
    return _NUMBERS.sub(lambda m: "[" + re.sub(r",\n\s+", ", ", m.group(1)) + "]", text) + "\n"


def _probe_modes(
    modes: Sequence[str],
    mode_knobs: dict[str, Knobs],
    shape: Shape,
    run_dir: Path,
    args: argparse.Namespace,
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every probed mode under each allocator, ``args.probe_repeats`` times, the modes
    in a different order each repeat. ioreplay and iospread run none's training: their
    memory is none's, so they are not probed."""
    probed = [m for m in modes if m not in REPLAY_MODES]
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for allocator in ALLOCATORS:
        requests = [
            (m, mode_knobs[m]) for r in range(args.probe_repeats) for m in round_order(probed, r)
        ]
        results = probe_many(requests, shape, run_dir, jobs=args.probe_jobs, allocator=allocator)
        by_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in probed}
        for (mode, _), result in zip(requests, results, strict=True):
            by_mode[mode].append(result)
        out[allocator] = by_mode
    return out


def _pending_probes(
    knobs: Knobs,
    shape: Shape,
    run_dir: Path,
    args: argparse.Namespace,
    disk_probes: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Disk's default-allocator probe at each --pending-sweep cap (its own cap reused)."""
    caps = [v for v in dict.fromkeys(args.pending_sweep) if v != knobs.max_pending_write_bytes]
    requests = [("disk", dataclasses.replace(knobs, max_pending_write_bytes=v)) for v in caps]
    results = probe_many(requests, shape, run_dir, jobs=args.probe_jobs, allocator="default")
    by_cap = dict(zip(caps, results, strict=True))
    by_cap[knobs.max_pending_write_bytes] = disk_probes[0]
    return [
        {"max_pending_write_bytes": value, "probe": by_cap[value]} for value in args.pending_sweep
    ]


def _probe_max(probe: dict[str, Any] | None, key: str) -> float | None:
    if probe is None or not probe.get(key):
        return None
    return float(max(probe[key]))


def _pending_table(
    pending: Sequence[dict[str, Any]], rows: Sequence[StepResult], saved_bytes: int
) -> str:
    none = next((r for r in rows if r.mode == "none"), None)
    base = none.peak if none is not None else None
    body = []
    for item in pending:
        probe = item["probe"]
        peak = _probe_max(probe, "step_peak_bytes")
        act = None if peak is None or base is None else peak - (base - saved_bytes)
        counters = probe.get("counters", {})  # over the probed steps
        steps = probe.get("probed_steps", PROBE_STEPS)
        wait = counters.get("pack_wait_seconds")
        body.append(
            (
                fmt(item["max_pending_write_bytes"], ".0f", 1 / _MiB),
                fmt(peak, ".1f", 1 / MB),
                fmt(act, ".1f", 1 / MB),
                fmt(None if act is None else 1 - act / saved_bytes, ".0f", 100, "%"),
                fmt(probe["heap_bytes"][-1] if probe.get("heap_bytes") else None, ".1f", 1 / MB),
                fmt(counters.get("peak_pending_write_bytes"), ".1f", 1 / MB),
                fmt(None if wait is None else wait / steps, ".4f"),
            )
        )
    header = (
        "pending MiB",
        "peak MiB",
        "act MiB",
        "act cut",
        "heap MiB",
        "peak pending MiB",
        "pack wait s/step",
    )
    return format_table(header, body, left=0)


# Issue 13's targets, default allocator, whole steps: disk (device_budget 0) cuts the
# activation memory by TARGET_CUT; budget peaks at most at its budget + what none holds
# beside its activations + BUDGET_SLACK x saved, and writes within MOVE_TOLERANCE of
# (saved - budget) per step, in less time than disk and within IOSPREAD_LIMIT of iospread
# (a bare thread moving every saved byte, paced as an engine's IO lands).
TARGET_CUT = 0.80
BUDGET_SLACK = 0.10
MOVE_TOLERANCE = 0.10
IOSPREAD_LIMIT = 1.05


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _target(rows: Sequence[StepResult]) -> dict[str, Any] | None:
    """The targets for disk and budget that this run measured, or None if none was."""
    by_mode = {r.mode: r for r in rows}
    out: dict[str, Any] = {}
    lines: list[str] = []
    disk = by_mode.get("disk")
    if disk is not None and disk.act_mem is not None and disk.act_cut is not None:
        assert disk.peak is not None and disk.baseline_peak_bytes is not None
        assert disk.saved_bytes is not None
        met = disk.act_cut >= TARGET_CUT
        out["disk"] = {
            "device_budget": disk.device_budget,
            "peak": disk.peak,
            "act_mem": disk.act_mem,
            "act_cut": disk.act_cut,
            "needed": TARGET_CUT,
            "met": met,
        }
        lines.append(
            f"target (disk, device_budget {fmt(disk.device_budget, 'g', 1 / MB)} MiB): "
            f"activation memory {disk.act_mem / MB:.1f} MiB = peak {disk.peak / MB:.1f} - "
            f"(none's peak {disk.baseline_peak_bytes / MB:.1f} - saved "
            f"{disk.saved_bytes / MB:.1f}); cut {disk.act_cut * 100:.0f}%, needs >= "
            f"{TARGET_CUT * 100:.0f}%: {_met(met)}"
        )
    budget = by_mode.get("budget")
    if budget is not None and budget.device_budget is not None and budget.saved_bytes:
        saved, held = budget.saved_bytes, budget.device_budget
        got: dict[str, Any] = {"device_budget": held}
        if budget.peak is not None and budget.baseline_peak_bytes is not None:
            limit = held + (budget.baseline_peak_bytes - saved) + BUDGET_SLACK * saved
            got.update(peak=budget.peak, peak_limit=limit, peak_met=budget.peak <= limit)
            lines.append(
                f"target (budget, device_budget {held / MB:.1f} MiB): peak "
                f"{budget.peak / MB:.1f} MiB <= budget + (none's peak - saved) + "
                f"{BUDGET_SLACK * 100:.0f}% of saved = {limit / MB:.1f}: "
                f"{_met(got['peak_met'])}"
            )
        if budget.moved_ratio is not None and budget.move_target is not None:
            moved_met = abs(budget.moved_ratio - 1) <= MOVE_TOLERANCE
            got.update(
                moved_per_step=budget.offloaded_per_step,
                demoted_per_step=budget.demoted_per_step,
                move_target=budget.move_target,
                moved_ratio=budget.moved_ratio,
                moved_met=moved_met,
            )
            lines.append(
                f"target (budget): wrote {fmt(budget.offloaded_per_step, '.1f', 1 / MB)} "
                f"MiB/step (demoted {fmt(budget.demoted_per_step, '.1f', 1 / MB)}) against "
                f"saved - budget = {budget.move_target / MB:.1f}: "
                f"{budget.moved_ratio:.2f}x, needs within {MOVE_TOLERANCE * 100:.0f}%: "
                f"{_met(moved_met)}"
            )
        if disk is not None:
            vs_disk = budget.median_step_s / disk.median_step_s
            got.update(time_vs_disk=vs_disk, time_met=vs_disk < 1.0)
            line = (
                f"target (budget): step time {vs_disk:.2f}x of disk's (offload "
                f"everything), needs < 1: {_met(vs_disk < 1.0)}"
            )
            lines.append(line)
        spread = by_mode.get("iospread")
        if spread is not None:
            vs_spread = budget.median_step_s / spread.median_step_s
            got.update(time_vs_iospread=vs_spread, iospread_met=vs_spread <= IOSPREAD_LIMIT)
            lines.append(
                f"target (budget): step time {vs_spread:.2f}x of iospread's (a bare thread "
                f"moving every saved byte), needs <= {IOSPREAD_LIMIT:.2f}: "
                f"{_met(got['iospread_met'])}"
            )
        out["budget"] = got
    if not out:
        return None
    out["lines"] = lines
    return out


def _io_bound(rows: Sequence[StepResult]) -> dict[str, Any] | None:
    """What disk's bytes cost moved by a bare thread (ioreplay, iospread) against what
    disk costs, if disk and at least one of them ran. The reference is iospread when it
    ran (its IO lands while compute runs, as an engine's does), else ioreplay."""
    by_mode = {r.mode: r for r in rows}
    disk = by_mode.get("disk")
    controls = [
        by_mode[m]
        for m in ("ioreplay", "iospread")
        if m in by_mode and by_mode[m].ratio is not None
    ]
    if disk is None or disk.ratio is None or not controls:
        return None
    ref = controls[-1]
    engine = disk.median_step_s / ref.median_step_s
    costs = ", ".join(f"{c.mode} {c.ratio:.2f}x" for c in controls)
    line = (
        f"io bound: disk's bytes moved by a bare thread with no hooks cost {costs} of none; "
        f"disk {disk.ratio:.2f}x, so the engine adds {engine:.2f}x beyond its IO ({ref.mode})"
    )
    moved, wrote = ref.offloaded_per_step, disk.offloaded_per_step
    if moved is not None and wrote is not None:
        # The replay moves every distinct saved storage; the engine skips small tensors
        # and the write tail. The two must stay close for the comparison to hold.
        line += f"; {ref.mode} wrote {moved / MB:.1f} MiB/step, disk {wrote / MB:.1f}"
    return {
        "controls": {c.mode: c.ratio for c in controls},
        "disk_ratio": disk.ratio,
        "reference": ref.mode,
        "disk_over_reference": engine,
        "reference_bytes_per_step": moved,
        "disk_bytes_per_step": wrote,
        "line": line,
    }


def _results(
    modes: list[str],
    workers: dict[str, ModeWorker],
    log: RoundLog,
    probes: dict[str, dict[str, list[dict[str, Any]]]],
    saved_bytes: int,
    mode_knobs: dict[str, Knobs],
) -> list[StepResult]:
    def peaks(allocator: str, mode: str, key: str) -> tuple[int, ...]:
        # Per probe: the largest over its steps, or for heap_bytes the last step's (what
        # forward leaves live once the first step's one-time allocations are made).
        docs = probes.get(allocator, {}).get(mode, [])
        pick = (lambda v: v[-1]) if key == "heap_bytes" else max
        return tuple(int(pick(d[key])) for d in docs if d.get(key))

    rows: list[StepResult] = []
    for mode in modes:
        counted = mode in ENGINE_MODES or mode in REPLAY_MODES
        delta = timed_delta(workers[mode]) if counted else {}
        rows.append(
            StepResult(
                mode=mode,
                label=LABELS[mode],
                step_seconds=tuple(log.times[mode]),
                steal_seconds=tuple(log.steal[mode]),
                minor_faults=tuple(log.faults.get(mode, ())),
                peak_bytes=peaks("default", mode, "step_peak_bytes"),
                forward_peak_bytes=peaks("default", mode, "forward_peak_bytes"),
                backward_peak_bytes=peaks("default", mode, "backward_peak_bytes"),
                tuned_peak_bytes=peaks("tuned", mode, "step_peak_bytes"),
                heap_bytes=peaks("default", mode, "heap_bytes"),
                cache_bytes=peaks("default", mode, "cache_bytes"),
                saved_bytes=saved_bytes,
                device_budget=mode_knobs[mode].device_budget if mode in ENGINE_MODES else None,
                bytes_offloaded=_int_or_none(delta.get("bytes_offloaded")),
                bytes_demoted_to_disk=_int_or_none(delta.get("bytes_demoted_to_disk")),
                prefetch_hits=_int_or_none(delta.get("prefetch_hits")),
                prefetch_misses=_int_or_none(delta.get("prefetch_misses")),
                stall_seconds=delta.get("stall_seconds"),
                pack_wait_seconds=delta.get("pack_wait_seconds"),
            )
        )
    if "none" in modes:
        ref = rows[modes.index("none")]
        rows = [
            dataclasses.replace(
                r,
                baseline_step_s=ref.median_step_s,
                baseline_peak_bytes=ref.peak,
                baseline_tuned_peak_bytes=ref.tuned_peak,
            )
            for r in rows
        ]
    return rows


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


def _check(
    modes: list[str], workers: dict[str, ModeWorker], losses: dict[str, list[float]]
) -> list[str]:
    """Messages for every mode whose final parameters differ from the reference mode's."""
    ref = "none" if "none" in modes else modes[0]
    problems: list[str] = []
    for mode in modes:
        if mode == ref:
            continue
        msg = compare_params(workers[ref].model, workers[mode].model, ref, mode)
        if msg is not None:
            first = _first_loss_divergence(losses[ref], losses[mode])
            if first is not None:
                msg += f"; losses first differ at round {first + 1}"
            problems.append(msg)
    return problems


if __name__ == "__main__":
    sys.exit(main())

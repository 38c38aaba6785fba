"""The training harness of ``bench/step.py`` and ``bench/sweep.py``: modes trained side by side.

Every mode trains its own copy of one model (same initial weights, same
batches), all on the calling thread: round ``r`` runs one step of every mode,
in the order ``round_order`` gives round ``r`` (a balanced Latin square), so
machine drift hits all modes alike. Each mode sets up what lives for the whole
run once (the engine and its IO threads, the seed's folder, ioreplay's file and
thread) and installs its saved-tensor hooks around each of its own steps:
exactly what ``offload_context`` does for a user who wraps ``trainer.train()``
(one engine, its hooks on the training thread), but with one training thread
for every mode. (A thread per mode would give each its own OpenMP team, whose
workers spin while another mode's step runs: the same computation then
measures up to 10% apart between ``none`` and ``save_on_cpu``, which on the
CPU are one thing.)

Sharing one process has one cost: heap memory that a mode gives back to the
kernel (an engine that trims glibc's heap) is faulted in again by whichever
mode allocates it next, so such a mode's page faults spread over every mode's
step time; compare trimming against not trimming in separate processes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import resource
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, TypeVar

import torch
from _common import IOReplay, SeedDiskHooks, round_order, steal_seconds

from prefetch_offload import OffloadConfig, OffloadEngine
from prefetch_offload.testing import TinyTransformer, make_batch

__all__ = [
    "ENGINE_MODES",
    "LABELS",
    "LEARNING_RATE",
    "MODES",
    "REPLAY_MODES",
    "SPREAD_MODES",
    "Flags",
    "Knobs",
    "ModeFailed",
    "ModeSetup",
    "ModeWorker",
    "RoundLog",
    "Shape",
    "add_args",
    "build",
    "compare_params",
    "counter_delta",
    "counters",
    "make_mode",
    "parse_mib_list",
    "parse_modes",
    "run_rounds",
    "timed_delta",
]

MODES: tuple[str, ...] = (
    "none",
    "disk",
    "budget",
    "ioreplay",
    "iospread",
    "iobudget",
    "seed",
    "save_on_cpu",
)
LABELS: dict[str, str] = {
    "none": "no offload",
    "disk": "prefetch_offload, disk",
    "budget": "disk, device_budget a share of saved",
    "ioreplay": "no hooks; disk's bytes by a bare thread",
    "iospread": "ioreplay, paced over forward and backward",
    "iobudget": "iospread moving saved - budget bytes",
    "seed": "seed: torch.save per tensor",
    "save_on_cpu": "torch save_on_cpu (CPU: no copy)",
}
# Modes that train as none does while a side thread moves bytes (IOReplay): disk's
# (ioreplay, iospread) or budget's (iobudget); make_mode's caller says how many.
REPLAY_MODES = frozenset({"ioreplay", "iospread", "iobudget"})
# The replay modes whose requests are paced over forward and backward (else a burst).
SPREAD_MODES = frozenset({"iospread", "iobudget"})
# Modes that run the engine (target disk); "budget" with device_budget > 0.
ENGINE_MODES = frozenset({"disk", "budget"})
LEARNING_RATE = 1e-3
# Engine counters that are levels, not running totals: reported as-is, not as deltas.
_GAUGES = frozenset(
    {
        "peak_pending_write_bytes",
        "disk_bytes_reserved",
        "peak_disk_bytes_reserved",
        "disk_bytes_in_use",
        "peak_disk_bytes_in_use",
        *(f"{p}{t}_tier_bytes" for p in ("", "peak_") for t in ("device", "host", "disk")),
    }
)
_CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(OffloadConfig)}


CHECKPOINT_MODES = ("off", "reentrant", "non-reentrant")


# -- what is measured: shape and knobs, and their flags ----------------------------------


class Flags:
    """A frozen dataclass of integers (or None) and strings (one of ``CHOICES``), each
    set by the flag of its name (``--io-workers``)."""

    HELP: ClassVar[dict[str, str]] = {}
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {}

    @classmethod
    def from_args(cls: type[_F], args: argparse.Namespace) -> _F:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def argv(self) -> list[str]:
        """The command-line flags that select these values."""
        return [x for name, value in self._items() for x in (_flag(name), str(value))]

    def _items(self) -> list[tuple[str, int | str]]:
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]

    def __str__(self) -> str:
        return ", ".join(f"{name} {value}" for name, value in self._items())


_F = TypeVar("_F", bound=Flags)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Shape(Flags):
    """The TinyTransformer and batch size trained, and whether its blocks are
    checkpointed (``torch.utils.checkpoint``: recomputed in backward)."""

    HELP: ClassVar[dict[str, str]] = {
        "checkpoint": "run every block under torch.utils.checkpoint, reentrant or not "
        "(default off)",
    }
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"checkpoint": CHECKPOINT_MODES}

    depth: int = 6
    width: int = 256
    heads: int = 4
    batch: int = 8
    seq: int = 256
    checkpoint: str = "off"


@dataclass(frozen=True)
class Knobs(Flags):
    """The offload settings under test (``min_offload_bytes`` applies to ``seed`` too)."""

    HELP: ClassVar[dict[str, str]] = {
        "min_offload_bytes": "smallest saved tensor sent to disk, for both disk and seed",
        "chunk_bytes": "write batch and read request size",
        "device_budget": "disk mode's device_budget in bytes (default 0: offload everything)",
        "heap_trim_bytes": "the engine modes' heap_trim_bytes (0: never give glibc's free "
        "heap pages back)",
    }

    prefetch_depth: int = _CONFIG_DEFAULTS["prefetch_depth"]
    io_workers: int = _CONFIG_DEFAULTS["io_workers"]
    max_pending_write_bytes: int = _CONFIG_DEFAULTS["max_pending_write_bytes"]
    min_offload_bytes: int = _CONFIG_DEFAULTS["min_offload_bytes"]
    chunk_bytes: int = _CONFIG_DEFAULTS["chunk_bytes"]
    # Bytes of saved activations that may stay in memory (engine modes; "budget" mode
    # sets its own from --budget-fraction).
    device_budget: int = _CONFIG_DEFAULTS["device_budget"]
    # Growth of glibc's resident free memory that triggers a heap trim (NOTE [heap
    # trim]); 0: never trim.
    heap_trim_bytes: int = _CONFIG_DEFAULTS["heap_trim_bytes"] or 0


def add_args(p: argparse.ArgumentParser, defaults: Flags) -> None:
    """A flag per field of ``defaults`` (``--depth``, ``--prefetch-depth``, ...), whose
    value is the flag's default."""
    for name, value in defaults._items():
        if isinstance(value, str):
            choices = defaults.CHOICES[name]
            p.add_argument(
                _flag(name), choices=choices, default=value, help=defaults.HELP.get(name)
            )
        else:
            p.add_argument(_flag(name), type=int, default=value, help=defaults.HELP.get(name))


def parse_modes(text: str, choices: Sequence[str]) -> list[str]:
    """``"a,b"`` -> the modes named, each once, in order; all must be ``choices``."""
    modes = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in modes if m not in choices]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown mode {unknown[0]!r}; choose from {', '.join(choices)}"
        )
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
        out.append(int(value * (1 << 20)))
    return out


def build(
    shape: Shape, rounds: int
) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The model (seeded, so every process builds the same weights) and one batch per round."""
    batches = [make_batch(shape.batch, shape.seq, seed=r) for r in range(rounds)]
    torch.manual_seed(0)
    model = TinyTransformer(width=shape.width, depth=shape.depth, heads=shape.heads)
    checkpoint_blocks(model, shape.checkpoint)
    return model, batches


class _Checkpointed(torch.nn.Module):
    """A block run under ``torch.utils.checkpoint``: recomputed during backward."""

    def __init__(self, block: torch.nn.Module, *, reentrant: bool) -> None:
        super().__init__()
        self.block = block
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=self.reentrant)


def checkpoint_blocks(model: torch.nn.Module, mode: str) -> None:
    """Checkpoint every block of ``model`` (a TinyTransformer) as ``mode`` says
    (one of CHECKPOINT_MODES; "off" changes nothing)."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint mode must be one of {CHECKPOINT_MODES}, got {mode!r}")
    if mode != "off":
        blocks = model.blocks  # type: ignore[union-attr]
        model.blocks = torch.nn.ModuleList(  # type: ignore[union-attr]
            _Checkpointed(b, reentrant=mode == "reentrant") for b in blocks
        )


# -- what turns a mode on ----------------------------------------------------------------


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
    """What turns ``mode`` on; the engine, replay and seed modes write under ``save_dir``.
    ``replay_bytes``: what a replay mode (``ioreplay``, ``iospread``, ``iobudget``)
    writes and reads per step, set by the caller per mode (disk's bytes for the first
    two, saved - budget for ``iobudget``). The engine modes take
    ``knobs.device_budget`` as it is (``budget``'s is set by the caller)."""
    if mode == "none":
        return ModeSetup(contextlib.nullcontext())
    if mode in REPLAY_MODES:
        replay = IOReplay(
            str(save_dir / mode),
            replay_bytes,
            chunk=knobs.chunk_bytes,
            spread=mode in SPREAD_MODES,
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


def counters(handle: Any) -> dict[str, float]:
    """A mode's cumulative counters now (engine stats, seed file counts, the bytes a
    replay moved), from its run handle; empty for modes without any."""
    if isinstance(handle, IOReplay):  # what the bare thread really moved
        return {"bytes_offloaded": handle.bytes_written, "bytes_read": handle.bytes_read}
    if isinstance(handle, SeedDiskHooks):
        return {"files_written": handle.files_written, "bytes_written": handle.bytes_written}
    if handle is not None and hasattr(handle, "stats"):
        return dict(dataclasses.asdict(handle.stats()))
    return {}


def counter_delta(start: dict[str, float], end: dict[str, float]) -> dict[str, float]:
    """Running totals: their change from ``start`` to ``end``; gauges: their level at end."""
    return {k: (v if k in _GAUGES else v - start.get(k, 0)) for k, v in end.items()}


# -- one mode, and the rounds ------------------------------------------------------------


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
    context exits. Steps are timed; memory is the probes' (``bench/_probe.py``).
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
        self.snapshots["end"] = counters(self.handle)

    def _step(self, round_index: int, phase: str) -> StepOut:
        if phase != self._phase:
            self.snapshots[phase] = counters(self.handle)
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


def timed_delta(worker: ModeWorker) -> dict[str, float]:
    """Counter changes over the timed phase (gauges: their level at its end)."""
    start = worker.snapshots.get("timed", {})
    return counter_delta(start, worker.snapshots.get("end", {}))


class ModeFailed(Exception):
    """A mode raised; the original exception is the ``__cause__``. ``where`` says when."""

    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where


class RoundLog:
    """Per-mode results of :func:`run_rounds`, in round order: step time, steal (where the
    kernel reports it) and page faults of the timed rounds, the loss of every round."""

    def __init__(self, modes: Sequence[str]) -> None:
        self.times: dict[str, list[float]] = {m: [] for m in modes}
        self.steal: dict[str, list[float]] = {m: [] for m in modes}
        self.faults: dict[str, list[int]] = {m: [] for m in modes}
        self.losses: dict[str, list[float]] = {m: [] for m in modes}

    def add(self, mode: str, phase: str, step: StepOut) -> None:
        self.losses[mode].append(step.loss)
        if phase == "timed":
            self.times[mode].append(step.seconds)
            self.faults[mode].append(step.faults)
            if step.steal is not None:
                self.steal[mode].append(step.steal)


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
    out = RoundLog(modes)
    where = "starting a mode"
    try:
        for mode in modes:
            where = f"mode {mode!r} entering its context"
            workers[mode].start()
        for r, phase in enumerate(phases):
            order = round_order(modes, r)
            for mode in order:
                where = f"mode {mode!r} in round {r + 1} ({phase})"
                out.add(mode, phase, workers[mode].step(r, phase))
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


def compare_params(
    ref: torch.nn.Module | Mapping[str, torch.Tensor],
    other: torch.nn.Module | Mapping[str, torch.Tensor],
    ref_name: str,
    name: str,
) -> str | None:
    """A message naming the parameters that differ, or None if all are bit-identical.
    ``ref`` and ``other`` are models or their state dicts."""
    ref_state, state = (
        m.state_dict() if isinstance(m, torch.nn.Module) else m for m in (ref, other)
    )
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

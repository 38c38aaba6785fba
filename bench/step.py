"""Train the small transformer under each offload mode and compare step time and memory.

Every mode trains its own copy of one model (same initial weights, same
batches) on one thread, one step of every mode per round, in the order of a
balanced Latin square, each mode's hooks installed around its own steps only
(``bench/_harness.py`` says why). ``--warmup`` rounds come first (not counted),
then ``--steps`` timed rounds (step times and engine counters). After the run
the final parameters of every mode must be bit-identical to those of ``none``;
if they are not, the script says which and exits with status 1.

``budget`` is ``disk`` with ``device_budget`` set to ``--budget-fraction``
(default 0.5) of the step's saved activation bytes, measured before the run:
the newest saved tensors up to the budget stay in memory, the rest go to disk.
Its bytes moved per step are reported against ``saved - budget``.

``ioreplay``, ``iospread`` and ``iobudget`` train as ``none`` does while a bare
thread (no hooks, no engine) writes bytes during forward and reads them back
during backward: ``ioreplay`` and ``iospread`` every saved byte (disk's bytes;
``iospread`` paced over the step, as an engine's IO lands), the reference for
what disk's IO alone costs; ``iobudget`` paces ``saved - budget`` bytes as
``iospread`` does, the reference for budget's step time.

Memory is measured in a fresh process per mode (``bench/_probe.py``), over
``PROBE_STEPS`` whole training steps (forward, backward, optimizer step) with no
warm-up first: ``peak MiB`` is the largest RSS over them minus the RSS before
the first one, ``fwd``/``bwd`` split it into forward and backward (with the
optimizer step). The primary probes run with glibc's default allocator, which
is what users run; a second set runs with ``MALLOC_MMAP_THRESHOLD_=65536`` (RSS
then tracks live memory): its columns are labelled ``tuned``, and stand beside
the default figures, never instead of them. The probes' RSS over their last
step is kept in the JSON (``timelines``); ``--plot`` draws it for none, disk
and budget.

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

``--pending-sweep`` probes the ``disk`` mode's memory at other values of
``max_pending_write_bytes`` (the engine's cap on bytes queued for writing,
which trades memory for speed: pack waits at the cap). ``bench/sweep.py``
measures the speed side.

Tables and the plot for the docs (``bench/report.py`` turns the JSON into markdown):
    .venv/bin/python bench/step.py --json docs/results/step.json --plot docs/memory.png
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import re
import subprocess
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
from _common import (
    MB,
    TORCH_THREADS,
    StepResult,
    filesystem_type,
    machine_info,
    round_order,
    scratch_folder,
)
from _harness import (
    ENGINE_MODES,
    LABELS,
    MODES,
    REPLAY_MODES,
    Knobs,
    ModeFailed,
    ModeWorker,
    RoundLog,
    Shape,
    add_args,
    build,
    compare_params,
    make_mode,
    parse_mib_list,
    parse_modes,
    run_rounds,
    timed_delta,
)
from _plot import memory_over_step
from _probe import ALLOCATORS, MMAP_THRESHOLD, PROBE_STEPS, ProbeError, probe_many, run_probe
from _text import end_progress, fmt, format_table, json_args, json_header, log, progress

from prefetch_offload.testing import warm_up_unary_ops

__all__ = ["BUDGET_FRACTION", "dumps", "headline", "main", "saved_storage_bytes"]

# The budget mode's device_budget as a share of the saved bytes, by default.
BUDGET_FRACTION = 0.5
# Issue 13's targets, default allocator, whole steps: disk (device_budget 0) cuts the
# activation memory by TARGET_CUT; budget peaks at most at its budget + what none holds
# beside its activations + BUDGET_SLACK x saved, and writes within MOVE_TOLERANCE of
# (saved - budget) per step, in less time than disk and within IOBUDGET_LIMIT of iobudget
# (a bare thread moving the same saved - budget bytes, paced as an engine's IO lands).
TARGET_CUT = 0.80
BUDGET_SLACK = 0.10
MOVE_TOLERANCE = 0.10
IOBUDGET_LIMIT = 1.05


# -- arguments ---------------------------------------------------------------------------


def _trim_list(text: str) -> list[int]:
    """``"64,256,off"`` -> heap_trim_bytes values in bytes, 0 for off (the Knobs spelling)."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    out = [0 if x == "off" else parse_mib_list(x)[0] for x in items]
    if any(v == 0 and x != "off" for v, x in zip(out, items, strict=True)):
        raise argparse.ArgumentTypeError(f"{text!r}: a value rounds to 0 bytes (write 'off')")
    return out


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/step.py",
        description="Step time and activation memory of TinyTransformer training per offload mode.",
    )
    p.add_argument(
        "--modes",
        type=functools.partial(parse_modes, choices=MODES),
        default=list(MODES),
        help="comma list (default: all)",
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
        "--trim-sweep",
        type=_trim_list,
        default=[],
        metavar="MIB,...",
        help="also probe disk's activation memory at these heap_trim_bytes values, in MiB, "
        "'off' for None (default: none; e.g. 64,256,off)",
    )
    p.add_argument(
        "--probe-jobs",
        type=int,
        default=1,
        metavar="N",
        help="memory probes run at once (default 1; more is faster, but they compete "
        "for cores, which can change disk's number)",
    )
    add_args(p, Shape())
    p.add_argument(
        "--save-dir",
        default=None,
        help="folder to create the run's scratch folder in (default: ./.scratch); "
        "the scratch folder is removed at the end",
    )
    add_args(p, Knobs())
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
    return args


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"the budget fraction must be > 0, got {text!r}")
    return value


# -- the run -----------------------------------------------------------------------------


@dataclass
class Run:
    """What one run measured and judged: everything the report and the JSON show."""

    args: argparse.Namespace
    shape: Shape
    knobs: Knobs
    mode_knobs: dict[str, Knobs]
    saved_bytes: int
    # What each replay mode that ran moved per step by design (its IOReplay's nbytes).
    replay_bytes: dict[str, int]
    fstype: str
    io_method: str | None
    rows: list[StepResult]
    # Counter changes over the timed rounds, per mode; the loss of every round, per mode.
    deltas: dict[str, dict[str, float]]
    losses: dict[str, list[float]]
    # allocator -> mode -> one probe document per repeat; disk's write-cap probes.
    probes: dict[str, dict[str, list[dict[str, Any]]]]
    pending: list[dict[str, Any]]
    # Disk's heap-trim probes (--trim-sweep).
    trim: list[dict[str, Any]]
    problems: list[str]
    # The JSON's first keys (_text.json_header): the command, the machine and its line.
    header: dict[str, Any]

    @property
    def modes(self) -> list[str]:
        return [r.mode for r in self.rows]

    @property
    def timelines(self) -> dict[str, dict[str, Any]]:
        """RSS over one whole step per mode: the first default-allocator probe's last step."""
        default = self.probes.get("default", {})
        return {m: docs[0]["timeline"] for m, docs in default.items() if docs}

    @functools.cached_property
    def target(self) -> dict[str, Any] | None:
        return _target(self.rows)

    @functools.cached_property
    def bound(self) -> dict[str, Any] | None:
        return _io_bound(self.rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 0, 1 (results differ between modes) or 2 (a mode failed)."""
    words = list(sys.argv[1:] if argv is None else argv)
    args = _parse_args(words)
    torch.set_num_threads(TORCH_THREADS)
    warm_up_unary_ops()  # NOTE [first unary call]: modes are compared bit for bit
    shape, knobs = Shape.from_args(args), Knobs.from_args(args)
    if args.memory_probe is not None:
        print(json.dumps(run_probe(args.memory_probe, shape, knobs, args.save_dir)), flush=True)
        return 0
    header = json_header("step.py", words, machine_info())
    args.command = header["command"]
    with scratch_folder(args.save_dir, prefix="bench-step-") as folder:
        run_dir = Path(folder).absolute()
        fstype = filesystem_type(folder)
        if fstype in ("tmpfs", "ramfs"):
            log(
                f"warning: {run_dir} is on {fstype}: 'disk' and 'seed' write to RAM there; "
                "pass --save-dir on a real disk"
            )
        return _run(args, shape, knobs, run_dir, fstype, header)


def _run(
    args: argparse.Namespace,
    shape: Shape,
    knobs: Knobs,
    run_dir: Path,
    fstype: str,
    header: dict[str, Any],
) -> int:
    modes: list[str] = args.modes
    phases = ["warmup"] * args.warmup + ["timed"] * args.steps
    model, batches = build(shape, len(phases))
    saved_bytes = _saved_activation_bytes(model, batches[0])
    budget = dataclasses.replace(knobs, device_budget=round(saved_bytes * args.budget_fraction))
    mode_knobs = {m: budget if m == "budget" else knobs for m in modes}
    replay_bytes = {
        m: n for m, n in _replay_bytes(saved_bytes, budget.device_budget).items() if m in modes
    }
    workers = {
        m: ModeWorker(
            m,
            copy.deepcopy(model),
            batches,
            make_mode(m, run_dir, mode_knobs[m], replay_bytes=replay_bytes.get(m, 0)),
        )
        for m in modes
    }
    del model
    try:
        rounds = run_rounds(workers, phases, progress)
    except ModeFailed as exc:
        log(f"error: {exc.where} failed:")
        traceback.print_exception(exc.__cause__ or exc)
        return 2
    probes: dict[str, dict[str, list[dict[str, Any]]]] = {}
    pending: list[dict[str, Any]] = []
    trim: list[dict[str, Any]] = []
    if args.mem_probe:
        try:
            probes = _probe_modes(modes, mode_knobs, shape, run_dir, args)
            if "disk" in modes:
                disk = probes["default"]["disk"][0]
                pending = _sweep_probes(
                    "max_pending_write_bytes", args.pending_sweep, knobs, shape, run_dir, args, disk
                )
                trim = _sweep_probes(
                    "heap_trim_bytes", args.trim_sweep, knobs, shape, run_dir, args, disk
                )
        except (ProbeError, subprocess.TimeoutExpired) as exc:
            log(f"error: {exc}")
            return 2
    deltas = {m: timed_delta(workers[m]) for m in modes}
    engine = next((workers[m].handle for m in modes if m in ENGINE_MODES), None)
    run = Run(
        args=args,
        shape=shape,
        knobs=knobs,
        mode_knobs=mode_knobs,
        saved_bytes=saved_bytes,
        replay_bytes=replay_bytes,
        fstype=fstype,
        io_method=getattr(engine, "io_method", None),
        rows=_results(rounds, deltas, probes, saved_bytes, mode_knobs),
        deltas=deltas,
        losses=rounds.losses,
        probes=probes,
        pending=pending,
        trim=trim,
        problems=_check(workers, rounds.losses),
        header=header,
    )
    _print_report(run)
    plot = _plot(run)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(dumps(_json_doc(run, plot)), encoding="utf-8")
    return 1 if run.problems else 0


def _replay_bytes(saved_bytes: int, device_budget: int) -> dict[str, int]:
    """Bytes per step each replay mode moves: every saved byte for ``ioreplay`` and
    ``iospread`` (what disk moves), what the budget leaves over for ``iobudget`` (what
    budget moves, ``device_budget`` being the budget mode's)."""
    return {
        "ioreplay": saved_bytes,
        "iospread": saved_bytes,
        "iobudget": max(saved_bytes - device_budget, 0),
    }


def _saved_activation_bytes(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> int:
    """Bytes of the distinct storages one forward saves for backward, parameters excluded."""
    return sum(saved_storage_bytes(model, batch))


def saved_storage_bytes(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> list[int]:
    """Bytes of each distinct storage one forward saves for backward, parameters excluded."""
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
    return list(storages.values())


def _probe_modes(
    modes: Sequence[str],
    mode_knobs: dict[str, Knobs],
    shape: Shape,
    run_dir: Path,
    args: argparse.Namespace,
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every probed mode under each allocator, ``args.probe_repeats`` times, the modes
    in a different order each repeat. The replay modes (ioreplay, iospread, iobudget)
    run none's training: their memory is none's, so they are not probed."""
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


def _sweep_probes(
    knob: str,
    values: Sequence[int],
    knobs: Knobs,
    shape: Shape,
    run_dir: Path,
    args: argparse.Namespace,
    disk_probe: dict[str, Any],
) -> list[dict[str, Any]]:
    """Disk's default-allocator probe at each value of ``knob`` (--pending-sweep,
    --trim-sweep), one probe each; the run's own value reuses its first disk probe."""
    own = getattr(knobs, knob)
    others = [v for v in dict.fromkeys(values) if v != own]
    requests = [("disk", dataclasses.replace(knobs, **{knob: v})) for v in others]
    results = probe_many(requests, shape, run_dir, jobs=args.probe_jobs, allocator="default")
    by_value = dict(zip(others, results, strict=True))
    by_value[own] = disk_probe
    return [{knob: value, "probe": by_value[value]} for value in values]


def _results(
    rounds: RoundLog,
    deltas: dict[str, dict[str, float]],
    probes: dict[str, dict[str, list[dict[str, Any]]]],
    saved_bytes: int,
    mode_knobs: dict[str, Knobs],
) -> list[StepResult]:
    """One row per mode: its timed steps, its engine counters and its memory probes."""
    modes = list(mode_knobs)

    def peaks(allocator: str, mode: str, key: str) -> tuple[int, ...]:
        # Per probe: the largest over its steps, or for heap_bytes the last step's (what
        # forward leaves live once the first step's one-time allocations are made).
        docs = probes.get(allocator, {}).get(mode, [])
        pick = (lambda v: v[-1]) if key == "heap_bytes" else max
        return tuple(int(pick(d[key])) for d in docs if d.get(key))

    def counted(mode: str, key: str) -> float | None:
        return deltas[mode].get(key) if mode in ENGINE_MODES | REPLAY_MODES else None

    def whole(value: float | None) -> int | None:
        return None if value is None else int(value)

    rows = [
        StepResult(
            mode=mode,
            label=LABELS[mode],
            step_seconds=tuple(rounds.times[mode]),
            steal_seconds=tuple(rounds.steal[mode]),
            minor_faults=tuple(rounds.faults[mode]),
            peak_bytes=peaks("default", mode, "step_peak_bytes"),
            forward_peak_bytes=peaks("default", mode, "forward_peak_bytes"),
            backward_peak_bytes=peaks("default", mode, "backward_peak_bytes"),
            tuned_peak_bytes=peaks("tuned", mode, "step_peak_bytes"),
            heap_bytes=peaks("default", mode, "heap_bytes"),
            cache_bytes=peaks("default", mode, "cache_bytes"),
            saved_bytes=saved_bytes,
            device_budget=mode_knobs[mode].device_budget if mode in ENGINE_MODES else None,
            bytes_offloaded=whole(counted(mode, "bytes_offloaded")),
            bytes_demoted_to_disk=whole(counted(mode, "bytes_demoted_to_disk")),
            prefetch_hits=whole(counted(mode, "prefetch_hits")),
            prefetch_misses=whole(counted(mode, "prefetch_misses")),
            stall_seconds=counted(mode, "stall_seconds"),
            pack_wait_seconds=counted(mode, "pack_wait_seconds"),
        )
        for mode in modes
    ]
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


def _check(workers: dict[str, ModeWorker], losses: dict[str, list[float]]) -> list[str]:
    """Messages for every mode whose final parameters differ from the reference mode's."""
    modes = list(workers)
    ref = "none" if "none" in modes else modes[0]
    problems: list[str] = []
    for mode in modes:
        msg = (
            None
            if mode == ref
            else compare_params(workers[ref].model, workers[mode].model, ref, mode)
        )
        if msg is None:
            continue
        pairs = zip(losses[ref], losses[mode], strict=True)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        if first is not None:
            msg += f"; losses first differ at round {first + 1}"
        problems.append(msg)
    return problems


# -- targets -----------------------------------------------------------------------------


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _target(rows: Sequence[StepResult]) -> dict[str, Any] | None:
    """The targets for disk and budget that this run measured, or None if none was."""
    by_mode = {r.mode: r for r in rows}
    out: dict[str, Any] = {}
    lines: list[str] = []
    disk = by_mode.get("disk")
    if disk is not None and disk.act_mem is not None and disk.act_cut is not None:
        out["disk"] = _disk_target(disk, lines)
    budget = by_mode.get("budget")
    if budget is not None and budget.device_budget is not None and budget.saved_bytes:
        out["budget"] = _budget_target(budget, disk, by_mode.get("iobudget"), lines)
    if not out:
        return None
    out["lines"] = lines
    return out


def _disk_target(disk: StepResult, lines: list[str]) -> dict[str, Any]:
    """Disk's activation memory cut against TARGET_CUT; its line is added to ``lines``."""
    assert disk.act_mem is not None and disk.act_cut is not None
    assert disk.peak is not None and disk.baseline_peak_bytes is not None
    assert disk.saved_bytes is not None
    met = disk.act_cut >= TARGET_CUT
    lines.append(
        f"target (disk, device_budget {fmt(disk.device_budget, 'g', 1 / MB)} MiB): "
        f"activation memory {disk.act_mem / MB:.1f} MiB = peak {disk.peak / MB:.1f} - "
        f"(none's peak {disk.baseline_peak_bytes / MB:.1f} - saved "
        f"{disk.saved_bytes / MB:.1f}); cut {disk.act_cut * 100:.0f}%, needs >= "
        f"{TARGET_CUT * 100:.0f}%: {_met(met)}"
    )
    return {
        "device_budget": disk.device_budget,
        "peak": disk.peak,
        "act_mem": disk.act_mem,
        "act_cut": disk.act_cut,
        "needed": TARGET_CUT,
        "met": met,
    }


def _budget_target(
    budget: StepResult, disk: StepResult | None, iobudget: StepResult | None, lines: list[str]
) -> dict[str, Any]:
    """The budget mode's peak, bytes written and step time against their targets, as far
    as this run measured them; their lines are added to ``lines``. The step time's
    reference is ``iobudget`` (a bare thread moving the same saved - budget bytes); if it
    did not run, that target is not judged."""
    assert budget.device_budget is not None and budget.saved_bytes
    saved, held = budget.saved_bytes, budget.device_budget
    got: dict[str, Any] = {"device_budget": held}
    if budget.peak is not None and budget.baseline_peak_bytes is not None:
        limit = held + (budget.baseline_peak_bytes - saved) + BUDGET_SLACK * saved
        got.update(peak=budget.peak, peak_limit=limit, peak_met=budget.peak <= limit)
        lines.append(
            f"target (budget, device_budget {held / MB:.1f} MiB): peak "
            f"{budget.peak / MB:.1f} MiB <= budget + (none's peak - saved) + "
            f"{BUDGET_SLACK * 100:.0f}% of saved = {limit / MB:.1f}: {_met(got['peak_met'])}"
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
            f"saved - budget = {budget.move_target / MB:.1f}: {budget.moved_ratio:.2f}x, "
            f"needs within {MOVE_TOLERANCE * 100:.0f}%: {_met(moved_met)}"
        )
    if disk is not None:
        vs_disk = budget.median_step_s / disk.median_step_s
        got.update(time_vs_disk=vs_disk, time_met=vs_disk < 1.0)
        lines.append(
            f"target (budget): step time {vs_disk:.2f}x of disk's (offload everything), "
            f"needs < 1: {_met(vs_disk < 1.0)}"
        )
    if iobudget is not None:
        vs_io = budget.median_step_s / iobudget.median_step_s
        got.update(
            time_vs_iobudget=vs_io,
            iobudget_limit=IOBUDGET_LIMIT,
            iobudget_met=vs_io <= IOBUDGET_LIMIT,
            iobudget_bytes_per_step=iobudget.offloaded_per_step,
        )
        lines.append(
            f"target (budget): step time {vs_io:.2f}x of iobudget's (a bare thread moving "
            f"saved - budget, {fmt(iobudget.offloaded_per_step, '.1f', 1 / MB)} MiB/step, "
            f"paced), needs <= {IOBUDGET_LIMIT:.2f}: {_met(got['iobudget_met'])}"
        )
    else:
        lines.append(
            "target (budget): step time against iobudget's (a bare thread moving saved - "
            "budget) not judged: iobudget did not run"
        )
    return got


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


# -- the report --------------------------------------------------------------------------


def _print_report(run: Run) -> None:
    """What a user wants to know first, then the tables, then what their columns mean."""
    end_progress()
    for line in headline(run.rows, run.problems, run.args.warmup + run.args.steps):
        print(line)
    print()
    print(_table(run.rows))
    if run.probes:
        print()
        print(_memory_table(run.rows))
    for knob, items in (("max_pending_write_bytes", run.pending), ("heap_trim_bytes", run.trim)):
        if items:
            print()
            print(f"disk memory by {knob} (default allocator, one probe each; other knobs as")
            print("above):")
            print(_sweep_table(knob, items, run.rows, run.saved_bytes))
    if run.target is not None:
        print()
        for line in run.target["lines"]:
            print(line)
    if run.bound is not None:
        print(run.bound["line"])
    print()
    for msg in run.problems:
        print(f"FAIL: {msg}")
    if not run.problems:
        ref = "none" if "none" in run.modes else run.modes[0]
        print(f"check: final parameters of every mode are bit-identical to {ref!r}")
    print()
    _print_setting(run)


def _print_setting(run: Run) -> None:
    """The machine, the shape, the rounds and knobs, and the legend of the columns."""
    args = run.args
    print(run.header["machine_line"])
    print(
        f"shape: {run.shape}; saved activations {run.saved_bytes / MB:.1f} MiB/step "
        "(distinct storages, parameters excluded)"
    )
    print(
        f"rounds: {args.warmup} warmup, {args.steps} timed; scratch on {run.fstype}"
        + (f", disk io_method {run.io_method}" if run.io_method else "")
        + f"; knobs: {run.knobs}"
    )
    if "budget" in run.modes:
        budget = run.mode_knobs["budget"].device_budget
        print(
            f"budget: disk with device_budget {budget / MB:.1f} MiB "
            f"({args.budget_fraction:g} x saved)"
        )
    probe_repeats = args.probe_repeats if run.probes else 0
    for line in _legend(run.modes, run.saved_bytes, run.replay_bytes, probe_repeats):
        print(line)


# Columns after the leading ones: (header, StepResult property, fmt's spec[, scale[, suffix]]).
_TIME_COLUMNS: tuple[tuple[Any, ...], ...] = (
    ("step s", "median_step_s", ".3f"),
    ("vs none", "ratio", ".2f", 1.0, "x"),
    ("offl MiB/step", "offloaded_per_step", ".1f", 1 / MB),
    ("vs saved-budget", "moved_ratio", ".2f", 1.0, "x"),
    ("hit rate", "hit_rate", ".1f", 100, "%"),
    ("stall s/step", "stall_per_step", ".4f"),
    ("steal s/step", "steal_per_step", ".3f"),
    ("faults/step", "faults_per_step", ".0f"),
)
_MEMORY_COLUMNS: tuple[tuple[Any, ...], ...] = (
    ("budget MiB", "device_budget", ".1f", 1 / MB),
    ("peak MiB", "peak", ".1f", 1 / MB),
    ("fwd MiB", "forward_peak", ".1f", 1 / MB),
    ("bwd MiB", "backward_peak", ".1f", 1 / MB),
    ("act MiB", "act_mem", ".1f", 1 / MB),
    ("act cut", "act_cut", ".0f", 100, "%"),
    ("heap MiB", "heap", ".1f", 1 / MB),
    ("cache MiB", "cache", ".1f", 1 / MB),
    ("tuned peak", "tuned_peak", ".1f", 1 / MB),
    ("tuned act", "tuned_act_mem", ".1f", 1 / MB),
    ("tuned cut", "tuned_act_cut", ".0f", 100, "%"),
)


def _rows_table(
    rows: Sequence[StepResult],
    lead: Sequence[tuple[str, str]],
    columns: Sequence[tuple[Any, ...]],
) -> str:
    """One line per row: the text columns ``lead`` (header, attribute), left-aligned,
    then ``columns``."""
    header = [h for h, _ in lead] + [c[0] for c in columns]
    body = [
        [getattr(r, a) for _, a in lead] + [fmt(getattr(r, c[1]), *c[2:]) for c in columns]
        for r in rows
    ]
    return format_table(header, body, left=len(lead))


def _table(rows: Sequence[StepResult]) -> str:
    """Timing and bytes moved, one line per mode."""
    return _rows_table(rows, (("mode", "mode"), ("what", "label")), _TIME_COLUMNS)


def _memory_table(rows: Sequence[StepResult]) -> str:
    """Memory over whole steps, one line per probed mode: default allocator, then tuned."""
    probed = [r for r in rows if r.peak_bytes or r.tuned_peak_bytes]
    return _rows_table(probed, (("mode", "mode"),), _MEMORY_COLUMNS)


# --pending-sweep and --trim-sweep: the column of the swept value, and the engine counters
# (per probed step) that show what the knob did.
_SWEEPS: dict[str, tuple[str, tuple[tuple[str, str, str, float], ...]]] = {
    "max_pending_write_bytes": (
        "pending MiB",
        (
            ("peak pending MiB", "peak_pending_write_bytes", ".1f", 1 / MB),
            ("pack wait s/step", "pack_wait_seconds", ".4f", 1.0),
        ),
    ),
    "heap_trim_bytes": (
        "heap_trim MiB",
        (
            ("heap trims/step", "heap_trims", ".1f", 1.0),
            ("trim s/step", "heap_trim_seconds", ".4f", 1.0),
        ),
    ),
}


def _sweep_table(
    knob: str, items: Sequence[dict[str, Any]], rows: Sequence[StepResult], saved_bytes: int
) -> str:
    """Disk's memory at each value of a swept knob, one line per value."""
    name, extra = _SWEEPS[knob]
    none = next((r for r in rows if r.mode == "none"), None)
    base = none.peak if none is not None else None
    body = []
    for item in items:
        probe = item["probe"]
        peak = float(max(probe["step_peak_bytes"])) if probe.get("step_peak_bytes") else None
        act = None if peak is None or base is None else peak - (base - saved_bytes)
        counters = probe.get("counters", {})  # over the probed steps
        steps = probe.get("probed_steps", PROBE_STEPS)
        per_step = {"peak_pending_write_bytes": 1}  # a maximum, not a sum
        body.append(
            (
                fmt(item[knob], ".0f", 1 / MB) if item[knob] else "off",
                fmt(peak, ".1f", 1 / MB),
                fmt(act, ".1f", 1 / MB),
                fmt(None if act is None else 1 - act / saved_bytes, ".0f", 100, "%"),
                fmt(probe["heap_bytes"][-1] if probe.get("heap_bytes") else None, ".1f", 1 / MB),
                *(
                    fmt(
                        None
                        if counters.get(key) is None
                        else counters[key] / per_step.get(key, steps),
                        spec,
                        scale,
                    )
                    for _, key, spec, scale in extra
                ),
            )
        )
    header = (name, "peak MiB", "act MiB", "act cut", "heap MiB", *(h for h, *_ in extra))
    return format_table(header, body, left=0)


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


def _legend(
    modes: Sequence[str], saved_bytes: int, replay_bytes: dict[str, int], probe_repeats: int
) -> list[str]:
    """What the columns and the replay modes mean (printed after the tables);
    ``replay_bytes``: what each replay mode that ran moves per step."""
    lines = [
        "step s: median of forward + backward + SGD step over the timed rounds",
        "offl MiB/step: bytes the engine (a replay mode: its bare thread) wrote per timed "
        "step; vs saved-budget: that over saved bytes minus device_budget",
        "steal s/step: CPU time the hypervisor took from this VM's CPUs per step (/proc/stat); "
        "faults/step: the process's minor page faults per step",
    ]
    if REPLAY_MODES.intersection(modes):
        lines += [
            f"ioreplay: none's training while a side thread writes {saved_bytes / MB:.1f} MiB "
            "(every saved byte) per step during forward and reads it back during backward "
            "(O_DIRECT);",
            "  iospread: the same, paced evenly over the previous step's forward and backward "
            "(the reference for disk's IO)",
        ]
        if "iobudget" in replay_bytes:
            lines.append(
                f"  iobudget: iospread moving saved - budget = {replay_bytes['iobudget'] / MB:.1f}"
                " MiB per step (budget's bytes; the reference for budget's step time)"
            )
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


def _plot(run: Run) -> Path | None:
    """Draw --plot from the probes' timelines; the path, or None where none was drawn."""
    path = run.args.plot
    if path is None:
        return None
    shape = run.shape
    title = (
        f"Memory over one training step: TinyTransformer, {shape.depth} blocks, width "
        f"{shape.width}, batch {shape.batch} x {shape.seq}"
    )
    budget = run.mode_knobs["budget"].device_budget if "budget" in run.mode_knobs else None
    if not memory_over_step(
        run.timelines, path, saved_bytes=run.saved_bytes, title=title, budget_bytes=budget
    ):
        return None
    print(f"plot: memory over one training step per mode in {path}")
    return path


# -- the JSON ----------------------------------------------------------------------------


def _json_doc(run: Run, plot: Path | None) -> dict[str, Any]:
    args = run.args
    return {
        **run.header,
        "shape": dataclasses.asdict(run.shape),
        "knobs": dataclasses.asdict(run.knobs),
        "mode_knobs": {m: dataclasses.asdict(k) for m, k in run.mode_knobs.items()},
        "args": json_args(args),
        "saved_activation_bytes": run.saved_bytes,
        # mode -> bytes per step its bare thread was set to move (replay modes that ran)
        "replay_bytes": run.replay_bytes,
        "scratch_fs": run.fstype,
        "disk_io_method": run.io_method,
        "rows": [row.to_json() for row in run.rows],
        "timed_counter_deltas": run.deltas,
        # allocator -> mode -> one probe document per repeat
        "memory_probes": run.probes,
        # RSS over one whole step per mode (the first default-allocator probe's last
        # step): t_s seconds from the step's start, rss_bytes above the RSS before
        # training, backward_s and end_s the phase marks.
        "timelines": run.timelines,
        "pending_sweep": run.pending,
        "trim_sweep": run.trim,
        "target": run.target,
        "io_bound": run.bound,
        "losses": run.losses,
        "check": {"ok": not run.problems, "problems": run.problems},
        "plot": None if plot is None else str(plot),
    }


_NUMBERS = re.compile(r"\[\n\s+((?:-?[0-9.eE+-]+,\n\s+)*-?[0-9.eE+-]+)\n\s+\]")


def dumps(doc: Any) -> str:
    """``doc`` as indented JSON, each list of numbers on one line (the RSS timelines and
    per-step samples would otherwise take a line per number)."""
    text = json.dumps(doc, indent=2)
    return _NUMBERS.sub(lambda m: "[" + re.sub(r",\n\s+", ", ", m.group(1)) + "]", text) + "\n"


if __name__ == "__main__":
    sys.exit(main())

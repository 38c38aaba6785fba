"""Train the benchmark transformer under each offload mode, side by side: step time and memory.

Every lane (a mode, or a ``--config`` of engine knobs) trains its own copy of
one model (same initial weights, same batches), one step of each lane per
round in the order of a balanced Latin square, ``--warmup`` rounds first (not
counted), then ``--steps`` timed rounds. Each lane runs in a process of its own
(its page faults, peak RSS and live heap are its own, as a user's training
is), stepped round by round from here; ``--shared`` runs every lane in this
process instead (faster to start; on the CPU memory is then not per lane).
After the run the final parameters of every lane must be bit-identical to
those of ``none``; if they are not, the script says which and exits with 1.

Modes (``bench/_harness.py``'s ``KINDS``): ``none``; ``disk`` (target "disk",
default settings); ``budget`` (``device_budget`` ``--budget-fraction`` of the
bytes a step saves; on a GPU with target "cpu"); ``cpu`` (target "cpu", GPU
and twin); ``save_on_cpu``; and two bare-IO references that train as ``none``
while a bare thread, with no hooks, writes bytes with O_DIRECT during forward
and reads them back during backward, paced over the previous step's phases as
an engine's IO lands: ``iospread`` every saved byte (disk's IO), ``iobudget``
the saved bytes less the budget (budget's IO).

``--config 'NAME:{"heap_trim_bytes": null}'`` adds a lane: OffloadConfig
keywords as JSON, with ``"mode"`` (default "disk"), ``"env"`` (its process's
environment, e.g. ``{"MALLOC_MMAP_THRESHOLD_": "65536"}`` or an ``LD_PRELOAD``
of another allocator) and ``"budget_fraction"``. ``--knobs JSON`` sets
keywords for every engine lane.

Memory, per lane and step: ``peak`` is the most the step held above the
lane's start (peak RSS, ``VmHWM`` reset at each step, against the RSS before
the first step, glibc's default allocator; on a GPU ``max_memory_reserved``
where each lane has a process of its own, else ``max_memory_allocated``, since
lanes in one process share the caching allocator); ``live``
is what was live at the end of forward (malloc's bytes in use; on a GPU
allocated memory). ``act`` is a lane's peak minus what ``none`` holds beside
its activations (``none``'s peak minus the saved bytes), and ``act cut`` the
share of the saved bytes a lane took out of the peak. ``--plot`` runs one more
step of each plotted lane with RSS and live bytes sampled every 10 ms
(``bench/_probe.py``), draws them, and prints that step's time against the
lane's median (the sampling must not slow the step it draws).

``--device cuda`` runs the same on a GPU (``--dtype bf16``, ``--attention``);
``--device twin`` runs the CUDA path's engine layer on the CPU (the GPU suite's
check without a GPU). Example (the docs' table and picture)::

    python bench/step.py --json docs/results/step.json --plot docs/memory.png
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
from _common import MB, TORCH_THREADS, filesystem_type, machine_info, round_order, scratch_folder
from _harness import (
    DEVICES,
    KINDS,
    REPLAY_KINDS,
    Lane,
    LaneSpec,
    ProcessLane,
    Shape,
    add_shape_args,
    build,
    close_all,
    parse_config,
)
from _plot import memory_over_step
from _probe import SAMPLE_INTERVAL_S
from _text import (
    COLUMNS,
    cells,
    end_progress,
    fmt,
    format_table,
    json_header,
    log,
    progress,
    with_vs_io,
)
from gpu_preflight import pinned_link_gbps as _link_gbps

from prefetch_offload.testing import saved_storage_bytes, warm_up_unary_ops

__all__ = ["BUDGET_FRACTION", "headline", "main", "run_lanes", "summarize"]

BUDGET_FRACTION = 0.5
# The lanes --plot draws, by name.
PLOT_LANES = ("none", "disk", "budget", "cpu")
# Engine counters reported per timed step (all running totals).
_COUNTERS = (
    "bytes_offloaded",
    "bytes_read",
    "prefetch_hits",
    "prefetch_misses",
    "stall_seconds",
    "pack_wait_seconds",
    "copy_wait_seconds",
    "heap_trims",
    "heap_trim_seconds",
)


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/step.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=DEVICES, default="cpu")
    p.add_argument(
        "--modes",
        type=lambda s: [m.strip() for m in s.split(",") if m.strip()],
        default=None,
        help="comma list of " + ", ".join(KINDS) + " (default: none,disk,budget,iospread,"
        "iobudget on the CPU; none,cpu,budget,save_on_cpu on a GPU or the twin)",
    )
    p.add_argument(
        "--config",
        type=parse_config,
        action="append",
        default=[],
        metavar="NAME:JSON",
        help="a lane with these OffloadConfig keywords (repeatable)",
    )
    p.add_argument(
        "--knobs",
        type=json.loads,
        default={},
        metavar="JSON",
        help="OffloadConfig keywords for every engine lane",
    )
    p.add_argument("--steps", type=int, default=8, help="timed rounds (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="uncounted rounds first (default 2)")
    p.add_argument("--budget-fraction", type=float, default=BUDGET_FRACTION, metavar="F")
    p.add_argument("--shared", action="store_true", help="every lane in this process")
    add_shape_args(p)
    p.add_argument("--save-dir", default=None, help="parent of the run's scratch folder")
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    p.add_argument("--plot", type=Path, default=None, metavar="PATH", help="memory over a step")
    args = p.parse_args(argv)
    if args.modes is None:
        args.modes = (
            ["none", "disk", "budget", "iospread", "iobudget"]
            if args.device == "cpu"
            else ["none", "cpu", "budget", "save_on_cpu"]
        )
    bad = [m for m in args.modes if m not in KINDS]
    if bad or (args.device == "cpu" and "cpu" in args.modes):
        p.error(f"--modes: unknown {bad} (or 'cpu' without a GPU); choose from {list(KINDS)}")
    if args.steps < 1 or args.warmup < 0 or not 0 < args.budget_fraction <= 1:
        p.error("--steps >= 1, --warmup >= 0 and 0 < --budget-fraction <= 1, please")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    return args


def _specs(args: argparse.Namespace, saved: int) -> list[LaneSpec]:
    """The lanes: --modes, then each --config (replacing a mode of its name)."""
    budget = round(saved * args.budget_fraction)
    docs: dict[str, dict[str, Any]] = {m: {"mode": m} for m in args.modes}
    docs.update(dict(args.config))
    specs = []
    for name, doc in docs.items():
        kind = doc.get("mode", "disk")
        knobs = {k: v for k, v in doc.items() if k not in ("mode", "env", "budget_fraction")}
        if kind not in REPLAY_KINDS | {"none", "save_on_cpu"}:
            knobs = {**args.knobs, **knobs}
        if kind == "budget" and "device_budget" not in knobs:
            knobs["device_budget"] = round(saved * doc.get("budget_fraction", args.budget_fraction))
        replay = {"iospread": saved, "iobudget": max(saved - budget, 0)}.get(kind, 0)
        if kind in REPLAY_KINDS and "chunk_bytes" in args.knobs:
            knobs["chunk_bytes"] = args.knobs["chunk_bytes"]
        own = {k: v for k, v in doc.items() if k != "mode"}
        label = f"{kind} {json.dumps(own)}" if own or name != kind else KINDS[kind]
        specs.append(LaneSpec(name, kind, knobs, doc.get("env", {}), replay, label))
    return specs


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0, 1 (final parameters differ between lanes) or 2 (a lane failed)."""
    words = list(sys.argv[1:] if argv is None else argv)
    args = _parse_args(words)
    torch.set_num_threads(TORCH_THREADS)
    warm_up_unary_ops()  # NOTE [first unary call]: lanes are compared bit for bit
    shape = Shape(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Shape)})
    model, (batch,) = build(dataclasses.replace(shape, compile="off"), 1, args.device)
    saved = sum(saved_storage_bytes(model, functools.partial(model, *batch)))
    del model, batch
    specs = _specs(args, saved)
    header = json_header("step.py", words, machine_info())
    with scratch_folder(args.save_dir, prefix="bench-step-") as folder:
        fstype = filesystem_type(folder)
        if fstype in ("tmpfs", "ramfs"):
            log(f"warning: the scratch folder is on {fstype}: disk writes go to RAM")
        try:
            doc = run_lanes(
                specs,
                shape,
                device=args.device,
                warmup=args.warmup,
                steps=args.steps,
                shared=args.shared,
                folder=folder,
                trace=args.plot is not None,
            )
        except Exception as exc:
            log(f"error: {exc}")
            traceback.print_exception(exc)
            return 2
    doc = {**header, "device": args.device, "shape": dataclasses.asdict(shape), **doc}
    if args.device == "cuda":
        doc["link_gbps"] = _link_gbps(256 * MB)
    doc.update(saved_bytes=saved, budget_fraction=args.budget_fraction, scratch_fs=fstype)
    doc["rows"] = summarize(doc)
    doc["targets"] = _targets(doc)
    _print_report(doc)
    if args.json is not None:  # before the picture: a failed or killed plot keeps it
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    if args.plot is not None and doc["timelines"]:
        try:
            if memory_over_step(doc, args.plot):
                print(f"plot: memory over one training step in {args.plot}")
        except Exception as exc:  # the figures are in the JSON; the picture is extra
            log(f"plot failed: {exc!r}")
    return 0 if doc["check"]["ok"] or doc["check"]["not_judged"] else 1


def run_lanes(
    specs: Sequence[LaneSpec],
    shape: Shape,
    *,
    device: str,
    warmup: int,
    steps: int,
    shared: bool,
    folder: str,
    trace: bool = False,
) -> dict[str, Any]:
    """Step every lane round by round (each in a process of its own unless ``shared``),
    check their final parameters, and with ``trace`` run one more traced step of each
    plotted lane; the raw measurements, JSON-ready."""
    rounds = warmup + steps
    make = Lane if shared else ProcessLane
    lanes: dict[str, Lane | ProcessLane] = {}
    try:
        for spec in specs:
            progress(f"starting lane {spec.name}")
            lanes[spec.name] = make(spec, shape, rounds, device, folder)
        for lane in lanes.values():
            if isinstance(lane, ProcessLane):
                lane.wait_ready()
        done: dict[str, list[dict[str, Any]]] = {n: [] for n in lanes}
        before: dict[str, dict[str, float]] = {}
        for r in range(rounds):
            if r == warmup:
                before = {n: lane.counters() for n, lane in lanes.items()}
            order = round_order(list(lanes), r)
            for n in order:
                out = lanes[n].step(r)
                if r >= warmup:
                    done[n].append(out)
            times = "  ".join(f"{n} {done[n][-1]['seconds']:.3f}s" for n in order if done[n])
            progress(f"round {r + 1}/{rounds} {times}")
        after = {n: lane.counters() for n, lane in lanes.items()}
        params = {n: lane.final_params() for n, lane in lanes.items()}
        timelines = {}
        if trace:
            for spec in specs:
                if spec.name in PLOT_LANES:
                    progress(f"tracing one step of {spec.name}")
                    timelines[spec.name] = lanes[spec.name].trace(rounds, SAMPLE_INTERVAL_S)
    except BaseException:
        try:
            close_all(list(lanes.values()))
        except BaseException as exc:
            log(f"(closing the lanes also failed: {exc})")
        raise
    close_all(list(lanes.values()))
    end_progress()
    ref = "none" if "none" in params else next(iter(params))
    differ = [
        n
        for n in params
        if not all(torch.equal(a, b) for a, b in zip(params[ref], params[n], strict=True))
    ]
    # Fused attention kernels on a GPU may use atomics: no offload makes them reproducible.
    not_judged = device == "cuda" and shape.attention == "sdpa"
    return {
        "isolated": not shared,
        "warmup": warmup,
        "lanes": [dataclasses.asdict(s) for s in specs],
        "steps": done,
        "counters": {
            n: {k: after[n][k] - before[n][k] for k in _COUNTERS if k in after[n]} for n in after
        },
        "check": {"ok": not differ, "reference": ref, "differ": differ, "not_judged": not_judged},
        "timelines": timelines,
    }


def summarize(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per lane of a run's JSON: medians, ratios and per-step counters."""
    steps, saved = doc["steps"], doc["saved_bytes"]
    memory = doc["isolated"] or doc["device"] == "cuda"  # else the process's, not a lane's
    # On a GPU: reserved memory where the lane has the caching allocator to itself.
    key = "peak_reserved" if doc["device"] == "cuda" and doc["isolated"] else "peak"
    base = None
    rows = []
    for lane in doc["lanes"]:
        s, c = steps[lane["name"]], doc["counters"][lane["name"]]
        n = len(s)
        hits, misses = c.get("prefetch_hits"), c.get("prefetch_misses")
        row = {
            "name": lane["name"],
            "kind": lane["kind"],
            "label": lane["label"],
            "step_s": statistics.median(x["seconds"] for x in s),
            "faults": statistics.fmean(x["faults"] for x in s),
            "peak": max(x["peak"] if x.get(key) is None else x[key] for x in s) if memory else None,
            "live": statistics.median(x["live"] for x in s) if memory else None,
            "offloaded": c["bytes_offloaded"] / n if "bytes_offloaded" in c else None,
            "hit_rate": hits / (hits + misses) if hits is not None and hits + misses else None,
            "stall": c["stall_seconds"] / n if "stall_seconds" in c else None,
            "trims": c["heap_trims"] / n if "heap_trims" in c else None,
            "budget": lane["knobs"].get("device_budget"),
        }
        if lane["name"] == doc["check"]["reference"]:
            base = row
        rows.append(row)
    for row in rows:
        row["ratio"] = row["step_s"] / base["step_s"] if base else None
        known = base is not None and row["peak"] is not None and base["peak"] is not None
        row["act"] = row["peak"] - (base["peak"] - saved) if known else None  # type: ignore[index]
        row["act_cut"] = 1 - row["act"] / saved if row["act"] is not None and saved else None
    return with_vs_io(rows)


def _targets(doc: dict[str, Any]) -> list[dict[str, str]]:
    """What a run is held to, each PASS, FAIL or n/a: exact training, and the memory and
    time targets of the lanes that ran."""
    by = {r["name"]: r for r in doc["rows"]}
    saved, check = doc["saved_bytes"], doc["check"]
    out: list[dict[str, str]] = []

    def add(target: str, ok: bool | None, value: str) -> None:
        verdict = "n/a" if ok is None else ("PASS" if ok else "FAIL")
        out.append({"target": target, "verdict": verdict, "value": value})

    exact = None if check["not_judged"] and check["differ"] else check["ok"]
    add(
        f"final parameters bit-identical to {check['reference']}",
        exact,
        "differ: " + ", ".join(check["differ"]) if check["differ"] else "all identical",
    )
    for name in ("disk", "cpu"):
        row = by.get(name)
        if row is not None and row["act_cut"] is not None:
            add(
                f"{name}: activation memory cut by 80% or more",
                row["act_cut"] >= 0.8,
                fmt(row["act_cut"], ".0f", 100, "%"),
            )
    if "cpu" in by and by["cpu"]["ratio"] is not None and doc["device"] != "cpu":
        # Every saved byte out and back at the pinned link's rate: a step's floor.
        floor, link = by["none"]["step_s"], doc.get("link_gbps")
        if link:
            floor = max(floor, saved / (link["d2h"] * 1e9) + saved / (link["h2d"] * 1e9))
        ratio = by["cpu"]["step_s"] / floor
        what = "the larger of none's and the link's floor" if link else "none"
        add(f"cpu: step time at most 1.03x {what}", ratio <= 1.03, fmt(ratio, ".3f", suffix="x"))
    b, none = by.get("budget"), by.get("none")
    if b is not None and b["budget"] is not None:
        move = max(saved - b["budget"], 0)
        if b["offloaded"] is not None and move:
            ratio = b["offloaded"] / move
            add(
                "budget: bytes moved per step within 10% of saved - budget",
                abs(ratio - 1) <= 0.1,
                f"{ratio:.2f}x",
            )
        if b["peak"] is not None and none is not None and none["peak"] is not None:
            limit = b["budget"] + none["peak"] - saved + 0.1 * saved
            add(
                "budget: peak at most budget + (none's peak - saved) + 10% of saved",
                b["peak"] <= limit,
                f"{b['peak'] / MB:.1f} vs {limit / MB:.1f} MiB",
            )
    return out


def headline(doc: dict[str, Any]) -> list[str]:
    """The figures a person can check first: peak memory with and without offload and
    how much of it was saved activations, step time with and without, and whether the
    parameters came out identical."""
    by = {r["name"]: r for r in doc["rows"]}
    none = by.get("none")
    off = next((by[m] for m in ("disk", "cpu", "budget") if m in by), None)
    lines = []
    where = "peak RSS, default allocator"
    if doc["device"] == "cuda":
        where = "reserved GPU memory" if doc["isolated"] else "allocated GPU memory"
    if none is not None and off is not None:
        if none["peak"] is not None and off["peak"] is not None:
            lines.append(
                f"Peak memory of a training step: {_mib(none['peak'])} without offload, "
                f"{_mib(off['peak'])} with {off['name']} ({where}, above the "
                f"process's start); the step saves {doc['saved_bytes'] / MB:.1f} MiB of "
                "activations for backward."
            )
        lines.append(
            f"Step time: {none['step_s']:.3f} s without offload, {off['step_s']:.3f} s with "
            f"{off['name']} ({off['ratio']:.2f}x; median of {len(doc['steps'][off['name']])} "
            f"steps, lanes interleaved{', each in its own process' if doc['isolated'] else ''})."
        )
    check, rounds = doc["check"], doc["warmup"] + len(next(iter(doc["steps"].values())))
    if check["ok"]:
        lines.append(
            f"Parameters after {rounds} steps: bit-identical to {check['reference']}'s "
            "in every lane."
        )
    else:
        lines.append(
            f"Parameters after {rounds} steps DIFFER from {check['reference']}'s in: "
            + ", ".join(check["differ"])
        )
    return lines


def _print_report(doc: dict[str, Any]) -> None:
    for line in headline(doc):
        print(line)
    print()
    print(format_table([c[0] for c in COLUMNS], [cells(r) for r in doc["rows"]], left=2))
    print()
    for t in doc["targets"]:
        print(f"target {t['verdict']}: {t['target']} ({t['value']})")
    traced = [
        f"{n} {t['seconds'] / r['step_s']:.2f}x"
        for n, t in doc["timelines"].items()
        for r in doc["rows"]
        if r["name"] == n
    ]
    if traced:
        print("traced step (--plot) against the lane's median: " + ", ".join(traced))
        slow = [n for n, t in doc["timelines"].items() if t["seconds"] > 1.1 * _median(doc, n)]
        if slow:
            print(
                f"(traced {', '.join(slow)} more than 10% slower than the median: a busy machine)"
            )
    print()
    print(doc["machine_line"])
    print(
        f"device {doc['device']}; {Shape(**doc['shape'])}; "
        f"saved {doc['saved_bytes'] / MB:.1f} MiB/step"
    )
    isolated = "each lane in its own process" if doc["isolated"] else "every lane in one process"
    timed = len(doc["steps"][doc["rows"][0]["name"]])
    print(f"{doc['warmup']} warm-up + {timed} timed rounds, {isolated}; on {doc['scratch_fs']}")
    print(_LEGEND)


def _mib(nbytes: float) -> str:
    """A headline size: MiB, or words where the process held less than at its start."""
    return f"{nbytes / MB:.1f} MiB" if nbytes >= 0 else "less than at the start"


def _median(doc: dict[str, Any], name: str) -> float:
    return float(statistics.median(x["seconds"] for x in doc["steps"][name]))


_LEGEND = """\
step s: median of forward + backward + SGD; faults: minor page faults per step
peak: most a step held above the lane's start (peak RSS; GPU: reserved, or allocated
  with --shared); live: malloc's
  bytes in use (GPU: allocated) at the end of forward, above the start
act: peak - (none's peak - saved bytes); act cut: 1 - act / saved, the share of the saved
  bytes a lane took out of the peak (above 100% where a lane also gives back free heap
  that none keeps)"""


if __name__ == "__main__":
    sys.exit(main())

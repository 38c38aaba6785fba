"""Markdown tables from the JSON the benchmarks write, for docs/benchmarks.md.

Reads what the ``--json`` of ``bench/step.py``, ``compiled.py``, ``gpu.py``,
``ab.py`` and ``hostcost.py`` write and prints, per file, the command that made
it, the machine it ran on, and one markdown table per part of the result:

- ``step.py``: step time per mode; memory per mode (default allocator, the
  tuned allocator as labelled columns); the budget mode against its budget;
  what disk's IO costs moved by a bare thread (ioreplay, iospread; iobudget
  moves budget's bytes); the write cap's memory; the targets as met / not met;
- ``compiled.py``: prefetch hit rate, IO and unpack order per compile mode;
- ``gpu.py``: step time and memory per mode; the budget mode against its budget
  and copybudget (a bare stream moving the same bytes); its targets as PASS / FAIL;
- ``ab.py``: engine settings side by side (step time, CPU, steal, page faults);
- ``hostcost.py``: GB/s, guest CPU and hypervisor steal per GB of disk IO.

The tables are computed from the JSON alone (nothing is measured here, and
torch is not imported), so a doc that pastes them cannot drift from the files
it cites. Sizes are MiB (2^20 bytes) unless a column says GB.

Example::

    python bench/report.py docs/results/*.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
import _text

__all__ = ["fmt", "kind_of", "main", "markdown_table", "render"]

MiB = float(1 << 20)
# A cell: ``value * scale`` formatted with ``spec`` plus ``suffix``; empty for None.
fmt = functools.partial(_text.fmt, none="")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """A GitHub markdown table; the first ``left`` columns left-aligned, the others right."""
    align = ["---"] * left + ["--:"] * (len(header) - left)
    lines = [header, align, *rows]
    return "\n".join("| " + " | ".join(str(c) for c in line) + " |" for line in lines)


def kind_of(doc: Any) -> str | None:
    """Which benchmark wrote ``doc`` (a key of ``RENDERERS``), or None."""
    if not isinstance(doc, dict):
        return None
    if doc.get("bench") in RENDERERS:
        return str(doc["bench"])
    rows = doc.get("rows") or [{}]
    if "timelines" in doc or "memory_probes" in doc:
        return "step.py"
    if "hit_rate_per_step" in rows[0]:
        return "compiled.py"
    if "targets" in doc and "fwd_peak_bytes" in rows[0]:
        return "gpu.py"
    return None


def _header(doc: dict[str, Any], title: str) -> list[str]:
    out = [f"**{title}**", ""]
    if doc.get("command"):
        out.append(f"Command: `{doc['command']}`")
    line = doc.get("machine_line")
    if line is None and doc.get("machine"):
        m = doc["machine"]
        line = ", ".join(f"{k} {v}" for k, v in m.items())
    if line:
        if line.startswith("bench/") and " on " in line:  # "bench/step.py on HOST: ..."
            line = line.split(" on ", 1)[1]
        out.append(f"Machine: {line}")
    out.append("")
    return out


def _per_step(total: float | None, steps: int) -> float | None:
    return None if total is None or not steps else total / steps


def _checkpointed(shape: dict[str, Any]) -> str:
    """ ", every block checkpointed (reentrant)" where the run checkpointed its blocks."""
    mode = shape.get("checkpoint", "off")
    return "" if mode == "off" else f", every block checkpointed ({mode})"


# -- bench/step.py -----------------------------------------------------------------------


def _step_time(doc: dict[str, Any]) -> str:
    deltas = doc.get("timed_counter_deltas", {})
    body = []
    for r in doc["rows"]:
        trims = deltas.get(r["mode"], {}).get("heap_trims")
        body.append(
            (
                f"{r['mode']}",
                r["label"],
                fmt(r["median_step_s"], ".3f"),
                fmt(r["ratio"], ".2f", suffix="x"),
                fmt(r["offloaded_per_step"], ".1f", 1 / MiB),
                fmt(r["hit_rate"], ".1f", 100, "%"),
                fmt(r["stall_per_step"], ".3f"),
                fmt(r["steal_per_step"], ".3f"),
                fmt(r.get("faults_per_step"), ".0f"),
                fmt(_per_step(trims, r["steps"]), ".1f"),
            )
        )
    header = (
        "mode",
        "what",
        "step s",
        "vs none",
        "written MiB/step",
        "hit rate",
        "stall s/step",
        "steal s/step",
        "page faults/step",
        "heap trims/step",
    )
    return markdown_table(header, body, left=2)


def _step_memory(doc: dict[str, Any]) -> str | None:
    rows = [r for r in doc["rows"] if r.get("peak_bytes") or r.get("tuned_peak_bytes")]
    if not rows:
        return None
    body = [
        (
            r["mode"],
            fmt(r["peak"], ".1f", 1 / MiB),
            fmt(r["forward_peak"], ".1f", 1 / MiB),
            fmt(r["backward_peak"], ".1f", 1 / MiB),
            fmt(r["act_mem"], ".1f", 1 / MiB),
            fmt(r["act_cut"], ".0f", 100, "%"),
            fmt(r["heap"], ".1f", 1 / MiB),
            fmt(r["cache"], ".1f", 1 / MiB),
            fmt(r["tuned_act_mem"], ".1f", 1 / MiB),
            fmt(r["tuned_act_cut"], ".0f", 100, "%"),
        )
        for r in rows
    ]
    header = (
        "mode",
        "peak MiB",
        "forward peak MiB",
        "backward peak MiB",
        "activation MiB",
        "activation cut",
        "heap live MiB",
        "page cache MiB",
        "tuned allocator: activation MiB",
        "tuned allocator: cut",
    )
    return markdown_table(header, body)


def _step_budget(doc: dict[str, Any]) -> str | None:
    by_mode = {r["mode"]: r for r in doc["rows"]}
    engine = [by_mode[m] for m in ("disk", "budget") if m in by_mode]
    if "budget" not in by_mode:
        return None
    disk_s = by_mode["disk"]["median_step_s"] if "disk" in by_mode else None
    target = (doc.get("target") or {}).get("budget", {})
    body = []
    for r in engine:
        limit = target.get("peak_limit") if r["mode"] == "budget" else None
        body.append(
            (
                r["mode"],
                fmt(r["device_budget"], ".1f", 1 / MiB),
                fmt(r["peak"], ".1f", 1 / MiB),
                fmt(limit, ".1f", 1 / MiB),
                fmt(r["move_target"], ".1f", 1 / MiB),
                fmt(r["offloaded_per_step"], ".1f", 1 / MiB),
                fmt(r["moved_ratio"], ".2f", suffix="x"),
                fmt(r.get("demoted_per_step"), ".1f", 1 / MiB),
                fmt(r["ratio"], ".2f", suffix="x"),
                fmt(None if disk_s is None else r["median_step_s"] / disk_s, ".2f", suffix="x"),
            )
        )
    header = (
        "mode",
        "device_budget MiB",
        "peak MiB",
        "peak limit MiB",
        "saved - budget MiB",
        "written MiB/step",
        "written / (saved - budget)",
        "demoted MiB/step",
        "step vs none",
        "step vs disk",
    )
    return markdown_table(header, body)


def _step_io(doc: dict[str, Any]) -> str | None:
    by_mode = {r["mode"]: r for r in doc["rows"]}
    replays = ("ioreplay", "iospread", "iobudget")
    modes = [m for m in ("none", *replays, "disk") if m in by_mode]
    if not set(replays) & set(modes):
        return None
    # The reference for disk's IO: iospread, else ioreplay (iobudget moves budget's bytes).
    ref = next(by_mode[m] for m in ("iospread", "ioreplay", "iobudget") if m in by_mode)
    body = [
        (
            m,
            by_mode[m]["label"],
            fmt(by_mode[m]["ratio"], ".2f", suffix="x"),
            fmt(by_mode[m]["median_step_s"] / ref["median_step_s"], ".2f", suffix="x"),
            fmt(by_mode[m]["offloaded_per_step"], ".1f", 1 / MiB),
            fmt(by_mode[m]["steal_per_step"], ".3f"),
            fmt(by_mode[m].get("faults_per_step"), ".0f"),
        )
        for m in modes
    ]
    header = (
        "mode",
        "what",
        "vs none",
        f"vs {ref['mode']}",
        "written MiB/step",
        "steal s/step",
        "page faults/step",
    )
    return markdown_table(header, body, left=2)


# Swept knobs of bench/step.py (--pending-sweep, --trim-sweep): the JSON key, the
# column of the swept value, and the engine counters (over the probed steps) shown
# beside disk's memory: (header, counter, format, scale, per step).
_SWEEPS: dict[str, tuple[str, str, tuple[tuple[str, str, str, float, bool], ...]]] = {
    "max_pending_write_bytes": (
        "pending_sweep",
        "max_pending_write_bytes MiB",
        (
            ("peak pending MiB", "peak_pending_write_bytes", ".1f", 1 / MiB, False),
            ("pack wait s/step", "pack_wait_seconds", ".4f", 1.0, True),
        ),
    ),
    "heap_trim_bytes": (
        "trim_sweep",
        "heap_trim_bytes MiB",
        (
            ("heap trims/step", "heap_trims", ".1f", 1.0, True),
            ("trim s/step", "heap_trim_seconds", ".4f", 1.0, True),
        ),
    ),
}


def _step_sweep(doc: dict[str, Any], knob: str) -> str | None:
    key, label, extra = _SWEEPS[knob]
    items = doc.get(key) or []
    none = next((r for r in doc["rows"] if r["mode"] == "none"), None)
    if not items:
        return None
    saved = doc["saved_activation_bytes"]
    default = doc["knobs"][knob]
    body = []
    for item in items:
        probe = item["probe"]
        peak = max(probe["step_peak_bytes"]) if probe.get("step_peak_bytes") else None
        act = None
        if peak is not None and none is not None and none.get("peak") is not None:
            act = peak - (none["peak"] - saved)
        steps = probe.get("probed_steps") or 1
        counters = probe.get("counters", {})
        value = item[knob]
        shown = fmt(value, ".0f", 1 / MiB) if value else "off"
        body.append(
            (
                shown + (" (default)" if value == default else ""),
                fmt(peak, ".1f", 1 / MiB),
                fmt(act, ".1f", 1 / MiB),
                fmt(None if act is None else 1 - act / saved, ".0f", 100, "%"),
                *(
                    fmt(
                        _per_step(counters.get(c), steps) if per_step else counters.get(c),
                        spec,
                        scale,
                    )
                    for _, c, spec, scale, per_step in extra
                ),
            )
        )
    header = (label, "peak MiB", "activation MiB", "activation cut", *(h for h, *_ in extra))
    return markdown_table(header, body)


def _step_targets(doc: dict[str, Any]) -> str | None:
    if doc.get("shape", {}).get("checkpoint", "off") != "off":
        return None  # the targets are set on the benchmark without checkpointing
    target = doc.get("target") or {}
    body = []

    def met(ok: bool | None) -> str:
        return "" if ok is None else ("met" if ok else "**not met**")

    disk = target.get("disk")
    if disk:
        body.append(
            (
                "disk (device_budget 0): activation memory cut",
                f">= {disk['needed'] * 100:.0f}%",
                fmt(disk["act_cut"], ".0f", 100, "%"),
                met(disk["met"]),
            )
        )
    budget = target.get("budget") or {}
    if "peak" in budget:
        body.append(
            (
                "budget: peak",
                f"<= {budget['peak_limit'] / MiB:.1f} MiB",
                fmt(budget["peak"], ".1f", 1 / MiB, " MiB"),
                met(budget["peak_met"]),
            )
        )
    # (what, needs, the ratio's key, its verdict's key).
    limit = budget.get("iobudget_limit", 1.05)
    ratios = (
        ("budget: written per step / (saved - budget)", "0.90x-1.10x", "moved_ratio", "moved_met"),
        ("budget: step time / disk's", "< 1.00x", "time_vs_disk", "time_met"),
        ("budget: step time / iobudget's", f"<= {limit:.2f}x", "time_vs_iobudget", "iobudget_met"),
    )
    for what, needs, key, verdict in ratios:
        if key in budget and verdict in budget:
            body.append((what, needs, fmt(budget[key], ".2f", suffix="x"), met(budget[verdict])))
    if not body:
        return None
    return markdown_table(("target", "needs", "measured", "verdict"), body, left=4)


def _render_step(doc: dict[str, Any]) -> list[str]:
    shape = doc["shape"]
    saved = doc["saved_activation_bytes"]
    steps = doc["rows"][0]["steps"] if doc["rows"] else 0
    out = _header(doc, "bench/step.py")
    out.append(
        f"Model: TinyTransformer, {shape['depth']} blocks, width {shape['width']}, "
        f"{shape['heads']} heads, batch {shape['batch']} x {shape['seq']} tokens"
        f"{_checkpointed(shape)}; "
        f"{saved / MiB:.1f} MiB saved for backward per step; {steps} timed steps per mode, "
        f"interleaved; scratch on {doc.get('scratch_fs')}"
        + (f", disk io_method {doc['disk_io_method']}" if doc.get("disk_io_method") else "")
        + "."
    )
    check = doc.get("check", {})
    out.append(
        "Final parameters of every mode bit-identical to none's: "
        + ("yes." if check.get("ok") else f"**no**: {'; '.join(check.get('problems', []))}")
    )
    out.append("")
    parts: list[tuple[str, Callable[[dict[str, Any]], str | None]]] = [
        ("Step time (median over the timed steps)", _step_time),
        (
            "Memory over whole training steps (peak RSS above the RSS before training; "
            "glibc's default allocator, then MALLOC_MMAP_THRESHOLD_=65536 as 'tuned')",
            _step_memory,
        ),
        ("Budget: disk with a device_budget, against disk", _step_budget),
        ("IO: disk's bytes moved by a bare thread, no hooks", _step_io),
        (
            "Disk's memory by write cap (default allocator, one probe each)",
            functools.partial(_step_sweep, knob="max_pending_write_bytes"),
        ),
        (
            "Disk's memory by heap_trim_bytes (default allocator, one probe each)",
            functools.partial(_step_sweep, knob="heap_trim_bytes"),
        ),
        ("Targets (default allocator, whole steps)", _step_targets),
    ]
    for title, part in parts:
        table = part(doc)
        if table is not None:
            out += [f"*{title}*", "", table, ""]
    return out


# -- bench/compiled.py -------------------------------------------------------------------


def _render_compiled(doc: dict[str, Any]) -> list[str]:
    shape = doc["shape"]
    out = _header(doc, "bench/compiled.py")
    args = doc.get("args", {})
    seqs = doc.get("seq_lengths") or [shape["seq"]]
    tokens = (
        f"{shape['batch']} x {seqs[0]} tokens"
        if len(set(seqs)) == 1
        else f"{shape['batch']} sequences of {', '.join(map(str, seqs))} tokens in turn, "
        "one length per step"
    )
    out.append(
        f"Model: TinyTransformer, {shape['depth']} blocks, width {shape['width']}, batch "
        f"{tokens}{_checkpointed(shape)}; {args.get('warmup', '?')} warm-up + "
        f"{args.get('steps', '?')} timed steps per mode; each mode against the same "
        "compile mode without offload, run one after the other."
    )
    out.append("")
    body = []
    for r in doc["rows"]:
        last = r["steps"][-1].get("unpack_order") or {}
        body.append(
            (
                r["mode"],
                r["label"],
                fmt(r["ref_median_step_s"], ".3f"),
                fmt(r["median_step_s"], ".3f"),
                fmt(r["median_step_s"] / r["ref_median_step_s"], ".2f", suffix="x"),
                fmt(r["hit_rate"], ".0f", 100, "%"),
                " ".join(fmt(h, ".0f", 100, "%") for h in r["hit_rate_per_step"]),
                fmt(r["bytes_offloaded_per_step"], ".1f", 1 / MiB),
                fmt(r["bytes_read_per_step"], ".1f", 1 / MiB),
                fmt(r["stall_seconds_per_step"], ".3f"),
                fmt(last.get("reverse_fraction"), ".2f"),
                f"{r['ref_graphs']}/{r['graphs']}",
                "yes" if r["exact"] else "**no**",
            )
        )
    header = (
        "mode",
        "what",
        "no offload s",
        "disk s",
        "vs no offload",
        "hit rate",
        "hit rate per step",
        "written MiB/step",
        "read MiB/step",
        "stall s/step",
        "unpacks in reverse pack order",
        "graphs",
        "bit-identical",
    )
    out += ["*Prefetch under torch.compile*", "", markdown_table(header, body, left=2), ""]
    return out


# -- bench/gpu.py ------------------------------------------------------------------------


def _render_gpu(doc: dict[str, Any]) -> list[str]:
    out = _header(doc, "bench/gpu.py")
    args, env = doc.get("args", {}), doc.get("env", {})
    out.append(
        f"Device: {doc.get('device')}, torch {doc.get('torch')}; {args.get('dtype')} width "
        f"{args.get('width')}, {args.get('depth')} blocks, batch {args.get('batch')} x "
        f"{args.get('seq')} tokens"
        + (
            f"; link D2H {env['d2h_gbps']:.1f} GB/s, H2D {env['h2d_gbps']:.1f} GB/s"
            if "d2h_gbps" in env
            else ""
        )
        + "."
    )
    out.append("")
    rows = doc["rows"]
    ref = rows[0]
    ref_fwd = statistics.median(ref["fwd_peak_bytes"]) if ref["fwd_peak_bytes"] else 0
    body = []
    for r in rows:
        fwd = statistics.median(r["fwd_peak_bytes"]) if r["fwd_peak_bytes"] else None
        step = statistics.median(r["step_peak_bytes"]) if r["step_peak_bytes"] else None
        cut = None if fwd is None or not ref_fwd else 1 - fwd / ref_fwd
        body.append(
            (
                r["mode"],
                fmt(r["median_step_s"], ".1f", 1e3),
                fmt(r["median_step_s"] / ref["median_step_s"], ".2f", suffix="x"),
                fmt(fwd, ".2f", 1e-9),
                fmt(cut, ".0f", 100, "%"),
                fmt(step, ".2f", 1e-9),
                fmt(r.get("bytes_offloaded_per_step"), ".2f", 1e-9),
                fmt(r.get("hit_rate"), ".2f"),
                fmt(r.get("stall_seconds_per_step"), ".1f", 1e3),
                r["exact"],
            )
        )
    header = (
        "mode",
        "step ms",
        "vs none",
        "forward peak GB",
        "cut",
        "step peak GB",
        "offloaded GB/step",
        "hit rate",
        "stall ms/step",
        "exact",
    )
    out += ["*Step time and allocated memory*", "", markdown_table(header, body), ""]
    budget = _gpu_budget(doc)
    if budget is not None:
        out += ["*Device budget*", "", budget, ""]
    targets = doc.get("targets") or []
    if targets:
        t_body = [(t["target"], t["verdict"], t["value"]) for t in targets]
        table = markdown_table(("target", "verdict", "measured"), t_body, left=3)
        out += ["*Targets*", "", table, ""]
    return out


def _gpu_budget(doc: dict[str, Any]) -> str | None:
    """The budget and copybudget rows against ``saved - device_budget``, or None if
    neither ran (or the JSON predates them). Sizes are KiB where one forward saves
    less than a MiB (the CPU twin's toy model), else MiB."""
    saved, held = doc.get("saved_activation_bytes"), doc.get("device_budget")
    by = {r["mode"]: r for r in doc["rows"]}
    modes = [m for m in ("budget", "copybudget") if m in by]
    if saved is None or held is None or not modes:
        return None
    unit, scale = ("KiB", 1 / 1024) if saved < MiB else ("MiB", 1 / MiB)
    move = saved - held
    body = []
    for mode in modes:
        r = by[mode]
        moved = r.get("bytes_offloaded_per_step")
        step = statistics.median(r["step_peak_bytes"]) if r["step_peak_bytes"] else None
        body.append(
            (
                mode,
                fmt(held, ".1f", scale),
                fmt(move, ".1f", scale),
                fmt(moved, ".1f", scale),
                fmt(moved / move if moved is not None and move > 0 else None, ".3f", suffix="x"),
                fmt(r.get("bytes_demoted_to_host_per_step"), ".1f", scale),
                fmt(r.get("peak_device_tier_bytes"), ".1f", scale),
                fmt(step, ".1f", scale),
                fmt(r["median_step_s"], ".1f", 1e3),
            )
        )
    header = (
        "mode",
        f"device_budget {unit}",
        f"saved - budget {unit}",
        f"moved {unit}/step",
        "vs saved - budget",
        f"demoted to host {unit}/step",
        f"device tier peak {unit}",
        f"step peak {unit}",
        "step ms",
    )
    return (
        f"One forward saves {saved * scale:.1f} {unit}; device_budget {held * scale:.1f} "
        f"{unit} ({fmt(doc.get('args', {}).get('budget_fraction'), 'g')} x saved).\n\n"
        + markdown_table(header, body)
    )


# -- bench/ab.py -------------------------------------------------------------------------


def _render_ab(doc: dict[str, Any]) -> list[str]:
    shape = doc["shape"]
    out = _header(doc, "bench/ab.py")
    out.append(
        f"Model: TinyTransformer, {shape['depth']} blocks, width {shape['width']}, batch "
        f"{shape['batch']} x {shape['seq']} tokens"
        + _checkpointed(shape)
        + "; "
        + ("a process per configuration" if doc.get("isolate") else "one process")
        + f", one step of each configuration per round, {doc['rounds']} timed rounds after "
        f"{doc['warmup']}."
    )
    if doc.get("unchecked"):
        out.append(
            f"Not checked for exactness (their IO is skipped on purpose): "
            f"{', '.join(doc['unchecked'])}."
        )
    out.append("")
    body = [
        (
            r["name"],
            "no offload"
            if r["knobs"] is None
            else (json.dumps(r["knobs"]) if r["knobs"] else "defaults"),
            fmt(r["step_s"], ".3f"),
            fmt(r["ratio"], ".2f", suffix="x"),
            fmt(r["user_s"] + r["sys_s"], ".3f"),
            fmt(r["steal_s"], ".3f"),
            fmt(r.get("faults_per_step"), ".0f"),
            fmt(r.get("mb_per_step"), ".0f"),
            fmt(r.get("hit_rate"), ".0f", 100, "%"),
        )
        for r in doc["rows"]
    ]
    header = (
        "config",
        "settings",
        "step s",
        "vs none",
        "CPU s/step",
        "steal s/step",
        "page faults/step",
        "written MB/step",
        "hit rate",
    )
    out += ["*Settings side by side*", "", markdown_table(header, body, left=2), ""]
    return out


# -- bench/hostcost.py -------------------------------------------------------------------


def _render_hostcost(doc: dict[str, Any]) -> list[str]:
    out = _header(doc, "bench/hostcost.py")
    out.append(
        f"{doc['total_mib']} MiB per row in {doc['request_mib']} MiB O_DIRECT requests; "
        "idle: the other CPUs idle; loaded: one busy-looping process per CPU, as in training."
    )
    out.append("")
    body = [
        (
            r["load"],
            r["buffer"],
            r["op"],
            fmt(r["gbps"], ".2f"),
            fmt(r["cpu_ms_per_gb"], ".0f"),
            fmt(r["steal_ms_per_gb"], ".0f"),
        )
        for r in doc["rows"]
    ]
    header = ("load", "buffer", "op", "GB/s", "guest CPU ms/GB", "steal ms/GB")
    out += ["*What a disk request costs*", "", markdown_table(header, body, left=3), ""]
    return out


RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "step.py": _render_step,
    "compiled.py": _render_compiled,
    "gpu.py": _render_gpu,
    "ab.py": _render_ab,
    "hostcost.py": _render_hostcost,
}


def render(doc: dict[str, Any]) -> str:
    """The markdown for one benchmark's JSON; ValueError if no benchmark here wrote it."""
    kind = kind_of(doc)
    if kind is None:
        raise ValueError(f"not the JSON of any of: {', '.join(f'bench/{k}' for k in RENDERERS)}")
    lines = RENDERERS[kind](doc)
    # The lines between the title and the first table's caption (command, machine, run)
    # as a list, so that markdown keeps them apart.
    first = next((i for i, x in enumerate(lines) if x.startswith("*") and i > 0), len(lines))
    head, rest = lines[:first], lines[first:]
    lines = [head[0], "", *(f"- {x}" for x in head[1:] if x), "", *rest]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Print the tables of every file given; returns 1 if a file could not be read."""
    p = argparse.ArgumentParser(
        prog="bench/report.py", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    p.add_argument("files", nargs="+", type=Path, help="JSON written by a benchmark's --json")
    args = p.parse_args(argv)
    status = 0
    blocks = []
    for path in args.files:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            text = render(doc)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"bench/report.py: {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
            status = 1
            continue
        blocks.append(text)
    print("\n".join(blocks), end="")
    return status


if __name__ == "__main__":
    sys.exit(main())

"""The text around the benchmarks' tables: the step benchmark's columns, cells, aligned
columns, the machine line, the keys every JSON begins with, and progress lines on stderr.

Nothing here imports torch, so that ``bench/report.py`` can use it too.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from typing import Any

__all__ = [
    "COLUMNS",
    "cells",
    "end_progress",
    "fmt",
    "format_table",
    "json_header",
    "log",
    "machine_line",
    "progress",
    "with_vs_io",
]


def fmt(
    value: float | None, spec: str, scale: float = 1.0, suffix: str = "", *, none: str = "n/a"
) -> str:
    """``value * scale`` formatted with ``spec`` plus ``suffix``; ``none`` for None."""
    if value is None:
        return none
    text = format(value * scale, spec)
    if text.startswith("-") and float(text) == 0:  # "-0%" reads like a loss
        text = text[1:]
    return text + suffix


_MIB = 1 / float(1 << 20)
# The step benchmark's columns: (header, row key[, format spec, scale, suffix]); the
# first two are text (the lane and what it runs).
COLUMNS: tuple[tuple[Any, ...], ...] = (
    ("lane", "name"),
    ("what", "label"),
    ("step s", "step_s", ".3f"),
    ("vs none", "ratio", ".2f", 1.0, "x"),
    ("vs iospread", "vs_io", ".2f", 1.0, "x"),
    ("faults/step", "faults", ".0f"),
    ("peak MiB", "peak", ".1f", _MIB),
    ("live MiB", "live", ".1f", _MIB),
    ("act MiB", "act", ".1f", _MIB),
    ("act cut", "act_cut", ".0f", 100.0, "%"),
    ("written MiB/step", "offloaded", ".1f", _MIB),
    ("hit rate", "hit_rate", ".0f", 100.0, "%"),
    ("stall s/step", "stall", ".3f"),
    ("trims/step", "trims", ".1f"),
)


def with_vs_io(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with ``vs_io``: each step time over the bare-IO lane's (``iospread``),
    the limit a disk offloader's step lives within; None without that lane."""
    io = next((r["step_s"] for r in rows if r["name"] == "iospread"), None)
    return [{**r, "vs_io": None if io is None else r["step_s"] / io} for r in rows]


def cells(row: dict[str, Any], none: str = "n/a") -> list[str]:
    """A step benchmark row's cells, in the order of :data:`COLUMNS`."""
    return [
        str(row[c[1]]) if len(c) == 2 else fmt(row.get(c[1]), *c[2:], none=none) for c in COLUMNS
    ]


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


def machine_line(prog: str, machine: dict[str, Any]) -> str:
    """One line naming the machine a report was measured on (``_common.machine_info``)."""
    parts = [f"{machine['cores']} cores ({machine['usable_cores']} usable)"]
    if machine.get("cpu"):
        parts.append(str(machine["cpu"]))
    if machine.get("memory_gib"):
        parts.append(f"{machine['memory_gib']:g} GiB RAM")
    if machine.get("system"):
        parts.append(str(machine["system"]))
    parts.append(f"torch {machine['torch']} ({machine['torch_threads']} threads)")
    parts.append(f"python {machine['python']}")
    if machine.get("load_average") is not None:
        parts.append(f"load average {machine['load_average']:g} at the start")
    return f"{prog} on {machine['host']}: " + ", ".join(parts)


def json_header(script: str, words: Sequence[str], machine: dict[str, Any]) -> dict[str, Any]:
    """The keys every benchmark's JSON begins with: the script (``"step.py"``), the command
    that ran it with ``words`` as its arguments (after the allocator's settings, where the
    environment has them: they change every figure), the machine and its
    :func:`machine_line`."""
    prog = f"bench/{script}"
    env = [f"{k}={os.environ[k]}" for k in ("GLIBC_TUNABLES", "LD_PRELOAD") if os.environ.get(k)]
    return {
        "bench": script,
        "command": shlex.join([*env, "python", prog, *words]),
        "machine": machine,
        "machine_line": machine_line(prog, machine),
    }


def log(msg: str) -> None:
    """A line on stderr (after clearing a :func:`progress` line)."""
    end_progress()
    print(msg, file=sys.stderr, flush=True)


def progress(msg: str) -> None:
    """A progress line on stderr: on a terminal, one line rewritten in place (cleared
    before the report, which then leads the output); elsewhere, a line per call."""
    if not sys.stderr.isatty():
        print(msg, file=sys.stderr, flush=True)
        return
    width = shutil.get_terminal_size().columns - 1
    sys.stderr.write("\r\033[K" + msg[:width])
    sys.stderr.flush()


def end_progress() -> None:
    """Clear the :func:`progress` line, if stderr is a terminal."""
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()

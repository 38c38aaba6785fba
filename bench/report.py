"""Markdown tables from the JSON the benchmarks write, for docs/benchmarks.md.

Per file: the command that made it, the machine it ran on, and its table:
``step.py`` one row per lane (the columns ``bench/step.py`` prints, those
measured in no row left out) and its targets; ``sweep.py`` one row per cell;
``io.py`` engine against raw bandwidth, or with ``--cost`` the CPU per GB;
``recompute.py`` its own tables (``bench/recompute.py``'s ``markdown``).
Nothing is measured here, so a doc that pastes the tables cannot drift from the
files it cites. ``--update FILE`` rewrites, in a markdown file, every block between
``<!-- report.py PATH -->`` and ``<!-- end report.py -->`` with the tables of the
JSON at PATH (relative to the working directory). Examples::

    python bench/report.py docs/results/*.json
    python bench/report.py --update docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
from _text import COLUMNS, cells, with_vs_io

__all__ = ["main", "markdown_table", "render", "update"]

MiB = float(1 << 20)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """A GitHub markdown table; the first ``left`` columns left-aligned, the others right."""
    align = ["---"] * left + ["--:"] * (len(header) - left)
    lines = [list(header), align, *rows]
    return "\n".join("| " + " | ".join(str(c) for c in line) + " |" for line in lines)


def _step(doc: dict[str, Any]) -> list[str]:
    rows = [cells(r, none="") for r in with_vs_io(doc["rows"])]
    keep = [i for i, c in enumerate(COLUMNS) if i < 2 or any(r[i] for r in rows)]
    shape = doc["shape"]
    where = "each lane in its own process" if doc["isolated"] else "every lane in one process"
    timed = len(next(iter(doc["steps"].values())))
    out = [
        f"- Model: TinyTransformer, {shape['depth']} blocks, width {shape['width']}, batch "
        f"{shape['batch']} x {shape['seq']} tokens"
        + "".join(
            f", {k} {v}" for k, v in shape.items() if k in ("checkpoint", "compile") and v != "off"
        )
        + f" ({doc['device']}); {doc['saved_bytes'] / MiB:.1f} MiB saved for backward per step;"
        f" {doc['warmup']} warm-up + {timed} timed rounds, {where}.",
        f"- Final parameters of every lane bit-identical to {doc['check']['reference']}'s: "
        + ("yes" if doc["check"]["ok"] else "NO (" + ", ".join(doc["check"]["differ"]) + ")"),
        "",
        markdown_table([COLUMNS[i][0] for i in keep], [[r[i] for i in keep] for r in rows], left=2),
    ]
    return out


def _sweep(doc: dict[str, Any]) -> list[str]:
    head = ["prefetch_depth", "io_workers", "pending MiB", "vs none", "stall s/step", "hit rate"]
    rows = [
        [
            str(c["prefetch_depth"]),
            str(c["io_workers"]),
            f"{c['max_pending_write_bytes'] / MiB:.0f}",
            f"{c['ratio']:.2f}x",
            f"{c['stall']:.3f}",
            "" if c["hit_rate"] is None else f"{c['hit_rate']:.0%}",
        ]
        for c in doc["cells"]
    ]
    return ["", markdown_table(head, rows, left=0)]


def _io(doc: dict[str, Any]) -> list[str]:
    if "cost" in doc:
        head = ["load", "buffer", "op", "GB/s", "guest CPU ms/GB", "steal ms/GB"]
        rows = [
            [
                c["load"],
                c["buffer"],
                c["op"],
                f"{c['gbps']:.2f}",
                f"{c['cpu_ms_per_gb']:.0f}",
                "" if c["steal_ms_per_gb"] is None else f"{max(c['steal_ms_per_gb'], 0):.0f}",
            ]
            for c in doc["cost"]
        ]
        return ["", markdown_table(head, rows, left=3)]
    head = ["kind", "request MiB", "workers", "write GB/s", "read GB/s", "write/raw", "read/raw"]
    rows = [
        [r["kind"], str(r["request_mib"]), str(r["workers"])]
        + [f"{r[k]:.2f}" for k in ("write_gbps", "read_gbps", "write_ratio", "read_ratio")]
        for r in doc["rows"]
    ]
    return ["", markdown_table(head, rows, left=1)]


def _recompute(doc: dict[str, Any]) -> list[str]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # however report was loaded
    import recompute

    return ["", recompute.markdown(doc)]


RENDERERS = {"step.py": _step, "sweep.py": _sweep, "io.py": _io, "recompute.py": _recompute}


def render(doc: dict[str, Any]) -> str:
    """One benchmark JSON as markdown: its command, its machine, its tables."""
    lines = [f"- Command: `{doc['command']}`"]
    machine = doc.get("machine_line", "")
    lines.append(f"- Machine: {machine.split(': ', 1)[-1]}")
    lines += RENDERERS[doc["bench"]](doc)
    return "\n".join(lines) + "\n"


_BLOCK = re.compile(r"(<!-- report\.py (\S+) -->\n).*?(<!-- end report\.py -->)", re.S)


def update(path: Path) -> None:
    """Regenerate every marked block of the markdown file ``path`` (see above)."""
    text = path.read_text(encoding="utf-8")

    def block(m: re.Match[str]) -> str:
        doc = json.loads(Path(m.group(2)).read_text(encoding="utf-8"))
        return m.group(1) + render(doc) + m.group(3)

    path.write_text(_BLOCK.sub(block, text), encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/report.py", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", type=Path, help="JSON written by a benchmark's --json")
    p.add_argument("--update", type=Path, default=None, metavar="MARKDOWN")
    args = p.parse_args(argv)
    if args.update is not None:
        update(args.update)
    status = 0
    for path in args.files:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            print(f"{path}: {exc}", file=sys.stderr)
            status = 1
            continue
        if not isinstance(doc, dict) or doc.get("bench") not in RENDERERS:
            print(f"{path}: not the JSON of any of: bench/{', '.join(RENDERERS)}", file=sys.stderr)
            status = 1
            continue
        print(f"### {path.name}\n\n{render(doc)}")
    return status


if __name__ == "__main__":
    sys.exit(main())

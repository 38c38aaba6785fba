"""``python -m prefetch_offload``: probe a scratch folder, or run the step benchmark.

Commands::

    python -m prefetch_offload probe --save-dir /scratch/acts [--json]
    python -m prefetch_offload bench -- --steps 4 --modes none,disk
    python -m prefetch_offload run train.py --lr 3e-4

``probe`` measures the folder's raw write and read bandwidth (:mod:`.probe`)
and prints a table and a suggested ``offload_context(...)`` call, or one JSON
object on stdout with ``--json``. A progress bar goes to stderr when stderr is
a terminal (or with ``--progress``).

``bench`` runs ``bench/step.py`` from the source checkout this package was
imported from, with this Python, passing on every argument after ``bench``
(after an optional ``--``); the benchmarks are not part of an installed wheel.

``run`` starts this Python on the arguments after ``run`` (a script, ``-m
module``, ``-c code``) with glibc's per-thread cache and fastbins turned off in
``GLIBC_TUNABLES`` (other tunables kept), so that the heap reuses freed
activations instead of needing trims (NOTE [heap trim] in heap.py). glibc reads
the setting only when a process starts: this command replaces itself with the
new Python (``exec``), whose children (DataLoader workers, ``torchrun``'s ranks)
inherit it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from .heap import fast_reuse_tunables, heap_trim_supported

if TYPE_CHECKING:
    from .probe import ProbeResult

__all__ = ["ProgressBar", "bench_script", "main", "run_environment"]

PROG = "python -m prefetch_offload"
# The probe (and torch, which its buffers need) is imported by the probe command
# only: --help and run start without it (run execs a Python that imports it anyway).
MiB = 1 << 20


class ProgressBar:
    """A one-line text progress bar: ``[#####.....] 5/10 probe 8 MiB x 2 workers``.

    On a terminal it redraws one line in place; elsewhere (a log file) it
    writes one line per update. Call it as a ``probe_bandwidth`` progress callback.
    """

    def __init__(self, stream: TextIO, width: int = 20) -> None:
        self.stream = stream
        self.width = width
        self.tty = stream.isatty()
        self._last = 0

    def __call__(self, done: int, total: int, label: str) -> None:
        filled = self.width * done // total if total else self.width
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} {label}"
        if self.tty:
            pad = " " * max(0, self._last - len(line))
            self.stream.write(f"\r{line}{pad}")
            self._last = len(line)
            if done >= total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def bench_script() -> Path:
    """Where ``bench/step.py`` is in a source checkout: next to the package's folder."""
    return Path(__file__).resolve().parent.parent / "bench" / "step.py"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers, got {text!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive whole numbers, got {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected one positive whole number, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Tuning tools for prefetch_offload (see docs/tuning.md).",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="{probe,bench,run}")
    probe = sub.add_parser(
        "probe",
        help="measure a folder's write/read bandwidth and suggest settings",
        description=(
            "Measure the raw write and read bandwidth of SAVE_DIR for each request size "
            "and worker count, with the library's own unlinked O_DIRECT scratch files, "
            "and suggest chunk_bytes, io_workers and prefetch_depth (a heuristic). "
            "Needs TOTAL_MIB of free space; leaves nothing in the folder."
        ),
    )
    probe.add_argument("--save-dir", required=True, help="the folder you will offload to")
    probe.add_argument(
        "--total-mib", type=_positive, default=256, help="MiB moved per measurement (256)"
    )
    probe.add_argument(
        "--requests",
        type=_int_list,
        default=[1, 8],
        metavar="MIB,...",
        help="request sizes in MiB, comma separated (1,8)",
    )
    probe.add_argument(
        "--workers",
        type=_int_list,
        default=[1, 2, 4],
        metavar="N,...",
        help="IO thread counts, comma separated (1,2,4)",
    )
    probe.add_argument(
        "--repeats", type=_positive, default=1, help="measure each cell N times, report medians"
    )
    probe.add_argument(
        "--json", action="store_true", help="print one JSON object (results, recommendation)"
    )
    probe.add_argument(
        "--progress",
        action="store_true",
        help="show the progress bar on stderr even when it is not a terminal",
    )
    # Listed for --help only: main() hands everything after "bench" to the script.
    sub.add_parser(
        "bench",
        help="run bench/step.py (source checkout only); every argument after bench goes to it",
        add_help=False,
    )
    sub.add_parser(
        "run",
        help="run python on the arguments after run, with glibc's fast reuse caches off",
        add_help=False,
    )
    return p


# probe_bandwidth's arguments, as the probe command's flags name them (its errors).
_PROBE_FLAGS = {
    "total_bytes": "--total-mib",
    "request_sizes": "--requests",
    "worker_counts": "--workers",
    "repeats": "--repeats",
}


def _run_probe(args: argparse.Namespace) -> int:
    from .probe import combined_gbps, probe_bandwidth, recommend
    from .slab import direct_io_supported

    show = args.progress or sys.stderr.isatty()
    # "~" as OffloadConfig reads it; the header's io_method must test the same folder.
    args.save_dir = os.path.expanduser(args.save_dir)
    try:
        results = probe_bandwidth(
            args.save_dir,
            total_bytes=args.total_mib * MiB,
            request_sizes=[r * MiB for r in args.requests],
            worker_counts=args.workers,
            repeats=args.repeats,
            progress=ProgressBar(sys.stderr) if show else None,
        )
    except ValueError as exc:
        message = str(exc).removeprefix("prefetch_offload: ")
        for name, flag in _PROBE_FLAGS.items():  # the flags this command was given
            message = message.replace(name, flag)
        print(f"{PROG} probe: error: {message}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{PROG} probe: IO error in {args.save_dir!r}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # as bench does; the scratch file had no name to leave behind
        print(f"{PROG} probe: interrupted", file=sys.stderr)
        return 130
    rec = recommend(results)
    direct = direct_io_supported(args.save_dir)
    if args.json:
        doc = {
            "save_dir": args.save_dir,
            "io_method": "direct" if direct else "buffered",
            "total_bytes": args.total_mib * MiB,
            "repeats": args.repeats,
            "results": [
                asdict(r) | {"combined_gbps": combined_gbps(r.write_gbps, r.read_gbps)}
                for r in results
            ],
            "recommendation": rec,
        }
        print(json.dumps(doc, indent=2))
        return 0
    _print_table(args, results, rec, direct)
    return 0


def _print_table(
    args: argparse.Namespace, results: list[ProbeResult], rec: dict[str, int], direct: bool
) -> None:
    from .probe import LOW_READ_GBPS, TOLERANCE, combined_gbps

    how = "O_DIRECT" if direct else "buffered (page cache included: reads may be optimistic)"
    median = f"median of {args.repeats}" if args.repeats > 1 else "1 run each"
    print(f"# {args.save_dir}: {how}, {args.total_mib} MiB per measurement, {median}")
    print(
        f"{'request MiB':>11} {'workers':>7} {'write GB/s':>10} {'read GB/s':>9} {'both GB/s':>9}"
    )
    for r in results:
        both = combined_gbps(r.write_gbps, r.read_gbps)
        print(
            f"{r.request_bytes / MiB:>11g} {r.workers:>7} {r.write_gbps:>10.2f} "
            f"{r.read_gbps:>9.2f} {both:>9.2f}"
        )
    chunk = rec["chunk_bytes"]
    chunk_text = f"{chunk // MiB} << 20" if chunk % MiB == 0 else str(chunk)
    print()
    print("both = 2 / (1/write + 1/read): the rate of writing a byte and reading it back.")
    print("Suggested settings (a heuristic; see docs/tuning.md, then check engine.stats()):")
    print()
    print(
        f'    offload_context("disk", save_dir={args.save_dir!r}, chunk_bytes={chunk_text}, '
        f"io_workers={rec['io_workers']}, prefetch_depth={rec['prefetch_depth']})"
    )
    print()
    cell = next(r for r in results if r.request_bytes == chunk and r.workers == rec["io_workers"])
    best = max(results, key=lambda r: combined_gbps(r.write_gbps, r.read_gbps))
    workers = f"{cell.workers} worker{'s' if cell.workers > 1 else ''}"
    print(
        f"Why: {cell.request_bytes / MiB:g} MiB x {workers} moves "
        f"{combined_gbps(cell.write_gbps, cell.read_gbps):.2f} GB/s both ways, the best cell "
        f"{combined_gbps(best.write_gbps, best.read_gbps):.2f}"
    )
    print(
        f"(within {TOLERANCE:.0%} of the best, a larger request or fewer workers win); "
        f"reads {cell.read_gbps:.2f} GB/s "
        f"{'<' if cell.read_gbps < LOW_READ_GBPS else '>='} {LOW_READ_GBPS} GB/s, "
        f"so prefetch_depth {rec['prefetch_depth']}."
    )


def _run_bench(rest: list[str]) -> int:
    if rest[:1] == ["--"]:
        rest = rest[1:]
    script = bench_script()
    if not script.is_file():
        print(
            f"{PROG} bench: error: the step benchmark is not at {script}. It ships with "
            "the source checkout of prefetch_offload, not with an installed wheel: clone "
            "the repository, install it with `pip install -e .`, and run this again "
            "(or run bench/step.py from the checkout directly).",
            file=sys.stderr,
        )
        return 2
    # The script imports prefetch_offload: make it the same copy this command runs.
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    try:
        rc = subprocess.call([sys.executable, str(script), *rest], env=env)
    except KeyboardInterrupt:
        return 130
    return 128 - rc if rc < 0 else rc


def run_environment(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with ``GLIBC_TUNABLES`` set as ``run`` starts Python with it."""
    out = dict(environ)
    out["GLIBC_TUNABLES"] = fast_reuse_tunables(environ.get("GLIBC_TUNABLES", ""))
    return out


def _run_python(rest: list[str]) -> int:
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if not rest:
        print(
            f"{PROG} run: error: say what to run, as you would after `python`: "
            f"`{PROG} run train.py --lr 3e-4`, `{PROG} run -m torch.distributed.run "
            "--nproc-per-node 2 train.py`",
            file=sys.stderr,
        )
        return 2
    if not heap_trim_supported():
        print(
            f"{PROG} run: note: this process's malloc is not glibc's (another allocator "
            "is preloaded, or another C library): GLIBC_TUNABLES changes nothing here.",
            file=sys.stderr,
        )
    env = run_environment(dict(os.environ))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *rest], env)
    except OSError as exc:
        print(f"{PROG} run: could not start {sys.executable}: {exc}", file=sys.stderr)
        return 1
    raise AssertionError("unreachable")  # pragma: no cover - execve does not return


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _run_bench(argv[1:])
    if argv[:1] == ["run"]:
        return _run_python(argv[1:])
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse has already printed
        return exc.code if isinstance(exc.code, int) else 2
    if args.command == "probe":
        return _run_probe(args)
    raise AssertionError(args.command)  # pragma: no cover - argparse rejects others

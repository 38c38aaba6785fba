"""Keep, offload or recompute: the memory-time curve of each way to train in less memory.

Every mode trains its own copy of one model (same weights, same batch) in a
process of its own (its peak RSS is its own heap's), stepped one at a time, one
step of each mode per round in a balanced Latin square's order (as ``bench/ab.py
--isolate``); each mode's ``offload_context`` or checkpoint wrapping stays
entered over all its steps. ``--warmup`` rounds (>= 21: ``recompute="auto"``
profiles nine steps, tries its plan for three (five where it moves nothing,
the last two without heap trims), keeps or replaces it as the next step
begins, which also releases what the steps before held, and on the CPU weighs
plain checkpointing without heap trims against offload alone or a tried plan,
for four more, and the heap trims of a plan that moves nothing, for four more
at most, the last of which leaves a heap untrimmed that the trims give back as
the next step begins: NOTE [trial steps], NOTE [a trim where the plan
changes], NOTE [trims a plan does without], NOTE [plain without
trims]), then ``--steps`` timed rounds.

Per mode: ``peak MiB`` is the largest peak RSS (``VmHWM``, reset before each
timed step) over the timed steps minus the process's RSS before its first
step, as ``bench/step.py`` measures it (glibc's default allocator; every
mode imports ``torch._dynamo``, as a first checkpoint does, before that RSS is
read); ``step s`` is the median step time (forward, backward, SGD step); ``moved MiB/step`` is
what the engine wrote per timed step (its ``bytes_offloaded``). Budgets are a
share of the bytes one step saves for backward (distinct storages, parameters
excluded), counted in a step without offload before the run.

The targets of ``recompute="auto"`` at each budget (issue 23) are judged and
recorded: (a) peak at most budget + what no offload holds beside its
activations (its peak minus the saved bytes) + 5% of the saved bytes; (b) step
time at most 1.03x the fastest other (non-auto) mode whose peak is at or below
auto's (the fastest by median step; the ratio is the median, over the timed rounds,
of auto's step over that mode's step in the same round), and 10% or more below it at
one budget at least; (c) bytes moved per
step 30% or more below offload-only's at the same budget.

``--throttle-mbps N`` makes the disk slower than forward saves (the IO-bound
shape): each mode's process joins a cgroup-v1 blkio group that caps reads and
writes of the scratch folder's disk at N MB/s (needs root; removed at the end).

``--gpu`` runs the same comparison on CUDA, in bf16, on a Llama-shaped model (Hugging
Face's Llama where transformers is installed, else the benchmark transformer) with
eager attention (SDPA picks cuDNN's fused kernel on an H200, whose results vary from
run to run, so the losses could not be compared bit for bit), offloading to host RAM
(``target="cpu"``): ``peak MiB`` is then ``torch.cuda.max_memory_reserved()`` above
the process's reserved memory before its first step, ``host MiB`` the peak RSS above
its RSS, and each step ends with a synchronize. ``--twin`` runs that path on the CPU
at toy sizes, three modes, on the benchmark transformer by default (no CUDA call; the
GPU suite's twin mode and tests/test_bench_recompute.py use it).

    .venv/bin/python bench/recompute.py --json docs/results/recompute-transformer.json \\
        --plot docs/results/recompute-transformer.png
    .venv/bin/python bench/recompute.py --markdown docs/results/recompute-transformer.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import multiprocessing
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ is not a package
from _common import (
    MB,
    TORCH_THREADS,
    machine_info,
    peak_rss_bytes,
    read_rss_bytes,
    reset_peak_rss,
    round_order,
    scratch_folder,
)
from _harness import Shape, build
from _probe import _sgd_step
from _text import json_header, log, progress

MODES: dict[str, str] = {
    "none": "no offload",
    "offload10": "offload only (disk), device_budget 10% of saved",
    "offload25": "offload only (disk), device_budget 25% of saved",
    "offload50": "offload only (disk), device_budget 50% of saved",
    "full": "full checkpointing, no offload",
    "full_offload": 'recompute="full" (block inputs offloaded to disk)',
    "selective": "selective checkpointing (matmul, attention saved), no offload",
    "selective_offload": "selective, matmul and attention MUST_CPU_OFFLOAD (disk)",
    "auto10": 'recompute="auto", device_budget 10% of saved',
    "auto25": 'recompute="auto", device_budget 25% of saved',
    "auto50": 'recompute="auto", device_budget 50% of saved',
}
# device_budget as a share of the saved bytes, for the modes that take one.
BUDGETS = {f"{kind}{p}": p / 100 for kind in ("offload", "auto") for p in (10, 25, 50)}
# The rounds before auto's plan settles (the module docstring).
WARMUP = 21
# Issue 23's targets for recompute="auto".
PEAK_SLACK, TIME_LIMIT, TIME_WIN, MOVE_CUT = 0.05, 1.03, 0.90, 0.30
# The common save list of selective checkpointing: matmul and attention outputs.
_SAVE_NAMES = "mm addmm bmm _scaled_dot_product_flash_attention_for_cpu " + " ".join(
    f"_scaled_dot_product_{kind}_attention" for kind in ("flash", "efficient", "cudnn")
)
_SAVE_OPS = {getattr(torch.ops.aten, n) for n in _SAVE_NAMES.split() if hasattr(torch.ops.aten, n)}


def save_list_policy(store: CheckpointPolicy) -> Any:
    """A selective-checkpoint policy: the save list's outputs get ``store``, the rest
    are recomputed."""

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return store if op.overloadpacket in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


# -- the models --------------------------------------------------------------------------


def build_model(args: argparse.Namespace) -> tuple[torch.nn.Module, Any]:
    """The seeded model and a function of it giving one step's loss (same in every process);
    with ``--gpu`` in bf16 on the device (the CPU for ``--twin``)."""
    where = "cuda" if args.gpu and not args.twin else "cpu"
    if args.model == "transformer":
        attention = "sdpa" if args.twin else "explicit"
        shape = Shape(args.depth, args.width, args.heads, args.batch, args.seq, attention=attention)
        model, (batch,) = build(shape, 1)
        model, batch = _on(model, where, args), tuple(t.to(where) for t in batch)
        return model, lambda m: m(*batch)
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = {"hidden_size": args.width, "intermediate_size": args.width * 8 // 3}
    sizes |= {"num_attention_heads": args.heads, "num_key_value_heads": args.heads}
    config = LlamaConfig(
        vocab_size=args.vocab, num_hidden_layers=args.depth, **sizes,
        max_position_embeddings=max(args.seq, 128),
        attn_implementation="eager" if where == "cuda" else "sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = _on(LlamaForCausalLM(config), where, args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator())
    ids = ids.to(where)
    return (
        model,
        lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss,
    )  # as HF does under checkpointing


def _on(model: torch.nn.Module, where: str, args: argparse.Namespace) -> torch.nn.Module:
    return model.to(where, torch.bfloat16) if args.gpu else model


# -- one mode's process ------------------------------------------------------------------


def _mode_context(
    mode: str, model: torch.nn.Module, folder: str, budget: int, chunk: int | None, target: str
) -> Any:
    from prefetch_offload import offload_context
    from prefetch_offload.blocks import WrappedBlocks, find_blocks

    if mode in ("full", "selective"):
        fn = None
        if mode == "selective":
            policy = save_list_policy(CheckpointPolicy.MUST_SAVE)
            fn = functools.partial(create_selective_checkpoint_contexts, policy)
        restore = contextlib.ExitStack()
        restore.callback(WrappedBlocks(find_blocks(model), fn).restore)
        return restore
    recompute: Any = None
    if mode == "full_offload":
        recompute = "full"
    elif mode == "selective_offload":
        recompute = save_list_policy(CheckpointPolicy.MUST_CPU_OFFLOAD)
    elif mode.startswith("auto"):
        recompute = "auto"
    kw: dict[str, Any] = {"model": model, "recompute": recompute} if recompute else {}
    if chunk:
        kw["chunk_bytes"] = chunk
    if target == "cpu":
        return offload_context("cpu", device_budget=budget, **kw)
    return offload_context("disk", folder, device_budget=budget, **kw)


class Lane:
    """One mode's training in this process: model, optimizer, and the mode's context."""

    def __init__(self, mode: str, args: argparse.Namespace, budget: int, folder: str) -> None:
        self.model, self.loss_of = build_model(args)
        self.params = list(self.model.parameters())
        self.stack = contextlib.ExitStack()
        self.engine = None
        if mode != "none":
            where = os.path.join(folder, mode)
            target = "cpu" if args.gpu else "disk"
            ctx = _mode_context(mode, self.model, where, budget, args.chunk_bytes, target)
            handle = self.stack.enter_context(ctx)
            self.engine = handle if hasattr(handle, "stats") else None
        import torch._dynamo  # a first checkpoint imports it: not activations

        self.cuda = args.gpu and not args.twin
        self.base = read_rss_bytes()
        self.base_gpu = torch.cuda.memory_reserved() if self.cuda else 0

    def step(self) -> dict[str, Any]:
        before = self.engine.stats() if self.engine is not None else None
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        exact = reset_peak_rss()
        t0 = time.perf_counter()
        loss = self.loss_of(self.model)
        loss.backward()
        _sgd_step(self.params)  # what torch.optim.SGD does, without importing dynamo
        if self.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        host = max(peak_rss_bytes() if exact else 0, read_rss_bytes()) - self.base
        peak = torch.cuda.max_memory_reserved() - self.base_gpu if self.cuda else host
        out = {"seconds": seconds, "peak": peak, "host": host, "loss": loss.item(), "moved": 0}
        if self.engine is not None and before is not None:
            s = self.engine.stats()
            out["moved"] = s.bytes_offloaded - before.bytes_offloaded
            for k in ("step_bytes_kept", "step_bytes_offloaded", "step_bytes_recomputed"):
                out[k] = getattr(s, k, None)
        return out

    def plan(self) -> str | None:
        plan = getattr(self.engine, "recompute_plan", lambda: None)()
        return None if plan is None else str(plan)

    def close(self) -> None:
        self.stack.close()


def _serve(conn: Any, mode: str, args: argparse.Namespace, budget: int, folder: str) -> None:
    """A mode's process: answers "step", "plan" and "close" calls with (ok, value)."""
    torch.set_num_threads(TORCH_THREADS)
    from prefetch_offload.testing import warm_up_unary_ops

    warm_up_unary_ops()  # NOTE [first unary call]: modes compare their losses
    try:
        if args.cgroup:
            Path(args.cgroup, "cgroup.procs").write_text(str(os.getpid()))
        lane = Lane(mode, args, budget, folder)
        conn.send((True, "ready"))
        while (call := conn.recv()) != "close":
            conn.send((True, getattr(lane, call)()))
        lane.close()
        conn.send((True, None))
    except BaseException:
        conn.send((False, traceback.format_exc()))


class ProcessLane:
    """A :class:`Lane` in a spawned process; a failure there raises RuntimeError here."""

    def __init__(self, mode: str, args: argparse.Namespace, budget: int, folder: str) -> None:
        ctx = multiprocessing.get_context("forkserver")  # torch imported once, not per mode
        ctx.set_forkserver_preload(["torch", "torch._dynamo", "prefetch_offload", "recompute"])
        self.mode, (self.conn, child) = mode, ctx.Pipe()
        serve = __import__("recompute")._serve  # the child imports it from bench/
        self.proc = ctx.Process(target=serve, args=(child, mode, args, budget, folder))
        self.proc.start()
        child.close()

    def call(self, name: str) -> Any:
        if name != "ready":
            self.conn.send(name)
        try:
            ok, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"mode {self.mode!r}: its process died") from None
        if not ok:
            raise RuntimeError(f"mode {self.mode!r} failed in its process:\n{value}")
        return value

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.proc.is_alive():
                self.call("close")
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.kill()


@contextlib.contextmanager
def throttled(folder: str, mbps: int | None) -> Any:
    """A blkio cgroup (v1) capping the disk under ``folder`` at ``mbps`` MB/s each way."""
    if not mbps:
        yield None
        return
    dev = os.stat(folder).st_dev
    sys_dev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if (sys_dev / "partition").exists():  # throttle the whole disk
        sys_dev = sys_dev.resolve().parent
    disk = (sys_dev / "dev").read_text().strip()
    group = Path(f"/sys/fs/cgroup/blkio/prefetch-offload-bench-{os.getpid()}")
    group.mkdir()
    try:
        for kind in ("read", "write"):
            (group / f"blkio.throttle.{kind}_bps_device").write_text(f"{disk} {mbps * 10**6}")
        yield str(group)
    finally:
        for _ in range(50):  # the lanes' processes leave it as they end
            with contextlib.suppress(OSError):
                group.rmdir()
                break
            time.sleep(0.1)


# -- the run -----------------------------------------------------------------------------


def run(args: argparse.Namespace, header: dict[str, Any]) -> dict[str, Any]:
    from prefetch_offload.testing import saved_storage_bytes

    torch.set_num_threads(TORCH_THREADS)
    model, loss_of = build_model(args)
    saved = sum(saved_storage_bytes(model, functools.partial(loss_of, model)))
    del model
    log(f"{args.model}: {saved / MB:.1f} MiB saved for backward per step")
    with scratch_folder(args.save_dir, prefix="bench-recompute-") as folder:
        with throttled(folder, args.throttle_mbps) as group:
            args.cgroup = group
            lanes = {
                m: ProcessLane(m, args, round(saved * BUDGETS.get(m, 0)), folder)
                for m in args.modes
            }
            try:
                for lane in lanes.values():
                    lane.call("ready")
                log(f"{len(lanes)} mode processes ready")
                samples: dict[str, list[dict[str, Any]]] = {m: [] for m in args.modes}
                for r in range(args.warmup + args.steps):
                    progress(f"round {r + 1}/{args.warmup + args.steps}")
                    for m in round_order(list(args.modes), r):
                        out = lanes[m].call("step")
                        if r >= args.warmup:
                            samples[m].append(out)
                plans = {m: lanes[m].call("plan") for m in args.modes}
            finally:
                for lane in lanes.values():
                    lane.close()
    rows = []
    for m in args.modes:
        s = samples[m]
        rows.append(
            {
                "mode": m,
                "label": MODES[m].replace("disk", "host RAM") if args.gpu else MODES[m],
                "budget_bytes": round(saved * BUDGETS[m]) if m in BUDGETS else None,
                "step_seconds": [x["seconds"] for x in s],
                "step_peak_bytes": [x["peak"] for x in s],
                "losses": [x["loss"] for x in s],
                "median_step_s": statistics.median(x["seconds"] for x in s),
                "peak_bytes": max(x["peak"] for x in s),
                "host_peak_bytes": max(x["host"] for x in s),
                "moved_per_step": statistics.fmean(x["moved"] for x in s),
                **{k: s[-1][k] for k in s[-1] if k.startswith("step_bytes_")},
            }
        )
    doc = {**header, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}  # fmt: skip  # noqa: E501
    doc.update(model=args.model, saved_bytes=saved, rows=rows, plans=plans)
    doc["targets"] = targets(rows, saved)
    ref = next((r["losses"] for r in rows if r["mode"] == "none"), None)
    doc["loss_mismatch"] = [r["mode"] for r in rows if ref is not None and r["losses"] != ref]
    return doc


def targets(rows: list[dict[str, Any]], saved: int) -> dict[str, Any]:
    """Issue 23's targets for each auto budget, and the verdicts."""
    by = {r["mode"]: r for r in rows}
    none = by.get("none")
    out: dict[str, Any] = {"per_budget": [], "met": {}}
    for mode in (m for m in BUDGETS if m.startswith("auto") and m in by):
        auto, share = by[mode], BUDGETS[mode]
        t: dict[str, Any] = {"mode": mode, "budget_share": share}
        if none is not None:
            beside = none["peak_bytes"] - saved
            t["peak_limit"] = auto["budget_bytes"] + beside + PEAK_SLACK * saved
            t["peak_met"] = auto["peak_bytes"] <= t["peak_limit"]
        at_or_below = [r for r in rows if r["peak_bytes"] <= auto["peak_bytes"]]
        others = [r for r in at_or_below if not r["mode"].startswith("auto")]
        best = min(others, key=lambda r: r["median_step_s"], default=None)
        t["fastest_at_or_below"] = best and best["mode"]
        # Round by round (each round runs every mode once, side by side), auto's step over
        # the other mode's. The verdict is their median: a round the machine runs slow
        # for moves both steps of its pair, where a ratio of two medians can pair a fast
        # step of one mode with a slow one of the other.
        t["time_ratio_rounds"] = _round_ratios(auto, best)
        t["time_ratio"] = best and (
            statistics.median(t["time_ratio_rounds"])
            if t["time_ratio_rounds"]
            else auto["median_step_s"] / best["median_step_s"]
        )
        t["time_met"] = best is None or t["time_ratio"] <= TIME_LIMIT
        offload = by.get(f"offload{round(share * 100)}")
        if offload is not None and offload["moved_per_step"] > 0:
            t["moved_ratio"] = auto["moved_per_step"] / offload["moved_per_step"]
            t["moved_met"] = t["moved_ratio"] <= 1 - MOVE_CUT
        out["per_budget"].append(t)
    per = out["per_budget"]
    if per:
        out["met"]["peak"] = all(t.get("peak_met", False) for t in per)
        win = any(t["time_ratio"] is not None and t["time_ratio"] <= TIME_WIN for t in per)
        out["met"]["time"] = all(t["time_met"] for t in per) and win
        out["met"]["moved"] = all(t.get("moved_met", False) for t in per)
    return out


def _round_ratios(auto: dict[str, Any], other: dict[str, Any] | None) -> list[float]:
    """Round by round, ``auto``'s step over ``other``'s."""
    theirs = other.get("step_seconds", []) if other else []
    pairs = zip(auto.get("step_seconds", []), theirs, strict=False)
    return [a / b for a, b in pairs if b > 0]


# -- the report --------------------------------------------------------------------------


def _f(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def markdown(doc: dict[str, Any]) -> str:
    """The curve and the targets as markdown tables (what docs/benchmarks.md shows): the
    verdicts the JSON holds, with each one's round-by-round ratios (from its rows where
    the JSON lacks them)."""
    by = {r["mode"]: r for r in doc["rows"]}
    none = by.get("none")
    head = ["mode", "what", "budget MiB", "peak MiB", "step s", "vs none", "moved MiB/step"]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- |" + " --: |" * 5]
    for r in doc["rows"]:
        ratio = none and r["median_step_s"] / none["median_step_s"]
        cells = [r["mode"], r["label"], _f(r["budget_bytes"] and r["budget_bytes"] / MB, ".1f")]
        cells += [f"{r['peak_bytes'] / MB:.1f}", f"{r['median_step_s']:.3f}", _f(ratio, ".2f")]
        cells += [f"{r['moved_per_step'] / MB:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| auto | peak MiB (limit) | step vs fastest at or below | moved vs offload only |",
    ]
    lines.append("| --- | --- | --- | --- |")
    for t in doc["targets"]["per_budget"]:
        a = by[t["mode"]]
        peak = f"{a['peak_bytes'] / MB:.1f} ({_f(t.get('peak_limit', 0) / MB, '.1f')}) "
        peak += _ok(t.get("peak_met"))
        best = t["fastest_at_or_below"]
        rounds = t.get("time_ratio_rounds")
        if rounds is None:
            rounds = _round_ratios(a, by.get(best or ""))
        spread = f" (rounds {min(rounds):.2f}-{max(rounds):.2f})" if len(rounds) > 1 else ""
        tm = (
            f"{t['time_ratio']:.2f}x {best}{spread} {_ok(t['time_met'])}"
            if best
            else "no mode at or below"
        )
        mv = f"{t['moved_ratio']:.2f}x {_ok(t['moved_met'])}" if "moved_ratio" in t else "n/a"
        lines.append(f"| {t['mode']} | {peak} | {tm} | {mv} |")
    met = doc["targets"]["met"]
    lines += ["", "Targets: " + ", ".join(f"{k} {_ok(v)}" for k, v in met.items()) + "."]
    return "\n".join(lines)


def _ok(flag: bool | None) -> str:
    return "met" if flag else "**not met**"


def plot(doc: dict[str, Any], path: Path) -> None:
    """x: peak MiB, y: step seconds, one point per mode, the budget series joined."""
    try:
        from _plot import _pyplot, _save
    except ImportError:
        log("matplotlib is not installed: no plot")
        return
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = {r["mode"]: r for r in doc["rows"]}
    for kind in ("offload", "auto"):
        pts = [rows[m] for m in BUDGETS if m.startswith(kind) and m in rows]
        ax.plot([r["peak_bytes"] / MB for r in pts], [r["median_step_s"] for r in pts], "-o")
    for m, r in rows.items():
        x, y = r["peak_bytes"] / MB, r["median_step_s"]
        ax.plot([x], [y], "ko", ms=3)
        ax.annotate(m, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("peak activation memory, MiB (peak RSS over a step above the RSS before)")
    ax.set_ylabel("step time, s (median)")
    ax.set_title(f"Keep, offload or recompute: {doc['model']}")
    ax.grid(alpha=0.3)
    _save(fig, path, dpi=110, bbox_inches="tight")


# Default sizes (depth, width, heads, batch, seq, vocab, steps): the CPU's (depth 24 for
# the transformer), a GPU's bf16 Llama shape (a minute in the GPU suite), the twin's toys.
SIZES = {
    "cpu": (None, 256, 4, 8, 256, 2048, 5),
    "gpu": (8, 1024, 8, 4, 1024, 8192, 2),
    "twin": (2, 32, 2, 2, 32, 128, 1),
}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/recompute.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("transformer", "llama"), default=None)
    p.add_argument("--modes", default=None, help="comma list (default: all; --twin: 3)")
    names = ("depth", "width", "heads", "batch", "seq", "vocab", "steps")
    for name, what in zip(names, ("blocks", "width", "heads", "sequences", "tokens each",
                                  "llama's vocabulary", "timed rounds"), strict=True):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=None, help=f"{what} (default: SIZES)")
    for name, default, what in (
        ("warmup", WARMUP, f"uncounted rounds first (>= {WARMUP})"),
        ("throttle-mbps", None, "cap the scratch disk's reads and writes at MB/s (root)"),
        ("chunk-bytes", None, "the engine's chunk_bytes (default: its own)"),
    ):
        p.add_argument(f"--{name}", type=int, default=default, help=what)
    p.add_argument("--gpu", action="store_true", help="bf16 on CUDA, offload to host RAM")
    p.add_argument("--twin", action="store_true", help="with --gpu: on the CPU, toy sizes")
    p.add_argument("--save-dir", default=None, help="scratch parent (default ./.scratch)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="PNG of the curve (matplotlib)")
    p.add_argument("--markdown", type=Path, default=None, help="print a JSON's tables; no run")
    args = p.parse_args(argv)
    modes = args.modes or ("none,full,auto50" if args.twin else ",".join(MODES))
    args.modes = [m.strip() for m in modes.split(",") if m.strip()]
    if bad := [m for m in args.modes if m not in MODES]:
        p.error(f"unknown modes {bad}; choose from {', '.join(MODES)}")
    if args.twin and not args.gpu:
        p.error("--twin runs the --gpu path on the CPU: pass both")
    if args.gpu and not args.twin and not torch.cuda.is_available():
        p.error("--gpu: torch sees no CUDA device (--twin runs the same path on the CPU)")
    kind = "twin" if args.twin else "gpu" if args.gpu else "cpu"
    for name, default in zip(names, SIZES[kind], strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.model is None:
        hf = importlib.util.find_spec("transformers") is not None
        args.model = "llama" if kind == "gpu" and hf else "transformer"
    args.depth = args.depth or (24 if args.model == "transformer" else 8)
    if args.warmup < WARMUP or args.steps < 1:
        p.error(
            f"--warmup must be >= {WARMUP} (auto profiles nine steps, tries its plan for "
            "three or five, weighs plain checkpointing without trims for four and its heap "
            "trims for four, and settles a step after that); "
            "--steps >= 1"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    args = _parse_args(words)
    if args.markdown is not None:
        print(markdown(json.loads(args.markdown.read_text())))
        return 0
    header = json_header("recompute.py", words, machine_info())
    doc = run(args, header)
    print(header["machine_line"])
    print(f"{args.model}: {doc['saved_bytes'] / MB:.1f} MiB saved per step")
    for mode, plan in doc["plans"].items():
        if plan and mode.startswith("auto"):
            print(f"{mode}: {plan}")
    print(markdown(doc))
    print("targets:", json.dumps(doc["targets"]["met"]))
    if doc["loss_mismatch"]:
        print("losses differ from none's:", ", ".join(doc["loss_mismatch"]))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    if args.plot is not None:
        plot(doc, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

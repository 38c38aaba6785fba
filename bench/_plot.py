"""The benchmarks' pictures: memory over one training step (``bench/step.py --plot``) and
step time over a grid of knobs (``bench/sweep.py --plot``).

matplotlib is imported only when a picture is drawn (the ``bench`` extra).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import MB
from _text import log

__all__ = ["PLOT_MODES", "memory_over_step", "sweep_grid"]

# The modes the memory plot draws, in this order (the others' lines would crowd it).
PLOT_MODES: tuple[str, ...] = ("none", "disk", "budget")
_COLORS = {
    "none": "tab:gray",
    "disk": "tab:blue",
    "budget": "tab:orange",
    "cpu": "tab:green",
    "save_on_cpu": "tab:purple",
    "ondemand": "tab:red",
}


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend; ImportError where it is missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path, **kwargs: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, **kwargs)
    _pyplot().close(fig)


def memory_over_step(
    timelines: dict[str, dict[str, Any]],
    path: Path,
    *,
    saved_bytes: int | None,
    title: str,
    budget_bytes: int | None = None,
    modes: Sequence[str] = PLOT_MODES,
    ylabel: str = "memory held by training, MiB\n(RSS above RSS before training)",
) -> bool:
    """Draw memory over one training step per mode into a PNG: the memory probes' RSS
    timelines (``bench/step.py``), or ``torch.cuda.memory_allocated`` (``bench/gpu.py``).

    x: seconds from the step's start (each mode's backward start marked); y: the
    timeline's ``rss_bytes``, memory above what the process held before the step
    (``ylabel`` says which). Returns False, with a message, where matplotlib is
    missing or no timeline was recorded.
    """
    wanted = modes
    modes = [m for m in wanted if timelines.get(m, {}).get("t_s")]
    if not modes:
        log(f"--plot: no memory timeline of {', '.join(wanted)} (probes off?); no plot")
        return False
    try:
        plt = _pyplot()
    except ImportError:
        log("--plot: matplotlib is not installed (pip install -e '.[bench]'); no plot drawn")
        return False
    names = {
        "none": "no offload",
        "cpu": 'target "cpu" (pinned host RAM)',
        "disk": "disk (device_budget 0)",
        "budget": "disk, device_budget "
        + (f"{budget_bytes / MB:.0f} MiB" if budget_bytes else "a share"),
    }
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    for mode in modes:
        line = timelines[mode]
        y = [b / MB for b in line["rss_bytes"]]
        color = _COLORS.get(mode)
        ax.plot(line["t_s"], y, label=names.get(mode, mode), color=color, linewidth=1.6)
        ax.axvline(line["backward_s"], color=color, linestyle=":", linewidth=1)
    if saved_bytes:
        ax.axhline(saved_bytes / MB, color="black", linestyle="--", linewidth=0.8)
        ax.annotate(
            f"saved for backward per step: {saved_bytes / MB:.0f} MiB",
            xy=(0, saved_bytes / MB),
            xytext=(2, 3),
            textcoords="offset points",
            fontsize=8,
        )
    ax.set_xlabel("seconds into the training step (dotted: backward starts)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    _save(fig, path)
    return True


def sweep_grid(cells: Sequence[Any], path: Path, title: str) -> None:
    """Step-time ratio and stall vs prefetch_depth (a line per io_workers), and the
    pending-cap trade-off, from ``bench/sweep.py``'s cells."""
    plt = _pyplot()
    grid = [c for c in cells if c.group == "grid"]
    pending = sorted(
        (c for c in cells if c.group == "pending"), key=lambda c: c.max_pending_write_bytes
    )
    panels = 3 if pending else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2), constrained_layout=True)
    ratio_ax, stall_ax = axes[0], axes[1]
    depths = sorted({c.prefetch_depth for c in grid})
    for w in sorted({c.io_workers for c in grid}):
        line = sorted((c for c in grid if c.io_workers == w), key=lambda c: c.prefetch_depth)
        xs = [c.prefetch_depth for c in line]
        ratio_ax.plot(xs, [c.ratio for c in line], marker="o", label=f"io_workers {w}")
        stall_ax.plot(xs, [c.stall_per_step for c in line], marker="o", label=f"io_workers {w}")
    ratio_ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ratio_ax.set(
        xlabel="prefetch_depth",
        ylabel="step time, disk / none",
        title="step-time ratio (side by side)",
    )
    stall_ax.set(
        xlabel="prefetch_depth", ylabel="seconds per step", title="backward stall on reads"
    )
    for ax in (ratio_ax, stall_ax):
        ax.set_xticks(depths)
        ax.grid(alpha=0.3)
        ax.legend()
    if pending:
        _pending_panel(axes[2], pending)
    fig.suptitle(title, fontsize=9)
    _save(fig, path, dpi=110)


def _pending_panel(ax: Any, pending: Sequence[Any]) -> None:
    """Step-time ratio over max_pending_write_bytes, and the probed cut where measured."""
    xs = [c.max_pending_write_bytes / MB for c in pending]
    ax.plot(xs, [c.ratio for c in pending], marker="o", color="C0", label="step ratio")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{x:g}" for x in xs])
    d0, w0 = pending[0].prefetch_depth, pending[0].io_workers
    ax.set(
        xlabel="max_pending_write_bytes, MiB",
        ylabel="step time, disk / none",
        title=f"write cap (depth {d0}, workers {w0})",
    )
    ax.grid(alpha=0.3)
    cuts = [c.act_cut for c in pending]
    if not any(x is not None for x in cuts):
        ax.legend()
        return
    twin = ax.twinx()
    twin.plot(
        [x for x, c in zip(xs, cuts, strict=True) if c is not None],
        [c * 100 for c in cuts if c is not None],
        marker="s",
        color="C3",
        label="act cut",
    )
    twin.set_ylabel("activation memory cut vs none, % (probe)")
    twin.set_ylim(0, 100)
    handles = ax.get_legend_handles_labels()
    twin_handles = twin.get_legend_handles_labels()
    ax.legend(handles[0] + twin_handles[0], handles[1] + twin_handles[1], loc="lower right")

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

__all__ = ["memory_over_step", "sweep_grid"]


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


def memory_over_step(doc: dict[str, Any], path: Path) -> bool:
    """Draw a step benchmark run's traced steps (its JSON's ``timelines``) into a PNG.

    Per lane, one colour: the live bytes (solid: malloc's bytes in use, or allocated
    GPU memory) and the RSS (dashed), both above the lane's start, over seconds from
    the step's start, backward's start dotted. Returns False, with a message, where
    matplotlib is missing.
    """
    try:
        plt = _pyplot()
    except ImportError:
        log("--plot: matplotlib is not installed (pip install -e '.[bench]'); no plot drawn")
        return False
    labels = {lane["name"]: lane["label"] for lane in doc["lanes"]}
    fig, ax = plt.subplots(figsize=(8.5, 4.5), dpi=110)
    for i, (name, line) in enumerate(doc["timelines"].items()):
        color = f"C{i}"
        ax.plot(
            line["t_s"],
            [b / MB for b in line["live_bytes"]],
            color=color,
            linewidth=1.8,
            label=f"{name}: live ({labels.get(name, name)})",
        )
        if doc["device"] != "cuda":
            ax.plot(
                line["t_s"],
                [b / MB for b in line["rss_bytes"]],
                color=color,
                linewidth=1.0,
                linestyle="--",
                label=f"{name}: RSS",
            )
        ax.axvline(line["backward_s"], color=color, linestyle=":", linewidth=1)
    saved = doc["saved_bytes"] / MB
    ax.axhline(saved, color="black", linestyle="--", linewidth=0.7)
    ax.annotate(
        f"saved for backward per step: {saved:.0f} MiB",
        xy=(0, saved),
        xytext=(2, 3),
        textcoords="offset points",
        fontsize=8,
    )
    live = next(iter(doc["timelines"].values()))["live_counter"]
    ax.set_xlabel("seconds into the training step (dotted: backward starts)")
    ax.set_ylabel(f"MiB above the lane's start\n(solid: {live}; dashed: RSS)")
    shape = doc["shape"]
    ax.set_title(
        f"One training step: TinyTransformer, {shape['depth']} blocks, width {shape['width']}, "
        f"batch {shape['batch']} x {shape['seq']} ({doc['device']})",
        fontsize=10,
    )
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    _save(fig, path)
    return True


def sweep_grid(cells: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Step-time ratio and stall against prefetch_depth, a line per io_workers, from
    ``bench/sweep.py``'s cells."""
    plt = _pyplot()
    fig, (ratio_ax, stall_ax) = plt.subplots(1, 2, figsize=(10.4, 4.2), constrained_layout=True)
    for w in sorted({c["io_workers"] for c in cells}):
        line = sorted((c for c in cells if c["io_workers"] == w), key=lambda c: c["prefetch_depth"])
        xs = [c["prefetch_depth"] for c in line]
        ratio_ax.plot(xs, [c["ratio"] for c in line], marker="o", label=f"io_workers {w}")
        stall_ax.plot(xs, [c["stall"] for c in line], marker="o", label=f"io_workers {w}")
    ratio_ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ratio_ax.set(xlabel="prefetch_depth", ylabel="step time, disk / none", title="step time")
    stall_ax.set(xlabel="prefetch_depth", ylabel="seconds per step", title="backward stall")
    for ax in (ratio_ax, stall_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    _save(fig, path, dpi=110)

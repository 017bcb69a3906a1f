"""Plots of sweep results (matplotlib, headless): hit rate vs capacity per policy (the paper's
Figures 7/8) and hit rate by input length (Figure 10)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from marconi.sim.sweep import Row


def _finish(fig: Figure, ax: Axes, path: Path) -> Path:
    """Legend, layout, save as PNG, free the figure."""
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_hit_vs_capacity(rows: Sequence[Row], out_dir: Path) -> list[Path]:
    """One PNG per trace: token hit rate vs capacity, a line per policy."""
    paths = []
    for trace in sorted({r.result.trace for r in rows}):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label in dict.fromkeys(r.label for r in rows):
            pts = sorted(
                (r.result.capacity_bytes / 1e9, 100 * r.result.token_hit_rate)
                for r in rows
                if r.label == label and r.result.trace == trace
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=label)
        ax.set_xscale("log")
        gb = FuncFormatter(lambda v, _: f"{v:g}")
        ax.xaxis.set_major_formatter(gb)
        ax.xaxis.set_minor_formatter(gb)
        ax.set_xlabel("cache capacity (GB)")
        ax.set_ylabel("token hit rate (%)")
        ax.set_title(f"{trace}: hit rate vs capacity")
        ax.grid(alpha=0.3)
        paths.append(_finish(fig, ax, out_dir / f"hit_vs_capacity_{trace}.png"))
    return paths


def plot_hit_by_length(rows: Sequence[Row], out_dir: Path) -> list[Path]:
    """One PNG per trace: token hit rate per input-length bucket at the largest capacity."""
    paths = []
    for trace in sorted({r.result.trace for r in rows}):
        sel = [r for r in rows if r.result.trace == trace]
        cap = max(r.result.capacity_bytes for r in sel)
        sel = [r for r in sel if r.result.capacity_bytes == cap]
        buckets = list(dict.fromkeys(b for r in sel for b in r.result.by_length))
        fig, ax = plt.subplots(figsize=(6, 4))
        width = 0.8 / max(len(sel), 1)
        for i, r in enumerate(sel):
            xs = [j + i * width for j in range(len(buckets))]
            ys = [100 * r.result.by_length.get(b, 0.0) for b in buckets]
            ax.bar(xs, ys, width=width, label=r.label)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(buckets))], buckets)
        ax.set_xlabel("input length (tokens)")
        ax.set_ylabel("token hit rate (%)")
        ax.set_title(f"{trace}: hit rate by input length ({cap / 1e9:g} GB)")
        paths.append(_finish(fig, ax, out_dir / f"hit_by_length_{trace}.png"))
    return paths

"""``peers.png``: per model, each method's peak against its step time, budgets as lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peers_data import (
    CHECKPOINT_SEQUENTIAL,
    HF_CHECKPOINTING,
    NONE,
    REMAT_CHEN,
    REMAT_COMPILED,
    REMAT_OPTIMAL,
    TORCH_COMPILE,
    ModelFacts,
    Results,
    Row,
)

from remat.core import MIB

MARKERS = {NONE: ("s", "tab:gray"), REMAT_OPTIMAL: ("*", "tab:blue"),
           REMAT_CHEN: ("P", "tab:cyan"), CHECKPOINT_SEQUENTIAL: ("o", "tab:red"),
           HF_CHECKPOINTING: ("D", "tab:orange"), TORCH_COMPILE: ("^", "tab:purple"),
           REMAT_COMPILED: ("X", "tab:green")}


def point_label(row: Row) -> str:
    """A short label for a plotted point."""
    if row.method == REMAT_OPTIMAL:
        return row.setting.split(":")[0]
    if row.method == REMAT_COMPILED:
        return "c " + row.setting.split(":")[0]
    if row.method == TORCH_COMPILE:
        return "c " + row.setting.removeprefix("budget=")
    return {NONE: "none", REMAT_CHEN: "chen", HF_CHECKPOINTING: "HF"}.get(row.method, row.setting)


def plot_model(ax: Any, facts: ModelFacts, budgets: dict[float, int], rows: list[Row]) -> None:
    """One model's panel: peak (judging instrument) against step time, budgets as lines."""
    for method, (marker, color) in MARKERS.items():
        pts = [r for r in rows if r.method == method and r.judged_peak and r.step_ms]
        if not pts:
            continue
        ax.scatter([r.step_ms for r in pts], [r.judged_peak / MIB for r in pts],
                   marker=marker, color=color, s=110 if marker == "*" else 40, label=method,
                   zorder=3)
        for r in pts:
            ax.annotate(point_label(r), (r.step_ms, r.judged_peak / MIB), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
    for f, b in budgets.items():
        ax.axhline(b / MIB, linestyle="--", linewidth=0.8, color="grey", zorder=1)
        ax.annotate(f"budget {f:.0%}", (1.0, b / MIB), xycoords=("axes fraction", "data"),
                    fontsize=7, ha="right", va="bottom", color="grey")
    ax.set_title(f"{facts.name}: {facts.description}", fontsize=8)
    ax.set_xlabel("step time, median (ms)")
    ax.set_ylabel("peak MiB (eager: dispatch; compile: allocator)")
    ax.legend(fontsize=7)


def write_plot(path: Path, results: Results) -> None:
    """One panel per model, in a grid two wide."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = results.models
    cols = min(2, len(models))
    rows = -(-len(models) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 5 * rows), squeeze=False)
    for ax, facts in zip(axes.flat, models):
        plot_model(ax, facts, results.budgets.get(facts.name, {}), results.rows_of(facts.name))
    for ax in list(axes.flat)[len(models):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

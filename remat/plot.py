"""``plot_pareto``: peak memory against step time, the optimal frontier and the baselines."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from remat.errors import RematError

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["plot_pareto"]

_MIB = 2**20
_X_AXES = {"time": ("time_ms", "step time (ms)"), "overhead": ("overhead_pct", "overhead (%)")}


def _measured_frame(measured: Any) -> pd.DataFrame:
    import pandas as pd

    frame = measured if isinstance(measured, pd.DataFrame) else pd.DataFrame(list(measured))
    missing = {"peak_bytes", "time_ms"} - set(frame.columns)
    if missing:
        raise RematError(
            f"measured points need columns peak_bytes and time_ms (and optionally label); "
            f"missing {sorted(missing)}"
        )
    return frame


def plot_pareto(
    frontier: pd.DataFrame,
    *,
    measured: pd.DataFrame | Iterable[Mapping[str, Any]] | None = None,
    x: str = "time",
    budgets: Iterable[int] = (),
    title: str | None = None,
    ax: Axes | None = None,
) -> Figure:
    """Draw the memory/time trade-off.

    Args:
        frontier: the DataFrame of :func:`remat.pareto` (rows of kind
            ``"optimal"`` form the frontier, ``"baseline"`` rows are labelled points).
        measured: measured points (``peak_bytes``, ``time_ms``, optional ``label``),
            e.g. from :func:`remat.measure`, drawn as crosses.
        x: ``"time"`` (step time, ms) or ``"overhead"`` (% over no checkpointing).
        budgets: budgets in bytes to draw as horizontal lines.
        title: the figure title.
        ax: draw into these axes instead of a new figure.

    Returns:
        The matplotlib ``Figure`` (not shown; ``fig.savefig(path)`` writes it).
    """
    if x not in _X_AXES:
        raise RematError(f"x={x!r} is not an axis; valid: {sorted(_X_AXES)}")
    from matplotlib.figure import Figure

    column, xlabel = _X_AXES[x]
    if ax is None:
        fig = Figure(figsize=(7.5, 4.8), layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.figure

    optimal = frontier[frontier["kind"] == "optimal"].sort_values("peak_bytes")
    ax.step(
        optimal[column],
        optimal["peak_bytes"] / _MIB,
        where="post",
        marker="o",
        markersize=3,
        label="remat optimal frontier",
        color="tab:blue",
    )
    baselines = frontier[frontier["kind"] == "baseline"]
    for row in baselines.itertuples():
        ax.scatter(getattr(row, column), row.peak_bytes / _MIB, marker="s", s=28, zorder=3)
        ax.annotate(
            row.algorithm,
            (getattr(row, column), row.peak_bytes / _MIB),
            textcoords="offset points",
            xytext=(5, 4),
            fontsize=8,
        )
    if measured is not None:
        points = _measured_frame(measured)
        if column not in points.columns:
            raise RematError(f"measured points need a {column!r} column to plot with x={x!r}")
        ax.scatter(
            points[column],
            points["peak_bytes"] / _MIB,
            marker="x",
            s=50,
            color="black",
            zorder=4,
            label="measured",
        )
        for row in points.itertuples():
            label = getattr(row, "label", None)
            if label:
                ax.annotate(
                    str(label),
                    (getattr(row, column), row.peak_bytes / _MIB),
                    textcoords="offset points",
                    xytext=(5, -10),
                    fontsize=7,
                )
    for budget in budgets:
        ax.axhline(budget / _MIB, linestyle="--", linewidth=0.8, color="gray")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("peak memory of a training step (MiB)")
    ax.set_title(title or "memory / time trade-off")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    return fig

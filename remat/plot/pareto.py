"""``plot_pareto``: peak memory against step time, the optimal frontier and the baselines.

What the figure shows: the optimal frontier as a step line (one point per distinct
plan, none that another beats), the baselines as labelled squares, measured points
as crosses joined by a dotted line to their predictions when the caller gives them,
and each budget as a dashed, labelled line. Labels are placed by
:mod:`remat.plot.labels` so that each stays inside the axes and clear of the others;
the legend sits below the axes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from remat.core.errors import RematError
from remat.plot.labels import Label, place_labels

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["PlotError", "plot_pareto"]

_MIB = 2**20
_X_AXES = {"time": ("time_ms", "step time (ms)"), "overhead": ("overhead_pct", "overhead (%)")}
_FRONTIER_COLUMNS = {"kind", "peak_bytes", "algorithm"}


class PlotError(RematError, ValueError):
    """A frame or points that cannot be drawn (empty, or missing columns)."""


def _measured_frame(measured: Any) -> pd.DataFrame:
    import pandas as pd

    frame = measured if isinstance(measured, pd.DataFrame) else pd.DataFrame(list(measured))
    missing = {"peak_bytes", "time_ms"} - set(frame.columns)
    if missing:
        raise PlotError(
            f"measured points need columns peak_bytes and time_ms (and optionally label, "
            f"predicted_peak_bytes, predicted_time_ms); missing {sorted(missing)}"
        )
    return frame


def _check_frontier(frontier: Any, column: str) -> None:
    import pandas as pd

    if not isinstance(frontier, pd.DataFrame):
        raise PlotError(f"plot_pareto() needs the DataFrame of remat.pareto(), got "
                        f"{type(frontier).__name__}")
    if frontier.empty:
        raise PlotError("plot_pareto() got an empty frame: nothing to draw; pass the frame "
                        "remat.pareto(profile) returns")
    missing = sorted((_FRONTIER_COLUMNS | {column}) - set(frontier.columns))
    if missing:
        raise PlotError(f"plot_pareto() needs the columns of remat.pareto()'s frame; missing "
                        f"{missing}")


def frontier_rows(frontier: pd.DataFrame, column: str) -> pd.DataFrame:
    """The optimal rows, each (peak, x) once, none beaten by another (no slower, no higher)."""
    optimal = frontier[frontier["kind"] == "optimal"].drop_duplicates(["peak_bytes", column])
    optimal = optimal.sort_values(["peak_bytes", column])
    keep, best = [], float("inf")
    for index, x in zip(optimal.index, optimal[column]):
        if x < best:  # ascending peak: a row stays when it is faster than every lower one
            keep.append(index)
            best = x
    return optimal.loc[keep]


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
            e.g. from :func:`remat.measure`, drawn as crosses. A point with
            ``predicted_peak_bytes`` and ``predicted_time_ms`` (``predicted_overhead_pct``
            for ``x="overhead"``) is joined to its prediction by a dotted line.
        x: ``"time"`` (step time, ms) or ``"overhead"`` (% over no checkpointing).
        budgets: budgets in bytes to draw as labelled horizontal lines.
        title: the figure title.
        ax: draw into these axes instead of a new figure.

    Returns:
        The matplotlib ``Figure`` (not shown; ``fig.savefig(path)`` writes it).

    Raises:
        PlotError: an empty frame, missing columns, or measured points without theirs.
    """
    if x not in _X_AXES:
        raise PlotError(f"x={x!r} is not an axis; valid: {sorted(_X_AXES)}")
    column, xlabel = _X_AXES[x]
    _check_frontier(frontier, column)
    points = None
    if measured is not None:
        points = _measured_frame(measured)
        if column not in points.columns:
            raise PlotError(f"measured points need a {column!r} column to plot with x={x!r}")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    own = ax is None
    if ax is None:
        fig = Figure(figsize=(8, 5.2), layout="constrained")
        FigureCanvasAgg(fig)  # a renderer, to measure the labels while placing them
        ax = fig.add_subplot()
    else:
        fig = ax.figure

    labels: list[Label] = []
    optimal = frontier_rows(frontier, column)
    ax.step(optimal[column], optimal["peak_bytes"] / _MIB, where="post", marker="o",
            markersize=3, label="remat optimal frontier", color="tab:blue", zorder=2)
    baselines = frontier[frontier["kind"] == "baseline"]
    colors = iter(["tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
                   "tab:olive", "tab:cyan"] * 4)
    for row in baselines.itertuples():
        xy = (getattr(row, column), row.peak_bytes / _MIB)
        color = next(colors)
        ax.scatter(*xy, marker="s", s=30, color=color, zorder=3,
                   label=f"baseline: {row.algorithm}")
        labels.append(Label(xy, str(row.algorithm), fontsize=8, color=color))
    if points is not None:
        _draw_measured(ax, points, column, labels)
    budget_labels = []
    for budget in budgets:
        ax.axhline(budget / _MIB, linestyle="--", linewidth=0.9, color="gray", zorder=1)
        budget_labels.append(budget)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("peak memory of a training step (MiB)")
    ax.set_title(title or "memory / time trade-off")
    ax.grid(True, alpha=0.3)
    ax.margins(x=0.12, y=0.15)
    if own:
        fig.legend(loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    else:
        ax.legend(fontsize=8)
    # Every marker the texts must keep clear of: the frontier's and the measured ones.
    markers = list(zip(optimal[column], optimal["peak_bytes"] / _MIB))
    if points is not None:
        markers += list(zip(points[column], points["peak_bytes"] / _MIB))
    place_labels(ax, labels, points=markers, freeze_layout=own,
                 line_labels=[(b / _MIB, f"budget {b / _MIB:.4g} MiB") for b in budget_labels])
    return fig


def _draw_measured(ax: Axes, points: pd.DataFrame, column: str, labels: list[Label]) -> None:
    """Crosses at the measured points, each joined to its prediction when it has one."""
    predicted = f"predicted_{column}"
    joined = {"predicted_peak_bytes", predicted} <= set(points.columns)
    ax.scatter(points[column], points["peak_bytes"] / _MIB, marker="x", s=50, color="black",
               zorder=4, label="measured")
    first = True
    for row in points.to_dict("records"):
        xy = (row[column], row["peak_bytes"] / _MIB)
        if joined and row.get("predicted_peak_bytes") is not None:
            pred = (row[predicted], row["predicted_peak_bytes"] / _MIB)
            ax.plot([pred[0], xy[0]], [pred[1], xy[1]], linestyle=":", linewidth=1,
                    color="black", alpha=0.6, zorder=3,
                    label="measured vs predicted" if first else None)
            ax.scatter(*pred, marker="o", s=18, facecolors="none", edgecolors="black",
                       zorder=4, label="predicted" if first else None)
            first = False
        label = row.get("label")
        if label:
            labels.append(Label(xy, str(label), fontsize=7))

"""Placing point labels on a plot: inside the axes, clear of each other and of the points.

Each label tries a ring of positions around its point (right, left, above, below,
then farther out with a leader line) and takes the first whose box lies inside the
axes and overlaps no label placed before it, no data point and no other text in
the axes (budget labels). When no position is clear, it takes the one with the
least overlap, still inside the axes, where covering another text counts a thousand
times covering a marker: a label over a marker still reads, two labels over each
other do not. Boxes are measured with the figure's
renderer after its layout has run; the layout is then frozen (a figure made by
remat) so the saved image keeps the positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.transforms import Bbox

__all__ = ["Label", "place_labels"]

# (dx, dy) in points, horizontal and vertical alignment: near ones first.
_NEAR = [(6, 4, "left", "bottom"), (6, -4, "left", "top"), (-6, 4, "right", "bottom"),
         (-6, -4, "right", "top"), (0, 8, "center", "bottom"), (0, -8, "center", "top")]
_FAR = [(dx * k, dy * k, ha, va) for k in (3, 5, 8, 12) for dx, dy, ha, va in _NEAR]
_TEXT_WEIGHT = 1000.0  # covering a text, against covering a marker (module docstring)
_POINT_HALF = 4.0  # pixels around a marker that a label must not cover
# A light background keeps a label readable where it crosses a line.
_BACKGROUND = {"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none",
               "alpha": 0.75}


@dataclass(frozen=True)
class Label:
    """A text for the data point ``xy``."""

    xy: tuple[float, float]
    text: str
    fontsize: float = 8
    color: str = "black"  # the marker's colour, so neighbouring labels are told apart


def _overlap(a: Bbox, b: Bbox) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def _inside(inner: Bbox, outer: Bbox) -> bool:
    return (inner.x0 >= outer.x0 and inner.x1 <= outer.x1 and inner.y0 >= outer.y0
            and inner.y1 <= outer.y1)


def place_labels(
    ax: Axes,
    labels: Sequence[Label],
    *,
    line_labels: Sequence[tuple[float, str]] = (),
    points: Sequence[tuple[float, float]] = (),
    freeze_layout: bool = False,
) -> None:
    """Annotate ``ax`` with ``labels``, each inside the axes and clear of the others.

    Args:
        labels: texts for data points.
        line_labels: ``(y, text)`` for horizontal lines (budgets): placed first, at the
            right or the left end of the line, above or below it, clear of the points.
        points: other data points (markers without a label) the texts must not cover.
        freeze_layout: turn the figure's layout engine off afterwards, so saving does
            not move the axes the labels were measured against (a figure remat made).
    """
    from matplotlib.transforms import Bbox

    fig = ax.figure
    try:
        fig.draw_without_rendering()  # runs the layout: the axes' final place and size
        renderer = fig.canvas.get_renderer()
    except AttributeError:  # a canvas without a renderer: plain offsets, no checks
        for label in labels:
            ax.annotate(label.text, label.xy, xytext=(6, 4), textcoords="offset points",
                        fontsize=label.fontsize)
        return
    frame = ax.get_window_extent(renderer)
    taken = [t.get_window_extent(renderer) for t in ax.texts]  # texts
    markers = []
    for xy in [label.xy for label in labels] + list(points):
        px, py = ax.transData.transform(xy)
        markers.append(Bbox.from_extents(px - _POINT_HALF, py - _POINT_HALF,
                                         px + _POINT_HALF, py + _POINT_HALF))
    for y, text in line_labels:
        taken.append(_place_line_label(ax, y, text, frame, taken + markers, renderer))
    for label in labels:
        best = None
        for dx, dy, ha, va in _NEAR + _FAR:
            far = abs(dx) > 8 or abs(dy) > 8
            text = ax.annotate(
                label.text, label.xy, xytext=(dx, dy), textcoords="offset points", ha=ha,
                va=va, fontsize=label.fontsize, color=label.color, bbox=_BACKGROUND,
                arrowprops={"arrowstyle": "-", "color": "gray", "lw": 0.6} if far else None)
            box = text.get_window_extent(renderer)
            if _inside(box, frame):
                cost = (_TEXT_WEIGHT * sum(_overlap(box, other) for other in taken)
                        + sum(_overlap(box, other) for other in markers))
                if best is None or cost < best[0]:
                    if best is not None:
                        best[1].remove()
                    best = (cost, text, box)
                    if cost == 0:
                        break
                    continue
            text.remove()
        if best is None:  # nowhere inside: the nearest position, clipped to the axes
            text = ax.annotate(label.text, label.xy, xytext=(6, 4), textcoords="offset points",
                               fontsize=label.fontsize, color=label.color, clip_on=True)
            taken.append(text.get_window_extent(renderer))
        else:
            taken.append(best[2])
    if freeze_layout:
        fig.set_layout_engine("none")


def _place_line_label(ax: Axes, y: float, text: str, frame: Bbox, taken: list[Bbox],
                      renderer: object) -> Bbox:
    """Label the horizontal line at ``y`` at whichever end (and side) covers least."""
    best = None
    for x, ha, dy, va in ((1.0, "right", 3, "bottom"), (0.0, "left", 3, "bottom"),
                          (1.0, "right", -3, "top"), (0.0, "left", -3, "top")):
        note = ax.annotate(text, (x, y), xycoords=("axes fraction", "data"),
                           xytext=(-4 if ha == "right" else 4, dy), textcoords="offset points",
                           ha=ha, va=va, fontsize=8, color="dimgray", bbox=_BACKGROUND)
        box = note.get_window_extent(renderer)
        cost = sum(_overlap(box, other) for other in taken)
        cost += 0 if _inside(box, frame) else 1e9
        if best is None or cost < best[0]:
            if best is not None:
                best[1].remove()
            best = (cost, note, box)
            if cost == 0:
                break
        else:
            note.remove()
    assert best is not None
    return best[2]

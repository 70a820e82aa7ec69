"""plot_pareto: budget lines labelled, labels inside the axes and apart, measured joined to
predicted, the frontier without duplicate or dominated rows."""

from __future__ import annotations

import itertools

import pandas as pd
import pytest
from matplotlib.text import Annotation

import remat
from remat.models import build
from remat.plot.pareto import frontier_rows

REF = build("gpt", size="tiny", seed=0, depth=6)
PROFILE = remat.profile(REF.model, REF.batch)
FRONTIER = remat.pareto(PROFILE, points=12)
MIB = 2**20


def _measured() -> list[dict]:
    rows = []
    for row in FRONTIER[FRONTIER["kind"] == "baseline"].itertuples():
        rows.append({"peak_bytes": int(row.peak_bytes * 1.01), "time_ms": row.time_ms * 1.05,
                     "label": f"measured {row.algorithm}",
                     "predicted_peak_bytes": row.peak_bytes, "predicted_time_ms": row.time_ms})
    return rows


@pytest.fixture(scope="module")
def figure():
    budget = int(FRONTIER["peak_bytes"].median())
    fig = remat.plot_pareto(FRONTIER, measured=_measured(), budgets=[budget], title="t")
    fig.canvas.draw()
    return fig, budget


def test_the_budget_line_is_labelled(figure) -> None:
    fig, budget = figure
    ax = fig.axes[0]
    assert any(t.get_text() == f"budget {budget / MIB:.4g} MiB" for t in ax.texts)


def test_labels_stay_inside_the_axes_and_apart(figure) -> None:
    fig, _ = figure
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in ax.texts
             if isinstance(t, Annotation)]
    assert len(boxes) >= 8
    for text, box in boxes:
        assert frame.x0 - 0.5 <= box.x0 and box.x1 <= frame.x1 + 0.5, text
        assert frame.y0 - 0.5 <= box.y0 and box.y1 <= frame.y1 + 0.5, text
    for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
        assert not box_a.overlaps(box_b), (a, b)


@pytest.mark.parametrize("seed", [6, 22, 23, 36])
def test_labels_stay_apart_on_frontiers_whose_times_moved(seed: int) -> None:
    # The frontier's times are measured, so its points move from run to run; with these
    # jitters two labels were placed over each other when no position was clear of
    # everything (covering a marker now counts far less than covering a text).
    import random

    import matplotlib.pyplot as plt

    rng = random.Random(seed)
    frontier = FRONTIER.copy()
    frontier["time_ms"] = [t * rng.uniform(0.7, 1.3) for t in frontier["time_ms"]]
    measured = [{"peak_bytes": int(r.peak_bytes * 1.01), "time_ms": r.time_ms * 1.05,
                 "label": f"measured {r.algorithm}", "predicted_peak_bytes": r.peak_bytes,
                 "predicted_time_ms": r.time_ms}
                for r in frontier[frontier["kind"] == "baseline"].itertuples()]
    fig = remat.plot_pareto(frontier, measured=measured,
                            budgets=[int(frontier["peak_bytes"].median())], title="t")
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in fig.axes[0].texts
                 if isinstance(t, Annotation)]
        for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
            assert not box_a.overlaps(box_b), (a, b)
    finally:
        plt.close(fig)


def test_measured_points_are_joined_to_their_predictions(figure) -> None:
    fig, _ = figure
    ax = fig.axes[0]
    joins = [line for line in ax.get_lines() if line.get_linestyle() == ":"]
    assert len(joins) == len(_measured())


def test_the_frontier_drops_duplicate_and_dominated_rows() -> None:
    base = {"algorithm": "dp", "kind": "optimal", "plan": "", "budget_bytes": 0,
            "overhead_pct": 0.0}
    frame = pd.DataFrame([
        {**base, "peak_bytes": 100, "time_ms": 10.0},
        {**base, "peak_bytes": 100, "time_ms": 10.0},  # duplicate
        {**base, "peak_bytes": 120, "time_ms": 12.0},  # dominated: higher and slower
        {**base, "peak_bytes": 80, "time_ms": 15.0},
    ])
    kept = frontier_rows(frame, "time_ms")
    assert list(zip(kept["peak_bytes"], kept["time_ms"])) == [(80, 15.0), (100, 10.0)]


def test_the_demo_figure_saves(tmp_path, figure) -> None:
    fig, _ = figure
    fig.savefig(tmp_path / "p.png", dpi=130)
    assert (tmp_path / "p.png").stat().st_size > 10_000

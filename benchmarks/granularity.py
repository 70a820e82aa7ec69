"""Blocks or their children as units: both frontiers of one CNN (issue 13).

The reference ResNet-style CNN with one BasicBlock per stage (four blocks and the
stem that discovery joins: few, large units) is profiled twice: with its blocks as
units (``granularity="blocks"``) and with the blocks' children (``"children"``:
conv, norm and downsample layers; the ReLUs and residual adds between them are
functional). Both optimal frontiers (``remat.solver.pareto_frontier``) go into one
table and one plot, with the score ``granularity="auto"`` decides on
(``remat.tune.granularity``: mean relative step time at five budgets).

Writes benchmarks/results/granularity.md and granularity.png.

    .venv/bin/python benchmarks/granularity.py [--batch 32] [--points 12]
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see peers.py

import torch  # noqa: E402
from _common import RESULTS, machine_line, markdown_table, write_result  # noqa: E402

from remat import models  # noqa: E402
from remat.core import format_bytes  # noqa: E402
from remat.profiler import find_units, profile  # noqa: E402
from remat.solver import pareto_frontier  # noqa: E402
from remat.tune import level_scores  # noqa: E402


def _plot(frontiers: dict, path) -> None:  # noqa: ANN001
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (level, frame), marker in zip(frontiers.items(), ("o", "s")):
        ax.step(frame["peak_bytes"] / 2**20, frame["overhead_pct"], where="post", marker=marker,
                label=level)
    ax.set_xlabel("predicted peak (MiB)")
    ax.set_ylabel("predicted step time over no checkpointing (%)")
    ax.set_title("ResNet-style CNN, 4 blocks: blocks vs their children as units")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--points", type=int, default=12)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    ref = models.build("cnn", size="small", blocks_per_stage=1, batch_size=args.batch)
    profiles = {}
    for level in ("blocks", "children"):
        choice = find_units(ref.model, ref.batch, loss_fn=ref.loss_fn, granularity=level)
        profiles[level] = profile(ref.model, ref.batch, loss_fn=ref.loss_fn, units=choice.names,
                                  progress=False)
    scores = level_scores(profiles)
    frontiers = {k: pareto_frontier(p, points=args.points, baselines=False)
                 for k, p in profiles.items()}
    rows = []
    for level, frame in frontiers.items():
        for r in frame.itertuples():
            rows.append([level, format_bytes(int(r.budget_bytes)), format_bytes(int(r.peak_bytes)),
                         f"{r.time_ms:.1f}", f"{r.overhead_pct:+.1f}%", r.plan])
    summary = [[k, p.n, "yes" if p.is_chain else "no", f"{p.coverage:.0%}",
                format_bytes(s["min_peak_bytes"]), f"{p.step_ms:.1f}",
                " / ".join(f"{t:.3f}" for t in s["relative_times"]), f"{s['score']:.3f}"]
               for (k, p), s in zip(profiles.items(), scores.values())]
    best = min(scores, key=lambda k: scores[k]["score"])
    budgets = ", ".join(format_bytes(b) for b in scores["blocks"]["budgets"])
    lines = [
        "# Granularity: blocks or their children",
        "",
        f"{dt.date.today()}, {machine_line(1)}. `python benchmarks/granularity.py`.",
        "",
        f"{ref.description}, one block per stage. Predicted figures (the profile's "
        "simulation); the time column is the optimal plan's step time at each frontier "
        "budget.",
        "",
        *markdown_table(["level", "units", "chain", "coverage", "min peak", "step ms",
                         "relative time at the 5 budgets", "score"], summary),
        "",
        f"Budgets of the score: {budgets}. Lower score is faster; `granularity=\"auto\"` "
        f"keeps children only when they score more than 0.01 lower. Here: **{best}**.",
        "",
        "## Frontiers",
        "",
        *markdown_table(["level", "budget", "peak", "time ms", "overhead", "plan"], rows),
        "",
        "![frontiers](granularity.png)",
        "",
    ]
    _plot(frontiers, RESULTS / "granularity.png")
    write_result(RESULTS / "granularity.md", "\n".join(lines))


if __name__ == "__main__":
    main()

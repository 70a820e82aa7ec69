"""How well remat's predictions hold: solve, apply, measure, compare.

For each reference model (the "small" presets) and each budget, solve the
optimal plan, apply it, and measure a real training step (peak with the
dispatch-level meter, median step time). Prints a markdown table and writes it to
benchmarks/results/prediction_accuracy.md.

Budgets: 30/50/70% of the activation memory (as in benchmarks/peers.py), and,
because some of those lie below what any plan reaches, also 10/50/90% of the way
from the smallest feasible peak to no checkpointing.

    .venv/bin/python benchmarks/prediction_accuracy.py [--models mlp gpt] [--repeats 5]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see peers.py

import torch  # noqa: E402
from _common import RESULTS, machine_line, markdown_table, write_result  # noqa: E402

import remat  # noqa: E402
from remat import models  # noqa: E402
from remat.api import activation_budget  # noqa: E402
from remat.bytesize import mib  # noqa: E402
from remat.solver.pareto import min_feasible_peak  # noqa: E402
from remat.solver.solve import no_checkpoint_peak_bytes  # noqa: E402

COLUMNS = ("model", "budget", "plan", "pred MiB", "meas MiB", "peak err %", "within budget",
           "pred ms", "meas ms", "time err %")


def budgets(profile: remat.Profile) -> list[tuple[str, int]]:
    """30/50/70% of the activation memory, then 10/50/90% of the way from the smallest
    feasible peak to no checkpointing: ``(label, bytes)``."""
    lo = min_feasible_peak(profile)
    hi = no_checkpoint_peak_bytes(profile)
    out = [(f"{int(f * 100)}% act.", activation_budget(profile, f)) for f in (0.3, 0.5, 0.7)]
    out += [(f"min+{int(f * 100)}%", lo + int(f * (hi - lo))) for f in (0.1, 0.5, 0.9)]
    return out


def rows_for(name: str, repeats: int) -> list[dict[str, str]]:
    """Solve, apply and measure ``name`` at each budget: one row of cells per budget."""
    ref = models.build(name, size="small", seed=0)
    profile = remat.profile(ref.model, ref.batch, loss_fn=ref.loss_fn)
    rows = []
    for label, budget in budgets(profile):
        try:
            plan = remat.solve(profile, memory_budget=budget)
        except remat.InfeasibleBudgetError as exc:
            rows.append({"model": name, "budget": f"{label} ({mib(budget)})",
                         "plan": f"infeasible (min {mib(exc.min_feasible_bytes)} MiB)"})
            continue
        remat.apply_plan(ref.model, plan)
        try:
            m = remat.measure(ref.model, ref.batch, loss_fn=ref.loss_fn, repeats=repeats)
        finally:
            remat.remove_plan(ref.model)
        peak_err = (plan.predicted_peak_bytes - m.peak_bytes) / m.peak_bytes
        time_err = (plan.predicted_time_ms - m.time_ms) / m.time_ms
        rows.append({
            "model": name,
            "budget": f"{label} ({mib(budget)})",
            "plan": plan.summary(),
            "pred MiB": mib(plan.predicted_peak_bytes, 2),
            "meas MiB": mib(m.peak_bytes, 2),
            "peak err %": f"{100 * peak_err:+.2f}",
            "within budget": "yes" if m.peak_bytes <= budget else "NO",
            "pred ms": f"{plan.predicted_time_ms:.0f}",
            "meas ms": f"{m.time_ms:.0f}",
            "time err %": f"{100 * time_err:+.1f}",
        })
        print(" | ".join(rows[-1].values()), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "gpt", "hf-gpt2"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "prediction_accuracy.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    rows = [row for name in args.models for row in rows_for(name, args.repeats)]
    measured = [r for r in rows if "peak err %" in r]
    worst_peak = max(abs(float(r["peak err %"])) for r in measured)
    worst_time = max(abs(float(r["time err %"])) for r in measured)
    over = sum(r["within budget"] != "yes" for r in measured)
    header = (
        "# Prediction accuracy\n\n"
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; machine: "
        f"{machine_line(args.threads)}\n"
        f"- command: `.venv/bin/python benchmarks/prediction_accuracy.py` "
        f"({time.perf_counter() - start:.0f} s)\n"
        "- peak: dispatch-level meter, everything included (parameters, gradients, "
        "activations); time: median of the measured steps; pred: `simulate()` via the plan\n"
        f"- **{len(measured)} plans measured: worst peak error {worst_peak:.2f}%, worst step-time "
        f"error {worst_time:.1f}%, {over} over budget**\n"
    )
    table = markdown_table(COLUMNS, [[r.get(c, "") for c in COLUMNS] for r in rows])
    write_result(args.out, "\n".join([header, *table]) + "\n")


if __name__ == "__main__":
    main()

"""The README's main command: remat's whole job on a reference model, with measurements.

Profile the model, draw the optimal frontier, solve at half of its activation
memory (``"50%"``; raised to the smallest feasible peak when half is below what
any plan reaches, as on the tiny models, and said so), apply the plan, measure a
real step, compare with the baselines, train a few steps under the plan, and write
the plot. ``python -m remat demo`` runs it
(the command line imports this module only then); it prints, as the CLI does.
"""

from __future__ import annotations

from pathlib import Path

import torch

import remat
from remat.api import activation_budget
from remat.cli.output import check_writable, write_atomic
from remat.cli.report import print_table
from remat.core.bytesize import format_bytes, mib
from remat.measurement.runner import forward_loss
from remat.models.load import load_model
from remat.solver.head_choice import min_peak_bytes_over_heads
from remat.solver.resolve import no_checkpoint_peak_bytes

__all__ = ["run_demo"]


def run_demo(*, model_name: str = "gpt", size: str = "small", out_dir: Path = Path("out")) -> None:
    """Run the demo on ``model_name`` (a built-in name or ``module:function``) at
    ``size``; writes ``demo_pareto.png`` and ``demo_plan.json`` into ``out_dir``."""
    # The outputs are checked before the minutes of work that make them.
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_path, plan_path = out_dir / "demo_pareto.png", out_dir / "demo_plan.json"
    check_writable(plot_path, "--out-dir")
    model, batch, loss_fn, label = load_model(model_name, size=size)
    print(f"== remat demo: {label}")
    profile = remat.profile(model, batch, loss_fn=loss_fn)
    print(
        f"profiled {profile.n} units (chain={profile.is_chain}) on {profile.device}: "
        f"step {profile.step_ms:.0f} ms, no-checkpoint peak "
        f"{mib(no_checkpoint_peak_bytes(profile))} MiB (predicted, not run)"
    )
    budget = activation_budget(profile, 0.5)
    floor = min_peak_bytes_over_heads(profile)
    if budget < floor:
        print(f"budget: half of the activation memory ({format_bytes(budget)}) is below the "
              f"smallest peak any plan reaches, so the demo uses that: {format_bytes(floor)}\n")
        budget = floor
    else:
        print(f"budget: half of the activation memory (\"50%\") = {mib(budget)} MiB\n")

    plans = {
        "no checkpointing": remat.solve(profile, method="none"),
        "every block (HF)": remat.solve(profile, method="all"),
        "chen sqrt(n)": remat.solve(profile, method="chen"),
        "remat optimal": remat.solve(profile, memory_budget=budget),
    }
    rows, measured = [], []
    for name, plan in plans.items():
        remat.apply_plan(model, plan)
        try:
            m = remat.measure(model, batch, loss_fn=loss_fn)
        finally:
            remat.remove_plan(model)
        measured.append({"peak_bytes": m.peak_bytes, "time_ms": m.time_ms, "label": name,
                         "predicted_peak_bytes": plan.record.predicted_peak_bytes,
                         "predicted_time_ms": plan.record.predicted_time_ms})
        rows.append(
            {
                "method": name,
                "plan": plan.summary(),
                "pred MiB": mib(plan.record.predicted_peak_bytes),
                "meas MiB": mib(m.peak_bytes),
                "pred ms": f"{plan.record.predicted_time_ms:.0f}",
                "meas ms": f"{m.time_ms:.0f}",
                "fits budget": "yes" if m.peak_bytes <= budget else "no",
            }
        )
    print_table(rows)

    plan = plans["remat optimal"]
    remat.apply_plan(model, plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    print("\ntraining 3 steps under the optimal plan:")
    for step in range(3):
        loss = forward_loss(model, batch, loss_fn)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"  step {step}: loss {loss.item():.4f}")
    remat.remove_plan(model)

    frontier = remat.pareto(profile)
    fig = remat.plot_pareto(
        frontier, measured=measured, budgets=[budget], title=f"remat on {label}"
    )
    write_atomic(plot_path, lambda tmp: fig.savefig(tmp, format="png", dpi=130))
    text = plan.to_json()
    write_atomic(plan_path, lambda tmp: Path(tmp).write_text(text))
    print(f"\nwrote {plot_path} and {plan_path}")

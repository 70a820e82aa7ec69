"""The memory/time trade-off of a profile: the optimum at many budgets, next to the baselines."""

from __future__ import annotations

import logging
import math

import numpy as np
import pandas as pd

from remat.errors import InfeasibleBudgetError
from remat.solver.baselines import (
    checkpoint_all_plan,
    chen_plan,
    keep_all_plan,
    uniform_plan,
)
from remat.solver.dp import min_peak_bytes
from remat.solver.plan import Plan, Status
from remat.solver.profile import Profile
from remat.solver.solve import algorithm, no_checkpoint_peak_bytes

__all__ = ["COLUMNS", "frontier_plans", "min_feasible_peak", "pareto_frontier"]

log = logging.getLogger(__name__)

COLUMNS = ("budget_bytes", "peak_bytes", "time_ms", "overhead_pct", "algorithm", "plan", "kind")


def min_feasible_peak(profile: Profile) -> int:
    """The smallest simulated peak of any plan (every option, every segment), in bytes."""
    return min_peak_bytes(profile)


def _budgets(lo: int, hi: int, points: int) -> list[int]:
    """``points`` integer budgets from ``lo`` to ``hi`` inclusive, evenly spread, unique."""
    if points < 1:
        raise ValueError(f"points must be >= 1, got {points}")
    if points == 1 or hi <= lo:
        return [lo]
    return sorted({int(round(b)) for b in np.linspace(lo, hi, points)})


def _row(plan: Plan, base_ms: float, kind: str, label: str, budget: int | None) -> dict:
    assert plan.predicted_time_ms is not None
    return {
        "budget_bytes": budget,
        "peak_bytes": plan.predicted_peak_bytes,
        "time_ms": plan.predicted_time_ms,
        "overhead_pct": 100.0 * (plan.predicted_time_ms / base_ms - 1.0) if base_ms else math.nan,
        "algorithm": label,
        "plan": plan.summary(),
        "kind": kind,
    }


def _uniform_ks(n: int) -> list[int]:
    """A few ``k`` for ``uniform``: 2, 4, 8 and ~sqrt(n), within 2..n."""
    return sorted({k for k in (2, 4, 8, round(math.sqrt(n))) if 2 <= k <= n})


def _baseline_rows(profile: Profile, base_ms: float) -> list[dict]:
    """none, all, uniform for a few k, and chen, each without a budget."""
    plans = [("none", keep_all_plan(profile)), ("all", checkpoint_all_plan(profile))]
    plans += [(f"uniform(k={k})", uniform_plan(profile, k=k)) for k in _uniform_ks(profile.n)]
    plans.append(("chen", chen_plan(profile)))
    return [_row(plan, base_ms, "baseline", label, None) for label, plan in plans]


def frontier_plans(profile: Profile, *, points: int = 20, method: str = "dp") -> list[Plan]:
    """The distinct best plans at ``points`` budgets from the smallest feasible peak to
    the no-checkpoint peak, fastest first (ties: smaller peak first).

    Budgets ``method`` cannot meet give no plan.
    """
    solve = algorithm(method)
    found: dict[tuple, Plan] = {}
    for budget in _budgets(min_feasible_peak(profile), no_checkpoint_peak_bytes(profile), points):
        try:
            plan = solve(profile, budget)
        except InfeasibleBudgetError:
            continue
        found.setdefault((plan.options, plan.segments), plan)
    return sorted(found.values(), key=lambda p: (p.predicted_time_ms, p.predicted_peak_bytes))


def pareto_frontier(
    profile: Profile, *, points: int = 20, method: str = "dp", baselines: bool = True
) -> pd.DataFrame:
    """The best plan at ``points`` budgets from the smallest feasible peak to the
    no-checkpoint peak, plus the baselines' plans without a budget.

    Columns: ``budget_bytes`` (``<NA>`` for baselines), ``peak_bytes``, ``time_ms``,
    ``overhead_pct`` (time over the no-checkpoint plan's, in percent), ``algorithm``,
    ``plan`` (its summary) and ``kind``: ``"optimal"`` for proven optima,
    ``"feasible"`` for budgeted plans not proven optimal (a heuristic ``method`` or
    a CP-SAT time limit), ``"baseline"`` for the baselines. A budget the method
    cannot meet (a heuristic's) gives no row.
    """
    solve = algorithm(method)
    keep = keep_all_plan(profile)
    base_ms = keep.predicted_time_ms or 0.0
    rows = []
    for budget in _budgets(min_feasible_peak(profile), no_checkpoint_peak_bytes(profile), points):
        try:
            plan = solve(profile, budget)
        except InfeasibleBudgetError as err:
            log.info("pareto: %s cannot meet %d B: %s", method, budget, err)
            continue
        kind = "optimal" if plan.status == Status.OPTIMAL else "feasible"
        rows.append(_row(plan, base_ms, kind, plan.algorithm, budget))
    if baselines:
        rows += _baseline_rows(profile, base_ms)
    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    return frame.astype({"budget_bytes": "Int64", "peak_bytes": "int64", "time_ms": "float64",
                         "overhead_pct": "float64"})

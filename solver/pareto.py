"""The memory/time trade-off of a profile: the optimum at many budgets, next to the baselines.

A frontier holds each distinct plan once and no plan another one beats: among
the solved plans, a plan is dropped when another is no slower and peaks no
higher (on a tie in both, the one found at the smaller budget stays). pandas is
imported only where the frame is built.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from remat.core.checks import check_count
from remat.core.errors import InfeasibleBudgetError
from remat.core.plan import Plan, Status
from remat.core.profile import Profile
from remat.solver.baselines import (
    checkpoint_all_plan,
    chen_plan,
    keep_all_plan,
    uniform_plan,
)
from remat.solver.head_choice import min_peak_bytes_over_heads, solve_over_heads
from remat.solver.resolve import no_checkpoint_peak_bytes
from remat.solver.solve import algorithm

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["COLUMNS", "frontier_plans", "pareto_frontier"]

log = logging.getLogger(__name__)

COLUMNS = ("budget_bytes", "peak_bytes", "time_ms", "overhead_pct", "algorithm", "plan", "kind")

# Plan times are sums of floats: times this close count as equal.
_TIME_TOLERANCE_MS = 1e-9


def _budgets(lo: int, hi: int, points: int) -> list[int]:
    """``points`` integer budgets from ``lo`` to ``hi`` inclusive, evenly spread, unique."""
    if points == 1 or hi <= lo:
        return [lo]
    return sorted({int(round(b)) for b in np.linspace(lo, hi, points)})


def _check_points(points: object) -> int:
    return check_count("points", points, lo=1, meaning="how many budgets to solve at",
                       owner="the frontier")


def _solved(profile: Profile, points: int, method: str,
            head: str = "auto") -> list[tuple[int, Plan]]:
    """(budget, plan) at ``points`` budgets from the smallest feasible peak to the
    no-checkpoint peak, ascending; budgets ``method`` cannot meet give none."""
    solve = algorithm(method)
    found = []
    lo, hi = min_peak_bytes_over_heads(profile), no_checkpoint_peak_bytes(profile)
    for budget in _budgets(lo, hi, points):
        try:
            found.append((budget, solve_over_heads(solve, profile, budget, head=head)))
        except InfeasibleBudgetError as err:
            log.info("pareto: %s cannot meet %d B: %s", method, budget, err)
    return found


def _beats(a: Plan, b: Plan) -> bool:
    """``a`` is no slower than ``b`` and peaks no higher."""
    assert a.record.predicted_time_ms is not None and b.record.predicted_time_ms is not None
    return (
        a.record.predicted_time_ms <= b.record.predicted_time_ms + _TIME_TOLERANCE_MS
        and a.record.predicted_peak_bytes <= b.record.predicted_peak_bytes
    )


def _frontier(solved: Sequence[tuple[int, Plan]]) -> list[tuple[int, Plan]]:
    """The non-dominated (budget, plan) pairs, each distinct plan once, by budget.

    ``solved`` is ascending by budget, so a plan keeps the smallest budget at which
    it was found. A pair goes when an earlier pair beats it (no slower, no higher:
    a tie stays with the smaller budget) or a later one beats it strictly.
    """
    kept: list[tuple[int, Plan]] = []
    seen = set()
    for k, (budget, plan) in enumerate(solved):
        key = (plan.options, plan.segments, plan.head)
        if key in seen:
            continue
        seen.add(key)
        earlier = any(_beats(p, plan) for _, p in solved[:k])
        later = any(_beats(p, plan) and not _beats(plan, p) for _, p in solved[k + 1 :])
        if not earlier and not later:
            kept.append((budget, plan))
    return kept


def frontier_plans(profile: Profile, *, points: int = 20, method: str = "dp",
                   head: str = "auto") -> list[Plan]:
    """The distinct non-dominated best plans at ``points`` budgets from the smallest
    feasible peak to the no-checkpoint peak, fastest first (ties: smaller peak first).

    Budgets ``method`` cannot meet give no plan. Each plan's ``budget_bytes`` is the
    smallest of those budgets at which it was found. ``head``: as for
    :func:`~remat.solver.head_choice.solve_over_heads` (exact first by default).
    """
    points = _check_points(points)
    kept = _frontier(_solved(profile, points, method, head))
    return sorted((plan for _, plan in kept),
                  key=lambda p: (p.record.predicted_time_ms, p.record.predicted_peak_bytes))


def _row(plan: Plan, base_ms: float, kind: str, label: str, budget: int | None) -> dict:
    assert plan.record.predicted_time_ms is not None
    return {
        "budget_bytes": budget,
        "peak_bytes": plan.record.predicted_peak_bytes,
        "time_ms": plan.record.predicted_time_ms,
        "overhead_pct": (100.0 * (plan.record.predicted_time_ms / base_ms - 1.0) if base_ms
                         else math.nan),
        "algorithm": label,
        "plan": plan.summary(),
        "kind": kind,
    }


def _uniform_ks(n: int) -> list[int]:
    """A few ``k`` for ``uniform``: 2, 4, 8 and ~sqrt(n), within 2..n."""
    return sorted({k for k in (2, 4, 8, round(math.sqrt(n))) if 2 <= k <= n})


def _baseline_rows(profile: Profile, base_ms: float) -> list[dict]:
    """none, all, uniform for a few k, and chen, each without a budget.

    Baselines that make the same plan share one row, labelled with all their
    names (``"all = chen"``).
    """
    plans = [("none", keep_all_plan(profile)), ("all", checkpoint_all_plan(profile))]
    plans += [(f"uniform(k={k})", uniform_plan(profile, k=k)) for k in _uniform_ks(profile.n)]
    plans.append(("chen", chen_plan(profile)))
    labels: dict[tuple, list[str]] = {}
    first: dict[tuple, Plan] = {}
    for label, plan in plans:
        key = (plan.options, plan.segments)
        labels.setdefault(key, []).append(label)
        first.setdefault(key, plan)
    return [_row(first[key], base_ms, "baseline", " = ".join(names), None)
            for key, names in labels.items()]


def pareto_frontier(
    profile: Profile, *, points: int = 20, method: str = "dp", baselines: bool = True,
    head: str = "auto",
) -> pd.DataFrame:
    """The best plans at ``points`` budgets from the smallest feasible peak to the
    no-checkpoint peak, plus the baselines' plans without a budget.

    Columns: ``budget_bytes``, ``peak_bytes``, ``time_ms``, ``overhead_pct`` (time
    over the no-checkpoint plan's, in percent), ``algorithm``, ``plan`` (its
    summary) and ``kind``: ``"optimal"`` for proven optima, ``"feasible"`` for
    budgeted plans not proven optimal (a heuristic ``method`` or a CP-SAT time
    limit), ``"baseline"`` for the baselines.

    The budgeted rows are a frontier, by budget: each distinct plan appears once,
    with ``budget_bytes`` the smallest of the sampled budgets at which ``method``
    returned it, and no row is beaten by another (no slower and no higher peak;
    of two rows equal in both, the one at the smaller budget stays). So a budget
    whose plan another row matches or beats has no row of its own; the fastest row
    whose ``peak_bytes`` fits that budget is as fast as its plan. A budget the
    method cannot meet (a heuristic's) gives no row. Baseline rows (``budget_bytes`` is
    ``<NA>``) are reference points and are never dropped, but baselines that make
    the same plan share a row (``algorithm`` ``"all = chen"``). ``head``: how a measured
    chunked head may be chosen (:func:`~remat.solver.head_choice.solve_over_heads`).

    Raises:
        ParameterError: ``points`` is not an int >= 1.
        UnknownMethodError: ``method`` names no algorithm.
    """
    import pandas as pd  # slow to import: only when a frame is built

    points = _check_points(points)
    keep = keep_all_plan(profile)
    base_ms = keep.record.predicted_time_ms or 0.0
    rows = []
    for budget, plan in _frontier(_solved(profile, points, method, head)):
        kind = "optimal" if plan.record.status == Status.OPTIMAL else "feasible"
        rows.append(_row(plan, base_ms, kind, plan.record.algorithm, budget))
    if baselines:
        rows += _baseline_rows(profile, base_ms)
    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    return frame.astype({"budget_bytes": "Int64", "peak_bytes": "int64", "time_ms": "float64",
                         "overhead_pct": "float64"})

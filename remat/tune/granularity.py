"""Blocks or their children: which level of units plans a model better.

Where blocks are few and large, their children can be the better units: a plan
can then recompute a block's cheap half and keep its expensive one. But children
are rarely a chain (a residual add runs between them), so no segment spans them,
and the smallest feasible peak can rise. So both levels are profiled and
compared on what a user gets from the solver:

* the **score** of a level is its step time under the optimal plan, relative to
  its own step without checkpointing (so the two profiles' timing noise in
  ``step_ms`` cancels), averaged over :data:`BUDGETS` budgets evenly spread from
  the smaller of the two smallest feasible peaks to the larger no-checkpoint peak;
  a budget a level cannot meet scores :data:`INFEASIBLE` (a doubled step, more
  than recomputing every unit costs);
* the lower score wins; children must win by more than :data:`MARGIN`, since
  blocks are fewer units (cheaper to profile and apply) and form chains.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import numpy as np

from remat.core.errors import InfeasibleBudgetError
from remat.core.profile import Profile
from remat.solver.dp import solve_dp
from remat.solver.min_peak import min_peak_bytes
from remat.solver.resolve import no_checkpoint_peak_bytes

__all__ = ["BUDGETS", "INFEASIBLE", "MARGIN", "level_scores", "pick_level"]

log = logging.getLogger("remat")

BUDGETS = 5
INFEASIBLE = 2.0
MARGIN = 0.01


def _relative_time(profile: Profile, budget: int) -> float:
    try:
        plan = solve_dp(profile, budget)
    except InfeasibleBudgetError:
        return INFEASIBLE
    assert plan.record.predicted_time_ms is not None
    return plan.record.predicted_time_ms / profile.step_ms if profile.step_ms > 0 else 1.0


def level_scores(profiles: dict[str, Profile], budgets: int = BUDGETS) -> dict[str, dict[str, Any]]:
    """Per level: its smallest feasible peak, no-checkpoint peak, relative step time at
    each shared budget, and the score (their mean; see the module docstring)."""
    lows = {k: min_peak_bytes(p) for k, p in profiles.items()}
    highs = {k: no_checkpoint_peak_bytes(p) for k, p in profiles.items()}
    grid = sorted({int(b) for b in np.linspace(min(lows.values()), max(highs.values()), budgets)})
    out = {}
    for k, p in profiles.items():
        times = [_relative_time(p, b) for b in grid]
        out[k] = {"min_peak_bytes": lows[k], "no_checkpoint_peak_bytes": highs[k],
                  "budgets": grid, "relative_times": [round(t, 4) for t in times],
                  "score": round(float(np.mean(times)), 4), "units": p.n}
    return out


def pick_level(blocks: Profile, children: Profile) -> Profile:
    """The better of two profiles of one model (see the module docstring), with the
    comparison in its ``meta["granularity_compared"]``."""
    scores = level_scores({"blocks": blocks, "children": children})
    better = children if scores["children"]["score"] < scores["blocks"]["score"] - MARGIN \
        else blocks
    level = "children" if better is children else "blocks"
    log.info("granularity: %s (score blocks %.3f, children %.3f; lower is faster)", level,
             scores["blocks"]["score"], scores["children"]["score"])
    return replace(better, meta={**better.meta, "granularity": level,
                                 "granularity_compared": scores})

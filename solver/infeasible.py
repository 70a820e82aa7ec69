"""The error for a budget no plan fits: the smallest feasible peak, and where it sits.

Knowing that the best plan peaks at, say, the first block's backward with the
optimizer state as its largest part tells a user whether checkpointing can help
at all, and what else to shrink when it cannot.
"""

from __future__ import annotations

from remat.core.errors import InfeasibleBudgetError
from remat.core.plan import Plan
from remat.core.profile import Profile
from remat.solver.min_peak import min_peak_plan
from remat.solver.simulate import simulate

__all__ = ["infeasible_budget_error"]


def infeasible_budget_error(
    profile: Profile, budget: int, *, best: Plan | None = None, detail: str = ""
) -> InfeasibleBudgetError:
    """The :class:`InfeasibleBudgetError` for ``budget`` on ``profile``.

    Args:
        profile: the measured profile.
        budget: the budget no plan fits.
        best: the lowest-peak plan of the algorithm that failed, when it cannot
            reach the smallest peak of the whole plan space (a heuristic); by
            default a plan reaching that smallest peak.
        detail: a sentence appended to the message.
    """
    # min_peak_plan() peaks at min_peak_bytes() by the event model; simulate() is the
    # specification the message quotes.
    sim = simulate(profile, best if best is not None else min_peak_plan(profile))
    # The peak is the loop's: say which loop, so accumulated gradients or a kept output
    # in the parts are not a surprise.
    loop = f"This is for the loop it was profiled with ({profile.loop.describe()})"
    return InfeasibleBudgetError(
        budget, sim.peak_bytes, f"{detail} {loop}".strip(), peak_event=sim.peak_event,
        peak_parts=sim.peak_parts
    )

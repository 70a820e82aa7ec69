"""Pure optimisation over a measured profile: no torch import in this package.

It takes the contracts of :mod:`remat.core` (a :class:`~remat.core.profile.Profile`
in, a :class:`~remat.core.plan.Plan` out) and exports only what it computes: the
algorithms, ``simulate()`` (the specification of peak and time), the event model, the
frontier and the two ends of a profile's range.

Importing it is cheap: the CP-SAT solver (ortools) and the frontier (pandas) load
on first use of their names (PEP 562), and ``method="ilp"`` loads ortools when it
is first solved with.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from remat.solver.baselines import (
    checkpoint_all_plan,
    chen_greedy_plan,
    chen_plan,
    keep_all_plan,
    uniform_plan,
)
from remat.solver.dp import solve_dp
from remat.solver.events import StepModel, step_model
from remat.solver.head_choice import min_peak_bytes_over_heads
from remat.solver.min_peak import min_peak_bytes, min_peak_plan
from remat.solver.resolve import no_checkpoint_peak_bytes, resolve_budget
from remat.solver.simulate import PEAK_PARTS, Simulation, simulate
from remat.solver.solve import ALGORITHMS, UnknownMethodError, solve_profile

if TYPE_CHECKING:
    from remat.solver.ilp import solve_ilp
    from remat.solver.pareto import frontier_plans, pareto_frontier

# Names whose modules import heavy packages (ortools; pandas where a frame is built).
_LAZY = {
    "solve_ilp": "remat.solver.ilp",
    "frontier_plans": "remat.solver.pareto",
    "pareto_frontier": "remat.solver.pareto",
}
# Renamed names (docs/compatibility.md), an error naming the new one: old -> new name.
RENAMED = {"min_feasible_peak": "min_peak_bytes_over_heads"}

__all__ = [
    "ALGORITHMS",
    "PEAK_PARTS",
    "Simulation",
    "StepModel",
    "UnknownMethodError",
    "checkpoint_all_plan",
    "chen_greedy_plan",
    "chen_plan",
    "frontier_plans",
    "keep_all_plan",
    "min_peak_bytes",
    "min_peak_bytes_over_heads",
    "min_peak_plan",
    "no_checkpoint_peak_bytes",
    "pareto_frontier",
    "resolve_budget",
    "simulate",
    "solve_dp",
    "solve_ilp",
    "solve_profile",
    "step_model",
    "uniform_plan",
]


def __getattr__(name: str) -> Any:  # PEP 562: load heavy names on first use
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name in RENAMED:  # pre-1.0: no aliases
        raise AttributeError(f"remat.solver.{name} was renamed: use "
                             f"remat.solver.{RENAMED[name]}")
    raise AttributeError(f"module 'remat.solver' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

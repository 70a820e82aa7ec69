"""Pure optimisation over a measured profile: no torch import in this package."""

from remat.solver.baselines import (
    checkpoint_all_plan,
    chen_greedy_plan,
    chen_plan,
    keep_all_plan,
    uniform_plan,
)
from remat.solver.budget import parse_budget
from remat.solver.dp import min_peak_bytes, solve_dp
from remat.solver.ilp import solve_ilp
from remat.solver.pareto import min_feasible_peak, pareto_frontier
from remat.solver.plan import Plan, Status
from remat.solver.profile import Option, OptionCost, OutsideCost, Profile, UnitProfile
from remat.solver.simulate import Simulation, simulate
from remat.solver.solve import ALGORITHMS, UnknownMethodError, solve_profile

__all__ = [
    "ALGORITHMS",
    "Option",
    "OptionCost",
    "OutsideCost",
    "Plan",
    "Profile",
    "Simulation",
    "Status",
    "UnitProfile",
    "UnknownMethodError",
    "checkpoint_all_plan",
    "chen_greedy_plan",
    "chen_plan",
    "keep_all_plan",
    "min_feasible_peak",
    "min_peak_bytes",
    "parse_budget",
    "pareto_frontier",
    "simulate",
    "solve_dp",
    "solve_ilp",
    "solve_profile",
    "uniform_plan",
]

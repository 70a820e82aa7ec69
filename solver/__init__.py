"""Pure optimisation over a measured profile: no torch import in this package."""

from remat.solver.plan import Plan, Status
from remat.solver.profile import Option, OptionCost, OutsideCost, Profile, UnitProfile
from remat.solver.simulate import Simulation, simulate

__all__ = [
    "Option",
    "OptionCost",
    "OutsideCost",
    "Plan",
    "Profile",
    "Simulation",
    "Status",
    "UnitProfile",
    "simulate",
]

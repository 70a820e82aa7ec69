"""remat: activation checkpointing for PyTorch, planned optimally for a memory budget."""

from remat.errors import (
    BudgetError,
    InfeasibleBudgetError,
    LossNotFoundError,
    NoUnitsError,
    PlanMismatchError,
    ProfileError,
    RematError,
)
from remat.solver import Option, Plan, Profile, simulate

__all__ = [
    "BudgetError",
    "InfeasibleBudgetError",
    "LossNotFoundError",
    "NoUnitsError",
    "Option",
    "Plan",
    "PlanMismatchError",
    "Profile",
    "ProfileError",
    "RematError",
    "simulate",
]

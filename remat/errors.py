"""remat's exceptions: one base class, one subclass per thing a user can get wrong.

This module imports nothing heavy, so the torch-free solver can raise them too.
"""

from __future__ import annotations

from remat.bytesize import format_bytes

__all__ = [
    "BudgetError",
    "InfeasibleBudgetError",
    "LossNotFoundError",
    "NoUnitsError",
    "PlanError",
    "PlanMismatchError",
    "ProfileError",
    "RematError",
]


class RematError(Exception):
    """Base class of every error remat raises on purpose."""


class BudgetError(RematError, ValueError):
    """A memory budget that cannot be parsed or is out of range."""


class InfeasibleBudgetError(RematError):
    """No plan fits the budget. ``min_feasible_bytes`` is the smallest peak any plan reaches."""

    def __init__(self, budget_bytes: int, min_feasible_bytes: int, detail: str = "") -> None:
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        msg = (
            f"memory_budget={format_bytes(budget_bytes)} is infeasible: the smallest peak any "
            f"plan reaches is {format_bytes(min_feasible_bytes)} ({min_feasible_bytes} bytes); "
            "pass a budget of at least that"
        )
        super().__init__(msg + (f". {detail}" if detail else ""))


class ProfileError(RematError, ValueError):
    """A profile that is malformed or cannot be used."""


class PlanError(RematError, ValueError):
    """A plan that is malformed (an unreadable or edited plan file, wrong field types)."""


class PlanMismatchError(PlanError):
    """A plan applied to, or simulated against, a model or profile it was not made for."""


class NoUnitsError(RematError):
    """No units (checkpointing candidates) could be found in a model."""


class LossNotFoundError(RematError):
    """The loss of a training step could not be determined."""


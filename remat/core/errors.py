"""remat's exceptions: one base class, one subclass per thing a user can get wrong.

This module imports nothing heavy, so the torch-free solver can raise them too.
"""

from __future__ import annotations

from collections.abc import Mapping

from remat.core.bytesize import format_bytes

__all__ = [
    "ArgumentError",
    "BudgetError",
    "DeviceMemoryError",
    "InfeasibleBudgetError",
    "LoopError",
    "LossNotFoundError",
    "NoUnitsError",
    "ParameterError",
    "PlanError",
    "PlanMismatchError",
    "ProfileError",
    "RematError",
    "RematWarning",
    "UnknownParameterError",
]


class RematError(Exception):
    """Base class of every error remat raises on purpose."""


class RematWarning(UserWarning):
    """A warning remat gives on purpose (a planned model met inputs larger than it was
    planned for, a unit that cannot be recomputed runs unplanned...)."""


class ArgumentError(RematError, TypeError):
    """An argument of the wrong kind: a path where a Plan goes, a string for an optimizer."""


class ParameterError(RematError, ValueError):
    """An algorithm parameter (or a count such as ``points=``) of the wrong type or range."""


class UnknownParameterError(RematError, TypeError):
    """A keyword parameter the chosen algorithm does not take."""


class LoopError(RematError, ValueError):
    """A training-loop description that is out of range."""


class BudgetError(RematError, ValueError):
    """A memory budget that cannot be parsed or is out of range."""


class InfeasibleBudgetError(RematError):
    """No plan fits the budget.

    Attributes:
        budget_bytes: the budget asked for.
        min_feasible_bytes: the smallest peak any plan reaches.
        peak_event: the event at which a plan reaching that peak peaks
            (``"backward transformer.h.0"``), or ``None`` when unknown.
        peak_parts: what that peak is made of (``parameters``, ``buffers``,
            ``optimizer state``, ``gradients``, ``activations``), in bytes; empty
            when unknown.
    """

    def __init__(
        self,
        budget_bytes: int,
        min_feasible_bytes: int,
        detail: str = "",
        *,
        peak_event: str | None = None,
        peak_parts: Mapping[str, int] | None = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        self.detail = detail
        self.peak_event = peak_event
        self.peak_parts = dict(peak_parts or {})
        msg = (
            f"memory_budget={format_bytes(budget_bytes)} is infeasible: the smallest peak any "
            f"plan reaches is {format_bytes(min_feasible_bytes)} ({min_feasible_bytes} bytes)"
            f"{_where_it_peaks(peak_event, self.peak_parts)}; pass a budget of at least that"
        )
        super().__init__(msg + (f". {detail}" if detail else ""))


def _where_it_peaks(event: str | None, parts: Mapping[str, int]) -> str:
    """``", at 'backward h.0': optimizer state 1.00 GiB, ..."``, largest part first."""
    text = f", at {event!r}" if event else ""
    shown = sorted(((b, name) for name, b in parts.items() if b > 0), reverse=True)
    if shown:
        text += ": " + ", ".join(f"{name} {format_bytes(b)}" for b, name in shown)
        if shown[0][1] != "activations":
            # Only activations shrink with checkpointing; say so when they are not the bulk.
            text += f" (the largest part is {shown[0][1]}; checkpointing only reduces activations)"
    return text


class DeviceMemoryError(RematError):
    """remat's own work (profiling a unit, the code outside the units) does not fit the
    device's memory even in its most frugal form; the message names what and why."""


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


"""What the trainer callbacks share: their settings, solving and applying, and the report.

A callback plans once, when training starts: it takes the trainer's first batch, its
loop (accumulation, mixed precision) and its optimizer, solves with
:func:`remat.solve` (which verifies the plan by measuring it), applies the plan, and
later measures one real optimizer step of the trainer itself (:mod:`.step_meter`).
:class:`RunReport` holds the figures: the budget, the predicted peak, the peak
measured while verifying, and the trainer's own measured step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from remat.core.bytesize import format_bytes
from remat.core.checks import check_budget_arg, check_loss_fn
from remat.core.errors import RematError
from remat.core.loop import Loop
from remat.core.plan import Plan
from remat.core.settings import ProfilingSettings, Verify
from remat.measurement.step_meter import TrainerStepPeak
from remat.solver.solve import check_method

__all__ = ["CallbackSettings", "IntegrationError", "RunReport", "solve_plan"]

log = logging.getLogger("remat")


class IntegrationError(RematError):
    """A trainer set up in a way remat cannot plan for (its own checkpointing on, ...)."""


@dataclass(frozen=True)
class CallbackSettings:
    """What a callback solves with: the budget, :func:`remat.solve`'s method, the profiling
    settings as one value (the loss function, the units and the options; the loop and
    the optimizer are the trainer's, filled in when training starts), the verification
    (``None``: none) and the callback's own."""

    memory_budget: Any
    method: str = "optimal"
    profiling: ProfilingSettings = field(default_factory=ProfilingSettings)
    verify: Verify | None = field(default_factory=Verify)
    include_optimizer: bool = True
    measure_step: int | None = 1
    solver_params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Fail when the callback is made, not minutes later when training starts.
        if self.memory_budget is None:
            raise IntegrationError("RematCallback needs memory_budget (e.g. '8GB', '50%'): the "
                                   "peak one training step may reach on the device")
        check_budget_arg(self.memory_budget)
        check_method(self.method, self.solver_params)
        check_loss_fn(self.profiling.loss_fn, "RematCallback")
        step = self.measure_step
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)
                                 or step < 0):
            raise IntegrationError(f"RematCallback(measure_step={step!r}): the optimizer step "
                                   "to measure, an int >= 0, or None not to measure")


@dataclass
class RunReport:
    """A planned training run's memory figures, in bytes."""

    plan: Plan
    loop: Loop
    budget_bytes: int
    predicted_peak_bytes: int
    verified_peak_bytes: int | None
    trainer_step: TrainerStepPeak | None = None
    measured_at_step: int | None = None

    @classmethod
    def of(cls, plan: Plan, loop: Loop) -> RunReport:
        """The report of a solved plan (its budget, predicted and verified peaks)."""
        measured = plan.verification.measured_peak_bytes if plan.verification else None
        return cls(plan, loop, plan.budget_bytes or 0, plan.record.predicted_peak_bytes or 0,
                   measured)

    def summary(self) -> str:
        """One paragraph: the plan, the budget, predicted and measured peaks."""
        text = (f"remat: plan {self.plan.summary()} for {self.loop.describe()}; budget "
                f"{format_bytes(self.budget_bytes)}, predicted peak "
                f"{format_bytes(self.predicted_peak_bytes)}")
        if self.verified_peak_bytes is not None:
            text += f", measured while solving {format_bytes(self.verified_peak_bytes)}"
        if self.trainer_step is not None:
            text += (f", measured in the trainer's step {self.measured_at_step} "
                     f"{format_bytes(self.trainer_step.peak_bytes)} (meter "
                     f"{format_bytes(self.trainer_step.meter_peak_bytes)}, allocator "
                     f"{format_bytes(self.trainer_step.allocator_peak_bytes)})")
        return text

    def to_dict(self) -> dict[str, Any]:
        """The figures as flat ``remat/...`` keys (for a trainer's log history)."""
        d: dict[str, Any] = {
            "remat/plan": self.plan.summary(),
            "remat/budget_bytes": self.budget_bytes,
            "remat/predicted_peak_bytes": self.predicted_peak_bytes,
            "remat/verified_peak_bytes": self.verified_peak_bytes,
        }
        if self.trainer_step is not None:
            d["remat/trainer_peak_bytes"] = self.trainer_step.peak_bytes
            d["remat/trainer_step"] = self.measured_at_step
        return d

    def check_trainer_step(self) -> None:
        """Log the trainer's measured step against the budget."""
        if self.trainer_step is None:
            return
        peak = self.trainer_step.peak_bytes
        if peak > self.budget_bytes:
            log.warning("remat: the trainer's step %d measured %s, %s above the budget %s "
                        "(predicted %s): the trainer's step holds what remat's loop does not "
                        "(the next micro-batch it loads, gradient clipping, logging); lower "
                        "the budget by that much",
                        self.measured_at_step, format_bytes(peak),
                        format_bytes(peak - self.budget_bytes), format_bytes(self.budget_bytes),
                        format_bytes(self.predicted_peak_bytes))


def solve_plan(model: Any, batch: Any, loop: Loop, optimizer: Any,
               settings: CallbackSettings, *, loss_fn: Any = None, head: str = "auto") -> Plan:
    """The verified plan for ``model`` on ``batch`` in ``loop`` (:func:`remat.solve`): the
    callback's profiling settings with the trainer's loop and optimizer filled in
    (``loss_fn``, where given, replaces the callback's: a wrapper's loss is its output)."""
    from remat.api import solve_with

    profiling = settings.profiling.replace(
        loop=loop, optimizer=optimizer if settings.include_optimizer else None, head=head,
        loss_fn=loss_fn if loss_fn is not None else settings.profiling.loss_fn)
    return solve_with(model, batch, settings.memory_budget, profiling, method=settings.method,
                      verify=settings.verify, solver_params=settings.solver_params)

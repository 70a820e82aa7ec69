"""Closed-loop solving: apply the plan, measure a real step, and solve again when it is over.

``simulate()`` predicts the allocator's view of a step within a fraction of a
percent on the models remat is tested on, but a prediction is not a promise: a
kernel may allocate scratch the profile did not see, a tensor may be made outside
the dispatcher. So :func:`remat.solve` checks its plan. It applies the plan,
measures one optimizer step of the user's loop with both instruments (the
dispatch-level meter and the allocator), and when the higher of the two is above
the budget it lowers the budget it solves for by the excess and solves again, a
bounded number of rounds. The plan it returns carries the measured peak next to the
predicted one, and how many rounds it took.

The lowered budget is remat's own, never the user's: when the excess measured outgrows
the budget itself, the error names the user's budget, the measured peak and the
smallest budget that would measure within (never a lowered budget, which may be zero
or less). A plan measured further than :data:`PREDICTION_TOLERANCE` from its prediction
tells ``solve()`` that a *cached* profile no longer describes the model
(:func:`off_prediction`; :mod:`remat.tune.profile_cache`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from remat.core.bytesize import format_bytes
from remat.core.errors import InfeasibleBudgetError, RematError
from remat.core.loop import Loop
from remat.core.plan import Plan, Verification
from remat.core.settings import Verify
from remat.measurement.runner import LossFn
from remat.measurement.step import StepMeasurement, measure_step
from remat.runtime import apply_plan, remove_plan

__all__ = ["PREDICTION_TOLERANCE", "BudgetNotMetError", "measure_plan", "off_prediction",
           "verified"]

log = logging.getLogger("remat")

DEFAULT_ROUNDS = Verify().rounds
# How far a measured step may be from its prediction, as a share of the prediction: what
# the tests hold simulate() to against the higher of the two instruments (1%).
PREDICTION_TOLERANCE = 0.01


class BudgetNotMetError(RematError):
    """Solved plans kept measuring above the budget, round after round."""


def measure_plan(
    model: nn.Module,
    batch: Any,
    plan: Plan,
    *,
    loss_fn: LossFn | None,
    optimizer: torch.optim.Optimizer | None,
    loop: Loop | None,
    steps: int = 1,
    timed: bool = False,
) -> StepMeasurement:
    """``steps`` consecutive optimizer steps of ``loop`` with ``plan`` applied, measured
    with both instruments (the peak over all of them); the model is left as it was (plan
    removed, state restored)."""
    apply_plan(model, plan)
    try:
        # No warm-up: the first measured step creates the optimizer's state, as training's
        # first step does (its peak counts); with ``timed``, one more step for the time.
        # Only the peak is verified: not the bytes held after a forward (one forward more).
        return measure_step(model, batch, loss_fn=loss_fn, optimizer=optimizer, loop=loop,
                            warmup=0, repeats=1 if timed else 0, allocator=True, steps=steps,
                            held=False)
    finally:
        remove_plan(model)


def off_prediction(plan: Plan, measured: StepMeasurement) -> bool:
    """Whether ``measured`` (the higher instrument) is further from ``plan``'s predicted
    peak than :data:`PREDICTION_TOLERANCE` allows, either way."""
    predicted = plan.record.predicted_peak_bytes
    if not predicted:
        return False
    return abs(measured.worst_peak_bytes - predicted) > PREDICTION_TOLERANCE * predicted


def verified(
    plan: Plan,
    budget_bytes: int,
    solve_at: Callable[[int], Plan],
    measure: Callable[[Plan], StepMeasurement],
    *,
    rounds: int = DEFAULT_ROUNDS,
) -> Plan:
    """``plan``, measured; re-solved at a lower budget while it measures above ``budget_bytes``.

    Args:
        plan: the plan solved for ``budget_bytes``.
        budget_bytes: the user's budget.
        solve_at: solves for an internal budget (raises ``InfeasibleBudgetError``).
        measure: measures a plan (:func:`measure_plan` bound to the model).
        rounds: at most this many plans are measured.

    Raises:
        InfeasibleBudgetError: the lowered budget is below what any plan reaches.
        BudgetNotMetError: ``rounds`` plans all measured above the budget.
    """
    if rounds < 1:
        raise RematError(f"rounds={rounds!r}: need at least 1 (remat.Verify(rounds=...), or "
                         "verify=False)")
    target = budget_bytes
    for round_ in range(1, rounds + 1):
        try:
            measured = measure(plan)
        except torch.OutOfMemoryError as err:
            # The device refused the plan's step: over the budget by an amount it does not
            # tell. Count it 1% over, and solve again below.
            log.warning("remat: round %d's plan ran out of device memory (%s)", round_,
                        " ".join(str(err).split())[:200])
            peak, time_ms = budget_bytes + max(budget_bytes // 100, 1), None
            how = "counted (out of memory)"
        else:
            peak, time_ms = measured.worst_peak_bytes, measured.time_ms
            how = "measured"
        plan = plan.with_(verification=Verification(round_, target, peak, time_ms))
        if peak <= budget_bytes:
            log.info("remat: plan verified in round %d: measured %s, predicted %s, budget %s",
                     round_, format_bytes(peak),
                     format_bytes(plan.record.predicted_peak_bytes or 0),
                     format_bytes(budget_bytes))
            return plan
        excess = peak - budget_bytes
        target -= excess
        log.warning("remat: round %d's plan %s %s, %s over the budget (predicted %s); "
                    "solving again for %s below the budget", round_, how, format_bytes(peak),
                    format_bytes(excess), format_bytes(plan.record.predicted_peak_bytes or 0),
                    format_bytes(budget_bytes - target))
        try:
            # A budget of zero or less is no budget; solving for one byte, which no plan
            # reaches, still tells the smallest peak for the error below.
            plan = solve_at(max(target, 1))
        except InfeasibleBudgetError as err:
            raise InfeasibleBudgetError(
                budget_bytes, err.min_feasible_bytes + (budget_bytes - target),
                f"Round {round_}'s plan {how} {format_bytes(peak)}; the plans' measured "
                f"peaks run {format_bytes(budget_bytes - target)} above their predictions on "
                "this model, so the smallest budget that measures within is about that much "
                "above the smallest predicted peak",
                peak_event=err.peak_event, peak_parts=err.peak_parts,
            ) from None
    raise BudgetNotMetError(
        f"memory_budget={format_bytes(budget_bytes)}: {rounds} plans, each solved for a lower "
        f"budget than the last, all measured above it (the last {format_bytes(peak)}); raise "
        "the budget, or verify=remat.Verify(rounds=...) more rounds"
    )

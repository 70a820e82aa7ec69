"""Plans for a model that will train under ``torch.compile``: chosen by measuring it compiled.

remat's profile and simulator describe eager execution. Compiled, a plan's step
holds other tensors: inductor fuses kernels, and its partitioner can recompute
element-wise ops inside its backward kernels (how much is set by
``torch._functorch.config.activation_memory_budget``). A plan solved for the eager
figures may then checkpoint more than the compiled model needs, or fit eagerly
and not compiled.

:func:`search_compiled` therefore measures instead of predicting, over two knobs:
remat's plan and inductor's ``activation_memory_budget``. The plans are the
optimal plans along the eager frontier (:func:`frontier_plans`), fastest first.
For each partitioner budget (default 1.0, 0.7, 0.4, in that order), a binary
search compiles candidates and measures their training step's peak with the
allocator (:mod:`remat.measurement.allocator`: it sees compiled code, which the
dispatch-level meter cannot), for the fastest plan that fits; the fitting
candidates are also timed. A lower partitioner budget only searches the plans
faster than the best found so far (more recomputation by inductor is worth it
only if it lets a faster plan fit), and the search stops once keeping everything
fits. Of the per-budget winners the fastest by measured step time is returned.
The search assumes that a plan with a lower eager peak, or a lower partitioner
budget, gives a lower compiled peak (usual, not guaranteed), so the plan is
labelled ``feasible``, not ``optimal``; the figures it carries are measured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from remat.core.errors import InfeasibleBudgetError, RematError
from remat.core.loop import Loop
from remat.core.plan import CompiledChoice, Plan, Status
from remat.core.profile import Profile
from remat.measurement.runner import LossFn
from remat.measurement.step import measure_step
from remat.runtime import apply_plan, planned, remove_plan
from remat.solver.pareto import frontier_plans
from remat.solver.resolve import resolve_budget
from remat.solver.solve import solve_profile

__all__ = ["CompiledStep", "compile_planned", "measure_compiled", "search_compiled"]

log = logging.getLogger("remat")

EXACT_METHODS = ("optimal", "dp", "ilp")
DEFAULT_PARTITIONER_BUDGETS = (1.0, 0.7, 0.4)


@dataclass(frozen=True)
class CompiledStep:
    """A compiled training step, measured: allocator peak (everything included), in
    bytes, median time in milliseconds (``None`` when not timed), and on CUDA the
    caching allocator's reserved peak (``None`` elsewhere)."""

    peak_bytes: int
    time_ms: float | None = None
    reserved_bytes: int | None = None


@contextmanager
def partitioner_budget(fraction: float) -> Iterator[None]:
    """``torch._functorch.config.activation_memory_budget = fraction`` inside the block."""
    if not 0.0 <= fraction <= 1.0:
        raise RematError(f"activation_memory_budget must be within [0, 1], got {fraction}")
    with torch._functorch.config.patch(activation_memory_budget=fraction):
        yield


class _PlannedCompiled(nn.Module):
    """A compiled model whose calls run under the plan's partitioner budget."""

    def __init__(self, model: nn.Module, fraction: float, compile_options: Mapping[str, Any]):
        super().__init__()
        self.model = model
        self.fraction = fraction
        # Not a registered submodule: its parameters are the model's, listed once.
        self.__dict__["_compiled"] = torch.compile(model, **dict(compile_options))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Inductor reads the budget when it compiles, on a call, not in torch.compile().
        with partitioner_budget(self.fraction):
            return self._compiled(*args, **kwargs)


def compile_planned(model: nn.Module, plan: Plan, **compile_options: Any) -> nn.Module:
    """Apply ``plan`` to ``model`` (in place) and compile it as the plan was measured.

    Returns a module that calls ``torch.compile(model, **compile_options)`` under the
    plan's ``activation_memory_budget`` (1.0 when the plan has none), so that
    inductor partitions the graph as it did when :func:`search_compiled` measured it.
    Train with the returned module; ``model`` holds the parameters.
    """
    if planned(model) != plan:  # none applied, or another one: this plan replaces it
        apply_plan(model, plan)
    fraction = plan.compiled.activation_memory_budget if plan.compiled is not None else 1.0
    return _PlannedCompiled(model, fraction, compile_options)


def measure_compiled(
    model: nn.Module,
    sample_batch: Any,
    plan: Plan | None,
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    compile_options: Mapping[str, Any] | None = None,
    activation_memory_budget: float = 1.0,
    time_if_within: int | None = None,
    repeats: int = 5,
    loop: Loop | None = None,
) -> CompiledStep:
    """One compiled optimizer step of ``loop`` on ``model`` under ``plan``: peak and (maybe) time.

    The plan (``None``: the model as it is) is applied, the model compiled with
    ``torch.compile(model, **compile_options)`` under ``activation_memory_budget``,
    and its step measured by :func:`remat.measurement.step.measure_step` with the allocator
    only (the dispatch-level meter would run compiled code eagerly): one step compiles
    it (with an optimizer, that step also creates its state), two more are measured,
    and the peak is their rise plus what the step holds throughout (parameters,
    buffers, optimizer state, the batch, the gradients the loop keeps). When the peak
    is at most ``time_if_within`` bytes, ``repeats`` more steps are timed (median).
    Dynamo's caches are reset before and after (``torch._dynamo.reset()``), so each
    plan compiles from nothing. The model is left as it was: plan removed, and
    parameters, buffers, ``.grad``, modes, RNG and optimizer state restored.
    """
    torch._dynamo.reset()
    try:
        if plan is not None:
            apply_plan(model, plan)
        try:
            compiled = torch.compile(model, **dict(compile_options or {}))
            with partitioner_budget(activation_memory_budget):
                step = measure_step(model, sample_batch, loss_fn=loss_fn, optimizer=optimizer,
                                    loop=loop, warmup=1, repeats=repeats, meter=False,
                                    call=compiled, time_within=time_if_within)
        finally:
            if plan is not None:
                remove_plan(model)
    finally:
        torch._dynamo.reset()
    assert step.allocator_peak_bytes is not None  # measured with the allocator
    return CompiledStep(step.allocator_peak_bytes, step.time_ms, step.reserved_peak_bytes)


Measure = Callable[[Plan, float, int], CompiledStep]


def search_compiled(
    model: nn.Module,
    sample_batch: Any,
    profile: Profile,
    memory_budget: int | str,
    *,
    method: str = "optimal",
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    compile_options: Mapping[str, Any] | None = None,
    partitioner_budgets: Sequence[float] = DEFAULT_PARTITIONER_BUDGETS,
    points: int = 20,
    max_compiles: int = 6,
    measure: Measure | None = None,
) -> Plan:
    """The fastest (plan, partitioner budget) whose compiled training step fits ``memory_budget``.

    Args:
        model, sample_batch, loss_fn, optimizer: as for :func:`remat.solve`;
            ``profile`` is the model's (eager) profile.
        memory_budget: the compiled step's peak, everything included; bytes or a
            string as for :func:`remat.solve` (a percentage is of the profile's
            eager no-checkpoint peak).
        method: the exact algorithm that builds the frontier: ``"optimal"``,
            ``"dp"`` or ``"ilp"``.
        compile_options: keyword arguments of ``torch.compile`` (``backend``, ``mode``).
        partitioner_budgets: the ``activation_memory_budget`` values to search with
            (each may cost a binary search; ``(1.0,)``: remat's checkpointing only).
        points: budgets along the eager frontier (its distinct plans are the candidates).
        max_compiles: at most this many candidates are compiled per partitioner budget.
        measure: ``(plan, partitioner budget, time_if_within) -> CompiledStep``; by
            default :func:`measure_compiled` on ``model`` (tests pass their own).

    Returns:
        The plan, with ``compiled_peak_bytes`` and ``compiled_time_ms`` (measured),
        ``activation_memory_budget`` (compile it with :func:`compile_planned`),
        ``status="feasible"`` and ``algorithm`` ending in ``"+compiled"``. Its
        ``predicted_*`` figures stay the eager simulation's.

    Raises:
        InfeasibleBudgetError: no candidate fits compiled; it carries the smallest
            compiled peak measured.
    """
    if method not in EXACT_METHODS:
        raise RematError(
            f"compiled=True searches the optimal frontier: method must be one of "
            f"{list(EXACT_METHODS)}, got {method!r}"
        )
    if max_compiles < 1 or not partitioner_budgets:
        raise RematError(
            f"need max_compiles >= 1 and at least one partitioner budget, got "
            f"{max_compiles=} {partitioner_budgets=}"
        )
    started = time.perf_counter()
    budget = resolve_budget(memory_budget, profile)
    dp_method = "dp" if method == "optimal" else method
    candidates = frontier_plans(profile, points=points, method=dp_method)
    if measure is None:
        def measure(plan: Plan, fraction: float, within: int) -> CompiledStep:
            return measure_compiled(model, sample_batch, plan, loss_fn=loss_fn,
                                    optimizer=optimizer, compile_options=compile_options,
                                    activation_memory_budget=fraction, time_if_within=within,
                                    loop=profile.loop)

    steps: dict[tuple[float, int], CompiledStep] = {}
    winners: list[tuple[float, int]] = []
    hi = len(candidates) - 1
    start = _eager_choice(candidates, profile, budget, dp_method)
    for fraction in sorted(set(partitioner_budgets), reverse=True):
        # Less partitioner budget means more recomputation by inductor: worth it only
        # if it lets a faster plan fit than the best so far, so search only those.
        best = _fastest_fitting(hi, min(start, hi), max_compiles,
                                lambda i, f=fraction: _measured(steps, measure, candidates, f, i,
                                                                budget))
        if best is not None:
            winners.append((fraction, best))
            hi = start = best - 1
        if hi < 0:
            break  # keeping everything fits: nothing is faster
    if not winners:
        smallest = min(s.peak_bytes for s in steps.values())
        raise InfeasibleBudgetError(
            budget, smallest,
            f"measured compiled: no plan of the frontier fits under torch.compile with "
            f"activation_memory_budget in {list(partitioner_budgets)}; the smallest compiled "
            f"peak measured is {smallest} B",
        )
    fraction, best = min(winners, key=lambda w: _time_or_inf(steps[w]))
    chosen, step = candidates[best], steps[(fraction, best)]
    seconds = time.perf_counter() - started
    log.info("remat: compiled search measured %d configurations in %.1f s: %s with "
             "activation_memory_budget %g, peak %d B, step %s ms", len(steps), seconds,
             chosen.summary(), fraction, step.peak_bytes, step.time_ms)
    return chosen.with_(
        budget_bytes=budget,
        record=replace(chosen.record, algorithm=f"{chosen.record.algorithm}+compiled",
                       status=Status.FEASIBLE, solve_ms=seconds * 1e3),
        compiled=CompiledChoice(step.peak_bytes, fraction, step.time_ms),
    )


def _time_or_inf(step: CompiledStep) -> float:
    return step.time_ms if step.time_ms is not None else float("inf")


def _measured(steps: dict[tuple[float, int], CompiledStep], measure: Measure,
              candidates: list[Plan], fraction: float, i: int, budget: int) -> bool:
    """Whether candidate ``i`` fits compiled at ``fraction`` (measured once, then cached)."""
    key = (fraction, i)
    if key not in steps:
        steps[key] = measure(candidates[i], fraction, budget)
        log.info("remat: compiled candidate %d/%d (%s) at activation_memory_budget %g: "
                 "peak %d B (budget %d B), step %s ms", i + 1, len(candidates),
                 candidates[i].summary(), fraction, steps[key].peak_bytes, budget,
                 steps[key].time_ms)
    return steps[key].peak_bytes <= budget


def _fastest_fitting(hi: int, start: int, max_compiles: int,
                     fits: Callable[[int], bool]) -> int | None:
    """Binary search over candidates ``0..hi`` for the first (fastest) that fits,
    probing ``start`` first.

    At most ``max_compiles`` probes; if none of them fits, the candidate with the
    smallest eager peak (``hi``) is tried once more, unless already probed.
    """
    lo, top = 0, hi  # the answer lies in [lo, top], if anywhere
    best: int | None = None
    probes: set[int] = set()
    probe = min(max(start, 0), top)
    while lo <= top and len(probes) < max_compiles:
        probes.add(probe)
        if fits(probe):
            best, top = probe, probe - 1
        else:
            lo = probe + 1
        probe = (lo + top) // 2
    if best is None and hi >= 0 and hi not in probes and fits(hi):
        best = hi
    return best


def _eager_choice(candidates: list[Plan], profile: Profile, budget: int, method: str) -> int:
    """Index of the eager optimum at ``budget`` among ``candidates`` (the slowest
    candidate when the budget is below every eager plan)."""
    try:
        plan = solve_profile(profile, budget, method=method)
    except InfeasibleBudgetError:
        return len(candidates) - 1
    for i, c in enumerate(candidates):
        if c.record.predicted_time_ms is not None and plan.record.predicted_time_ms is not None \
                and c.record.predicted_time_ms >= plan.record.predicted_time_ms:
            return i
    return len(candidates) - 1

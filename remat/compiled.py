"""Plans for a model that will train under ``torch.compile``: chosen by measuring it compiled.

remat's profile and simulator describe eager execution. Compiled, a plan's step
holds other tensors: inductor's partitioner already recomputes cheap element-wise
ops in the backward and fuses kernels, so a compiled step usually needs less
memory than the eager prediction (and occasionally more). A plan solved for the
eager figures then checkpoints more than the compiled model needs, and is slower
than it has to be.

:func:`solve_compiled` therefore measures instead of predicting. The candidates
are the optimal plans along the eager frontier (:func:`frontier_plans`), fastest
first. Each candidate tried is applied to the model, compiled, and run for a
training step whose peak the allocator reports (:mod:`remat.allocator`: it sees
compiled code, which the dispatch-level meter cannot). A binary search, starting
from the eager optimum at the budget, finds the fastest candidate whose compiled
step fits. It assumes that a plan with a lower eager peak also has a lower
compiled peak (true along a frontier of nested choices, not guaranteed), so the
plan is labelled ``feasible``, not ``optimal``; the figure it fits by is measured.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from remat.allocator import allocator_peak
from remat.errors import InfeasibleBudgetError, RematError
from remat.profiler.state import ModelState, clear_grads
from remat.profiler.step import LossFn, fixed_bytes, forward_loss, model_device
from remat.runtime import apply_plan, remove_plan
from remat.solver.budget import parse_budget
from remat.solver.pareto import frontier_plans
from remat.solver.plan import Plan, Status
from remat.solver.profile import Profile
from remat.solver.solve import no_checkpoint_peak_bytes, solve_profile

__all__ = ["compiled_peak_bytes", "solve_compiled"]

log = logging.getLogger("remat")

EXACT_METHODS = ("optimal", "dp", "ilp")


def compiled_peak_bytes(
    model: nn.Module,
    sample_batch: Any,
    plan: Plan | None,
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    compile_options: Mapping[str, Any] | None = None,
) -> int:
    """Peak of one compiled training step of ``model`` under ``plan``, everything included.

    The plan (``None``: the model as it is) is applied, the model compiled with
    ``torch.compile(model, **compile_options)``, and one step run to compile it
    (with an optimizer, that step also creates its state). The next step is measured:
    parameters, buffers and optimizer state, plus the allocator's peak above them
    (gradients start cleared). Dynamo's caches are reset before and after
    (``torch._dynamo.reset()``), so each plan compiles from nothing. The model is left
    as it was: plan removed, and parameters, buffers, ``.grad``, modes, RNG and
    optimizer state restored.
    """
    device = model_device(model)
    state = ModelState.capture(model, optimizer)
    params = state.params
    torch._dynamo.reset()
    try:
        if plan is not None:
            apply_plan(model, plan)
        compiled = torch.compile(model, **dict(compile_options or {}))
        model.train()

        def step() -> None:
            forward_loss(compiled, sample_batch, loss_fn).backward()
            if optimizer is not None:
                optimizer.step()

        with torch.enable_grad():
            clear_grads(params)
            step()  # compiles
            state.rng.restore()
            state.restore_buffers()
            clear_grads(params)
            fixed = fixed_bytes(model, optimizer)
            peak = allocator_peak(step, device_type=device.type)
    finally:
        clear_grads(params)
        if plan is not None:
            remove_plan(model)
        state.restore()
        torch._dynamo.reset()
    return fixed + peak


def solve_compiled(
    model: nn.Module,
    sample_batch: Any,
    profile: Profile,
    memory_budget: int | str,
    *,
    method: str = "optimal",
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    compile_options: Mapping[str, Any] | None = None,
    points: int = 20,
    max_compiles: int = 6,
    measure: Callable[[Plan], int] | None = None,
) -> Plan:
    """The fastest frontier plan whose compiled training step fits ``memory_budget``.

    Args:
        model, sample_batch, loss_fn, optimizer: as for :func:`remat.solve`;
            ``profile`` is the model's (eager) profile.
        memory_budget: the compiled step's peak, everything included; bytes or a
            string as for :func:`remat.solve` (a percentage is of the profile's
            eager no-checkpoint peak).
        method: the exact algorithm that builds the frontier: ``"optimal"``,
            ``"dp"`` or ``"ilp"``.
        compile_options: keyword arguments of ``torch.compile`` (``backend``, ``mode``).
        points: budgets along the eager frontier (distinct plans are the candidates).
        max_compiles: at most this many candidates are compiled and measured.
        measure: ``plan -> compiled peak bytes``; by default
            :func:`compiled_peak_bytes` on ``model`` (tests pass their own).

    Returns:
        The plan, with ``compiled_peak_bytes`` (measured), ``status="feasible"`` and
        ``algorithm`` ending in ``"+compiled"``. Its ``predicted_*`` figures stay the
        eager simulation's.

    Raises:
        InfeasibleBudgetError: even the candidate with the lowest eager peak does
            not fit compiled; it carries that candidate's measured compiled peak.
    """
    if method not in EXACT_METHODS:
        raise RematError(
            f"compiled=True searches the optimal frontier: method must be one of "
            f"{list(EXACT_METHODS)}, got {method!r}"
        )
    if max_compiles < 1:
        raise RematError(f"max_compiles must be >= 1, got {max_compiles}")
    started = time.perf_counter()
    budget = parse_budget(memory_budget, reference_peak_bytes=no_checkpoint_peak_bytes(profile))
    dp_method = "dp" if method == "optimal" else method
    candidates = frontier_plans(profile, points=points, method=dp_method)
    if measure is None:
        def measure(plan: Plan) -> int:
            return compiled_peak_bytes(model, sample_batch, plan, loss_fn=loss_fn,
                                       optimizer=optimizer, compile_options=compile_options)

    peaks: dict[int, int] = {}

    def fits(i: int) -> bool:
        if i not in peaks:
            peaks[i] = measure(candidates[i])
            log.info("remat: compiled candidate %d/%d (%s): peak %d B, budget %d B",
                     i + 1, len(candidates), candidates[i].summary(), peaks[i], budget)
        return peaks[i] <= budget

    # Candidates run fastest (keep everything) to smallest eager peak; the first that
    # fits is wanted. Start at the eager optimum for the budget: compiled steps are
    # usually smaller, so the answer is usually there or faster.
    lo, hi = 0, len(candidates) - 1  # the answer lies in [lo, hi], if anywhere
    start = _eager_choice(candidates, profile, budget, dp_method)
    best: int | None = None
    probe = start
    while lo <= hi and len(peaks) < max_compiles:
        if fits(probe):
            best, hi = probe, probe - 1
        else:
            lo = probe + 1
        probe = (lo + hi) // 2
    if best is None:
        last = len(candidates) - 1
        if not fits(last):  # may exceed max_compiles by one: the error needs the figure
            raise InfeasibleBudgetError(
                budget, peaks[last],
                "measured compiled: the plan with the smallest eager peak "
                f"({candidates[last].summary()}) peaks at {peaks[last]} B under torch.compile",
            )
        best = last
    chosen = candidates[best]
    seconds = time.perf_counter() - started
    log.info("remat: compiled search measured %d of %d candidates in %.1f s: %s, peak %d B",
             len(peaks), len(candidates), seconds, chosen.summary(), peaks[best])
    return dataclasses.replace(
        chosen,
        algorithm=f"{chosen.algorithm}+compiled",
        status=Status.FEASIBLE,
        budget_bytes=budget,
        solve_ms=seconds * 1e3,
        compiled_peak_bytes=peaks[best],
    )


def _eager_choice(candidates: list[Plan], profile: Profile, budget: int, method: str) -> int:
    """Index of the eager optimum at ``budget`` among ``candidates`` (the slowest
    candidate when the budget is below every eager plan)."""
    try:
        plan = solve_profile(profile, budget, method=method)
    except InfeasibleBudgetError:
        return len(candidates) - 1
    for i, c in enumerate(candidates):
        if c.predicted_time_ms is not None and plan.predicted_time_ms is not None \
                and c.predicted_time_ms >= plan.predicted_time_ms:
            return i
    return len(candidates) - 1

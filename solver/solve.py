"""One entry point over every algorithm: ``solve_profile(profile, "8GB", method="optimal")``.

Importing this module does not import ortools: ``method="ilp"`` loads the CP-SAT
solver on first use.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from remat.core.errors import RematError, UnknownParameterError
from remat.core.plan import Plan
from remat.core.profile import Profile
from remat.solver.baselines import (
    checkpoint_all_plan,
    chen_greedy_plan,
    chen_plan,
    keep_all_plan,
    uniform_plan,
)
from remat.solver.dp import solve_dp
from remat.solver.head_choice import solve_over_heads
from remat.solver.resolve import resolve_budget

__all__ = [
    "ALGORITHMS",
    "UnknownMethodError",
    "algorithm",
    "algorithm_parameters",
    "check_method",
    "solve_profile",
]

log = logging.getLogger(__name__)

Algorithm = Callable[..., Plan]


def _ilp_solver() -> Algorithm:
    from remat.solver.ilp import solve_ilp  # ortools is slow to import: only when asked for

    return solve_ilp


def solve_ilp_on_first_use(profile: Profile, budget_bytes: int | None, **params: Any) -> Plan:
    """``method="ilp"``: :func:`remat.solver.ilp.solve_ilp`, imported on first call."""
    return _ilp_solver()(profile, budget_bytes, **params)


# "optimal" is the default and is the DP (its plans say algorithm="dp").
ALGORITHMS: Mapping[str, Algorithm] = MappingProxyType(
    {
        "none": keep_all_plan,
        "all": checkpoint_all_plan,
        "uniform": uniform_plan,
        "chen": chen_plan,
        "chen-greedy": chen_greedy_plan,
        "dp": solve_dp,
        "ilp": solve_ilp_on_first_use,
        "optimal": solve_dp,
    }
)
# Algorithms registered through a loader, and the function whose parameters they take.
_LOADED: Mapping[Algorithm, Callable[[], Algorithm]] = {solve_ilp_on_first_use: _ilp_solver}


class UnknownMethodError(RematError, ValueError):
    """A ``method=`` that names no algorithm."""


def algorithm(method: str) -> Algorithm:
    """The algorithm registered as ``method``."""
    try:
        return ALGORITHMS[method]
    except (KeyError, TypeError):
        raise UnknownMethodError(
            f"unknown method={method!r}; valid methods: {sorted(ALGORITHMS)}"
        ) from None


def algorithm_parameters(method: str) -> tuple[str, ...]:
    """The keyword parameters ``method`` takes besides the profile and the budget."""
    fn = algorithm(method)
    fn = _LOADED[fn]() if fn in _LOADED else fn
    params = list(inspect.signature(fn).parameters.values())[2:]
    return tuple(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))


def check_method(method: object, params: Mapping[str, Any]) -> None:
    """``method`` names an algorithm that takes every keyword in ``params``; entry points
    call it before profiling, so a typo costs nothing.

    Raises:
        UnknownMethodError: no algorithm is registered as ``method`` (the valid ones listed).
        UnknownParameterError: ``params`` names a keyword the algorithm does not take.
    """
    algorithm(method)  # type: ignore[arg-type]  # UnknownMethodError lists the methods
    unknown = sorted(set(params) - set(algorithm_parameters(method)))  # type: ignore[arg-type]
    if unknown:
        accepted = list(algorithm_parameters(method))  # type: ignore[arg-type]
        takes = f"its parameters are {accepted}" if accepted else "it takes no parameters"
        raise UnknownParameterError(
            f"method={method!r} does not take {unknown}; {takes}"
        )


def solve_profile(
    profile: Profile,
    memory_budget: int | str | None = None,
    *,
    method: str = "optimal",
    head: str = "auto",
    **params: Any,
) -> Plan:
    """Plan checkpointing for ``profile`` under ``memory_budget`` with ``method``.

    Args:
        profile: the measured profile.
        memory_budget: bytes, ``"8GB"``/``"7.5GiB"``, ``"60%"`` of the activation memory
            (``"60% of peak"``: of the no-checkpoint peak), or ``None`` for no budget.
        method: one of :data:`ALGORITHMS`.
        head: how a measured chunked head may be chosen (:mod:`remat.solver.head_choice`):
            ``"auto"`` only below the head as written's smallest peak (exact first),
            ``"chunked"`` wherever faster, ``"none"`` never.
        params: the algorithm's own parameters (``k=`` for uniform,
            ``time_limit_s=`` for ilp, ...: :func:`algorithm_parameters`).

    Raises:
        UnknownMethodError: ``method`` names no algorithm.
        UnknownParameterError: ``params`` has a parameter ``method`` does not take.
        ParameterError: a parameter of the wrong type or out of range.
        BudgetError: the budget cannot be parsed.
        InfeasibleBudgetError: no plan of the method fits the budget.
    """
    check_method(method, params)
    fn = algorithm(method)
    budget = None
    if memory_budget is not None:
        budget = resolve_budget(memory_budget, profile)
    # With a chunked head measured, the head is a decision too (exact first by default).
    plan = solve_over_heads(fn, profile, budget, head=head, **params)
    log.info(
        "remat: %s plan for %d units, budget %s B: peak %s B, %.3f ms (%s, %.1f ms to solve)",
        method, profile.n, budget, plan.record.predicted_peak_bytes,
        plan.record.predicted_time_ms or 0.0, plan.record.status, plan.record.solve_ms,
    )
    return plan

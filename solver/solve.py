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

from remat.errors import RematError
from remat.solver.baselines import (
    checkpoint_all_plan,
    chen_greedy_plan,
    chen_plan,
    keep_all_plan,
    uniform_plan,
)
from remat.solver.budget import resolve_budget
from remat.solver.dp import solve_dp
from remat.solver.params import UnknownParameterError
from remat.solver.plan import Plan
from remat.solver.profile import Profile
from remat.solver.simulate import simulate

__all__ = [
    "ALGORITHMS",
    "UnknownMethodError",
    "algorithm",
    "algorithm_parameters",
    "no_checkpoint_peak_bytes",
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


def _check_parameters(method: str, params: Mapping[str, Any]) -> None:
    unknown = sorted(set(params) - set(algorithm_parameters(method)))
    if unknown:
        accepted = list(algorithm_parameters(method))
        takes = f"its parameters are {accepted}" if accepted else "it takes no parameters"
        raise UnknownParameterError(
            f"method={method!r} does not take {unknown}; {takes}"
        )


def no_checkpoint_peak_bytes(profile: Profile) -> int:
    """The simulated peak of keeping everything: what percentage budgets refer to."""
    return simulate(profile, Plan.keep_all([u.name for u in profile.units])).peak_bytes


def solve_profile(
    profile: Profile,
    memory_budget: int | str | None = None,
    *,
    method: str = "optimal",
    **params: Any,
) -> Plan:
    """Plan checkpointing for ``profile`` under ``memory_budget`` with ``method``.

    Args:
        profile: the measured profile.
        memory_budget: bytes, ``"8GB"``/``"7.5GiB"``, ``"60%"`` of the activation memory
            (``"60% of peak"``: of the no-checkpoint peak), or ``None`` for no budget.
        method: one of :data:`ALGORITHMS`.
        params: the algorithm's own parameters (``k=`` for uniform,
            ``time_limit_s=`` for ilp, ...: :func:`algorithm_parameters`).

    Raises:
        UnknownMethodError: ``method`` names no algorithm.
        UnknownParameterError: ``params`` has a parameter ``method`` does not take.
        ParameterError: a parameter of the wrong type or out of range.
        BudgetError: the budget cannot be parsed.
        InfeasibleBudgetError: no plan of the method fits the budget.
    """
    fn = algorithm(method)
    _check_parameters(method, params)
    budget = None
    if memory_budget is not None:
        budget = resolve_budget(memory_budget, profile)
    plan = fn(profile, budget, **params)
    log.info(
        "remat: %s plan for %d units, budget %s B: peak %s B, %.3f ms (%s, %.1f ms to solve)",
        method, profile.n, budget, plan.predicted_peak_bytes, plan.predicted_time_ms or 0.0,
        plan.status, plan.solve_ms,
    )
    return plan

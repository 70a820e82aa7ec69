"""Bad input to the solver is a RematError naming the input and the fix, never a raw
OverflowError, TypeError or a CP-SAT status blamed on the time limit."""

from __future__ import annotations

import math

import pytest
from solver_testlib import KEEP, keep_peak, transformer_like

from remat.core.errors import BudgetError, ParameterError, RematError, UnknownParameterError
from remat.solver.baselines import chen_greedy_plan, uniform_groups, uniform_plan
from remat.solver.dp import solve_dp
from remat.solver.ilp import solve_ilp
from remat.solver.pareto import frontier_plans, pareto_frontier
from remat.solver.solve import ALGORITHMS, UnknownMethodError, solve_profile

PROFILE = transformer_like(12, seed=1)


# ---------------------------------------------------------------------------------
# Budgets at and above the no-checkpoint peak, up to far beyond int64
# ---------------------------------------------------------------------------------
HUGE = [0, 1, 2**62, 2**63 - 1, 2**63, 2**64, 10**30]


@pytest.mark.parametrize("solve", [solve_dp, solve_ilp], ids=["dp", "ilp"])
@pytest.mark.parametrize("above", HUGE)
def test_a_budget_above_the_no_checkpoint_peak_keeps_everything(solve, above: int) -> None:
    budget = keep_peak(PROFILE) + above
    plan = solve(PROFILE, budget)
    assert plan.options == (KEEP,) * PROFILE.n and plan.segments == ()
    assert plan.record.status == "optimal"
    assert plan.budget_bytes == budget  # the user's budget, as given
    assert plan.record.predicted_time_ms == pytest.approx(PROFILE.step_ms)


@pytest.mark.parametrize("method", sorted(ALGORITHMS))
def test_every_method_takes_a_huge_budget(method: str) -> None:
    plan = solve_profile(PROFILE, 2**64, method=method)
    assert plan.budget_bytes == 2**64
    assert plan.record.predicted_peak_bytes <= 2**64


@pytest.mark.parametrize("method", sorted(ALGORITHMS))
@pytest.mark.parametrize("budget", [1.5e9, "8GB", True, [8]])
def test_algorithms_take_whole_bytes(method: str, budget: object) -> None:
    with pytest.raises(BudgetError, match="budget_bytes="):
        ALGORITHMS[method](PROFILE, budget)


# ---------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("frontier", [pareto_frontier, frontier_plans])
@pytest.mark.parametrize("points", [0, -3, 2.5, True, False, "4", None, math.nan])
def test_points_must_be_a_positive_int(frontier, points: object) -> None:
    with pytest.raises(ParameterError) as err:
        frontier(PROFILE, points=points)
    assert isinstance(err.value, ValueError) and isinstance(err.value, RematError)
    assert "points, an int with 1 <= points" in str(err.value)
    assert f"points={points!r}" in str(err.value)


@pytest.mark.parametrize("k", [0, -1, 13, 2.0, True, "2"])
@pytest.mark.parametrize("call", [
    lambda k: uniform_plan(PROFILE, k=k),
    lambda k: uniform_plan(PROFILE, 10**12, k=k),
    lambda k: solve_profile(PROFILE, None, method="uniform", k=k),
    lambda k: uniform_groups(12, k),
], ids=["uniform_plan", "with-budget", "solve_profile", "uniform_groups"])
def test_uniform_k_must_be_within_the_units(call, k: object) -> None:
    with pytest.raises(ParameterError) as err:
        call(k)
    assert isinstance(err.value, ValueError)
    assert "uniform needs k, an int with 1 <= k <= 12 (the number of units)" in str(err.value)
    assert f"k={k!r}" in str(err.value)


@pytest.mark.parametrize(("method", "params", "takes"), [
    ("dp", {"foo": 1}, "it takes no parameters"),
    ("optimal", {"time_limit_s": 1.0}, "it takes no parameters"),
    ("chen", {"k": 2}, "it takes no parameters"),
    ("none", {"k": 2}, "it takes no parameters"),
    ("uniform", {"thresholds": 3}, "its parameters are ['k']"),
    ("chen-greedy", {"k": 2, "z": 1}, "its parameters are ['thresholds']"),
    ("ilp", {"k": 2}, "its parameters are ['time_limit_s', 'workers', 'seed', 'hint']"),
])
def test_unknown_parameters_list_the_accepted_ones(method: str, params: dict, takes: str) -> None:
    with pytest.raises(UnknownParameterError) as err:
        solve_profile(PROFILE, "80%", method=method, **params)
    assert isinstance(err.value, TypeError) and isinstance(err.value, RematError)
    message = str(err.value)
    assert f"method={method!r} does not take {sorted(params)}" in message
    assert takes in message


@pytest.mark.parametrize(("params", "phrase"), [
    ({"time_limit_s": 0}, "time_limit_s, a finite number of seconds > 0"),
    ({"time_limit_s": -1.0}, "time_limit_s, a finite number of seconds > 0"),
    ({"time_limit_s": math.inf}, "time_limit_s="),
    ({"time_limit_s": "10"}, "time_limit_s="),
    ({"time_limit_s": True}, "time_limit_s="),
    ({"workers": 0}, "workers, an int with 1 <= workers"),
    ({"workers": 1.5}, "workers="),
    ({"seed": -1}, "seed, an int with 0 <= seed <= 2147483647"),
    ({"seed": 2**40}, "seed="),
    ({"hint": "keep all"}, "hint, a Plan or None"),
])
def test_ilp_parameters_are_checked(params: dict, phrase: str) -> None:
    with pytest.raises(ParameterError, match=phrase.replace("(", r"\(")):
        solve_profile(PROFILE, "80%", method="ilp", **params)


@pytest.mark.parametrize("thresholds", [0, -2, 1.5, True])
def test_chen_greedy_thresholds_are_checked(thresholds: object) -> None:
    with pytest.raises(ParameterError, match="chen-greedy needs thresholds"):
        chen_greedy_plan(PROFILE, thresholds=thresholds)


@pytest.mark.parametrize("method", [None, 3, ["dp"], "DP"])
def test_a_method_that_is_not_a_name(method: object) -> None:
    with pytest.raises(UnknownMethodError, match="valid methods"):
        solve_profile(PROFILE, None, method=method)

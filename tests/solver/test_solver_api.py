"""The solver's public surface: the registry, solve_profile, baselines, pareto, CP-SAT details."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model
from solver_testlib import KEEP, all_plans, keep_peak, segment_profiles, transformer_like

from remat.core.errors import BudgetError, InfeasibleBudgetError, RematError
from remat.core.plan import Plan
from remat.solver import ilp as ilp_module
from remat.solver import min_peak_bytes_over_heads
from remat.solver.baselines import (
    chen_groups,
    chen_plan,
    greedy_groups,
    uniform_groups,
    uniform_plan,
)
from remat.solver.dp import solve_dp
from remat.solver.ilp import build_cp_model, solve_ilp
from remat.solver.min_peak import min_peak_bytes
from remat.solver.pareto import COLUMNS, pareto_frontier
from remat.solver.simulate import simulate
from remat.solver.solve import ALGORITHMS, UnknownMethodError, solve_profile

PROFILE = transformer_like(12, seed=1)


def test_importing_the_solver_does_not_import_torch() -> None:
    code = "import sys, remat.solver, remat.solver.solve; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_registry_names() -> None:
    assert set(ALGORITHMS) == {
        "none", "all", "uniform", "chen", "chen-greedy", "dp", "ilp", "optimal"
    }
    assert ALGORITHMS["optimal"] is ALGORITHMS["dp"]


def test_unknown_method_lists_the_valid_ones() -> None:
    with pytest.raises(UnknownMethodError) as err:
        solve_profile(PROFILE, "50%", method="greedy")
    assert isinstance(err.value, RematError) and isinstance(err.value, ValueError)
    for name in ALGORITHMS:
        assert repr(name) in str(err.value)


@pytest.mark.parametrize("method", sorted(ALGORITHMS))
def test_every_method_returns_a_stamped_plan(method: str) -> None:
    budget = keep_peak(PROFILE)  # every method fits the no-checkpoint peak... except `all`
    params = {"workers": 1} if method == "ilp" else {}
    plan = solve_profile(PROFILE, None, method=method, **params)
    sim = simulate(PROFILE, plan)
    assert plan.record.algorithm == ("dp" if method == "optimal" else method)
    assert plan.record.status == ("optimal" if method in ("dp", "ilp", "optimal") else "feasible")
    assert plan.target.unit_types == tuple(u.type_name for u in PROFILE.units)
    assert plan.budget_bytes is None
    assert plan.record.solve_ms >= 0
    record = plan.record
    assert (record.predicted_peak_bytes, record.predicted_time_ms) == (sim.peak_bytes, sim.time_ms)
    if method in ("dp", "ilp", "optimal", "none"):
        assert plan.options == (KEEP,) * PROFILE.n and sim.peak_bytes == budget


def test_solve_profile_parses_the_budget() -> None:
    reference = keep_peak(PROFILE)
    persistent = PROFILE.fixed_bytes + PROFILE.grad_bytes
    plan = solve_profile(PROFILE, "70%")  # of the activation memory
    expected = persistent + math.floor(0.7 * (reference - persistent))
    assert plan.budget_bytes == expected >= plan.record.predicted_peak_bytes
    assert solve_profile(PROFILE, "70% of peak").budget_bytes == math.floor(0.7 * reference)
    assert solve_profile(PROFILE, "400 MiB").budget_bytes == 400 * 2**20
    assert solve_profile(PROFILE, "0.4 GB").budget_bytes == 400_000_000
    assert solve_profile(PROFILE, reference).options == (KEEP,) * PROFILE.n
    with pytest.raises(BudgetError, match="'7 gigs'"):
        solve_profile(PROFILE, "7 gigs")


def test_a_heuristic_that_cannot_fit_points_to_optimal() -> None:
    floor = min_peak_bytes(PROFILE)
    chen = chen_plan(PROFILE)
    assert chen.record.predicted_peak_bytes > floor  # so a budget between the two exists
    budget = floor
    with pytest.raises(InfeasibleBudgetError) as err:
        solve_profile(PROFILE, budget, method="chen")
    assert "method='optimal'" in str(err.value)
    assert err.value.min_feasible_bytes == chen.record.predicted_peak_bytes
    assert solve_profile(PROFILE, budget).record.predicted_peak_bytes <= budget


@pytest.mark.parametrize("method", ["none", "all", "uniform", "chen", "chen-greedy", "dp"])
def test_below_the_minimum_every_method_reports_the_true_minimum(method: str) -> None:
    floor = min_peak_bytes_over_heads(PROFILE)
    with pytest.raises(InfeasibleBudgetError) as err:
        solve_profile(PROFILE, floor - 1, method=method)
    assert err.value.min_feasible_bytes == floor


def test_uniform_matches_checkpoint_sequential() -> None:
    """Which modules torch's checkpoint_sequential runs under checkpoint, for every n, k."""
    torch = pytest.importorskip("torch")
    from torch.utils.checkpoint import checkpoint_sequential

    class Probe(torch.nn.Module):
        def __init__(self, index: int, seen: dict[int, bool]) -> None:
            super().__init__()
            self.index, self.seen = index, seen

        def forward(self, x):  # noqa: ANN001, ANN201 - torch module
            # Reentrant checkpointing runs the first forward without grad.
            self.seen.setdefault(self.index, not torch.is_grad_enabled())
            return x * 1.0

    for n in range(1, 10):
        for k in range(1, n + 1):
            seen: dict[int, bool] = {}
            model = torch.nn.Sequential(*(Probe(i, seen) for i in range(n)))
            x = torch.ones(2, requires_grad=True)
            checkpoint_sequential(model, k, x, use_reentrant=True)
            expected = {i for i, checkpointed in seen.items() if checkpointed}
            got = {i for group in uniform_groups(n, k) for i in group}
            assert got == expected, (n, k)


def test_uniform_with_a_budget_takes_the_fastest_fitting_k() -> None:
    budget = (min_peak_bytes(PROFILE) + keep_peak(PROFILE)) // 2
    plan = uniform_plan(PROFILE, budget)
    fitting = [
        p for p in (uniform_plan(PROFILE, k=k) for k in range(1, PROFILE.n + 1))
        if p.record.predicted_peak_bytes <= budget
    ]
    assert plan.record.predicted_time_ms == min(p.record.predicted_time_ms for p in fitting)
    with pytest.raises(ValueError, match="1 <= k <= 12"):
        uniform_plan(PROFILE, k=13)


@pytest.mark.parametrize("n", [1, 2, 4, 10, 16, 100])
def test_chen_uses_about_sqrt_n_segments_of_sqrt_n_units(n: int) -> None:
    groups = chen_groups(n)
    assert len(groups) == max(1, round(math.sqrt(n)))
    assert [i for g in groups for i in g] == list(range(n))
    assert max(len(g) for g in groups) - min(len(g) for g in groups) <= 1


def test_greedy_cuts_where_the_running_sum_passes_the_threshold() -> None:
    assert greedy_groups([5, 5, 5, 5, 5], 9) == [range(0, 2), range(2, 4), range(4, 5)]
    assert greedy_groups([5, 5], 100) == [range(0, 2)]


def test_pareto_frontier() -> None:
    frame = pareto_frontier(PROFILE, points=6)
    assert tuple(frame.columns) == COLUMNS
    optimal = frame[frame.kind == "optimal"]
    baseline = frame[frame.kind == "baseline"]
    assert len(optimal) == 6
    assert set(baseline.algorithm) >= {"none", "all", "chen", "uniform(k=2)", "uniform(k=4)"}
    assert baseline.budget_bytes.isna().all()
    budgets = optimal.budget_bytes.tolist()
    assert budgets[0] == min_peak_bytes_over_heads(PROFILE) and budgets[-1] == keep_peak(PROFILE)
    assert (optimal.peak_bytes <= optimal.budget_bytes).all()
    assert optimal.time_ms.is_monotonic_decreasing
    assert optimal.time_ms.iloc[-1] == pytest.approx(PROFILE.step_ms)
    assert optimal.overhead_pct.iloc[-1] == pytest.approx(0.0)
    # No baseline beats the frontier: at a budget >= its peak, the optimum is as fast.
    for row in baseline.itertuples():
        at_least = optimal[optimal.budget_bytes >= row.peak_bytes]
        assert (at_least.time_ms <= row.time_ms + 1e-9).all()


def test_pareto_frontier_with_a_heuristic_method_and_no_baselines() -> None:
    frame = pareto_frontier(PROFILE, points=4, method="chen-greedy", baselines=False)
    assert set(frame.kind) <= {"feasible"}
    assert (frame.peak_bytes <= frame.budget_bytes).all()


@settings(max_examples=10, deadline=None)
@given(segment_profiles(max_units=4))
def test_cp_sat_variables_are_named(profile) -> None:
    model, _ = build_cp_model(profile, keep_peak(profile) * 10)
    names = {v.name for v in model.proto.variables}
    assert "opt[u0,keep]" in names and "A[u1]" in names and "H[b0]" in names
    if profile.units[0].options.get("checkpoint") and "checkpoint" in profile.units[1].options:
        assert "seg[0..1]" in names


def _feasible_when_fixed(profile, plan: Plan, budget: int) -> bool:
    """Whether CP-SAT's model admits ``plan`` (its decisions fixed) under ``budget``."""
    model, v = build_cp_model(profile, budget)
    for (i, o), x in v.opt.items():
        model.add(x == int(plan.segment_of(i) is None and plan.options[i] == o))
    for seg in plan.segments:
        if seg not in v.seg:
            return False  # left out because no feasible plan can use it
    for seg, x in v.seg.items():
        model.add(x == int(seg in plan.segments))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    return solver.solve(model) in (cp_model.OPTIMAL, cp_model.FEASIBLE)


@settings(max_examples=8, deadline=None)
@given(segment_profiles(max_units=4), st.randoms(use_true_random=False))
def test_cp_sat_model_admits_exactly_the_plans_that_fit(profile, rng) -> None:
    plans = list(all_plans(profile))
    lo, hi = min_peak_bytes(profile), keep_peak(profile)
    for budget in (lo, (lo + hi) // 2, hi):
        for plan in rng.sample(plans, min(25, len(plans))):
            fits = simulate(profile, plan).peak_bytes <= budget
            assert _feasible_when_fixed(profile, plan, budget) == fits, (plan, budget)


def test_ilp_with_a_hint_reaches_the_same_optimum() -> None:
    budget = (min_peak_bytes(PROFILE) + keep_peak(PROFILE)) // 2
    dp = solve_dp(PROFILE, budget)
    hinted = solve_ilp(PROFILE, budget, hint=dp, workers=1)
    assert hinted.record.status == "optimal"
    assert abs(hinted.record.predicted_time_ms - dp.record.predicted_time_ms) <= PROFILE.n * 1e-6


def test_ilp_ignores_a_hint_that_does_not_fit(caplog: pytest.LogCaptureFixture) -> None:
    budget = (min_peak_bytes(PROFILE) + keep_peak(PROFILE)) // 2
    keep = Plan.keep_all([u.name for u in PROFILE.units])
    plan = solve_ilp(PROFILE, budget, hint=keep, workers=1)
    assert plan.record.predicted_peak_bytes <= budget
    assert "ignoring it" in caplog.text


def test_ilp_reports_feasible_when_cp_sat_stops_without_proof(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Unproven(cp_model.CpSolver):
        def solve(self, model, callback=None):  # noqa: ANN001, ANN201 - CP-SAT's signature
            code = super().solve(model, callback)
            return cp_model.FEASIBLE if code == cp_model.OPTIMAL else code

    monkeypatch.setattr(ilp_module.cp_model, "CpSolver", Unproven)
    plan = solve_ilp(PROFILE, keep_peak(PROFILE) - 1, workers=1)
    assert plan.record.status == "feasible"


def test_ilp_without_a_plan_in_time_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    class Clueless(cp_model.CpSolver):
        def solve(self, model, callback=None):  # noqa: ANN001, ANN201 - CP-SAT's signature
            super().solve(model, callback)
            return cp_model.UNKNOWN

    monkeypatch.setattr(ilp_module.cp_model, "CpSolver", Clueless)
    with pytest.raises(RematError, match="time_limit_s"):
        solve_ilp(PROFILE, keep_peak(PROFILE) - 1, time_limit_s=0.5)

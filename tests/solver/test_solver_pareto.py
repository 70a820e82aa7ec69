"""The Pareto frontier: each plan once, no row beaten by another, every sampled budget's
optimum represented, and baselines that make the same plan share one row."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from solver_testlib import CKPT, KEEP, cost, keep_peak, profiles, segment_profiles, unit

from remat.core.profile import Profile
from remat.solver.baselines import checkpoint_all_plan, chen_plan, keep_all_plan, uniform_plan
from remat.solver.dp import solve_dp
from remat.solver.min_peak import min_peak_bytes
from remat.solver.pareto import frontier_plans, pareto_frontier

TOL = 1e-9


def _sampled_budgets(profile: Profile, points: int) -> list[int]:
    """The budgets the frontier solves at (as its docstring says: evenly spread, unique)."""
    lo, hi = min_peak_bytes(profile), keep_peak(profile)
    if points == 1 or hi <= lo:
        return [lo]
    return sorted({int(round(b)) for b in np.linspace(lo, hi, points)})


SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
any_profile = st.one_of(profiles(max_units=6, max_plans=100_000), segment_profiles(max_units=7))


@SETTINGS
@given(any_profile, st.integers(min_value=1, max_value=14))
def test_the_frontier_is_a_frontier(profile: Profile, points: int) -> None:
    frame = pareto_frontier(profile, points=points)
    rows = frame[frame.kind == "optimal"]
    peaks, times = rows.peak_bytes.tolist(), rows.time_ms.tolist()
    budgets = _sampled_budgets(profile, points)
    # No row is matched or beaten by another: no duplicates, nothing dominated.
    for i in range(len(rows)):
        for j in range(len(rows)):
            if i != j:
                assert not (times[j] <= times[i] + TOL and peaks[j] <= peaks[i]), (i, j)
    # Each row was solved at one of the sampled budgets, and fits it.
    assert set(rows.budget_bytes) <= set(budgets)
    assert (rows.peak_bytes <= rows.budget_bytes).all()
    # Every sampled budget's optimum is a row that fits it.
    for budget in budgets:
        best = solve_dp(profile, budget).record.predicted_time_ms
        fitting = [t for p, t in zip(peaks, times) if p <= budget]
        assert fitting and min(fitting) == pytest.approx(best, abs=TOL)
    # frontier_plans: the same plans, each once, fastest first.
    plans = frontier_plans(profile, points=points)
    records = [p.record for p in plans]
    assert sorted((r.predicted_peak_bytes, r.predicted_time_ms) for r in records) == sorted(
        zip(peaks, times)
    )
    assert len({(p.options, p.segments) for p in plans}) == len(plans)
    assert [r.predicted_time_ms for r in records] == sorted(r.predicted_time_ms for r in records)
    assert all(p.record.predicted_peak_bytes <= p.budget_bytes for p in plans)


def _baseline_plans(profile: Profile) -> list:
    ks = sorted({k for k in (2, 4, 8, round(profile.n**0.5)) if 2 <= k <= profile.n})
    return [keep_all_plan(profile), checkpoint_all_plan(profile),
            *(uniform_plan(profile, k=k) for k in ks), chen_plan(profile)]


@SETTINGS
@given(any_profile)
def test_baselines_that_make_the_same_plan_share_a_row(profile: Profile) -> None:
    frame = pareto_frontier(profile, points=2)
    rows = frame[frame.kind == "baseline"]
    distinct = {(p.options, p.segments) for p in _baseline_plans(profile)}
    assert len(rows) == len(distinct)
    labels = [name for label in rows.algorithm for name in label.split(" = ")]
    assert len(labels) == len(set(labels)) == len(_baseline_plans(profile))


def test_one_unit_all_and_chen_are_one_row() -> None:
    profile = Profile(units=(unit("u0", {KEEP: cost(100), CKPT: cost(0, bwd=100, ms=1.0)}),),
                      is_chain=True, step_ms=10.0)
    rows = pareto_frontier(profile, points=3)
    assert rows[rows.kind == "baseline"].algorithm.tolist() == ["none", "all = chen"]


def test_a_plan_found_at_several_budgets_is_one_row() -> None:
    # Every budget from the minimum to the no-checkpoint peak: most share their optimum.
    profile = Profile(
        units=tuple(unit(f"u{i}", {KEEP: cost(100), CKPT: cost(0, bwd=100, ms=1.0 + i)})
                    for i in range(3)),
        is_chain=True, step_ms=10.0,
    )
    lo, hi = min_peak_bytes(profile), keep_peak(profile)
    frame = pareto_frontier(profile, points=hi - lo + 1, baselines=False)
    assert len(frame) == frame.time_ms.nunique() == frame.peak_bytes.nunique()
    assert len(frame) < hi - lo + 1
    # Each row's budget is the smallest at which its plan was found: its own peak here.
    assert (frame.budget_bytes == frame.peak_bytes).all()

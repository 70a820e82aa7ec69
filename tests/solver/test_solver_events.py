"""The event model is built once per profile, and the plan it says reaches the smallest peak
does, by simulate() and by brute force."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from solver_testlib import (
    KEEP,
    brute_min_peak,
    keep_peak,
    profiles,
    segment_profiles,
    transformer_like,
)

from remat.core.profile import Profile
from remat.solver import events, pareto_frontier
from remat.solver.baselines import chen_greedy_plan, chen_plan, uniform_plan
from remat.solver.dp import solve_dp
from remat.solver.events import plan_peak_bytes, step_model
from remat.solver.ilp import solve_ilp
from remat.solver.min_peak import min_peak_bytes, min_peak_plan
from remat.solver.simulate import simulate


def test_one_model_per_profile_across_solves_frontiers_and_baselines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    profile = transformer_like(8, seed=2)
    built = []
    real = events.build_model
    monkeypatch.setattr(events, "build_model", lambda p: built.append(p) or real(p))
    lo, hi = min_peak_bytes(profile), keep_peak(profile)
    for budget in (lo, (lo + hi) // 2, hi, 10 * hi):
        solve_dp(profile, budget)
        solve_ilp(profile, budget, workers=1)
        chen_greedy_plan(profile, budget * 2)
    chen_plan(profile)
    uniform_plan(profile, k=2)
    pareto_frontier(profile, points=5)
    assert len(built) == 1
    # An equal profile is another object: it gets its own model.
    again = Profile.from_json(profile.to_json())
    assert step_model(again) is not step_model(profile)
    assert len(built) == 2


def test_the_cached_model_is_invisible_in_the_profile() -> None:
    profile = transformer_like(4, seed=0)
    text = profile.to_json()
    step_model(profile)
    assert profile.to_json() == text
    assert profile == Profile.from_json(text)
    assert "_remat_step_model" not in repr(profile)


SETTINGS = settings(max_examples=80, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@SETTINGS
@given(st.one_of(profiles(max_units=6, max_plans=2000), segment_profiles(max_units=6)))
def test_the_min_peak_plan_reaches_the_smallest_peak(profile: Profile) -> None:
    smallest = brute_min_peak(profile)
    plan = min_peak_plan(profile)
    assert simulate(profile, plan).peak_bytes == smallest == min_peak_bytes(profile)


@SETTINGS
@given(st.one_of(profiles(max_units=6, max_plans=2000), segment_profiles(max_units=6)))
def test_keep_all_peak_is_simulates(profile: Profile) -> None:
    assert plan_peak_bytes(step_model(profile), [KEEP] * profile.n) == keep_peak(profile)

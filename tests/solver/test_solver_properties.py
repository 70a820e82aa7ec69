"""Properties on random profiles (hypothesis), judged by an explicit brute force over
every plan scored with simulate() only.

Profiles: up to 8 units, random option subsets (keep always), random holds flags,
bytes and times, chains or not; non-keep options always cost time (extra_ms > 0).
A second strategy builds chains where multi-unit segments pay, so that the
segment part of the plan space is exercised too.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from solver_testlib import (
    KEEP,
    Scored,
    keep_peak,
    profiles,
    segment_profiles,
    transformer_like,
)

from remat.core.errors import InfeasibleBudgetError
from remat.core.plan import Plan
from remat.core.profile import Profile
from remat.solver import dp as dp_module
from remat.solver import min_peak_bytes_over_heads
from remat.solver.baselines import (
    checkpoint_all_plan,
    chen_greedy_plan,
    chen_plan,
    keep_all_plan,
    uniform_plan,
)
from remat.solver.dp import solve_dp
from remat.solver.events import build_model, plan_peak_bytes
from remat.solver.ilp import solve_ilp
from remat.solver.min_peak import min_peak_bytes
from remat.solver.simulate import simulate

SETTINGS = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
any_profile = st.one_of(profiles(max_units=8, max_plans=4000), segment_profiles(max_units=7))
fraction = st.floats(min_value=0.0, max_value=1.0)


def _budgets(scored: Scored, profile: Profile, frac: float) -> list[int]:
    """Below the minimum, at it, somewhere between, and at the no-checkpoint peak."""
    lo, hi = scored.min_peak, keep_peak(profile)
    return sorted({lo - 1, lo, lo + int(frac * (hi - lo)), hi})


def _ilp_tolerance(profile: Profile) -> float:
    # CP-SAT sees times rounded to whole nanoseconds (solver/ilp.py): n * 1e-6 ms at most.
    return profile.n * 1e-6 + 1e-9


def _check_fits(profile: Profile, plan: Plan, budget: int) -> None:
    sim = simulate(profile, plan)
    assert plan.record.predicted_peak_bytes == sim.peak_bytes <= budget
    assert plan.record.predicted_time_ms == pytest.approx(sim.time_ms)
    assert plan.target.device == profile.device.split(":")[0]
    assert plan.budget_bytes == budget


@settings(SETTINGS, max_examples=200)
@given(any_profile, fraction)
def test_dp_ilp_and_brute_force_agree(profile: Profile, frac: float) -> None:
    scored = Scored.of(profile)
    event(f"units: {profile.n}, plans: {'<100' if len(scored.plans) < 100 else '>=100'}")
    assert min_peak_bytes(profile) == min_peak_bytes_over_heads(profile) == scored.min_peak
    for budget in _budgets(scored, profile, frac):
        best = scored.best_time(budget)
        if best is None:
            for solve in (solve_dp, solve_ilp):
                with pytest.raises(InfeasibleBudgetError) as err:
                    solve(profile, budget)
                assert err.value.min_feasible_bytes == scored.min_peak
            continue
        dp = solve_dp(profile, budget)
        ilp = solve_ilp(profile, budget, workers=1)
        _check_fits(profile, dp, budget)
        _check_fits(profile, ilp, budget)
        assert dp.record.status == ilp.record.status == "optimal"
        assert dp.record.predicted_time_ms == pytest.approx(best, abs=1e-9)
        assert abs(ilp.record.predicted_time_ms - best) <= _ilp_tolerance(profile)
        event("optimum uses segments" if dp.segments else "optimum without segments")


@SETTINGS
@given(any_profile, fraction)
def test_heuristics_never_beat_the_optimum(profile: Profile, frac: float) -> None:
    scored = Scored.of(profile)
    budget = scored.min_peak + int(frac * (keep_peak(profile) - scored.min_peak))
    optimum = solve_dp(profile, budget).record.predicted_time_ms
    heuristics = [
        chen_plan, uniform_plan, chen_greedy_plan, checkpoint_all_plan, keep_all_plan,
        lambda p, b: uniform_plan(p, b, k=max(1, p.n // 2)),
    ]
    for heuristic in heuristics:
        try:
            plan = heuristic(profile, budget)
        except InfeasibleBudgetError as err:
            # Either nothing fits, or the optimum does and the message says so.
            assert "method='optimal'" in str(err) or budget < scored.min_peak
            continue
        _check_fits(profile, plan, budget)
        assert plan.record.status == "feasible"
        assert plan.record.predicted_time_ms >= optimum - 1e-9
        # And at the heuristic's own peak the optimum is at least as fast.
        free = heuristic(profile, None)
        own = solve_dp(profile, free.record.predicted_peak_bytes).record.predicted_time_ms
        assert own <= free.record.predicted_time_ms + 1e-9


@SETTINGS
@given(any_profile, fraction, fraction)
def test_a_larger_budget_never_costs_more_time(profile: Profile, f1: float, f2: float) -> None:
    lo, hi = min_peak_bytes(profile), keep_peak(profile)
    small, large = sorted(lo + int(f * (hi - lo)) for f in (f1, f2))
    tight = solve_dp(profile, small)
    loose = solve_dp(profile, large)
    assert loose.record.predicted_time_ms <= tight.record.predicted_time_ms + 1e-9


@SETTINGS
@given(any_profile, st.integers(min_value=0, max_value=1000))
def test_at_the_no_checkpoint_peak_everything_is_kept(profile: Profile, extra: int) -> None:
    budget = keep_peak(profile) + extra
    for plan in (solve_dp(profile, budget), solve_ilp(profile, budget, workers=1)):
        assert plan.options == (KEEP,) * profile.n
        assert plan.segments == ()
        assert plan.record.predicted_time_ms == pytest.approx(profile.step_ms)


@SETTINGS
@given(any_profile, fraction)
def test_plans_round_trip_through_json(profile: Profile, frac: float) -> None:
    lo, hi = min_peak_bytes(profile), keep_peak(profile)
    plan = solve_dp(profile, lo + int(frac * (hi - lo)))
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert simulate(profile, again) == simulate(profile, plan)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(any_profile, st.randoms(use_true_random=False))
def test_event_model_peak_is_simulates_peak(profile: Profile, rnd) -> None:
    # The DP's event model, plan by plan, against the specification.
    model = build_model(profile)
    plans = Scored.of(profile)
    for k in rnd.sample(range(len(plans.plans)), min(40, len(plans.plans))):
        plan = plans.plans[k]
        assert plan_peak_bytes(model, plan.options, plan.segments) == plans.peaks[k]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(any_profile, fraction, st.sampled_from([1, 2]))
def test_dp_is_exact_whatever_the_first_upper_bound(
    profile: Profile, frac: float, width: int
) -> None:
    # A beam of width 1-2 gives a poor first bound: the exact pass then prunes with it.
    scored = Scored.of(profile)
    budget = scored.min_peak + int(frac * (keep_peak(profile) - scored.min_peak))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dp_module, "BEAM_WIDTH", width)
        plan = solve_dp(profile, budget)
    assert plan.record.predicted_time_ms == pytest.approx(scored.best_time(budget), abs=1e-9)


@settings(max_examples=25, deadline=None)
@given(segment_profiles(max_units=20), fraction)
def test_dp_and_ilp_agree_beyond_brute_force(profile: Profile, frac: float) -> None:
    lo = min_peak_bytes(profile)
    budget = lo + int(frac * frac * (keep_peak(profile) - lo))  # mostly tight budgets
    dp = solve_dp(profile, budget)
    ilp = solve_ilp(profile, budget, workers=1)
    assert ilp.record.status == "optimal"
    gap = ilp.record.predicted_time_ms - dp.record.predicted_time_ms
    assert abs(gap) <= _ilp_tolerance(profile)


def _unpruned_optimum_ms(profile: Profile, budget: int) -> float:
    """The plain Pareto DP (need-to-go only, no upper bound, no beam): exact but slow."""
    model = build_model(profile)
    solver = dp_module._Solver(model, budget, dp_module._TimeBound(model, budget))
    solver.run()
    best = solver.best_end()
    assert best is not None
    return profile.step_time_ms(best[0])


@pytest.mark.parametrize("n", [40, 80])
@pytest.mark.parametrize("frac", [0.0, 0.02, 0.2, 0.5, 0.9])
def test_branch_and_bound_keeps_the_optimum_on_realistic_profiles(n: int, frac: float) -> None:
    # Realistic profiles make large, near-degenerate fronts (thousands of points here,
    # where the pruned search keeps about a hundred): the pruning matters there.
    profile = transformer_like(n, seed=n, varied=True)
    lo = min_peak_bytes(profile)
    budget = lo + int(frac * (keep_peak(profile) - lo))
    plan = solve_dp(profile, budget)
    assert plan.record.predicted_peak_bytes <= budget
    assert plan.record.predicted_time_ms == pytest.approx(_unpruned_optimum_ms(profile, budget))


@pytest.mark.parametrize("frac", [0.0, 0.1, 0.5])
def test_cp_sat_proves_the_dp_optimal_on_a_small_realistic_profile(frac: float) -> None:
    profile = transformer_like(12, seed=3)
    lo = min_peak_bytes(profile)
    budget = lo + int(frac * (keep_peak(profile) - lo))
    dp = solve_dp(profile, budget)
    ilp = solve_ilp(profile, budget, workers=1)
    assert ilp.record.status == "optimal"
    gap = ilp.record.predicted_time_ms - dp.record.predicted_time_ms
    assert abs(gap) <= _ilp_tolerance(profile)


@settings(max_examples=60, deadline=None)
@given(segment_profiles(max_units=30), fraction)
def test_the_beam_pass_always_ends_with_a_plan(profile: Profile, frac: float) -> None:
    # Regression: a width-1 beam once dropped the only segment source that could finish
    # at the smallest feasible budget.
    lo = min_peak_bytes(profile)
    budget = lo + int(frac**3 * (keep_peak(profile) - lo))
    model = build_model(profile)
    beam = dp_module._Solver(model, budget, dp_module._TimeBound(model, budget), beam=1)
    beam.run()
    assert beam.best_end() is not None
    assert solve_dp(profile, budget).record.predicted_time_ms == pytest.approx(
        _unpruned_optimum_ms(profile, budget)
    )

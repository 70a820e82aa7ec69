"""InfeasibleBudgetError says the smallest feasible peak, the event where the best plan peaks,
and what that peak is made of, for every algorithm."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from solver_testlib import KEEP, Scored, cost, profiles, segment_profiles, unit

from remat.core.bytesize import format_bytes
from remat.core.errors import InfeasibleBudgetError
from remat.core.profile import Profile
from remat.solver.baselines import chen_plan
from remat.solver.dp import solve_dp
from remat.solver.ilp import solve_ilp
from remat.solver.min_peak import min_peak_bytes
from remat.solver.simulate import simulate
from remat.solver.solve import ALGORITHMS, solve_profile


def test_the_error_keeps_its_old_signature() -> None:
    err = InfeasibleBudgetError(100, 200, "More.")
    assert (err.budget_bytes, err.min_feasible_bytes) == (100, 200)
    assert err.peak_event is None and err.peak_parts == {}
    assert str(err).endswith("pass a budget of at least that. More.")
    assert "200 bytes" in str(err)


# One kept unit under a large optimizer state: the peak is the unit's backward, and most
# of it is optimizer state, which checkpointing cannot shrink.
HEAVY = Profile(
    units=(unit("h.0", {KEEP: cost(100, bwd=50)}, in_grad=0),),
    is_chain=True, param_bytes=1000, optimizer_state_bytes=2**30,
)


@pytest.mark.parametrize("method", sorted(ALGORITHMS))
def test_the_message_names_the_event_and_the_parts(method: str) -> None:
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_profile(HEAVY, 1000, method=method)
    err = info.value
    smallest = min_peak_bytes(HEAVY)
    assert err.min_feasible_bytes == smallest
    assert err.peak_event == "backward h.0"
    assert err.peak_parts["optimizer state"] == 2**30
    assert err.peak_parts["parameters"] == 1000
    assert sum(err.peak_parts.values()) == smallest
    message = str(err)
    assert f"{format_bytes(smallest)} ({smallest} bytes), at 'backward h.0': " in message
    # Largest part first, zero parts left out, and why checkpointing cannot help.
    assert f"optimizer state {format_bytes(2**30)}, parameters {format_bytes(1000)}" in message
    assert "buffers" not in message
    assert "the largest part is optimizer state; checkpointing only reduces activations" in message


SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@SETTINGS
@given(st.one_of(profiles(max_units=5, max_plans=1500), segment_profiles(max_units=5)),
       st.sampled_from([solve_dp, solve_ilp]))
def test_the_event_is_where_a_smallest_peak_plan_peaks(profile: Profile, solve) -> None:
    scored = Scored.of(profile)
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(profile, scored.min_peak - 1)
    err = info.value
    assert err.min_feasible_bytes == scored.min_peak
    # Some plan of the smallest peak peaks at that event, made of exactly those parts.
    best = [simulate(profile, p) for p, peak in zip(scored.plans, scored.peaks)
            if peak == scored.min_peak]
    assert any((s.peak_event, dict(s.peak_parts)) == (err.peak_event, err.peak_parts)
               for s in best)
    assert repr(err.peak_event) in str(err)


def test_a_heuristic_reports_where_its_own_plan_peaks() -> None:
    # Between the true minimum and chen's peak, chen fails but the optimum fits.
    profile = Profile(
        units=tuple(unit(f"u{i}", {KEEP: cost(100), "checkpoint": cost(0, bwd=100, ms=1.0)})
                    for i in range(4)),
        is_chain=True, step_ms=10.0,
    )
    chen = chen_plan(profile)
    budget = min_peak_bytes(profile)
    assert chen.record.predicted_peak_bytes > budget
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_profile(profile, budget, method="chen")
    sim = simulate(profile, chen)
    assert info.value.min_feasible_bytes == chen.record.predicted_peak_bytes
    assert (info.value.peak_event, info.value.peak_parts) == (sim.peak_event, sim.peak_parts)
    assert "method='optimal'" in str(info.value)

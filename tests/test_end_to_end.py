"""solve -> apply_plan -> train: the plan fits its budget and the prediction holds.

These are the properties users rely on, checked on the reference models with
real measurements: the measured peak of a planned step never exceeds the budget,
and simulate()'s predicted peak is within 3% of the measured one (CPU, the
dispatch-level meter). Step time is not asserted (no wall-clock thresholds in
tests): the benchmark reports it.
"""

from __future__ import annotations

import pytest
import torch

import remat
from remat import models
from remat.api import activation_budget

PEAK_TOLERANCE = 0.03
MODELS = ["mlp", "cnn", "gpt"]


@pytest.fixture(scope="module", params=MODELS)
def reference(request):
    ref = models.build(request.param, size="tiny", seed=0)
    return ref, remat.profile(ref.model, ref.batch, loss_fn=ref.loss_fn)


@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.7])
def test_plan_meets_budget_and_prediction_holds(reference, fraction):
    ref, profile = reference
    budget = activation_budget(profile, fraction)
    try:
        plan = remat.solve(profile, memory_budget=budget)
    except remat.InfeasibleBudgetError as exc:
        # Only acceptable when even the smallest feasible peak is above the budget.
        assert exc.min_feasible_bytes > budget
        return
    assert plan.predicted_peak_bytes <= budget
    remat.apply_plan(ref.model, plan)
    try:
        measured = remat.measure(ref.model, ref.batch, loss_fn=ref.loss_fn, repeats=1)
    finally:
        remat.remove_plan(ref.model)
    assert measured.peak_bytes <= budget
    error = abs(plan.predicted_peak_bytes - measured.peak_bytes) / measured.peak_bytes
    assert error <= PEAK_TOLERANCE, (plan.summary(), plan.predicted_peak_bytes, measured.peak_bytes)


def test_solve_from_model_equals_solve_from_profile():
    ref = models.build("mlp", size="tiny", seed=0)
    profile = remat.profile(ref.model, ref.batch, loss_fn=ref.loss_fn)
    budget = activation_budget(profile, 0.5)
    from_profile = remat.solve(profile, memory_budget=budget)
    positional = remat.solve(profile, budget)
    assert from_profile.options == positional.options
    assert from_profile.segments == positional.segments
    from_model = remat.solve(ref.model, ref.batch, memory_budget="100%", loss_fn=ref.loss_fn)
    assert set(from_model.options) == {"keep"}  # the whole no-checkpoint peak fits


def test_infeasible_budget_names_the_smallest_feasible_peak():
    ref = models.build("mlp", size="tiny", seed=0)
    profile = remat.profile(ref.model, ref.batch, loss_fn=ref.loss_fn)
    with pytest.raises(remat.InfeasibleBudgetError) as info:
        remat.solve(profile, memory_budget=profile.param_bytes)
    assert info.value.min_feasible_bytes > profile.param_bytes
    assert str(info.value.min_feasible_bytes) in str(info.value)


def test_bad_budget_lists_accepted_forms():
    ref = models.build("mlp", size="tiny", seed=0)
    profile = remat.profile(ref.model, ref.batch, loss_fn=ref.loss_fn)
    with pytest.raises(remat.BudgetError, match="GiB"):
        remat.solve(profile, memory_budget="eight gigs")


def test_solve_leaves_the_model_as_it_found_it():
    ref = models.build("cnn", size="tiny", seed=0)
    state = {k: v.clone() for k, v in ref.model.state_dict().items()}
    rng = torch.get_rng_state()
    remat.solve(ref.model, ref.batch, memory_budget="70%", loss_fn=ref.loss_fn)
    for k, v in ref.model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in ref.model.parameters())
    assert ref.model.training


def test_pareto_and_plot(tmp_path):
    ref = models.build("gpt", size="tiny", seed=0)
    profile = remat.profile(ref.model, ref.batch, loss_fn=ref.loss_fn)
    frontier = remat.pareto(profile, points=6)
    optimal = frontier[frontier["kind"] == "optimal"].sort_values("peak_bytes")
    assert len(optimal) >= 2
    # Along the frontier more memory never costs more time.
    assert optimal["time_ms"].is_monotonic_decreasing or (
        optimal["time_ms"].diff().dropna() <= 1e-9
    ).all()
    assert {"none", "all"} <= set(frontier[frontier["kind"] == "baseline"]["algorithm"])
    fig = remat.plot_pareto(frontier, x="overhead")
    fig.savefig(tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0

"""solve -> apply_plan -> train: the plan fits its budget and the prediction holds.

These are the properties users rely on, checked on the reference models with
real measurements: the measured peak of a planned step never exceeds the budget on
either instrument (the dispatch-level meter and the allocator's view), and
simulate()'s predicted peak is within 1% of the allocator's view. Step time is not
asserted (no wall-clock thresholds in tests): the benchmark reports it.
"""

from __future__ import annotations

import pytest
import torch

import remat
from remat import models
from remat.solver import min_peak_bytes_over_heads
from remat.solver.resolve import no_checkpoint_peak_bytes

PEAK_TOLERANCE = 0.01
# Tiny models with activations large enough that checkpointing matters: their
# smallest feasible peak is 51-65% of the no-checkpoint peak, so every budget
# fraction below is a real test, not the infeasible branch.
PLANNING_SIZES = {
    "mlp": {"batch_size": 256},
    "cnn": {"batch_size": 32, "image_size": 16, "blocks_per_stage": 3},
    "gpt": {"batch_size": 8, "seq_len": 64},
    "hf-gpt2": {"batch_size": 8, "seq_len": 64},
}


def build(name: str) -> models.ReferenceModel:
    return models.build(name, size="tiny", seed=0, **PLANNING_SIZES[name])


@pytest.fixture(scope="module", params=["mlp", "cnn", "gpt"])
def reference(request):
    ref = build(request.param)
    return ref, remat.profile(ref.model, ref.batch, loss_fn=ref.loss_fn)


def between(profile: remat.Profile, fraction: float) -> int:
    """A budget ``fraction`` of the way from the smallest feasible peak to no checkpointing."""
    lo, hi = min_peak_bytes_over_heads(profile), remat.simulate(
        profile, remat.Plan.keep_all([u.name for u in profile.units])
    ).peak_bytes
    assert lo < 0.8 * hi, "the test model leaves no room to plan"
    return lo + int(fraction * (hi - lo))


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.7])
def test_plan_meets_budget_and_prediction_holds(reference, fraction):
    ref, profile = reference
    budget = between(profile, fraction)
    plan = remat.solve(profile, memory_budget=budget)
    assert plan.record.predicted_peak_bytes <= budget
    assert plan.options != ("keep",) * profile.n  # the budget binds
    remat.apply_plan(ref.model, plan)
    try:
        measured = remat.measure(ref.model, ref.batch, loss_fn=ref.loss_fn, repeats=1)
    finally:
        remat.remove_plan(ref.model)
    assert measured.peak_bytes <= budget and measured.allocator_peak_bytes <= budget
    error = (abs(plan.record.predicted_peak_bytes - measured.allocator_peak_bytes)
             / measured.allocator_peak_bytes)
    assert error <= PEAK_TOLERANCE, (
        plan.summary(), plan.record.predicted_peak_bytes, measured.allocator_peak_bytes)


def test_solve_from_model_equals_solve_from_profile():
    ref = build("mlp")
    profile = remat.profile(ref.model, ref.batch, loss_fn=ref.loss_fn)
    budget = (min_peak_bytes_over_heads(profile) + no_checkpoint_peak_bytes(profile)) // 2
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
    ref = build("cnn")
    state = {k: v.clone() for k, v in ref.model.state_dict().items()}
    rng = torch.get_rng_state()
    plan = remat.solve(ref.model, ref.batch, memory_budget="80%", loss_fn=ref.loss_fn)
    assert plan.options != ("keep",) * plan.n
    for k, v in ref.model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in ref.model.parameters())
    assert ref.model.training


def test_pareto_and_plot(tmp_path):
    ref = build("gpt")
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


@pytest.mark.transformers
def test_hf_gpt2_plan_meets_budget():
    ref = build("hf-gpt2")
    profile = remat.profile(ref.model, ref.batch)
    assert profile.is_chain
    budget = between(profile, 0.3)
    plan = remat.solve(profile, memory_budget=budget)
    remat.apply_plan(ref.model, plan)
    try:
        measured = remat.measure(ref.model, ref.batch, repeats=1)
    finally:
        remat.remove_plan(ref.model)
    assert measured.peak_bytes <= budget
    error = abs(plan.record.predicted_peak_bytes - measured.peak_bytes) / measured.peak_bytes
    assert error <= PEAK_TOLERANCE

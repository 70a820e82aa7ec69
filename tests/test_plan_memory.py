"""Measured memory honours the plan: apply_plan, measure, compare with simulate().

For every option and for multi-unit segments, on the reference models: the bytes
held after the forward pass (the meter) equal simulate()'s prediction within 2%,
and the step's peak (the allocator's view, which also sees kernels' scratch
buffers) within 1%; the dispatch-level peak is never above the prediction. This
joins the three stages: the profiler's numbers, the solver's simulator and the
runtime's behaviour.
"""

from __future__ import annotations

import pytest

import remat
from remat import models
from remat.core.plan import Plan

HELD_TOLERANCE = 0.02
PEAK_TOLERANCE = 0.01
SIZES = {
    "mlp": {"batch_size": 256},
    "cnn": {"batch_size": 32, "image_size": 16, "blocks_per_stage": 2},
    "gpt": {"batch_size": 8, "seq_len": 64, "depth": 4},
    "hf-gpt2": {"batch_size": 8, "seq_len": 64, "depth": 4},
}


def plans(profile: remat.Profile) -> dict[str, Plan]:
    """Every option, and segments along the chain's links that may be segmented (the
    model's code may keep a boundary, as the CNN keeps its stem's output)."""
    names = [u.name for u in profile.units]
    n = len(names)
    mixed = ["checkpoint", "checkpoint", "selective", "keep"] * n
    runs, start = [], 0
    for k in range(n):
        if k == n - 1 or not profile.segment_link(k):
            if k > start:
                runs.append((start, k))
            start = k + 1
    first = runs[0][0]
    mixed[first:first + 2] = ["checkpoint", "checkpoint"]
    return {
        "keep": Plan.keep_all(names),
        "checkpoint": Plan.checkpoint_all(names),
        "selective": Plan(names, ["selective"] * n),
        "whole-chain segment": Plan(names, ["checkpoint"] * n, runs),
        "segment + options": Plan(names, mixed[:n], [(first, first + 1)]),
    }


@pytest.fixture(scope="module", params=[
    "mlp", "cnn", "gpt", pytest.param("hf-gpt2", marks=pytest.mark.transformers),
])
def profiled(request):
    ref = models.build(request.param, size="tiny", seed=0, **SIZES[request.param])
    return ref, remat.profile(ref.model, ref.batch, loss_fn=ref.loss_fn, repeats=1)


@pytest.mark.parametrize(
    "plan_name", ["keep", "checkpoint", "selective", "whole-chain segment", "segment + options"]
)
def test_measured_memory_matches_simulate(profiled, plan_name):
    ref, profile = profiled
    plan = plans(profile)[plan_name]
    predicted = remat.simulate(profile, plan)
    remat.apply_plan(ref.model, plan)
    try:
        measured = remat.measure(ref.model, ref.batch, loss_fn=ref.loss_fn, repeats=1)
    finally:
        remat.remove_plan(ref.model)
    held, measured_held = predicted.held_after_forward_bytes, measured.held_after_forward_bytes
    assert abs(held - measured_held) <= HELD_TOLERANCE * measured_held, (
        plan.summary(), held, measured_held
    )
    peak, measured_peak = predicted.peak_bytes, measured.allocator_peak_bytes
    assert abs(peak - measured_peak) <= PEAK_TOLERANCE * measured_peak, (
        plan.summary(), predicted.peak_event, peak, measured_peak
    )
    assert measured.peak_bytes <= peak

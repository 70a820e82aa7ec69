"""CUDA paths: offload measured, CUDA-event timing, allocator figures (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from remat import models
from remat.core.plan import Plan
from remat.measurement.step import measure_step
from remat.profiler import default_options, profile
from remat.solver import simulate

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpt_on_cuda():
    return models.build("gpt", size="tiny", seed=0, device="cuda")


def test_offload_is_measured_by_default(gpt_on_cuda) -> None:
    ref = gpt_on_cuda
    assert "offload" in default_options(torch.device("cuda"))
    p = profile(ref.model, ref.batch, repeats=1, warmup=0)
    assert p.device.startswith("cuda")
    for u in p.units:
        off = u.options["offload"]
        # Saved tensors go to pinned host memory: nothing held on the device.
        assert off.held_bytes < u.keep.held_bytes
        assert not off.holds_input and not off.holds_output
        assert u.fwd_ms > 0 and u.bwd_ms > 0


def test_measure_step_reports_allocator_peak(gpt_on_cuda) -> None:
    ref = gpt_on_cuda
    m = measure_step(ref.model, ref.batch, repeats=1, warmup=1)
    assert m.cuda_peak_bytes is not None and m.cuda_peak_bytes > 0
    assert m.time_ms > 0


def test_keep_all_matches_the_measured_step_on_cuda(gpt_on_cuda) -> None:
    ref = gpt_on_cuda
    p = profile(ref.model, ref.batch, repeats=1, warmup=0)
    m = measure_step(ref.model, ref.batch, repeats=1, warmup=0)
    sim = simulate(p, Plan.keep_all([u.name for u in p.units]))
    assert abs(sim.held_after_forward_bytes - m.held_after_forward_bytes) <= (
        0.02 * m.held_after_forward_bytes
    )
    assert abs(sim.peak_bytes - m.peak_bytes) <= 0.03 * m.peak_bytes

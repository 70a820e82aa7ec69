"""The Profile a real model yields: serialisation, frame, shapes, optimizer figures."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from remat import models
from remat.core.plan import Plan
from remat.core.profile import Profile
from remat.measurement.step import StepMeasurement, measure_step
from remat.profiler import profile
from remat.solver import simulate


@pytest.fixture(scope="module")
def gpt_profile() -> Profile:
    ref = models.build("gpt", size="tiny", seed=0)
    return profile(ref.model, ref.batch, repeats=1, warmup=0)


def test_json_round_trip(gpt_profile: Profile, tmp_path) -> None:
    assert Profile.from_json(gpt_profile.to_json()) == gpt_profile
    path = tmp_path / "p.json"
    gpt_profile.to_json(str(path))
    assert Profile.from_json(str(path)) == gpt_profile


def test_frame_has_one_row_per_unit_and_every_option(gpt_profile: Profile) -> None:
    frame = gpt_profile.to_frame()
    # The blocks, and the final norm and head that discovery joins to them (issue 13).
    assert list(frame["unit"]) == ["blocks.0", "blocks.1", "ln_f", "lm_head"]
    for column in ("fwd_ms", "bwd_ms", "saved_bytes", "param_grad_bytes", "checkpoint_held_bytes",
                   "checkpoint_extra_ms", "selective_held_bytes", "selective_extra_ms"):
        assert column in frame.columns
    # Checkpointing a block holds less than keeping it.
    blocks = frame[frame["unit"].str.startswith("blocks.")]
    assert (blocks["checkpoint_held_bytes"] < blocks["saved_bytes"]).all()


def test_profile_fields(gpt_profile: Profile) -> None:
    p = gpt_profile
    assert p.device == "cpu" and p.dtype == "float32"
    assert p.input_shapes == {"idx": (2, 16), "targets": (2, 16)}
    assert p.available_options() == ("keep", "checkpoint", "selective", "derive")
    assert p.step_ms > 0 and all(u.fwd_ms > 0 and u.bwd_ms > 0 for u in p.units)
    assert all(c.extra_ms >= 0 for u in p.units for c in u.options.values())
    assert p.meta["torch"] == torch.__version__ and p.meta["meter"] == "dispatch"
    assert (p.meta["warmup"], p.meta["repeats"]) == (0, 1)
    assert p.grad_bytes == p.param_bytes  # every parameter trains, tied head counted once
    assert p.optimizer_state_bytes == 0 and p.optimizer_step_peak_bytes == 0


@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict"])
def test_batch_forms_and_input_shapes(kind: str) -> None:
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

        def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
            y = self.layers(x)
            return y if scale is None else y * scale

    x, scale = torch.randn(3, 4), torch.randn(1)
    batch = {"tensor": x, "tuple": (x, scale), "dict": {"x": x, "scale": scale}}[kind]
    expected = {
        "tensor": {"arg0": (3, 4)},
        "tuple": {"arg0": (3, 4), "arg1": (1,)},
        "dict": {"x": (3, 4), "scale": (1,)},
    }[kind]
    p = profile(TwoInputs(), batch, loss_fn=lambda out, b: out.sum(), repeats=1, warmup=0)
    assert p.input_shapes == expected


def test_optimizer_state_and_step_peak() -> None:
    ref = models.build("mlp", size="tiny", seed=0)
    optimizer = torch.optim.Adam(ref.model.parameters(), lr=1e-3)
    p = profile(ref.model, ref.batch, loss_fn=ref.loss_fn, optimizer=optimizer, repeats=1,
                warmup=0)
    n_params = len(list(ref.model.parameters()))
    # Adam: exp_avg and exp_avg_sq per parameter, plus a 4-byte float32 step counter.
    assert p.optimizer_state_bytes == 2 * p.param_bytes + 4 * n_params
    assert p.optimizer_step_peak_bytes > 0
    assert p.fixed_bytes == p.param_bytes + p.optimizer_state_bytes + p.batch_bytes
    assert not optimizer.state  # the fresh optimizer is fresh again
    measured = measure_step(ref.model, ref.batch, loss_fn=ref.loss_fn, optimizer=optimizer,
                            repeats=1, warmup=1)  # the warm-up creates the state
    sim = simulate(p, Plan.keep_all([u.name for u in p.units]))
    assert measured.resident_bytes == p.fixed_bytes
    assert abs(sim.peak_bytes - measured.peak_bytes) <= 0.03 * measured.peak_bytes


def test_step_measurement_fields() -> None:
    ref = models.build("cnn", size="tiny", seed=0)
    m = measure_step(ref.model, ref.batch, loss_fn=ref.loss_fn, repeats=2, warmup=0)
    assert isinstance(m, StepMeasurement)
    assert m.resident_bytes > 0 and m.peak_bytes > m.resident_bytes
    assert 0 < m.held_after_forward_bytes <= m.peak_bytes - m.resident_bytes
    assert m.time_ms > 0
    if not torch.cuda.is_available():
        assert m.cuda_peak_bytes is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.peak_bytes = 0  # type: ignore[misc]


def test_remat_exports_profile_and_measure() -> None:
    import remat
    from remat.api import profile as pf
    from remat.measurement.step import measure_step as ms

    assert remat.profile is pf and remat.measure is ms

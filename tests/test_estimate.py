"""remat.estimate: what a step needs before training, and whether a budget fits."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.cli.commands import main
from remat.models import build
from remat.preflight import Estimate, estimate_profile
from remat.solver.min_peak import min_peak_bytes
from remat.solver.simulate import simulate

REF = build("gpt", size="tiny", seed=0)
OPTIMIZER = torch.optim.AdamW(REF.model.parameters())
LOOP = remat.Loop(accumulation_steps=2)
PROFILE = remat.profile(REF.model, REF.batch, optimizer=OPTIMIZER, loop=LOOP)


@pytest.fixture(scope="module")
def est() -> Estimate:
    return remat.estimate(PROFILE)


def test_the_figures_add_up(est: Estimate) -> None:
    keep = remat.Plan.keep_all([u.name for u in PROFILE.units])
    assert est.parameters == PROFILE.param_bytes
    assert est.optimizer_state == PROFILE.optimizer_state_bytes > 0
    assert est.gradients == PROFILE.grad_bytes > 0
    assert est.persistent == (est.parameters + est.buffers + est.gradients + est.optimizer_state
                              + est.inputs)
    assert est.no_checkpoint.bytes == simulate(PROFILE, keep).peak_bytes
    assert est.activations == est.no_checkpoint.bytes - est.persistent
    assert est.smallest.bytes == min_peak_bytes(PROFILE) <= est.no_checkpoint.bytes
    for peak in (est.no_checkpoint, est.smallest):
        assert sum(peak.parts.values()) == peak.bytes
        assert peak.event  # where it sits
    assert est.loop == LOOP


def test_frame_and_text(est: Estimate) -> None:
    frame = est.to_frame()
    assert list(frame.columns) == ["item", "bytes", "MiB", "note"]
    row = frame.set_index("item")
    assert row.loc["smallest peak", "bytes"] == est.smallest.bytes
    assert row.loc["activations", "bytes"] == est.activations
    text = str(est)
    for phrase in ("optimizer state", "no-checkpoint peak", "smallest peak", "accumulate 2",
                   est.no_checkpoint.event):
        assert phrase in text


def test_verdicts() -> None:
    fits = estimate_profile(PROFILE, "100%").verdict
    assert fits is not None and fits.status == "fits"
    between = (min_peak_bytes(PROFILE) + estimate_profile(PROFILE).no_checkpoint.bytes) // 2
    squeezed = estimate_profile(PROFILE, between).verdict
    assert squeezed is not None and squeezed.status == "fits with checkpointing"
    assert squeezed.peak_bytes <= between
    short = estimate_profile(PROFILE, min_peak_bytes(PROFILE) - 1)
    assert short.verdict is not None and short.verdict.status == "does not fit"
    assert "does not fit" in str(short)
    assert short.fits("100%") and not short.fits(1000)


def test_estimate_from_the_model_profiles_once() -> None:
    ref = build("mlp", size="tiny", seed=0)
    est = remat.estimate(ref.model, ref.batch, loss_fn=ref.loss_fn, memory_budget="50%")
    assert est.verdict is not None and "predicted, not run" in str(est)
    assert est.optimizer_state == 0 and "no optimizer given" in str(est)


def test_cli_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", "mlp", "--size", "tiny", "--optimizer", "adamw",
                 "--accumulation-steps", "2", "--budget", "50%"]) == 0
    out = capsys.readouterr().out
    assert "smallest peak" in out and "accumulate 2" in out and "budget" in out

"""The profile means what ``simulate()`` assumes: its replay reproduces measured steps.

Unit figures come from isolated replays of each unit, outside figures from the
instrumented baseline step; the measurements they are checked against come from
``measure_step`` (an ordinary metered step, no hooks). Planned steps run each unit
through ``forward_with_option`` exactly as the runtime does (wired here by hand, so
these tests depend on the profiler and the option wrappers only).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from remat import models
from remat.core.plan import Plan
from remat.execute.options import forward_with_option
from remat.measurement.step import measure_step
from remat.profiler import profile
from remat.solver import simulate

HELD_TOLERANCE = 0.02
PEAK_TOLERANCE = 0.01  # against the allocator's view, which the profile predicts
RNG = torch.get_rng_state().untyped_storage().nbytes()  # checkpoint stashes one per region


def _run(module: nn.Module, option: str, forward: Any, *args: Any, **kwargs: Any) -> Any:
    return forward_with_option(module, option, forward, args, kwargs)


@contextlib.contextmanager
def options_applied(model: nn.Module, plan: Plan) -> Iterator[None]:
    """Run every unit of ``model`` under its option in ``plan`` (per-unit options only)."""
    changed = []
    for name, option in zip(plan.unit_names, plan.options):
        m = model.get_submodule(name)
        m.forward = functools.partial(_run, m, option, m.forward)
        changed.append(m)
    try:
        yield
    finally:
        for m in changed:
            del m.forward


def _plans(names: list[str]) -> list[Plan]:
    cycle = ("checkpoint", "selective", "keep")
    return [
        Plan.keep_all(names),
        Plan.checkpoint_all(names),
        Plan(tuple(names), tuple(cycle[i % 3] for i in range(len(names)))),
    ]


def _relative(predicted: int, measured: int) -> float:
    return abs(predicted - measured) / measured


@pytest.fixture(scope="module", params=[
    "mlp", "cnn", "gpt", pytest.param("hf-gpt2", marks=pytest.mark.transformers),
])
def reference(request):
    ref = models.build(request.param, size="tiny", seed=0)
    return ref, profile(ref.model, ref.batch, loss_fn=ref.loss_fn, repeats=1, warmup=0)


def test_keep_all_matches_the_measured_step(reference) -> None:
    ref, p = reference
    measured = measure_step(ref.model, ref.batch, loss_fn=ref.loss_fn, repeats=1, warmup=0)
    sim = simulate(p, Plan.keep_all([u.name for u in p.units]))
    held_err = _relative(sim.held_after_forward_bytes, measured.held_after_forward_bytes)
    peak_err = _relative(sim.peak_bytes, measured.allocator_peak_bytes)
    assert held_err <= HELD_TOLERANCE, (sim.held_after_forward_bytes, measured)
    assert peak_err <= PEAK_TOLERANCE, (sim.peak_bytes, sim.peak_event, measured)
    # profile() predicted that step without running it; what it holds throughout it read.
    assert p.meta["no_checkpoint_peak"] == "predicted"
    assert p.fixed_bytes == measured.resident_bytes


def test_planned_steps_match_simulate(reference) -> None:
    ref, p = reference
    for plan in _plans([u.name for u in p.units])[1:]:
        sim = simulate(p, plan)
        with options_applied(ref.model, plan):
            measured = measure_step(ref.model, ref.batch, loss_fn=ref.loss_fn, repeats=1,
                                    warmup=0)
        assert (
            _relative(sim.held_after_forward_bytes, measured.held_after_forward_bytes)
            <= HELD_TOLERANCE
        ), (plan.summary(), sim.held_after_forward_bytes, measured)
        assert _relative(sim.peak_bytes, measured.allocator_peak_bytes) <= PEAK_TOLERANCE, (
            plan.summary(), sim.peak_bytes, sim.peak_event, measured,
        )
        # Checkpointing holds less than keeping everything, but for the RNG state it
        # stashes per region (which outweighs a tiny unit's activations).
        if plan.options[0] == "checkpoint" and len(set(plan.options)) == 1:
            keep = simulate(p, Plan.keep_all(plan.unit_names))  # equal to the measurement
            assert measured.held_after_forward_bytes - p.n * RNG < keep.held_after_forward_bytes


def test_off_chain_model_matches_simulate() -> None:
    """Code between the units (``x = block(x) * 2``): every boundary is its own."""

    class Block(nn.Module):
        def __init__(self, d: int = 16) -> None:
            super().__init__()
            self.fc = nn.Linear(d, d)
            self.norm = nn.LayerNorm(d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.fc(self.norm(x)))

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(16, 16)
            self.blocks = nn.ModuleList([Block() for _ in range(4)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for b in self.blocks:
                x = b(x) * 2
            return x

    torch.manual_seed(0)
    model = Scaled()
    x = torch.randn(8, 16)

    def loss_fn(out: torch.Tensor, _b: object) -> torch.Tensor:
        return out.pow(2).mean()

    p = profile(model, x, loss_fn=loss_fn, repeats=1, warmup=0)
    assert not p.is_chain
    for plan in _plans([u.name for u in p.units]):
        sim = simulate(p, plan)
        with options_applied(model, plan):
            measured = measure_step(model, x, loss_fn=loss_fn, repeats=1, warmup=0)
        assert (
            _relative(sim.held_after_forward_bytes, measured.held_after_forward_bytes)
            <= HELD_TOLERANCE
        ), (plan.summary(), sim.held_after_forward_bytes, measured)
        assert _relative(sim.peak_bytes, measured.allocator_peak_bytes) <= PEAK_TOLERANCE, (
            plan.summary(), sim.peak_bytes, measured,
        )

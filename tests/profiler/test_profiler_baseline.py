"""Keep's bytes read off the instrumented baseline step.

They must equal the isolated metered replay's exactly: ``profile()`` skips that
replay where the step gives them. Where the step cannot tell (the batch as a
boundary, a boundary held outside autograd, off a chain) the replay still runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from remat import models
from remat.core.loop import Loop
from remat.measurement.runner import StepRunner, forward_loss
from remat.measurement.state import ModelState, clear_grads
from remat.profiler import profile
from remat.profiler.capture import UnitTrace, trace_units
from remat.profiler.instrument import BaselineStep, instrumented_step
from remat.profiler.replay import OptionFigures, measure_option
from remat.profiler.units import discover_units

REFERENCE = ["mlp", "cnn", "gpt", pytest.param("hf-gpt2", marks=pytest.mark.transformers)]


def _stack() -> tuple[nn.Module, torch.Tensor, Any]:
    """Leaf-module units, ReLU saving its output, LayerNorm its statistics."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.LayerNorm(16),
                          nn.Linear(16, 16))
    target = torch.randn(8, 16)
    return model, torch.randn(8, 16), lambda out, _b: (out * target).sum()


class _TwoOutputs(nn.Module):
    """Returns ``(y, aux)``; ``y`` is computed from views into a wider storage (chunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.fc(x).chunk(2, dim=-1)
        return torch.tanh(a) * b, b.sum()


class _Chunks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.blocks = nn.ModuleList([_TwoOutputs() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x, _ = block(x)
        return x


def _model(name: str) -> tuple[nn.Module, Any, Any]:
    if name == "stack":
        return _stack()
    if name == "chunks":
        torch.manual_seed(0)
        return _Chunks(), torch.randn(8, 16), lambda out, _b: out.pow(2).sum()
    ref = models.build(name, size="tiny", seed=0)
    return ref.model, ref.batch, ref.loss_fn


def _baseline_and_replays(
    model: nn.Module, batch: Any, loss_fn: Any, units: Any = None
) -> tuple[BaselineStep, UnitTrace, list[OptionFigures]]:
    """As profile() runs them: capture, baseline step, then each unit's metered keep replay."""
    state = ModelState.capture(model)
    try:
        model.train()
        clear_grads(state.params)
        trace = trace_units(model, discover_units(model, units),
                            lambda: forward_loss(model, batch, loss_fn))
        ordered = [(n, trace.calls[n].module) for n in trace.order]
        state.rng.restore()
        state.restore_buffers()
        runner = StepRunner(model, batch, loss_fn, None, Loop(keep_output=False), "cpu")
        base = instrumented_step(runner, ordered, is_chain=trace.chain.is_chain)
        clear_grads(state.params)
        state.rng.restore()
        state.restore_buffers()
        replayed = [measure_option(trace.calls[n], "keep", runner) for n in trace.order]
    finally:
        state.restore()
    return base, trace, replayed


@pytest.mark.parametrize("name", [*REFERENCE, "stack", "chunks"])
def test_keep_bytes_from_the_step_equal_the_replays(name: str) -> None:
    base, trace, replayed = _baseline_and_replays(*_model(name))
    assert trace.chain.is_chain and len(base.keep) == len(trace.order)
    read = [(i, k) for i, k in enumerate(base.keep) if k is not None]
    # Every unit but one fed the batch (not the step's storage: the replay runs).
    assert len(read) >= len(trace.order) - 1
    for i, figures in read:
        assert figures == replayed[i], trace.order[i]


def test_a_boundary_held_outside_autograd_is_left_to_the_replay() -> None:
    """A unit that caches its output on itself holds it, which no saved-tensor record
    shows: the step cannot tell, so those units are replayed."""

    class CachesOutput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.fc(x) * 2  # a multiplication by a number saves nothing
            self.last = out
            return out

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), CachesOutput(), CachesOutput())
    x = torch.randn(4, 8)

    def loss_fn(out: torch.Tensor, _b: object) -> torch.Tensor:
        return out.pow(2).sum()

    base, trace, replayed = _baseline_and_replays(model, x, loss_fn, ["1", "2"])
    assert trace.chain.is_chain and base.keep == [None, None]
    assert all(r.holds_output for r in replayed)
    p = profile(model, x, loss_fn=loss_fn, units=["1", "2"], repeats=1, warmup=0)
    assert all(u.keep.holds_output for u in p.units)


def test_no_keep_bytes_off_a_chain() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x) * 2
            return x

    base, trace, _ = _baseline_and_replays(Scaled(), torch.randn(4, 8), lambda o, _b: o.sum())
    assert not trace.chain.is_chain and base.keep == []


def test_profile_skips_the_keep_replays_the_step_measured(monkeypatch) -> None:
    import importlib

    module = importlib.import_module("remat.profiler.profile")
    metered: list[tuple[str, str]] = []
    original = module.measure_option

    def spy(call, option, *args, **kwargs):  # noqa: ANN001, ANN202
        metered.append((call.name, option))
        return original(call, option, *args, **kwargs)

    monkeypatch.setattr(module, "measure_option", spy)
    ref = models.build("mlp", size="tiny", seed=0)
    p = profile(ref.model, ref.batch, loss_fn=ref.loss_fn, repeats=1, warmup=0)
    keep = [name for name, option in metered if option == "keep"]
    assert keep == [p.units[0].name]  # only the unit fed the batch
    assert len(metered) == 1 + 2 * p.n  # checkpoint and selective for every unit
    assert all(set(u.options) == {"keep", "checkpoint", "selective"} for u in p.units)

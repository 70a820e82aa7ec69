"""The baseline step does two jobs of its own passes: keep's bytes and the capture.

Keep's figures read off the instrumented step must equal the isolated metered
replay's exactly (the replay is skipped where the step gives them), and the
capture recorded during that step must be the one a forward pass of its own
records, without the copies it keeps changing what the step's meter sees.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from remat import models
from remat.profiler import profile
from remat.profiler.capture import replica, trace_units
from remat.profiler.instrument import instrumented_step
from remat.profiler.replay import measure_option
from remat.profiler.state import ModelState, clear_grads
from remat.profiler.step import forward_loss
from remat.profiler.units import discover_units

REFERENCE = ["mlp", "cnn", "gpt", pytest.param("hf-gpt2", marks=pytest.mark.transformers)]


def _stack() -> tuple[nn.Module, torch.Tensor, object]:
    """Leaf-module units, ReLU saving its output, LayerNorm its statistics."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.LayerNorm(16),
                          nn.Linear(16, 16))
    target = torch.randn(8, 16)
    return model, torch.randn(8, 16), lambda out, _b: (out * target).sum()


class _TwoOutputs(nn.Module):
    """Returns ``(y, aux)``; ``y`` is a view into a wider storage (chunk)."""

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


def _model(name: str) -> tuple[nn.Module, object, object]:
    if name == "stack":
        return _stack()
    if name == "chunks":
        torch.manual_seed(0)
        return _Chunks(), torch.randn(8, 16), lambda out, _b: out.pow(2).sum()
    ref = models.build(name, size="tiny", seed=0)
    return ref.model, ref.batch, ref.loss_fn


@pytest.mark.parametrize("name", [*REFERENCE, "stack", "chunks"])
def test_keep_bytes_from_the_step_equal_the_replays(name: str) -> None:
    model, batch, loss_fn = _model(name)
    state = ModelState.capture(model)
    try:
        model.train()
        clear_grads(state.params)
        base, trace = instrumented_step(model, batch, loss_fn, discover_units(model),
                                        device_type="cpu")
        clear_grads(state.params)
        state.rng.restore()
        state.restore_buffers()
        replayed = [measure_option(trace.calls[n], "keep", "cpu", state.params)
                    for n in trace.order]
    finally:
        state.restore()
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
    units = discover_units(model, ["1", "2"])
    base, trace = instrumented_step(model, torch.randn(4, 8), lambda o, _b: o.pow(2).sum(),
                                    units, device_type="cpu")
    assert trace.chain.is_chain and base.keep == [None, None]
    p = profile(model, torch.randn(4, 8), loss_fn=lambda o, _b: o.pow(2).sum(),
                units=["1", "2"], repeats=1, warmup=0)
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

    model = Scaled()
    base, trace = instrumented_step(model, torch.randn(4, 8), lambda o, _b: o.sum(),
                                    discover_units(model), device_type="cpu")
    assert not trace.chain.is_chain and base.keep == []


@pytest.mark.parametrize("name", REFERENCE)
def test_capture_inside_the_step_matches_a_capture_pass(name: str) -> None:
    model, batch, loss_fn = _model(name)
    units = discover_units(model)
    state = ModelState.capture(model)
    try:
        model.train()
        alone = trace_units(model, units, lambda: forward_loss(model, batch, loss_fn))
        state.rng.restore()
        state.restore_buffers()
        clear_grads(state.params)
        _, inside = instrumented_step(model, batch, loss_fn, units, device_type="cpu")
    finally:
        state.restore()
    assert inside.order == alone.order and inside.chain == alone.chain
    for unit in alone.order:
        a, b = alone.calls[unit], inside.calls[unit]
        assert (a.out_shape, a.out_dtype, a.out_requires_grad) == (
            b.out_shape, b.out_dtype, b.out_requires_grad)
        assert torch.equal(a.rng.cpu, b.rng.cpu)
        x, y = a.first_input, b.first_input
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x.tensor, y.tensor) and x.requires_grad == y.requires_grad
            assert x.tensor.stride() == y.tensor.stride()


def test_replica_copies_storage_and_layout() -> None:
    base = torch.arange(24.0).reshape(4, 6)
    for t in (base[:, 1:4], base.t(), torch.randn(1, 6).expand(3, 6)):
        r = replica(t)
        assert torch.equal(r, t) and r.stride() == t.stride()
        assert r.storage_offset() == t.storage_offset()
        assert r.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        assert not r.requires_grad


def test_profile_skips_keep_replays_the_step_measured(monkeypatch) -> None:
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
    json.loads(p.to_json())  # the profile is complete

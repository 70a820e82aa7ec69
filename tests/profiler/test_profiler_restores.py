"""profile(), measure_step() and solve() put back state a forward *rebinds*, not only what it
writes into: reassigned buffers, plain attributes, Python's and NumPy's RNGs; lazy
modules are refused rather than materialised."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import remat
from remat.core.errors import ProfileError
from remat.measurement.state import ModelState
from remat.measurement.step import measure_step
from remat.profiler import profile

UNITS = ["blocks.0", "blocks.1"]


class Block(nn.Module):
    """Keeps an exponential moving average by *reassigning* its buffer, counts its calls,
    adds an attribute on first use, and draws from Python's and NumPy's RNGs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("ema", torch.zeros(8))
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        self.last_noise = random.random() + float(np.random.rand())
        self.ema = 0.9 * self.ema + 0.1 * x.detach().mean(dim=0)  # a new tensor each call
        return torch.relu(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(x)


def loss_fn(out: Tensor, batch: Any = None) -> Tensor:
    return out.pow(2).mean()


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))

ENTRY_POINTS: dict[str, Callable[[nn.Module], Any]] = {
    "profile": lambda m: profile(m, X, loss_fn=loss_fn, units=UNITS),
    "measure_step": lambda m: measure_step(m, X, loss_fn=loss_fn),
    "solve (with verification)": lambda m: remat.solve(m, X, 10**9, loss_fn=loss_fn, units=UNITS),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_rebound_state_and_global_rngs_are_put_back(entry: str) -> None:
    torch.manual_seed(0)
    model = Net()
    model(X)  # a used model: counters at 1, an attribute added, the EMA moved
    blocks = list(model.blocks)
    buffers = [b.ema for b in blocks]
    values = [b.ema.clone() for b in blocks]
    attrs = [dict(b.__dict__) for b in blocks]
    random.seed(1)
    np.random.seed(1)
    python_rng, numpy_rng = random.getstate(), np.random.get_state()

    ENTRY_POINTS[entry](model)

    for block, buf, value, before in zip(blocks, buffers, values, attrs):
        assert block._buffers["ema"] is buf  # the same tensor object...
        assert torch.equal(block.ema, value)  # ...with the same value
        assert block.calls == 1
        assert block.__dict__.keys() == before.keys()
        assert all(block.__dict__[k] is v for k, v in before.items())
    assert random.getstate() == python_rng
    after = np.random.get_state()
    assert after[0] == numpy_rng[0] and np.array_equal(after[1], numpy_rng[1])
    assert after[2:] == numpy_rng[2:]


def test_attributes_added_by_the_forward_are_removed() -> None:
    torch.manual_seed(0)
    model = Net()
    profile(model, X, loss_fn=loss_fn, units=UNITS)
    assert all("last_noise" not in b.__dict__ for b in model.blocks)
    assert all(b.calls == 0 for b in model.blocks)


def test_restore_buffers_between_steps_puts_back_reassigned_buffers() -> None:
    torch.manual_seed(0)
    model = Net()
    state = ModelState.capture(model)
    original = [b.ema for b in model.blocks]
    model(X)
    assert all(b.ema is not o for b, o in zip(model.blocks, original))
    state.restore_buffers()
    assert all(b.ema is o and not o.any() for b, o in zip(model.blocks, original))


LAZY = {
    "profile": lambda m: profile(m, X, loss_fn=loss_fn, units=["0", "2"]),
    "measure_step": lambda m: measure_step(m, X, loss_fn=loss_fn),
    # The entry points that consult the profile cache first: its key reads the parameters'
    # shapes, which a lazy parameter refuses with torch's own error.
    "remat.profile": lambda m: remat.profile(m, X, loss_fn=loss_fn),
    "remat.solve": lambda m: remat.solve(m, X, "60%", loss_fn=loss_fn),
    "remat.pareto": lambda m: remat.pareto(m, X, loss_fn=loss_fn),
    "remat.estimate": lambda m: remat.estimate(m, X, loss_fn=loss_fn),
}


@pytest.mark.parametrize("entry", list(LAZY))
def test_lazy_modules_are_refused_and_left_lazy(entry: str) -> None:
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 8))
    with pytest.raises(ProfileError, match=r"module '0' \(LazyLinear\).*run one forward pass"):
        LAZY[entry](model)
    assert isinstance(model[0], nn.LazyLinear) and model[0].has_uninitialized_params()


def test_a_lazy_model_after_one_forward_profiles() -> None:
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 8))
    with torch.no_grad():
        model(X)
    assert type(model[0]) is nn.Linear
    assert profile(model, X, loss_fn=loss_fn, units=["0", "2"]).n == 2


class HookedOnFirstCall(nn.Module):
    """Installs a forward hook on its blocks on its first call and marks that with an
    attribute, as ``transformers``' output capturing does; the hook collects each block's
    output for a second loss term."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.collected: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        if not getattr(self, "_hooks_installed", False):
            for block in self.blocks:
                block.register_forward_hook(lambda m, a, out: self.collected.append(out))
            self._hooks_installed = True
        self.collected.clear()
        out = self.blocks(x)
        return out + sum(c.mean() for c in self.collected)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_hooks_installed_in_a_step_go_with_the_attribute_that_marks_them(entry: str) -> None:
    # Before: the mark was removed and the hooks stayed, so the next call installed them
    # again, collected every output twice and changed the loss.
    torch.manual_seed(0)
    model = HookedOnFirstCall()
    ENTRY_POINTS[entry](model)
    assert all(not b._forward_hooks for b in model.blocks)
    model(X)
    assert len(model.collected) == 2
    assert all(len(b._forward_hooks) == 1 for b in model.blocks)

"""profile() and measure_step() leave no trace, also when they fail half-way."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from remat import models
from remat.measurement.step import measure_step
from remat.profiler import profile


@dataclass
class Snapshot:
    state: dict[str, torch.Tensor]
    grads: list[torch.Tensor | None]
    grad_values: list[torch.Tensor | None]
    requires_grad: list[bool]
    training: list[bool]
    rng: torch.Tensor
    optimizer: dict[str, Any]


def take(model: nn.Module, optimizer: torch.optim.Optimizer) -> Snapshot:
    params = list(model.parameters())
    return Snapshot(
        state={k: v.detach().clone() for k, v in model.state_dict().items()},
        grads=[p.grad for p in params],
        grad_values=[None if p.grad is None else p.grad.clone() for p in params],
        requires_grad=[p.requires_grad for p in params],
        training=[m.training for m in model.modules()],
        rng=torch.get_rng_state(),
        optimizer=copy.deepcopy(optimizer.state_dict()),
    )


def _same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested optimizer state."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def assert_unchanged(model: nn.Module, optimizer: torch.optim.Optimizer, before: Snapshot) -> None:
    after = take(model, optimizer)
    assert after.state.keys() == before.state.keys()
    for k, v in before.state.items():
        # Bitwise, BatchNorm running stats and num_batches_tracked included.
        assert torch.equal(after.state[k], v), k
    for p, g0, v0, g1 in zip(model.parameters(), before.grads, before.grad_values, after.grads):
        assert g1 is g0  # None stays None; an existing grad is the same tensor...
        if v0 is not None:
            assert torch.equal(p.grad, v0)  # ...with the same values
    assert after.requires_grad == before.requires_grad
    assert after.training == before.training
    assert torch.equal(after.rng, before.rng)
    assert _same(after.optimizer, before.optimizer)
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
        assert not m._backward_hooks
    for p in model.parameters():
        assert not getattr(p, "_post_accumulate_grad_hooks", None)
        assert not p._backward_hooks


@pytest.fixture()
def cnn_in_a_used_state():
    """The CNN after one optimizer step, with a mix of grads, frozen params and eval modules."""
    ref = models.build("cnn", size="tiny", seed=0)
    model = ref.model
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref.step()
    optimizer.step()  # optimizer state exists; BatchNorm stats moved off their init
    params = list(model.parameters())
    for i, p in enumerate(params):
        if i % 3 == 0:
            p.grad = None  # some grads None, the others left from the step
    params[-1].requires_grad_(False)
    model.stem[1].eval()  # one BatchNorm in eval mode
    torch.manual_seed(123)
    return ref, optimizer


def test_profile_leaves_no_trace(cnn_in_a_used_state) -> None:
    ref, optimizer = cnn_in_a_used_state
    before = take(ref.model, optimizer)
    p = profile(ref.model, ref.batch, loss_fn=ref.loss_fn, optimizer=optimizer, repeats=1,
                warmup=0)
    assert p.optimizer_state_bytes > 0
    assert_unchanged(ref.model, optimizer, before)


@pytest.mark.parametrize("fail_at", [1, 2, 3, 4, 5])
def test_profile_that_fails_leaves_no_trace(cnn_in_a_used_state, fail_at: int) -> None:
    """The loss function raises from its n-th call on: during the forward recording
    saves (1), the capture pass (2), the stub step that meters the optimizer (3), the
    timed stub step with shapes only (4, then again in its retry with every unit) or the
    instrumented step (5)."""
    ref, optimizer = cnn_in_a_used_state
    calls = [0]

    def flaky_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] >= fail_at:
            raise RuntimeError("injected failure")
        return ref.loss_fn(output, batch)

    before = take(ref.model, optimizer)
    with pytest.raises(RuntimeError, match="injected failure"):
        profile(ref.model, ref.batch, loss_fn=flaky_loss, optimizer=optimizer, repeats=1,
                warmup=0)
    assert_unchanged(ref.model, optimizer, before)


def test_measure_step_leaves_no_trace(cnn_in_a_used_state) -> None:
    ref, optimizer = cnn_in_a_used_state
    before = take(ref.model, optimizer)
    measured = measure_step(ref.model, ref.batch, loss_fn=ref.loss_fn, optimizer=optimizer,
                            repeats=2, warmup=1)
    assert measured.peak_bytes > measured.resident_bytes
    assert_unchanged(ref.model, optimizer, before)


def test_profile_consumes_no_randomness() -> None:
    ref = models.build("gpt", size="tiny", seed=0)  # dropout draws from the CPU RNG
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    profile(ref.model, ref.batch, repeats=1, warmup=0)
    assert torch.equal(torch.rand(4), expected)


def test_failure_inside_a_unit_replay_leaves_no_trace() -> None:
    """A unit that raises on its second call: the saves pass (1), its first replay (2)."""

    class Flaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("replay failure")
            return self.fc(x)

    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), Flaky())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model[0].weight.grad = torch.ones_like(model[0].weight)
    x = torch.randn(4, 8)
    before = take(model, optimizer)
    with pytest.raises(RuntimeError, match="replay failure"):
        profile(model, x, loss_fn=lambda o, b: o.sum(), repeats=1, warmup=0)
    assert_unchanged(model, optimizer, before)

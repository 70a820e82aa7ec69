"""What planning runs: counted forwards and backwards, never wall-clock times.

``remat.solve()`` is meant to cost a few training steps (``benchmarks/profile_cost.py``
measures them); these tests pin the counts that cost is made of, so that a change
which adds a pass shows here on any machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import remat
import remat.measurement.step as step_module
from remat.core.loop import Loop
from remat.tune.verify import measure_plan


@dataclass
class _Counts:
    forwards: int = 0
    backwards: int = 0


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)))


@contextmanager
def _counting(model: nn.Module) -> Iterator[tuple[_Counts, object]]:
    """Counts of the model's training forwards and of the backwards of its loss, and a
    loss function that counts them."""
    counts = _Counts()

    def hook(_module: nn.Module, _args: object, _out: object) -> None:
        if torch.is_grad_enabled():
            counts.forwards += 1

    def loss_fn(out: torch.Tensor, _batch: object) -> torch.Tensor:
        loss = (out * out).mean()
        if loss.requires_grad:
            loss.register_hook(lambda g: setattr(counts, "backwards", counts.backwards + 1))
        return loss

    handle = model.register_forward_hook(hook)
    try:
        yield counts, loss_fn
    finally:
        handle.remove()


@pytest.mark.parametrize("keep_output", [True, False])
def test_verification_without_an_optimizer_runs_one_backward(keep_output: bool) -> None:
    """A loop without an optimizer repeats itself: verification runs one step and the next
    one's forward (with what the loop carries alive), one backward, and measures the
    peak that two whole steps measure."""
    model, x = _model(), torch.randn(256, 64)
    loop = Loop(keep_output=keep_output)
    with _counting(model) as (counts, loss_fn):
        plan = remat.solve(model, x, None, method="all", loss_fn=loss_fn, loop=loop,
                           verify=False)
        counts.forwards = counts.backwards = 0
        short = measure_plan(model, x, plan, loss_fn=loss_fn, optimizer=None, loop=loop)
        assert (counts.forwards, counts.backwards) == (2, 1)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(step_module, "_repeats_itself", lambda _runner: False)
            full = measure_plan(model, x, plan, loss_fn=loss_fn, optimizer=None, loop=loop)
    assert (short.peak_bytes, short.allocator_peak_bytes) == (
        full.peak_bytes, full.allocator_peak_bytes)
    assert short.held_after_forward_bytes is None  # not asked for: one forward less



class _Stashing(nn.Module):
    """Keeps the gradient of its hidden layer from one backward to the next (a gradient
    tracker): memory that outlives the loop's variables into the next step's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _model()
        self.stash: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body[:2](x)
        if h.requires_grad:
            h.register_hook(lambda g: self.stash.__setitem__(slice(None), [g * 2]))
        return self.body[2:](h)


def test_verification_runs_a_whole_second_step_where_memory_outlives_the_loop() -> None:
    """Where something made in the step outlives the loop's variables, the second step's
    backward runs with it: a whole step more, and the peak of two whole steps."""
    model, x = _Stashing(), torch.randn(256, 64)
    units = ["body.0", "body.1", "body.2", "body.3"]
    with _counting(model) as (counts, loss_fn):
        plan = remat.solve(model, x, None, method="all", loss_fn=loss_fn, units=units,
                           verify=False)
        counts.forwards = counts.backwards = 0
        model.stash.clear()
        short = measure_plan(model, x, plan, loss_fn=loss_fn, optimizer=None, loop=Loop())
        assert (counts.forwards, counts.backwards) == (3, 2)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(step_module, "_repeats_itself", lambda _runner: False)
            model.stash.clear()
            full = measure_plan(model, x, plan, loss_fn=loss_fn, optimizer=None, loop=Loop())
    assert short.peak_bytes >= full.peak_bytes
    assert short.allocator_peak_bytes >= full.allocator_peak_bytes


def test_verification_with_an_optimizer_runs_two_steps() -> None:
    """The optimizer's first step creates its state, so the second starts with more:
    both run whole."""
    model, x = _model(), torch.randn(64, 64)
    optimizer = torch.optim.Adam(model.parameters())
    with _counting(model) as (counts, loss_fn):
        plan = remat.solve(model, x, None, method="all", loss_fn=loss_fn,
                           optimizer=optimizer, verify=False)
        counts.forwards = counts.backwards = 0
        measure_plan(model, x, plan, loss_fn=loss_fn, optimizer=optimizer, loop=Loop())
    assert (counts.forwards, counts.backwards) == (2, 2)


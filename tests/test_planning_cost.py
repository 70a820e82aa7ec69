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
from remat.measurement.runner import StepRunner
from remat.measurement.state import training_session
from remat.measurement.timing import Stopwatch
from remat.profiler.capture import trace_units
from remat.profiler.outside_time import time_outside
from remat.profiler.replay import time_unit
from remat.profiler.units import discover_units
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
            patch.setattr(step_module, "_repeats_itself", lambda *_: False)
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
            patch.setattr(step_module, "_repeats_itself", lambda *_: False)
            model.stash.clear()
            full = measure_plan(model, x, plan, loss_fn=loss_fn, optimizer=None, loop=Loop())
    assert short.peak_bytes >= full.peak_bytes
    assert short.allocator_peak_bytes >= full.allocator_peak_bytes


def test_verification_with_an_optimizer_runs_one_backward() -> None:
    """The optimizer's state is made before the measured step (one optimizer step over
    zero gradients), so the step is the steady one: one step and the next one's forward,
    one backward (tests/test_steady_state.py: the peak of two whole steps)."""
    model, x = _model(), torch.randn(64, 64)
    optimizer = torch.optim.Adam(model.parameters())
    with _counting(model) as (counts, loss_fn):
        plan = remat.solve(model, x, None, method="all", loss_fn=loss_fn,
                           optimizer=optimizer, verify=False)
        counts.forwards = counts.backwards = 0
        measure_plan(model, x, plan, loss_fn=loss_fn, optimizer=optimizer, loop=Loop())
    assert (counts.forwards, counts.backwards) == (2, 1)


class _Watch(Stopwatch):
    """Runs the work and says it took 10, 12 or 11 ms, by turns (a spread of 10 to 20% of
    the outside code's time, 0.2% of a step whose units take 1 s)."""

    calls = 0

    def time(self, fn):  # noqa: ANN001, ANN202
        self.calls += 1
        return fn(), (10.0, 12.0, 11.0)[self.calls % 3]


def _stub_steps(units_ms: float) -> int:
    """How many stub steps :func:`time_outside` runs (warm-up and metered ones included)."""
    model, x = _model(), torch.randn(8, 64)
    units = list(model)
    with _counting(model) as (counts, loss_fn), training_session(model) as state:
        runner = StepRunner(model, x, loss_fn, None, Loop(), "cpu")
        time_outside(runner, units, state, _Watch(torch.device("cpu")), warmup=1, repeats=3,
                     tolerance=0.05, units_ms=units_ms)
    return counts.forwards


def test_outside_time_is_judged_against_the_step() -> None:
    """The outside code's samples settle once their spread is small against the step
    (units included), not against the outside code alone: two timed steps, not three."""
    assert _stub_steps(units_ms=0.0) == 1 + 3
    assert _stub_steps(units_ms=1000.0) == 1 + 2


def test_metered_optimizer_steps_are_the_outside_warm_up() -> None:
    """With an optimizer, the metered stub steps (two whole, one per parameter) warm the
    outside code up: no un-timed step after them."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with _counting(model) as (counts, loss_fn), training_session(model, optimizer) as state:
        runner = StepRunner(model, torch.randn(8, 64), loss_fn, optimizer, Loop(), "cpu")
        time_outside(runner, list(model), state, _Watch(torch.device("cpu")), warmup=1,
                     repeats=3, tolerance=0.05, units_ms=1000.0)
    assert counts.forwards == 3 + 2


class _SplitWatch(Stopwatch):
    """Says keep takes 10 + 20 ms every round, and selective 35 ms in all, split 10 + 25
    and 14 + 21 by turns (a round times keep's forward and backward, then selective's)."""

    calls = 0

    def time(self, fn):  # noqa: ANN001, ANN202
        self.calls += 1
        round_, k = divmod(self.calls - 1, 4)
        selective = ((10.0, 25.0), (14.0, 21.0))[round_ % 2]
        return fn(), (10.0, 20.0, *selective)[k]


def test_an_options_split_it_does_not_use_does_not_hold_its_timing() -> None:
    """An option's extra time is its total less keep's: its forward/backward split may
    vary, and its samples still settle once the totals agree (two rounds of three)."""
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    x = torch.randn(8, 32)
    trace = trace_units(model, discover_units(model, None), lambda: model(x).sum())
    runner = StepRunner(model, x, lambda out, _: out.sum(), None, Loop(), "cpu")
    samples = time_unit(trace.calls["1"], ["keep", "selective"], runner,
                        _SplitWatch(torch.device("cpu")), warmup=0, repeats=3, tolerance=0.05)
    assert samples.rounds == 2

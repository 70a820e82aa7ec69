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
def _counting(model: nn.Module, of: object = None) -> Iterator[tuple[_Counts, object]]:
    """Counts of the model's training forwards and of the backwards of its loss, and a
    loss function that counts them (``of``'s loss, or the output's mean square)."""
    counts = _Counts()

    def hook(_module: nn.Module, _args: object, _out: object) -> None:
        if torch.is_grad_enabled():
            counts.forwards += 1

    def loss_fn(out: torch.Tensor, batch: object) -> torch.Tensor:
        loss = of(out, batch) if callable(of) else (out * out).mean()
        if loss.requires_grad:
            loss.register_hook(lambda g: setattr(counts, "backwards", counts.backwards + 1))
        return loss

    handle = model.register_forward_hook(hook)
    try:
        yield counts, loss_fn
    finally:
        handle.remove()


def _wide_model() -> nn.Sequential:
    """:func:`_model` with a wide last layer: its output outweighs its activations."""
    torch.manual_seed(0)
    return nn.Sequential(*_model(), nn.Linear(64, 4096))


def _mean_square(out: torch.Tensor, _batch: object) -> torch.Tensor:
    return (out * out).mean()


def _total(out: torch.Tensor, _batch: object) -> torch.Tensor:
    return out.sum()  # its gradient is an expanded scalar: the output's has no storage


# (model, loss, forwards of the short measurement): the next step's forward runs only
# where it can set the peak. With a mean square, the peak is at the backward's start,
# the output's gradient alive beside the output: never below the next forward's, which
# has the carried output beside the new one. With a sum, the output's gradient costs
# nothing, and the carried output (or the loss's graph) makes the next forward higher.
_VERIFIED = [(_model, _mean_square, 1), (_wide_model, _mean_square, 1),
             (_wide_model, _total, 2)]


@pytest.mark.parametrize("keep_output", [True, False])
@pytest.mark.parametrize(("build", "loss", "forwards"), _VERIFIED)
@pytest.mark.parametrize("method", ["all", "none"])
def test_verification_without_an_optimizer_runs_one_backward(
        keep_output: bool, build, loss, forwards: int, method: str) -> None:  # noqa: ANN001
    """A loop without an optimizer repeats itself: verification runs one step and, where
    it can set the peak, the next one's forward (with what the loop carries alive): one
    backward, and the peak that two whole steps measure, on both instruments."""
    model, x = build(), torch.randn(256, 64)
    loop = Loop(keep_output=keep_output)
    with _counting(model, loss) as (counts, loss):
        plan = remat.solve(model, x, None, method=method, loss_fn=loss, loop=loop,
                           verify=False)
        counts.forwards = counts.backwards = 0
        short = measure_plan(model, x, plan, loss_fn=loss, optimizer=None, loop=loop)
        assert (counts.forwards, counts.backwards) == (forwards, 1)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(step_module, "_repeats_itself", lambda *_: False)
            full = measure_plan(model, x, plan, loss_fn=loss, optimizer=None, loop=loop)
    assert (short.peak_bytes, short.allocator_peak_bytes) == (
        full.peak_bytes, full.allocator_peak_bytes)
    assert short.held_after_forward_bytes is None  # not asked for: one forward less


def test_the_allocators_view_overrules_a_skipped_forward() -> None:
    """The allocator's view on CPU is read only once its region has ended: where it says
    the next forward could set its peak, the forward runs in a second region, the carry
    still alive, and the peak over both regions is the two whole steps' peak."""
    model, x = _model(), torch.randn(256, 64)
    with _counting(model) as (counts, loss):
        plan = remat.solve(model, x, None, method="all", loss_fn=loss, verify=False)
        counts.forwards = counts.backwards = 0
        def fails(regions, _mark):  # noqa: ANN001, ANN202
            regions.stop()
            regions.resume()  # as where it does not hold: the forward in a second region
            return False

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(step_module, "_allocator_bound_holds", fails)
            again = measure_plan(model, x, plan, loss_fn=loss, optimizer=None, loop=Loop())
        assert (counts.forwards, counts.backwards) == (2, 1)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(step_module, "_repeats_itself", lambda *_: False)
            full = measure_plan(model, x, plan, loss_fn=loss, optimizer=None, loop=Loop())
    assert (again.peak_bytes, again.allocator_peak_bytes) == (
        full.peak_bytes, full.allocator_peak_bytes)


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
        # The next forward is not run (it cannot set the peak), the whole step is (in a
        # second region of the allocator's view where the first was read to decide).
        assert (counts.forwards, counts.backwards) == (2, 2)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(step_module, "_repeats_itself", lambda *_: False)
            model.stash.clear()
            full = measure_plan(model, x, plan, loss_fn=loss_fn, optimizer=None, loop=Loop())
    assert short.peak_bytes >= full.peak_bytes
    assert short.allocator_peak_bytes >= full.allocator_peak_bytes


def test_verification_with_an_optimizer_runs_one_backward() -> None:
    """The optimizer's state is made before the measured step (one optimizer step over
    zero gradients), so the step is the steady one: one step and the next one's forward,
    one backward, the next forward only where it can set the peak
    (tests/test_steady_state.py: the peak of two whole steps)."""
    model, x = _model(), torch.randn(64, 64)
    optimizer = torch.optim.Adam(model.parameters())
    with _counting(model) as (counts, loss_fn):
        plan = remat.solve(model, x, None, method="all", loss_fn=loss_fn,
                           optimizer=optimizer, verify=False)
        counts.forwards = counts.backwards = 0
        measure_plan(model, x, plan, loss_fn=loss_fn, optimizer=optimizer, loop=Loop())
    # The next forward cannot set the peak here (the optimizer's step does): not run.
    assert (counts.forwards, counts.backwards) == (1, 1)


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
    """With an optimizer, the first metered stub step warms the outside code up (no
    un-timed step after it); the other two metered ones (whole, per parameter) step the
    optimizer over zero gradients, without a forward."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with _counting(model) as (counts, loss_fn), training_session(model, optimizer) as state:
        runner = StepRunner(model, torch.randn(8, 64), loss_fn, optimizer, Loop(), "cpu")
        time_outside(runner, list(model), state, _Watch(torch.device("cpu")), warmup=1,
                     repeats=3, tolerance=0.05, units_ms=1000.0)
    assert counts.forwards == 1 + 2


def test_optimizer_figures_without_the_steps_that_made_the_gradients() -> None:
    """The optimizer's metered figures are the same whether its steps follow a whole stub
    step each or zero gradients laid out as the first one's."""
    import remat.profiler.outside_time as outside_time

    def figures(layouts):  # noqa: ANN001, ANN202
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        with pytest.MonkeyPatch.context() as patch, training_session(model, optimizer) as state:
            patch.setattr(outside_time, "_grad_layouts", layouts)
            runner = StepRunner(model, torch.randn(8, 64), lambda out, _: out.square().mean(),
                                optimizer, Loop(), "cpu")
            times = time_outside(runner, list(model), state, _Watch(torch.device("cpu")),
                                 warmup=1, repeats=3, tolerance=0.05, units_ms=1000.0)
        return (times.optimizer_state_bytes, times.optimizer_step_peak_bytes,
                times.param_step_peaks and sorted(times.param_step_peaks.values()))

    whole_steps = figures(lambda _params: None)
    assert whole_steps[1] > 0 and whole_steps[2]
    assert figures(outside_time._grad_layouts) == whole_steps


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


class _Counted(nn.Module):
    """A layer that counts the times its forward really ran."""

    def __init__(self, wrap: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
        self.wrap = wrap  # return a dataclass, which may hold tensors its structure hides
        self.ran: list[int] = []  # changed in place: the session puts rebound ones back

    @property
    def runs(self) -> int:
        return len(self.ran)

    def forward(self, x: torch.Tensor) -> torch.Tensor | _Wrapped:
        if isinstance(x, _Wrapped):
            x = x.value
        self.ran.append(1)
        y = self.body(x)
        return _Wrapped(y) if self.wrap else y


@dataclass
class _Wrapped:
    value: torch.Tensor


def _outside_steps(model: nn.Sequential, x: torch.Tensor) -> int:
    """:func:`time_outside` over ``model``'s layers as units; the steps it ran."""
    with _counting(model) as (counts, loss_fn), training_session(model) as state:
        runner = StepRunner(model, x, loss_fn, None, Loop(), "cpu")
        time_outside(runner, list(model), state, _Watch(torch.device("cpu")), warmup=1,
                     repeats=3, tolerance=0.05, units_ms=1000.0)
    return counts.forwards


def test_outside_time_runs_the_units_in_its_first_step_only() -> None:
    """The stub steps that only time the outside code hand out zeros shaped as the units'
    outputs were in the first step: the units' forwards run once, in that step."""
    torch.manual_seed(0)
    model = nn.Sequential(*(_Counted() for _ in range(3)))
    assert _outside_steps(model, torch.randn(8, 64)) == 1 + 2
    assert [unit.runs for unit in model] == [1, 1, 1]


def test_the_instrumented_step_teaches_the_timed_steps_the_units_outputs() -> None:
    """The outside passes run the units for real once: in the instrumented step, which
    runs first and hands what they gave to the timed steps' stubs (one clock), so every
    timed step, its first included, hands out zeros (a whole forward saved per profile)."""
    from remat.profiler.instrument import instrumented_step
    from remat.profiler.stub import StubClock

    torch.manual_seed(0)
    model = nn.Sequential(*(_Counted() for _ in range(3)))
    x = torch.randn(8, 64)
    clock = StubClock()
    with _counting(model) as (counts, loss_fn), training_session(model) as state:
        runner = StepRunner(model, x, loss_fn, None, Loop(), "cpu")
        instrumented_step(runner, list(model.named_children()), is_chain=True, clock=clock)
        state.between_passes()
        time_outside(runner, list(model), state, _Watch(torch.device("cpu")), warmup=1,
                     repeats=3, tolerance=0.05, units_ms=1000.0, clock=clock)
    assert counts.forwards == 1 + 1 + 2  # the instrumented step, the warm-up, two timed
    assert [unit.runs for unit in model] == [1, 1, 1]


def test_a_first_step_with_shapes_only_that_fails_runs_the_units() -> None:
    """Taught by the instrumented step, the timed steps' first one hands out zeros too;
    where the outside code needs what a unit computes, it runs again with the units."""
    from remat.profiler.instrument import instrumented_step
    from remat.profiler.stub import StubClock

    torch.manual_seed(0)
    model = _Noting()
    model.units = nn.ModuleList(_NotingUnit() for _ in range(3))
    x = torch.randn(8, 64)
    clock = StubClock()
    with _counting(model) as (counts, loss_fn), training_session(model) as state:
        runner = StepRunner(model, x, loss_fn, None, Loop(), "cpu")
        units = [(f"units.{i}", u) for i, u in enumerate(model.units)]
        instrumented_step(runner, units, is_chain=True, clock=clock)
        state.between_passes()
        time_outside(runner, list(model.units), state, _Watch(torch.device("cpu")),
                     warmup=1, repeats=3, tolerance=0.05, units_ms=1000.0, clock=clock)
    # The instrumented step, then the warm-up (after its try with shapes only failed)
    # and two timed steps with every unit.
    assert counts.forwards == 1 + 1 + 2
    assert [unit.runs for unit in model.units] == [4, 5, 5]


def test_a_unit_whose_output_can_hide_tensors_runs_in_every_step() -> None:
    """A dataclass output may hold tensors its structure does not show: run for real."""
    torch.manual_seed(0)
    model = nn.Sequential(_Counted(), _Counted(wrap=True), _Counted())
    assert _outside_steps(model, torch.randn(8, 64)) == 1 + 2
    assert [unit.runs for unit in model] == [1, 3, 1]


def test_a_stub_called_on_other_shapes_runs_for_real() -> None:
    """Zeros stand in for a call only where the inputs have the shapes and kinds of the
    call seen in the first step (a unit called twice per step on different shapes)."""
    from remat.profiler.stub import StubClock, stubbed

    torch.manual_seed(0)
    unit = _Counted()
    with stubbed([unit]) as clock:
        assert isinstance(clock, StubClock)
        for step in range(3):
            clock.new_step(shapes_only=step > 0)
            small = unit(torch.randn(4, 64, requires_grad=True))
            other = unit(torch.randn(4 + step, 64, requires_grad=True))
            assert small.shape == (4, 64) and other.shape == (4 + step, 64)
            assert small.requires_grad and other.requires_grad
            (small.sum() + other.sum()).backward()
    # The first step's two calls, then each step's second call (its shape changed).
    assert unit.runs == 2 + 2


def test_a_unit_with_a_hook_inside_runs_in_every_step() -> None:
    """A forward hook inside a unit may hand what it sees to the outside code (how
    ``transformers`` collects a router's logits for its auxiliary loss): run for real."""
    torch.manual_seed(0)
    model = nn.Sequential(*(_Counted() for _ in range(3)))
    model[1].body[0].register_forward_hook(lambda *_: None)
    assert _outside_steps(model, torch.randn(8, 64)) == 1 + 2
    assert [unit.runs for unit in model] == [1, 3, 1]


class _Noting(nn.Module):
    """Its units note a figure of what they compute in a list the outside code reads (a
    side channel no stub with shapes only can fill)."""

    def __init__(self) -> None:
        super().__init__()
        self.units = nn.ModuleList(_Counted() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        notes: list[torch.Tensor] = []
        for unit in self.units:
            x = unit(x, notes)
        return x + torch.stack(notes).view(len(self.units)).sum()  # every unit's note


class _NotingUnit(_Counted):
    def forward(self, x: torch.Tensor, notes: list[torch.Tensor]) -> torch.Tensor:
        y = super().forward(x)
        notes.append(y.mean())
        return y


def test_a_step_with_shapes_only_that_fails_runs_the_units_from_then_on() -> None:
    torch.manual_seed(0)
    model = _Noting()
    model.units = nn.ModuleList(_NotingUnit() for _ in range(3))
    x = torch.randn(8, 64)
    with _counting(model) as (counts, loss_fn), training_session(model) as state:
        runner = StepRunner(model, x, loss_fn, None, Loop(), "cpu")
        time_outside(runner, list(model.units), state, _Watch(torch.device("cpu")),
                     warmup=1, repeats=3, tolerance=0.05, units_ms=1000.0)
    # The warm-up step, then the two timed ones with every unit (the first of them after
    # its try with shapes only failed: a forward that never finished, so not counted).
    assert counts.forwards == 1 + 2
    # Each unit ran in the three steps that finished; in the failed one, the first unit
    # handed out zeros, so the others, with a note fewer in their list, ran for real.
    assert [unit.runs for unit in model.units] == [3, 4, 4]


def test_under_several_ranks_the_next_forward_always_runs() -> None:
    """Each rank's bound is its own: a rank that skipped the forward would leave the
    others' collectives in it waiting (an FSDP2 verification hung so on 2 gloo ranks)."""
    model, x = _model(), torch.randn(256, 64)
    with _counting(model) as (counts, loss):
        plan = remat.solve(model, x, None, method="all", loss_fn=loss, verify=False)
        counts.forwards = counts.backwards = 0
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(step_module, "_other_ranks_step", lambda: True)
            measure_plan(model, x, plan, loss_fn=loss, optimizer=None, loop=Loop())
        assert (counts.forwards, counts.backwards) == (2, 1)
        counts.forwards = counts.backwards = 0
        measure_plan(model, x, plan, loss_fn=loss, optimizer=None, loop=Loop())
        assert (counts.forwards, counts.backwards) == (1, 1)  # alone, it is skipped here

"""Pass 3 of :mod:`.profile` (outside time).

Stub steps (:mod:`.stub`) run plainly: the outside code's time, and the optimizer's figures.
The stubs run with shapes only (zeros of the units' outputs, the units not run), since
nothing here reads what the units compute: from the first step where the instrumented
step (:mod:`.instrument`, which runs them for real) taught their outputs to the clock
handed in, else after the first.

The unplanned step is never run, so its time is derived: the outside code's forward and
backward time, measured here on steps whose units are stubs (each step's time less the
time its stubs took), plus the units' own times from their replays, plus the optimizer
step's. The optimizer's figures are taken on the same steps: the first creates its state
(unless it has some already), the second is steady; each ``optimizer.step()`` is metered,
its peak taken above the bytes alive when it starts, with every parameter's gradient
alive as in a real step (:func:`~remat.profiler.stub.give_missing_grads`).

Where the optimizer can be stepped one parameter at a time (:mod:`remat.measurement.in_backward`),
a third metered step meters each parameter's own step alone (its gradient alive, the state
there): what stepping it in backward adds (``Loop(optimizer_in_backward=True)``). These
figures are taken whatever the loop, so one profile predicts both loops; the steps are
timed as the loop runs them (the whole optimizer step, or one per parameter).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from remat.core.errors import ArgumentError, RematError
from remat.measurement.in_backward import ParamSteps
from remat.measurement.meter import MemoryMeter
from remat.measurement.runner import StepRunner
from remat.measurement.state import ModelState, clear_grads
from remat.measurement.storage import optimizer_state_bytes
from remat.measurement.timing import Stopwatch, median, parts_settled
from remat.profiler.records import OutsideTimes
from remat.profiler.stub import (
    Layout,
    StubClock,
    give_missing_grads,
    layout_of,
    stubbed,
    zeros_laid_out,
)

__all__ = ["time_outside"]

log = logging.getLogger("remat")


def _param_steps(runner: StepRunner) -> tuple[ParamSteps | None, str]:
    """The per-parameter optimizers to meter, or ``None`` and why there are none."""
    if runner.in_backward is not None:
        return runner.in_backward, "measured"
    if runner.optimizer is None:
        return None, "no optimizer"
    try:
        return ParamSteps(runner.optimizer), "measured"
    except ArgumentError as err:
        return None, str(err)


def _meter_each(steps: ParamSteps, runner: StepRunner) -> dict[int, int]:
    """Each parameter's own step, metered alone (its gradient alive), then ``zero_grad``."""
    peaks = {}
    for p in steps.params:
        if p.grad is None:
            continue
        with MemoryMeter(device_type=runner.device_type) as meter:
            steps.step(p)
        peaks[id(p)] = meter.peak_bytes
    runner.zero_grad()
    return peaks


def _step_each(steps: ParamSteps, runner: StepRunner) -> None:
    """Every parameter's own step, then ``zero_grad``: the loop that steps in backward."""
    for p in steps.params:
        if p.grad is not None:
            steps.step(p)
    runner.zero_grad()


@dataclass
class _Gradients:
    """What gives each stub step's optimizer step its gradients: the step's forward and
    backward, or (metering the optimizer alone) zeros laid out as the first step's."""

    runner: StepRunner
    state: ModelState
    clock: StubClock
    watch: Stopwatch
    shapes_only: bool = True  # until a step with shapes only fails
    layouts: list[_GradLayout] | None = None  # the first step's gradients

    def step(self, *, first: bool, optimizer_only: bool) -> tuple[float, float, float]:
        """Every parameter's gradient made; the forward's time, the stubs' part of it and
        the backward's (ms; 0 where neither ran)."""
        self.state.between_passes()
        if optimizer_only and self.layouts is not None:
            _give_grads(self.layouts)
            return 0.0, 0.0, 0.0
        # The stubs hand out zeros of their outputs (:mod:`.stub`, "shapes only"): only
        # the outside code's time is read here. A stub runs its unit where the clock has
        # not seen that call run for real (in the first step, unless the instrumented
        # step taught it).
        try:
            times = self._forward_backward(shapes_only=self.shapes_only)
        except (torch.OutOfMemoryError, RematError):
            raise
        except Exception as err:
            if not self.shapes_only:
                raise
            # The outside code needed what a unit computes: every unit runs from now on.
            log.debug("outside time: a step with shapes only failed (%s: %s); the units "
                      "run in every step", type(err).__name__, err)
            self.shapes_only = False
            self.state.between_passes()
            times = self._forward_backward(shapes_only=False)
        give_missing_grads(self.runner.params)
        if first:
            self.layouts = _grad_layouts(self.runner.params)
        return times

    def _forward_backward(self, *, shapes_only: bool) -> tuple[float, float, float]:
        runner, watch = self.runner, self.watch
        self.clock.new_step(shapes_only=shapes_only)
        (output, loss), f_ms = watch.time(runner.forward)
        if not runner.loop.keep_output:
            del output  # dropped once the loss is taken, as the loop does
        stub_ms = self.clock.ms
        _, b_ms = watch.time(lambda: runner.backward(loss, release=False))
        return f_ms, stub_ms, b_ms


_GradLayout = tuple[nn.Parameter, Layout]


def _grad_layouts(params: list[nn.Parameter]) -> list[_GradLayout] | None:
    """Every gradient's parameter and layout, or ``None`` where one is not a plain strided
    tensor (a sparse gradient, or a tensor subclass such as FSDP2's ``DTensor``, which
    zeros of its shape would not stand for)."""
    grads = [(p, p.grad) for p in params if p.grad is not None]
    if any(type(g) is not torch.Tensor or g.layout != torch.strided for _, g in grads):
        return None
    return [(p, layout_of(g)) for p, g in grads]


def _give_grads(layouts: list[_GradLayout]) -> None:
    """Zero gradients laid out as the first step's: the optimizer's step allocates and
    takes as long on them (its figures are its peak above the gradients, and its time on
    the timed steps, whose gradients are the backward's)."""
    for p, layout in layouts:
        p.grad = zeros_laid_out(layout)


def time_outside(
    runner: StepRunner,
    units: list[nn.Module],
    state: ModelState,
    watch: Stopwatch,
    *,
    warmup: int,
    repeats: int,
    tolerance: float = 0.0,
    optimizer: bool = True,
    units_ms: float = 0.0,
    clock: StubClock | None = None,
) -> OutsideTimes:
    """Run stub steps of the runner's loop (see the module docstring): with an optimizer
    two metered ones first, then ``warmup`` un-timed and up to ``repeats`` timed ones
    (fewer once the samples settle within ``tolerance``). ``optimizer=False`` leaves
    the optimizer out (its figures 0, no parameter's step metered): a variant of the
    outside code (a chunked head) changes the micro-batch, not the optimizer's step.

    ``clock``: what the units gave in a step before (:class:`~.stub.StubClock`), so that
    no step here runs them; without one, the first step runs them.

    The first metered step is a whole stub step, so it is the warm-up run too; the other
    metered ones step the optimizer alone, over zero gradients laid out as that step's
    (:func:`_give_grads`): neither the units nor the outside code run for them (a
    language model's head, forward and backward, was a third of every such step). The
    tolerance is a fraction of the step's time, the units' own (``units_ms``) included:
    the outside code of a CNN (a pooling and a linear layer, 1% of its step) would
    otherwise need its spread within 5% of its own few milliseconds, and take every
    repeat for a figure the step hardly sees."""
    stepping = optimizer and runner.optimizer is not None
    steps, why = (_param_steps(runner) if stepping else
                  (None, "no optimizer" if runner.optimizer is None else "not in this run"))
    whole = 2 if stepping else 0  # metered whole steps
    metered = whole + (steps is not None)
    warmup = max(warmup - metered, 0)
    param_peaks: dict[int, int] = {}
    fwd: list[float] = []
    bwd: list[float] = []
    opt: list[float] = []
    total: list[float] = []
    peaks: list[int] = []
    with stubbed(units, clock) as clock:
        making = _Gradients(runner, state, clock, watch)
        for r in range(metered + warmup + repeats):
            f_ms, stub_ms, b_ms = making.step(first=r == 0, optimizer_only=0 < r < metered)
            o_ms = 0.0
            if r < whole:
                with MemoryMeter(device_type=runner.device_type) as meter:
                    runner.optimizer_step(whole=True)
                peaks.append(meter.peak_bytes)
            elif r < metered:
                assert steps is not None
                param_peaks = _meter_each(steps, runner)
            elif stepping and (in_backward := runner.in_backward) is not None:
                _, o_ms = watch.time(lambda s=in_backward: _step_each(s, runner))
            elif stepping:
                _, o_ms = watch.time(runner.optimizer_step)
            if r >= metered + warmup:
                fwd.append(max(f_ms - stub_ms, 0.0))
                bwd.append(b_ms)
                opt.append(o_ms)
                total.append(fwd[-1] + b_ms + o_ms)
                if parts_settled(total, fwd, bwd, repeats=repeats, tolerance=tolerance,
                                 scale=min(total) + units_ms):
                    break
    clear_grads(state.params)
    state_bytes = optimizer_state_bytes(runner.optimizer) if stepping else 0
    step_peak = max(peaks[1], peaks[0] - state_bytes) if peaks else 0
    return OutsideTimes(median(fwd), median(bwd), median(opt), state_bytes, step_peak,
                        param_peaks, why)

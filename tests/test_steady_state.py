"""The optimizer's state made ahead (remat/measurement/steady.py): one measured step and
the next one's forward measure what two whole steps measure, the first (which creates
the state while the gradients are alive) included.

Every optimizer class made ahead (``STEADY_OPTIMIZERS``) is measured here both ways, on
a planned step, with both instruments: the allocator's peak is the same, and the
dispatch-level meter's is the same or higher by at most the 0-dim state tensors
(``step``, NAdam's ``mu_product``) that ``torch.tensor(0.0)`` makes without a dispatch
the meter sees, which the steady path reads from the state as it stands (a fused or
capturable optimizer makes them on the device through the dispatcher: equal there).
Where the state made ahead would not be the step's own (a parameter without a
gradient), or where it cannot be established (a gradient scaler, gradients zeroed in
place, a class not measured, the optimizer stepped in backward), two whole steps run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import remat
import remat.measurement.step as step_module
from remat import models
from remat.measurement.runner import Carry, LossFn, StepRunner
from remat.measurement.state import training_session
from remat.measurement.steady import STEADY_OPTIMIZERS
from remat.measurement.step import StepMeasurement
from remat.tune.verify import measure_plan

Make = Callable[[nn.Module], torch.optim.Optimizer]

OPTIMIZERS: dict[str, Make] = {
    "AdamW foreach": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True),
    "AdamW fused": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
    "Adam one tensor at a time": lambda m: torch.optim.Adam(m.parameters(), foreach=False),
    "Adam amsgrad": lambda m: torch.optim.Adam(m.parameters(), amsgrad=True),
    "SGD momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "SGD nesterov, weight decay": lambda m: torch.optim.SGD(
        m.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "NAdam": lambda m: torch.optim.NAdam(m.parameters()),
    "RAdam": lambda m: torch.optim.RAdam(m.parameters()),
    "Adamax": lambda m: torch.optim.Adamax(m.parameters()),
    "Adagrad": lambda m: torch.optim.Adagrad(m.parameters()),
    "RMSprop centered, momentum": lambda m: torch.optim.RMSprop(
        m.parameters(), momentum=0.9, centered=True),
    "Adadelta": lambda m: torch.optim.Adadelta(m.parameters()),
    "Rprop": lambda m: torch.optim.Rprop(m.parameters()),
    "ASGD": lambda m: torch.optim.ASGD(m.parameters()),
    "Adafactor": lambda m: torch.optim.Adafactor(m.parameters()),
}
# Every class made ahead is measured on every model (below), in its default form at least.
assert {type(make(nn.Linear(1, 1))) for make in OPTIMIZERS.values()} == set(STEADY_OPTIMIZERS)

# The whole table on the smallest model; the common and the lazily made ones on the rest.
CASES = [("mlp", name) for name in OPTIMIZERS] + [
    (model, name) for model in ("cnn", "gpt", "hf-gpt2")
    for name in ("AdamW foreach", "AdamW fused", "SGD momentum", "Rprop", "Adafactor")]


@dataclass
class _Runs:
    forwards: int = 0
    backwards: int = 0
    optimizer_steps: int = 0


@contextmanager
def _counting(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[_Runs]:
    """Counts of the model's training forwards, its backwards and the optimizer's steps."""
    runs = _Runs()

    def forward(_m: nn.Module, _a: object, _o: object) -> None:
        runs.forwards += torch.is_grad_enabled()

    def backward(_p: torch.Tensor) -> None:  # the first parameter's gradient complete
        runs.backwards += 1

    def step(_o: object, _a: object, _k: object) -> None:
        runs.optimizer_steps += 1

    first = next(model.parameters())
    handles = [model.register_forward_hook(forward),
               first.register_post_accumulate_grad_hook(backward),
               optimizer.register_step_pre_hook(step)]
    try:
        yield runs
    finally:
        for h in handles:
            h.remove()


def _both_ways(model: nn.Module, batch: object, loss_fn: LossFn | None,
               optimizer: torch.optim.Optimizer, loop: remat.Loop, plan: object = None
               ) -> tuple[StepMeasurement, StepMeasurement, _Runs]:
    """The plan's step measured from the state made ahead and as two whole steps, and
    what the first ran."""
    if plan is None:
        plan = remat.solve(model, batch, None, method="all", loss_fn=loss_fn,
                           optimizer=optimizer, loop=loop, verify=False)
    with _counting(model, optimizer) as runs:
        steady = measure_plan(model, batch, plan, loss_fn=loss_fn, optimizer=optimizer,
                              loop=loop)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step_module, "make_state_ahead", lambda *_: None)
        whole = measure_plan(model, batch, plan, loss_fn=loss_fn, optimizer=optimizer,
                             loop=loop)
    return steady, whole, runs


def _state_keys(optimizer: torch.optim.Optimizer) -> set[tuple[int, str]]:
    return {(id(p), k) for p, s in optimizer.state.items() for k in s}


def _unseen_scalars(optimizer: torch.optim.Optimizer, model: nn.Module, batch: object,
                    loss_fn: LossFn | None) -> int:
    """Bytes of the 0-dim CPU state tensors a first step creates by ``torch.tensor(0.0)``
    (a fused or capturable optimizer makes them through the dispatcher), which the
    dispatch-level meter does not see made: one whole step of the loop, in a session
    that puts everything back."""
    if any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups):
        return 0
    before = _state_keys(optimizer)
    with training_session(model, optimizer):
        StepRunner(model, batch, loss_fn, optimizer, remat.Loop(), "cpu").optimizer_step_cycle(
            Carry())
        return sum(t.nbytes for p, s in optimizer.state.items() for k, t in s.items()
                   if (id(p), k) not in before and isinstance(t, torch.Tensor)
                   and t.dim() == 0 and t.device.type == "cpu")


@pytest.mark.parametrize(("model_name", "optimizer_name"), CASES)
def test_one_step_from_the_state_made_ahead_measures_two_whole_steps(
        model_name: str, optimizer_name: str) -> None:
    """The same peak as two whole steps (the allocator's exactly; the dispatch meter's
    never lower, and higher by at most the 0-dim state it cannot see made), from one
    forward, one backward and one optimizer step fewer."""
    ref = models.build(model_name, size="tiny", seed=0)
    optimizer = OPTIMIZERS[optimizer_name](ref.model)
    before = _state_keys(optimizer)  # Adagrad makes its state when it is made
    steady, whole, runs = _both_ways(ref.model, ref.batch, ref.loss_fn, optimizer, remat.Loop())
    # The optimizer step over zero gradients, then one step and, where it can set the
    # peak, the next one's forward (tests/test_planning_cost.py: when it is skipped).
    assert (runs.backwards, runs.optimizer_steps) == (1, 2) and runs.forwards in (1, 2)
    assert steady.allocator_peak_bytes == whole.allocator_peak_bytes
    unseen = _unseen_scalars(optimizer, ref.model, ref.batch, ref.loss_fn)
    assert 0 <= steady.peak_bytes - whole.peak_bytes <= unseen
    assert _state_keys(optimizer) == before  # the state made ahead is gone with the session


@pytest.mark.parametrize("loop", [remat.Loop(keep_output=False),
                                  remat.Loop(accumulation_steps=2)],
                         ids=["Trainer-style", "2 micro-batches"])
def test_other_loops_measure_the_same_from_the_state_made_ahead(loop: remat.Loop) -> None:
    """A loop that drops the output and one that accumulates: the same peaks too."""
    ref = models.build("hf-gpt2", size="tiny", seed=0)
    optimizer = torch.optim.AdamW(ref.model.parameters(), lr=1e-3, fused=True)
    steady, whole, runs = _both_ways(ref.model, ref.batch, ref.loss_fn, optimizer, loop)
    assert runs.backwards == loop.accumulation_steps
    assert (steady.peak_bytes, steady.allocator_peak_bytes) == (
        whole.peak_bytes, whole.allocator_peak_bytes)


class _Unused(nn.Module):
    """A trainable parameter that no step gives a gradient: a real step makes no state
    for it, the state made ahead would."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*(nn.Linear(64, 64) for _ in range(3)))
        self.spare = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _square(out: torch.Tensor, _batch: object) -> torch.Tensor:
    return (out * out).mean()


def test_state_made_for_a_parameter_the_step_leaves_alone_is_dropped() -> None:
    """The step gives the spare parameter no gradient: the state made ahead is dropped
    and two whole steps measured, the same peaks as the two whole steps alone."""
    torch.manual_seed(0)
    model, x = _Unused(), torch.randn(32, 64)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    plan = remat.solve(model, x, None, method="all", loss_fn=_square, optimizer=optimizer,
                       units=["body.0", "body.1", "body.2"], verify=False)
    steady, whole, runs = _both_ways(model, x, _square, optimizer, remat.Loop(), plan)
    # The step made ahead, one step (and the next forward, where it can set the peak:
    # not here); then two whole steps.
    assert (runs.forwards, runs.backwards, runs.optimizer_steps) == (1 + 2, 1 + 2, 2 + 2)
    assert (steady.peak_bytes, steady.allocator_peak_bytes) == (
        whole.peak_bytes, whole.allocator_peak_bytes)
    assert not optimizer.state


class _Later(torch.optim.AdamW):
    """A subclass: it may step otherwise, so it is not taken for its base class."""


@pytest.mark.parametrize(("loop", "make"), [
    (remat.Loop(set_to_none=False), lambda m: torch.optim.AdamW(m.parameters())),
    (remat.Loop(grad_scaler=True, autocast="bfloat16"),
     lambda m: torch.optim.AdamW(m.parameters())),
    (remat.Loop(), lambda m: _Later(m.parameters())),
    (remat.Loop(keep_output=False, optimizer_in_backward=True),
     lambda m: torch.optim.AdamW(m.parameters())),
], ids=["zeroed in place", "GradScaler", "a subclass", "optimizer in backward"])
def test_where_it_cannot_be_established_two_whole_steps_run(
        loop: remat.Loop, make: Make) -> None:
    """No state made ahead: two whole steps (two backwards)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(3)))
    x = torch.randn(8, 32)
    optimizer = make(model)
    plan = remat.solve(model, x, None, method="all", loss_fn=_square, optimizer=optimizer,
                       loop=loop, verify=False)
    with _counting(model, optimizer) as runs:
        measure_plan(model, x, plan, loss_fn=_square, optimizer=optimizer, loop=loop)
    assert runs.backwards == 2


def test_a_warm_up_makes_the_state_as_training_does() -> None:
    """With a warm-up (``remat.measure``'s default) the state is the warm-up's own: the
    measured steps run whole, as before."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(3)))
    optimizer = torch.optim.Adam(model.parameters())
    with _counting(model, optimizer) as runs:
        remat.measure(model, torch.randn(8, 32), loss_fn=_square, optimizer=optimizer,
                      repeats=0, held=False)
    assert runs.backwards == 1 + 2

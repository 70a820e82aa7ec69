"""The optimizer's state made before a measured step, so that one step is the steady state.

``torch.optim`` optimizers create their state lazily, in the first ``step()`` that sees
a parameter's gradient: a training run's first step starts without it, the second with
it, and a measured step had to run two whole steps to see both (:mod:`.step`). Where the
state is made ahead instead, by one ``step()`` over zero gradients before the
instruments start, the measured step starts as every later step does, and one step and
the next one's forward (what the loop carries into it) measure it, one backward and one
optimizer step less (:func:`remat.measurement.step.measure_step`).

That is the same peak only where the optimizer's steps are alike from the first on: the
state the first step creates, while the gradients are alive, is the state every later
step updates in place, with the same temporaries. It is established by measurement, per
optimizer class, in ``tests/test_steady_state.py`` (both paths' peaks, both
instruments, several models): only those classes (:data:`STEADY_OPTIMIZERS`), exactly
(a subclass may step otherwise), are made ahead. Everything else measures two whole
steps as before: closure-based optimizers (LBFGS), a gradient scaler (its own lazy
state, steps skipped on overflow), the optimizer stepped in backward (its per-parameter
optimizers), gradients zeroed in place, an optimizer holding a gradient already.

The state is made only for the parameters that receive a gradient in the measured step:
which ones is known only once it ran, so the zero gradients go to every trainable
parameter of the optimizer, and :class:`StateAhead` checks afterwards that the step gave
each of them a strided gradient of its own dtype (a parameter left without one would
hold state the real step never makes; a sparse gradient makes other state). Where it did
not, the caller drops the state and measures two whole steps.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from remat.measurement.runner import StepRunner
from remat.measurement.state import ModelState

__all__ = ["STEADY_OPTIMIZERS", "StateAhead", "make_state_ahead"]

log = logging.getLogger("remat")

# The classes whose first step's peak the steady step's covers, measured (module
# docstring). Muon (2-D parameters only), SparseAdam (sparse gradients) and LBFGS (a
# closure) are not among them.
STEADY_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adamax, torch.optim.Adagrad, torch.optim.RMSprop,
    torch.optim.Adadelta, torch.optim.Rprop, torch.optim.ASGD, torch.optim.Adafactor,
)


@dataclass
class StateAhead:
    """The optimizer's state made ahead for ``given`` (ids of parameters), and what the
    measured step's ``optimizer.step()`` then saw (:meth:`watching`)."""

    optimizer: torch.optim.Optimizer
    given: frozenset[int]
    seen: dict[int, bool] = field(default_factory=dict)  # id -> a gradient like the zeros

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Record, at every ``optimizer.step()``, which parameters have a gradient."""
        def hook(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
            for p in _params(optimizer):
                if p.grad is not None:
                    self.seen[id(p)] = (p.grad.layout == torch.strided
                                        and p.grad.dtype == p.dtype)

        handle = self.optimizer.register_step_pre_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    def held(self) -> bool:
        """Whether the measured step stepped exactly the parameters given zero gradients,
        each with a gradient like them: the state made ahead is the step's own."""
        return set(self.seen) == set(self.given) and all(self.seen.values())


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _why_not(runner: StepRunner) -> str | None:
    """Why the state cannot be made ahead for ``runner``'s loop, or ``None``."""
    optimizer, loop = runner.optimizer, runner.loop
    assert optimizer is not None
    if type(optimizer) not in STEADY_OPTIMIZERS:
        return f"{type(optimizer).__name__} is not among the optimizers measured alike"
    if runner.scaler is not None or runner.in_backward is not None:
        return "a gradient scaler or the optimizer in backward"
    if not loop.set_to_none:
        return "gradients zeroed in place"
    params = _params(optimizer)
    if any(p.grad is not None for p in params):
        return "a parameter of the optimizer holds a gradient"
    if not {id(p) for p in params} <= {id(p) for p in runner.params}:
        return "a parameter of the optimizer is not the model's (not snapshotted)"
    return None


def make_state_ahead(runner: StepRunner, state: ModelState) -> StateAhead | None:
    """One ``optimizer.step()`` over zero gradients, which creates the state the first
    step would; the parameters' values put back after it (the measured step starts from
    the model's own, as training's first does). ``None`` where it cannot be made
    (module docstring): the caller measures two whole steps.

    Price: the optimizer step over every parameter (no forward or backward) and a copy of
    the parameters back from the host snapshot; it holds the gradients and the state at
    once, as the step's own optimizer step does.
    """
    if runner.optimizer is None:
        return None  # no state to make: the loop may repeat itself as it is
    why = _why_not(runner)
    if why is not None:
        log.debug("measured step: no optimizer state made ahead, two whole steps (%s)", why)
        return None
    optimizer = runner.optimizer
    given = [p for p in _params(optimizer) if p.requires_grad]
    try:
        for p in given:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for p in given:
            p.grad = None
    state.restore_param_values()
    return StateAhead(optimizer, frozenset(id(p) for p in given))

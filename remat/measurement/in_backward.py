"""The optimizer stepped in backward: one optimizer per parameter, stepped as soon as that
parameter's gradient is complete, the gradient then freed.

This is torchtune's and PyTorch's pattern ("How to save memory by fusing the optimizer
step into the backward pass"): a ``Tensor.register_post_accumulate_grad_hook`` on each
parameter runs its own optimizer's ``step()`` and sets ``.grad`` to ``None``, so no
parameter gradient lives beyond the backward phase that made it, and none accumulates
to the end of the backward pass (``Loop(optimizer_in_backward=True)``).

remat makes the per-parameter optimizers from the one the user has
(:class:`ParamSteps`): the same ``torch.optim`` class, each built on one parameter
with that parameter's group's hyperparameters, read again before every step (so an LR
scheduler on the user's optimizer keeps working), and all of them sharing the user's
optimizer's ``state``: the state lives where it did, ``optimizer.state_dict()`` saves
it, and remat's snapshot (:mod:`.state`) restores it. Only optimizers whose constructor
takes the parameters and their hyperparameters can be split so (``SGD``, ``Adam``,
``AdamW``...); LBFGS (its step re-evaluates the whole loss) and optimizers from outside
``torch.optim`` are refused.

The :class:`~remat.measurement.runner.StepRunner` installs them around the backward
passes of the steps it measures; ``remat.optimizer_in_backward`` installs them for
training. While remat measures a model, the hooks the user installed are suspended
(:func:`suspended`, entered by :func:`~remat.measurement.state.training_session`): remat
runs the loop it was told, and must not step the user's model behind its own back.
:func:`steps_in_backward` tells the planned model's loop checks
(:mod:`remat.runtime.guard`) whether a parameter is stepped in backward: hooks are
installed on it, or remat is measuring it (its steps install their own).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from remat.core.errors import ArgumentError

__all__ = ["ParamSteps", "installed_on", "steps_in_backward", "suspended"]

# Classes of torch.optim that take params and hyperparameters but cannot be split.
_REFUSED = {
    "LBFGS": "its step() needs a closure that re-evaluates the whole loss, for all "
             "parameters at once",
}
_NOT_HYPERPARAMETERS = ("params", "param_names")

# Every ParamSteps whose hooks are installed (remat's measured steps and the user's).
_INSTALLED: weakref.WeakSet[ParamSteps] = weakref.WeakSet()
# id(param) -> how many measuring sessions (nested) hold it: remat runs its own loop there.
_MEASURED: dict[int, int] = {}


def _refusal(optimizer: Any) -> str | None:
    """Why ``optimizer`` cannot be split per parameter, or ``None`` when it can."""
    cls = type(optimizer)
    name = cls.__name__
    if not isinstance(optimizer, torch.optim.Optimizer) or not cls.__module__.startswith(
            "torch.optim"):
        return (f"{name} is not one of torch.optim's optimizers, whose constructor remat "
                "knows takes the parameters and their hyperparameters")
    if name in _REFUSED:
        return f"{name}: {_REFUSED[name]}"
    params = list(inspect.signature(cls.__init__).parameters)
    if len(params) < 2 or params[1] != "params":
        return f"{name}'s constructor does not take the parameters first"
    return None


class ParamSteps:
    """One optimizer per parameter of ``optimizer``, to step each in backward.

    Args:
        optimizer: a ``torch.optim`` optimizer over the parameters to step (its class,
            its groups' hyperparameters and its ``state`` are used; it is not changed).

    Raises:
        ArgumentError: an optimizer remat does not know how to split (LBFGS, one from
            outside ``torch.optim``), naming it and the fix.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        why = _refusal(optimizer)
        if why is not None:
            raise ArgumentError(
                f"optimizer={type(optimizer).__name__} cannot be stepped one parameter at a "
                f"time in backward (Loop(optimizer_in_backward=True)): {why}. Use a "
                "torch.optim optimizer that takes params and hyperparameters (SGD, Adam, "
                "AdamW...), or step it after backward: loop=remat.Loop() and "
                "optimizer.step() in your loop")
        self.optimizer = optimizer
        cls = type(optimizer)
        accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
        # id(param) -> (param, its group in the user's optimizer, its own optimizer)
        self._steps: dict[int, tuple[torch.Tensor, dict[str, Any], torch.optim.Optimizer]] = {}
        for group in optimizer.param_groups:
            kwargs = {k: v for k, v in group.items() if k in accepted}
            for p in group["params"]:
                try:
                    own = cls([p], **kwargs)
                except Exception as err:  # the class's own check of its hyperparameters
                    raise ArgumentError(
                        f"optimizer={cls.__name__}: one {cls.__name__} per parameter could "
                        f"not be made from its group's hyperparameters ({err}); step it "
                        "after backward instead: loop=remat.Loop()") from err
                self._steps[id(p)] = (p, group, own)
        self._handles: list[Any] = []
        self.active = True  # False while suspended: the hooks then do nothing

    def __repr__(self) -> str:
        state = "installed" if self.installed else "not installed"
        return (f"ParamSteps({type(self.optimizer).__name__}, {len(self._steps)} parameters, "
                f"{state})")

    # -- what it steps -------------------------------------------------------------
    def covers(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of the optimizer's parameters."""
        return id(param) in self._steps

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for p, _, _ in self._steps.values()]

    def step(self, param: torch.Tensor) -> None:
        """``param``'s own optimizer's ``step()``, with its group's hyperparameters as they
        are now and the user's optimizer's state (which ``load_state_dict`` may have
        replaced)."""
        _, group, own = self._steps[id(param)]
        own.param_groups[0].update(
            {k: v for k, v in group.items() if k not in _NOT_HYPERPARAMETERS})
        own.state = self.optimizer.state
        own.step()
        # The user's optimizer is never stepped itself: an LR scheduler on it checks this
        # flag (set by its wrapper of optimizer.step) and would warn that it steps first.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

    def _hook(self, param: torch.Tensor) -> None:
        if self.active:
            self.step(param)
            param.grad = None

    # -- hooks -----------------------------------------------------------------------
    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self) -> None:
        """Register the hooks: from now on each backward steps every parameter as its
        gradient is complete, and frees the gradient."""
        if self._handles:
            return
        for p, _, _ in self._steps.values():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook))
        _INSTALLED.add(self)

    def remove(self) -> None:
        """Remove the hooks: backward leaves gradients in ``.grad`` again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        _INSTALLED.discard(self)

    @contextlib.contextmanager
    def hooked(self) -> Iterator[None]:
        """The hooks installed inside the block (removed after, also on error)."""
        self.install()
        try:
            yield
        finally:
            self.remove()


def installed_on(params: Iterable[torch.Tensor]) -> list[ParamSteps]:
    """The installed :class:`ParamSteps` that step any of ``params``."""
    ids = {id(p) for p in params}
    return [s for s in list(_INSTALLED) if any(id(p) in ids for p in s.params)]


def steps_in_backward(param: torch.Tensor) -> bool:
    """Whether ``param`` is stepped in backward now: hooks are installed on it (active or
    suspended), or remat is measuring it (:func:`suspended`), whose measured steps run
    the loop they were told. A few set look-ups: the planned model's forward asks."""
    return id(param) in _MEASURED or any(s.covers(param) for s in list(_INSTALLED))


@contextlib.contextmanager
def suspended(params: Iterable[torch.Tensor]) -> Iterator[list[ParamSteps]]:
    """Inside the block, the installed hooks that step any of ``params`` do nothing (remat
    measures the loop it was told), and :func:`steps_in_backward` says they are stepped;
    yields the hooks suspended."""
    params = list(params)
    found = [s for s in installed_on(params) if s.active]
    for s in found:
        s.active = False
    ids = [id(p) for p in params]
    for i in ids:
        _MEASURED[i] = _MEASURED.get(i, 0) + 1
    try:
        yield found
    finally:
        for s in found:
            s.active = True
        for i in ids:
            left = _MEASURED.pop(i) - 1
            if left:
                _MEASURED[i] = left

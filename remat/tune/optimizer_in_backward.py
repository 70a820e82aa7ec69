"""``remat.optimizer_in_backward``: step each parameter in backward and free its gradient.

The set-up of ``Loop(optimizer_in_backward=True)`` for training: one optimizer per
parameter, stepped by a hook as soon as the parameter's gradient is complete, the
gradient then freed (:mod:`remat.measurement.in_backward` has the mechanics, which
remat's own measured steps use too). No parameter gradient then outlives the backward
phase that made it: on a model whose peak sits at the end of backward or in the
optimizer step, that is every gradient less.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from remat.core.checks import check_model
from remat.core.errors import ArgumentError
from remat.measurement.in_backward import ParamSteps, installed_on

__all__ = ["optimizer_in_backward"]

OptimizerSpec = (torch.optim.Optimizer | type[torch.optim.Optimizer]
                 | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer])


def optimizer_in_backward(model: nn.Module, optimizer: OptimizerSpec,
                          **hyperparameters: Any) -> ParamSteps:
    """Step ``model``'s parameters in the backward pass, each as soon as its gradient is
    complete, and free the gradient then (``Tensor.register_post_accumulate_grad_hook``).

    The training loop then has no ``optimizer.step()`` and no ``zero_grad()``::

        steps = remat.optimizer_in_backward(model, torch.optim.AdamW, lr=3e-4)
        loop = remat.Loop(optimizer_in_backward=True, keep_output=False)
        plan = remat.solve(model, batch, "8GB", loop=loop, optimizer=steps.optimizer)
        remat.apply_plan(model, plan)
        for batch in loader:
            loss = loss_fn(model(**batch), batch)
            loss.backward()        # every parameter stepped, every gradient freed

    Args:
        model: the model to train; every trainable parameter must be in the optimizer.
        optimizer: a ``torch.optim`` optimizer over the model's parameters (its class,
            groups and hyperparameters are used; its ``state`` holds the state, so
            ``optimizer.state_dict()`` saves it and an LR scheduler on it keeps
            working), or an optimizer class (``torch.optim.AdamW``, made over the
            trainable parameters with ``hyperparameters``), or a function of the
            trainable parameters that returns one.
        hyperparameters: for an optimizer class (``lr=3e-4``...).

    Returns:
        The handle: ``.optimizer`` (pass it as ``optimizer=`` with
        ``loop=remat.Loop(optimizer_in_backward=True)`` to ``remat.solve``,
        ``remat.measure`` and ``remat.estimate``, which suspend the hooks while they
        measure and leave them as they were), ``.remove()`` takes the hooks off.

    Raises:
        ArgumentError: an optimizer remat cannot split per parameter (LBFGS, one from
            outside ``torch.optim``), trainable parameters the optimizer does not hold,
            hooks installed already, or hyperparameters given with an optimizer instance.

    Not with gradient accumulation, a ``GradScaler``, or **gradient clipping over all
    parameters** (``clip_grad_norm_`` needs every gradient at once, and each is gone
    before the next exists): remat cannot see clipping in your loop, so leave it out.
    """
    check_model(model, "optimizer_in_backward()")
    trainable = [p for p in model.parameters() if p.requires_grad]
    built = _optimizer(optimizer, trainable, hyperparameters)
    if installed_on(trainable):
        raise ArgumentError(
            "optimizer_in_backward(): the model's parameters are stepped in backward already "
            "(an earlier remat.optimizer_in_backward); call .remove() on its handle first")
    steps = ParamSteps(built)  # refuses what it cannot split
    missed = [n for n, p in model.named_parameters() if p.requires_grad and not steps.covers(p)]
    if missed:
        raise ArgumentError(
            f"optimizer_in_backward(): the trainable parameters {missed[:3]}"
            f"{'...' if len(missed) > 3 else ''} are not in the optimizer, so nothing would "
            "step them or free their gradients; make the optimizer over model.parameters(), "
            "or set requires_grad=False on them")
    steps.install()
    return steps


def _optimizer(spec: Any, trainable: list[nn.Parameter],
               hyperparameters: dict[str, Any]) -> torch.optim.Optimizer:
    """The optimizer ``spec`` names: itself, its class made over ``trainable``, or what the
    function returns for them."""
    if isinstance(spec, torch.optim.Optimizer):
        if hyperparameters:
            raise ArgumentError(
                f"optimizer_in_backward(): hyperparameters {sorted(hyperparameters)} were given "
                f"with an optimizer instance ({type(spec).__name__}), which has its own; give "
                "them to its constructor, or pass the class: "
                f"optimizer_in_backward(model, torch.optim.{type(spec).__name__}, lr=...)")
        return spec
    if isinstance(spec, type) and issubclass(spec, torch.optim.Optimizer):
        return spec(trainable, **hyperparameters)
    if callable(spec) and not isinstance(spec, type):
        built = spec(trainable, **hyperparameters)
        if isinstance(built, torch.optim.Optimizer):
            return built
        raise ArgumentError(
            f"optimizer_in_backward(): the function {getattr(spec, '__name__', spec)!r} "
            f"returned {type(built).__name__}, not a torch.optim optimizer; return one made "
            "over the parameters it is given")
    raise ArgumentError(
        f"optimizer_in_backward() needs a torch.optim optimizer, its class or a function "
        f"that makes one, got {type(spec).__name__}; e.g. "
        "remat.optimizer_in_backward(model, torch.optim.AdamW, lr=3e-4)")

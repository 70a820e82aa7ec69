"""Checks of what users pass to remat's entry points, before any work starts.

Each check raises an :class:`ArgumentError` (a :class:`~remat.errors.RematError`)
that names the argument, what it got, and the fix. They look at types and shapes
of arguments only: they never call the user's model or loss, so the user's own
exceptions surface unchanged from where they are raised.

Profiling takes seconds to minutes, so everything that can be checked without the
profile (the budget's syntax, the method and its keyword names, the loop) is
checked before it starts: a typo costs nothing.
"""

from __future__ import annotations

import collections.abc
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from remat.errors import RematError
from remat.solver.budget import RelativeBudget, check_budget
from remat.solver.loop import Loop
from remat.solver.plan import Plan
from remat.solver.profile import Profile

__all__ = [
    "ArgumentError",
    "check_batch",
    "check_budget_arg",
    "check_inputs",
    "check_loop",
    "check_loss_fn",
    "check_method",
    "check_model",
    "check_optimizer",
    "check_plan",
    "check_profile_args",
]


class ArgumentError(RematError, TypeError):
    """An argument of the wrong kind: a path where a Plan goes, a string for an optimizer."""


def check_model(model: Any, where: str = "profile()") -> None:
    """``model`` must be a ``torch.nn.Module``."""
    from torch import nn

    if isinstance(model, nn.Module):
        return
    if isinstance(model, Profile):
        raise ArgumentError(f"{where} needs the model, got a Profile; a profile is what "
                            "remat.profile() returns, pass it to remat.solve() or remat.pareto()")
    raise ArgumentError(f"{where} needs model, a torch.nn.Module, got {_kind(model)}; pass "
                        "the model you train (e.g. remat.profile(model, batch))")


def check_batch(batch: Any, where: str = "profile()") -> None:
    """One micro-batch: a tensor, a tuple/list of inputs or a dict of keyword inputs.

    A loader, a generator or an iterator is refused: remat runs the batch many times,
    and an iterator would be used up (or yield other batches) on the way.
    """
    from torch.utils.data import DataLoader

    if batch is None:
        raise ArgumentError(f"{where} needs a sample batch (one micro-batch of what the model "
                            "takes), got None; e.g. batch = next(iter(train_loader))")
    if isinstance(batch, DataLoader) or isinstance(batch, collections.abc.Iterator):
        raise ArgumentError(
            f"{where} needs one sample batch, got {_kind(batch)}; remat runs the same batch "
            "several times, so pass one: batch = next(iter(loader))")


def check_loss_fn(loss_fn: Any, where: str = "profile()") -> None:
    """``loss_fn`` is ``None`` or a callable ``(output, batch) -> scalar``."""
    if loss_fn is not None and not callable(loss_fn):
        raise ArgumentError(
            f"{where}: loss_fn must be a callable loss_fn(output, batch) -> scalar Tensor, or "
            f"None to use the output's .loss; got {_kind(loss_fn)}")


def check_optimizer(optimizer: Any, where: str = "profile()") -> None:
    """``optimizer`` is ``None`` or an optimizer instance (``step()`` and ``param_groups``)."""
    if optimizer is None:
        return
    if isinstance(optimizer, (str, type)):
        raise ArgumentError(
            f"{where}: optimizer must be an optimizer instance, got {_kind(optimizer)}; create "
            "it first, e.g. optimizer=torch.optim.AdamW(model.parameters())")
    if not (callable(getattr(optimizer, "step", None)) and hasattr(optimizer, "param_groups")):
        raise ArgumentError(
            f"{where}: optimizer must be a torch.optim.Optimizer (with step() and "
            f"param_groups), got {_kind(optimizer)}")


def check_loop(loop: Any, where: str = "profile()") -> None:
    """``loop`` is ``None`` or a :class:`remat.Loop`."""
    if loop is None or isinstance(loop, Loop):
        return
    hint = "remat.Loop(**loop)" if isinstance(loop, Mapping) else (
        "remat.Loop.hf_trainer(training_args)" if hasattr(loop, "gradient_accumulation_steps")
        else "remat.Loop(accumulation_steps=..., autocast=...)")
    raise ArgumentError(f"{where}: loop must be a remat.Loop, got {_kind(loop)}; pass {hint}")


def check_budget_arg(budget: Any) -> int | RelativeBudget | None:
    """The budget read without the profile (``None`` stays ``None``); a
    :class:`~remat.errors.BudgetError` names a malformed one."""
    return None if budget is None else check_budget(budget)


def check_method(method: Any, params: Mapping[str, Any]) -> None:
    """``method`` names an algorithm that takes every keyword in ``params``."""
    from remat.solver.params import UnknownParameterError
    from remat.solver.solve import algorithm, algorithm_parameters

    algorithm(method)  # UnknownMethodError lists the methods
    unknown = sorted(set(params) - set(algorithm_parameters(method)))
    if unknown:
        accepted = list(algorithm_parameters(method))
        takes = f"its parameters are {accepted}" if accepted else "it takes no parameters"
        raise UnknownParameterError(f"method={method!r} does not take {unknown}; {takes}")


def check_plan(plan: Any, where: str = "apply_plan()") -> None:
    """``plan`` must be a :class:`~remat.solver.plan.Plan` (a path or a dict is refused
    with the call that loads it)."""
    if isinstance(plan, Plan):
        return
    if isinstance(plan, (str, os.PathLike, Path)):
        raise ArgumentError(f"{where} needs a remat Plan, got the path {str(plan)!r}; load it "
                            f"first: remat.Plan.from_json({str(plan)!r})")
    if isinstance(plan, Mapping):
        raise ArgumentError(f"{where} needs a remat Plan, got a dict; build it with "
                            "remat.Plan.from_dict(d)")
    raise ArgumentError(f"{where} needs a remat Plan (from remat.solve()), got {_kind(plan)}")


def check_profile_args(
    model: Any,
    sample_batch: Any,
    *,
    loss_fn: Any = None,
    optimizer: Any = None,
    loop: Any = None,
    where: str = "profile()",
) -> None:
    """Every check :func:`remat.profile` needs before it runs the model."""
    check_model(model, where)
    check_batch(sample_batch, where)
    check_loss_fn(loss_fn, where)
    check_optimizer(optimizer, where)
    check_loop(loop, where)


def check_inputs(
    where: str,
    model_or_profile: Any,
    sample_batch: Any,
    *,
    loss_fn: Any = None,
    optimizer: Any = None,
    loop: Any = None,
) -> None:
    """The checks of an entry point that takes a model (and profiles it) or a Profile."""
    if isinstance(model_or_profile, Profile):
        return
    check_model(model_or_profile, where)
    if sample_batch is None:
        call = where.removesuffix("()")
        raise ArgumentError(
            f"{where} needs a sample batch to profile the model: remat.{call}(model, "
            f"sample_batch, ...), or pass a Profile: remat.{call}(profile, ...)"
        )
    check_profile_args(model_or_profile, sample_batch, loss_fn=loss_fn, optimizer=optimizer,
                       loop=loop, where=where)


def _kind(value: Any) -> str:
    """``"the str 'adam'"``, ``"a generator"``: what a user passed, briefly."""
    name = type(value).__name__
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        text = repr(value)
        return f"the {name} {text[:60]}{'...' if len(text) > 60 else ''}"
    if isinstance(value, type):
        return f"the class {value.__name__} (not an instance)"
    article = "an" if name[:1].lower() in "aeiou" else "a"
    return f"{article} {name}"

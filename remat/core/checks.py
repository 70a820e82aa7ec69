"""Checks of what users pass to remat, before any work starts: one home for every stage.

Each check raises a :class:`~remat.core.errors.RematError` that names the argument,
what it got, and the fix: an :class:`~remat.core.errors.ArgumentError` for an argument
of the wrong kind, a :class:`~remat.core.errors.ParameterError` for a count or a time
out of range, a :class:`~remat.core.errors.BudgetError` for a budget. They look at
types and shapes of arguments only: they never call the user's model or loss, so the
user's own exceptions surface unchanged from where they are raised.

Profiling takes seconds to minutes, so everything that can be checked without the
profile (the budget's syntax, the method and its keyword names, the loop) is checked
before it starts: a typo costs nothing. (The method's check is the solver's own:
:func:`remat.solver.solve.check_method`.)

This floor imports no torch: a torch object can only exist once torch is imported, so
the checks look it up in ``sys.modules`` instead of importing it.
"""

from __future__ import annotations

import collections.abc
import inspect
import math
import numbers
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from remat.core.budget import Budget, check_budget
from remat.core.errors import ArgumentError, BudgetError, LoopError, ParameterError, ProfileError
from remat.core.loop import Loop, loop_code
from remat.core.plan import Plan
from remat.core.profile import Profile

__all__ = [
    "check_batch",
    "check_budget_arg",
    "check_budget_bytes",
    "check_count",
    "check_flag",
    "check_head_setting",
    "check_inputs",
    "check_loop",
    "check_loss_fn",
    "check_model",
    "check_not_lazy",
    "check_not_meta",
    "check_optimizer",
    "check_plan",
    "check_profile_args",
    "check_seconds",
    "check_timing",
    "why_not_callable_with",
]


def check_count(name: str, value: object, *, lo: int, hi: int | None = None,
                meaning: str = "", owner: str = "") -> int:
    """``value`` when it is an int (not a bool) in ``[lo, hi]``; else :class:`ParameterError`.

    The message reads ``"uniform needs k, an int with 1 <= k <= 12 (the number of
    units), got k=13"``.
    """
    problem = _count_problem(name, value, lo=lo, hi=hi, meaning=meaning, owner=owner)
    if problem is not None:
        raise ParameterError(problem)
    return int(value)


def _count_problem(name: str, value: object, *, lo: int, hi: int | None = None,
                   meaning: str = "", owner: str = "") -> str | None:
    """:func:`check_count`'s message for ``value``, or ``None`` when it is fine."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if ok and lo <= value and (hi is None or value <= hi):
        return None
    bound = f"{lo} <= {name}" + (f" <= {hi}" if hi is not None else "")
    who = f"{owner} needs" if owner else "needs"
    note = f" ({meaning})" if meaning else ""
    return f"{who} {name}, an int with {bound}{note}, got {name}={value!r}"


def check_seconds(name: str, value: object, *, owner: str = "") -> float:
    """``value`` when it is a finite number of seconds > 0; else :class:`ParameterError`."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not math.isfinite(float(value)) or float(value) <= 0:
        who = f"{owner} needs" if owner else "needs"
        raise ParameterError(
            f"{who} {name}, a finite number of seconds > 0, got {name}={value!r}"
        )
    return float(value)


def check_flag(name: str, value: object, *, owner: str = "") -> bool:
    """``value`` when it is a bool; else :class:`ArgumentError` (``strict="yes"`` would
    read as true, and ``strict="no"`` too)."""
    if not isinstance(value, bool):
        who = f"{owner}: " if owner else ""
        raise ArgumentError(f"{who}{name} must be True or False, got {name}={value!r}")
    return value


def check_timing(warmup: object, repeats: object, tolerance: object = None, *,
                 min_repeats: int = 1, where: str = "profile()") -> None:
    """The timing settings of :func:`remat.profile` (``tolerance`` too) and
    :func:`remat.measure` (``tolerance=None``): whole counts (not bools) and a fraction.

    A :class:`~remat.core.errors.ProfileError`, as these functions have always raised
    for a count out of range, that names the argument and its valid values.
    """
    untimed = "; 0 for no timing" if min_repeats == 0 else ""
    for problem in (
        _count_problem("warmup", warmup, lo=0, meaning="un-timed runs before the timed ones",
                       owner=where),
        _count_problem("repeats", repeats, lo=min_repeats,
                       meaning=f"timed runs whose median is taken{untimed}", owner=where),
    ):
        if problem is not None:
            raise ProfileError(problem)
    if tolerance is None:
        return
    number = isinstance(tolerance, numbers.Real) and not isinstance(tolerance, bool)
    if not number or not 0 <= float(tolerance) < 1:  # NaN fails both comparisons
        raise ProfileError(
            f"{where} needs tolerance, a number with 0 <= tolerance < 1 (within this fraction "
            "of a time the runs taken may settle its median; 0 takes every repeat), got "
            f"tolerance={tolerance!r}")


def why_not_callable_with(fn: Any, count: int) -> str | None:
    """Why ``fn`` cannot be called with ``count`` positional arguments (``"getcwd() cannot
    be called with 2 positional arguments"``), or ``None`` when it can or its signature is
    not known (some builtins): a mismatch then surfaces where it is called, as before.
    Read from the signature: ``fn`` is not called."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*range(count))
    except TypeError:
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        return f"{name}{signature} cannot be called with {count} positional argument" + (
            "s" if count != 1 else "")
    return None


def check_budget_bytes(budget_bytes: object) -> int | None:
    """``budget_bytes`` when it is ``None`` or an int of bytes; else :class:`BudgetError`.

    Algorithms take whole bytes; ``solve_profile`` and :func:`parse_budget` accept
    ``"8GB"`` or ``"60%"`` and convert them.
    """
    if budget_bytes is None:
        return None
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, numbers.Integral):
        raise BudgetError(
            f"budget_bytes={budget_bytes!r} is not an int of bytes; pass an int, or a string "
            "such as '8GB' or '60%' to solve_profile() (parse_budget() converts them)"
        )
    return int(budget_bytes)


def check_model(model: Any, where: str = "profile()") -> None:
    """``model`` must be a ``torch.nn.Module``."""
    nn = sys.modules.get("torch.nn")  # a module exists only once torch is imported
    if nn is not None and isinstance(model, nn.Module):
        return
    if isinstance(model, Profile):
        raise ArgumentError(f"{where} needs the model, got a Profile; a profile is what "
                            "remat.profile() returns, pass it to remat.solve() or remat.pareto()")
    call = f"remat.{where.removesuffix('()')}(model, ...)" if where.endswith("()") else where
    raise ArgumentError(f"{where} needs model, a torch.nn.Module, got {_kind(model)}; pass "
                        f"the model you train ({call})")


def check_not_meta(model: Any, where: str = "profile()") -> None:
    """``model``'s parameters and buffers must hold data: none may be on the ``meta`` device.

    A model built under ``torch.device("meta")`` (or with ``init_empty_weights``) has
    shapes but no storage, so a step of it allocates almost nothing: profiled, it would
    count almost no activation memory and "fit" any budget. Read duck-typed (``.device.type``),
    so this floor needs no torch.
    """
    for tensors in (model.parameters(), model.buffers()):
        for t in tensors:
            if getattr(getattr(t, "device", None), "type", None) == "meta":
                raise ArgumentError(
                    f"{where}: the model's parameters are on the 'meta' device (built under "
                    "torch.device('meta') or with init_empty_weights): they hold no data, so "
                    "a training step cannot be run or measured. Materialise the model first: "
                    "model.to_empty(device='cpu') (or 'cuda'), then initialise or load its "
                    "weights (model.load_state_dict(...)); or build it on a real device")


def check_not_lazy(model: Any, where: str = "profile()") -> None:
    """``model`` must have no uninitialised (lazy) parameters: a :class:`ProfileError`
    naming the first module that has them.

    A measured step would materialise them (``nn.LazyLinear`` becomes ``nn.Linear`` with
    freshly drawn weights), a change to the model no restore can undo and that an
    optimizer created earlier would not see. Checked before anything reads the
    parameters' shapes (the profile cache's key does), which a lazy parameter refuses
    with torch's own error. Duck-typed (``has_uninitialized_params``): no torch import.
    """
    for name, module in model.named_modules():
        has_lazy = getattr(module, "has_uninitialized_params", None)
        if callable(has_lazy) and has_lazy():
            raise ProfileError(
                f"{where}: module {name or '(the model)'!r} ({type(module).__name__}) has "
                "uninitialised lazy parameters; run one forward pass first "
                "(model(sample_batch), e.g. under torch.no_grad()) so lazy modules create "
                "their parameters, then create the optimizer and profile, solve or measure"
            )


def check_batch(batch: Any, where: str = "profile()") -> None:
    """One micro-batch: a tensor, a tuple/list of inputs or a dict of keyword inputs.

    A loader, a generator or an iterator is refused: remat runs the batch many times,
    and an iterator would be used up (or yield other batches) on the way.
    """
    if batch is None:
        raise ArgumentError(f"{where} needs a sample batch (one micro-batch of what the model "
                            "takes), got None; e.g. batch = next(iter(train_loader))")
    data = sys.modules.get("torch.utils.data")
    loader = data is not None and isinstance(batch, data.DataLoader)
    if loader or isinstance(batch, collections.abc.Iterator):
        raise ArgumentError(
            f"{where} needs one sample batch, got {_kind(batch)}; remat runs the same batch "
            "several times, so pass one: batch = next(iter(loader))")


def check_loss_fn(loss_fn: Any, where: str = "profile()") -> None:
    """``loss_fn`` is ``None`` or a callable ``(output, batch) -> scalar``."""
    if loss_fn is not None and not callable(loss_fn):
        raise ArgumentError(
            f"{where}: loss_fn must be a callable loss_fn(output, batch) -> scalar Tensor, or "
            f"None to use the output's .loss; got {_kind(loss_fn)}")
    # Called as loss_fn(output, batch): a function that cannot take them (os.getcwd, a
    # loss of the output alone) would fail only after the forward, with a raw TypeError.
    why = None if loss_fn is None else why_not_callable_with(loss_fn, 2)
    if why is not None:
        raise ArgumentError(
            f"{where}: loss_fn is called as loss_fn(output, batch), and {why}; pass a "
            "function of (output, batch) returning the scalar loss, e.g. "
            "lambda output, batch: my_loss(output)")


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


# The head= settings (remat.profiler.heads measures what they ask for).
HEAD_SETTINGS = ("auto", "chunked", "none")


def check_head_setting(head: object, where: str = "profile()") -> str:
    """``head`` is one of :data:`HEAD_SETTINGS`."""
    if head not in HEAD_SETTINGS:
        raise ArgumentError(
            f"{where}: head={head!r} is not one of {list(HEAD_SETTINGS)}: 'auto' offers a chunked "
            "head where remat recognises one and the loop drops the output, 'chunked' wherever "
            "it recognises one, 'none' never")
    return str(head)


def check_budget_arg(budget: Any) -> Budget | None:
    """The budget read without the profile (``None`` stays ``None``); a
    :class:`~remat.core.errors.BudgetError` names a malformed one."""
    return None if budget is None else check_budget(budget)


def check_plan(plan: Any, where: str = "apply_plan()") -> None:
    """``plan`` must be a :class:`~remat.core.plan.Plan` (a path or a dict is refused
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
    check_not_lazy(model, where)
    check_not_meta(model, where)
    check_batch(sample_batch, where)
    check_loss_fn(loss_fn, where)
    check_optimizer(optimizer, where)
    check_loop(loop, where)
    if isinstance(loop, Loop) and loop.optimizer_in_backward and optimizer is None:
        raise LoopError(
            f"{where}: loop={loop_code(loop)} steps the optimizer in backward, and no "
            "optimizer was given: pass optimizer=, the optimizer you train with (the one "
            "remat.optimizer_in_backward(model, optimizer) steps)")


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

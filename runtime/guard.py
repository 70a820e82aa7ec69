"""Checks at the top of a planned model's forward: inputs larger than planned, replaced units.

A plan's figures hold for the model it was made for, on inputs up to the shapes it
was profiled with. Two things can change under it while it is applied, and both
are checked by one forward pre-hook on the planned model (only for training
forwards, under grad: in eval or under ``torch.no_grad()`` nothing is held for
backward, so neither matters; and not while ``torch.compile`` traces):

* **larger inputs**: each tensor argument's shape is compared, dimension by
  dimension, with the shape recorded for that argument (``Plan.input_shapes``).
  Larger in any dimension (a bigger batch, a longer sequence) warns once per new
  shape (:class:`~remat.core.errors.RematWarning`) with the predicted peak scaled to it,
  or with ``strict_shapes`` raises :class:`~remat.core.errors.PlanMismatchError`.
  Smaller inputs (the short last batch, dynamic padding) pass silently. The scaled
  figure (:func:`scaled_peak`) grows the plan's activation peak linearly with the
  elements of the smallest shape that covers both the recorded and the new one,
  on top of the persistent bytes: an estimate, low where memory grows faster than
  the input (attention scores grow with the square of the sequence).
* **replaced units**: a unit module replaced after ``apply_plan``
  (``model.layers[3] = NewBlock()``) would run unplanned, outside the plan's
  figures and outside its segment. The hook checks that every unit is still the
  module the plan was applied to and raises :class:`PlanMismatchError` otherwise.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from remat.core.bytesize import format_bytes
from remat.core.errors import PlanMismatchError, RematWarning
from remat.core.plan import Plan

__all__ = ["PlanGuard", "call_shapes", "replaced_units", "scaled_peak"]

Shape = tuple[int, ...]


def positional_names(model: nn.Module) -> tuple[str, ...]:
    """The names of the positional parameters of ``model``'s forward (``()`` if unknown)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def call_shapes(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], names: tuple[str, ...] = ()
) -> dict[str, Shape]:
    """The shapes of a call's tensor arguments by the names the profile records them under.

    Positional arguments are ``"arg0"``, ``"arg1"``..., keyword arguments their names
    (as :func:`remat.profiler.assemble.input_shapes` names a sample batch). With the
    forward's positional parameter ``names``, each is also known by its other name,
    so a plan profiled with ``model(**batch)`` checks ``model(input_ids)`` too.
    """
    shapes: dict[str, Shape] = {}
    for i, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            shapes[f"arg{i}"] = tuple(value.shape)
            if i < len(names):
                shapes.setdefault(names[i], tuple(value.shape))
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            shapes[key] = tuple(value.shape)
            if key in names:
                shapes.setdefault(f"arg{names.index(key)}", tuple(value.shape))
    return shapes


def _larger(shape: Shape, recorded: Shape) -> bool:
    if len(shape) != len(recorded):
        return math.prod(shape) > math.prod(recorded)
    return any(d > r for d, r in zip(shape, recorded))


def _growth(shape: Shape, recorded: Shape) -> float:
    """Elements of the smallest shape covering ``shape`` and ``recorded``, per recorded one."""
    base = max(math.prod(recorded), 1)
    if len(shape) != len(recorded):
        return max(math.prod(shape) / base, 1.0)
    return math.prod(max(d, r) for d, r in zip(shape, recorded)) / base


def scaled_peak(plan: Plan, growth: float) -> int | None:
    """The plan's peak estimated for inputs ``growth`` times as large (in elements).

    ``persistent + growth * activation peak`` (``Plan.activation_peak_bytes``), at
    least the predicted peak: it bounds every moment of the step when activations
    grow linearly with the input. Without those figures (a plan from an older
    remat), the predicted peak less ``persistent_bytes`` is scaled instead.
    """
    record = plan.record
    peak = record.predicted_peak_bytes
    if peak is None:
        return None
    fixed = min(record.persistent_bytes or 0, peak)
    if record.persistent_bytes is not None and record.activation_peak_bytes is not None:
        return max(peak, int(record.persistent_bytes + growth * record.activation_peak_bytes))
    return int(fixed + (peak - fixed) * growth)


def replaced_units(model: nn.Module, names: tuple[str, ...], modules: list[nn.Module]) -> list[int]:
    """Indices of the units whose name in ``model`` no longer leads to the planned module."""
    out = []
    for i, (name, module) in enumerate(zip(names, modules)):
        try:
            live = model.get_submodule(name)
        except AttributeError:
            live = None
        if live is not module:
            out.append(i)
    return out


class PlanGuard:
    """The planned model's forward pre-hook (``with_kwargs``); see the module docstring.

    A plain class, so planned models pickle and deep-copy (the copy's guard checks
    the copy's units).
    """

    def __init__(self, plan: Plan, modules: list[nn.Module], positional: tuple[str, ...],
                 strict_shapes: bool) -> None:
        self.plan = plan
        self.modules = modules
        self.positional = positional
        self.strict_shapes = strict_shapes
        self.recorded = dict(plan.target.input_shapes or ())
        self.warned: set[tuple[tuple[str, Shape], ...]] = set()

    def __call__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and model.training):
            return
        self.check_units(model)
        if self.recorded:
            self.check_shapes(call_shapes(args, kwargs, self.positional))

    def check_units(self, model: nn.Module) -> None:
        replaced = replaced_units(model, self.plan.unit_names, self.modules)
        if not replaced:
            return
        details = []
        for i in replaced[:3]:
            name = self.plan.unit_names[i]
            try:
                now = type(model.get_submodule(name)).__name__
            except AttributeError:
                now = "missing"
            details.append(f"{name!r} (now {now}; the plan was applied to a "
                           f"{type(self.modules[i]).__name__})")
        raise PlanMismatchError(
            f"{len(replaced)} unit(s) of the plan were replaced after apply_plan: "
            f"{', '.join(details)}; a replaced unit would run unplanned, outside the plan's "
            "memory figures. Apply the plan again (remat.apply_plan(model, plan), which checks "
            "the new modules), or solve again when the new modules differ (remat.solve(...))"
        )

    def check_shapes(self, shapes: Mapping[str, Shape]) -> None:
        over = [(name, shapes[name], recorded) for name, recorded in self.recorded.items()
                if name in shapes and _larger(shapes[name], recorded)]
        if not over:
            return
        key = tuple((name, shape) for name, shape, _ in over)
        if key in self.warned and not self.strict_shapes:
            return
        growth = max(_growth(shape, recorded) for _, shape, recorded in over)
        seen = ", ".join(f"{name} {list(shape)} (planned for {list(recorded)})"
                         for name, shape, recorded in over)
        estimate = scaled_peak(self.plan, growth)
        budget = self.plan.budget_bytes
        figures = ""
        if estimate is not None:
            predicted = format_bytes(self.plan.record.predicted_peak_bytes or 0)
            figures = (f"; its predicted peak of {predicted}"
                       f" grows to at most about {format_bytes(estimate)} (the persistent bytes "
                       f"plus the activation peak scaled linearly "
                       f"with the input's elements, x{growth:.2f}; more where memory grows "
                       "faster, as attention does with the sequence length)")
            if budget is not None and estimate > budget:
                figures += f", above the budget of {format_bytes(budget)}"
        message = (
            f"the planned model was called with inputs larger than the plan was made for: {seen}"
            f"{figures}. The budget holds for inputs up to the profiled shapes: solve again with "
            "a sample batch of the largest shape you train on (remat.solve(model, batch, ...))"
        )
        if self.strict_shapes:
            raise PlanMismatchError(message)
        self.warned.add(key)
        warnings.warn(message + "; apply_plan(..., strict_shapes=True) makes this an error",
                      RematWarning, stacklevel=3)

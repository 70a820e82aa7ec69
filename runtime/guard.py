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

A plan is also made for one training loop (``Plan.target.loop``) and one model, and
the same hook watches that they are the ones that run (:class:`LoopChecks`), at the
cost of a few attribute reads per training forward:

* **gradients alive at the start of a forward** that the loop says are cleared
  (``Loop()``: one micro-batch, ``zero_grad(set_to_none=True)``): the loop
  accumulates them or zeroes them in place, and they take their bytes on top of
  every figure of the plan. One parameter is read (the first trainable one of the
  first unit).
* **parameters not stepped in backward** where the loop says they are
  (``Loop(optimizer_in_backward=True)``): no hooks of ``remat.optimizer_in_backward``
  on the first trainable parameter of the first unit (a few set look-ups), so every
  gradient lives to the end of backward and an optimizer step runs after it, which the
  plan did not count. (The other way round, hooks on a plan for a loop that steps after
  backward, frees gradients the plan counted: the budget holds, nothing is said.)
* **autocast** on, off or in another dtype than the loop says.
* **parameters in another dtype** than planned (``model.float()`` after solving in
  bfloat16): one parameter's dtype is read.
* **a module added** to a container of the units after ``apply_plan`` (a block
  appended): it runs unplanned. The containers' lengths are read.
* **the output kept through backward** when the loop says it is dropped
  (``Loop(keep_output=False)``): a forward hook (:class:`OutputWatch`) puts a hook on
  the node that made the output's largest tensor, holding only a weak reference to the
  tensor; the hook runs once that tensor's consumers (the loss) have run their backward
  and let go of it, so if it is still alive then, the loop holds it (a few µs per
  forward, for such plans only).

Each mismatch warns once (:class:`RematWarning`), naming what differs, the bytes the
plan did not count where they can be told (or its peak scaled), and the fix; with
``apply_plan(..., strict=True)`` it raises :class:`PlanMismatchError`. None is
checked in eval mode, under ``torch.no_grad()`` or while ``torch.compile`` traces;
the loop checks need a plan that records its loop (a solved one), the dtype check
one that records its units' signatures.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from remat.core.bytesize import format_bytes
from remat.core.errors import PlanMismatchError, RematWarning
from remat.core.loop import loop_code
from remat.core.plan import Plan
from remat.measurement.in_backward import steps_in_backward
from remat.measurement.runner import output_tensors
from remat.measurement.storage import storage_bytes

__all__ = ["LoopChecks", "OutputWatch", "PlanGuard", "call_shapes", "replaced_units",
           "scaled_peak"]

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
    """Indices of the units whose name in ``model`` no longer leads to the planned module.

    Run at every training forward, so the names are split once per plan
    (:func:`_parent_keys`), each distinct container on the units' paths is looked up
    once per call, in the ``_modules`` dicts themselves, and each unit is one dict
    read in a comprehension: no function call per unit (about 1.5 us a unit when
    each walked its path: 0.3 ms a step for 200 units).
    """
    found: dict[str, nn.Module | None] = {"": model}

    def lookup(path: str) -> nn.Module | None:
        if path in found:
            return found[path]
        parent_path, _, key = path.rpartition(".")
        parent = lookup(parent_path)
        live = None if parent is None else parent._modules.get(key)
        found[path] = live
        return live

    keys, parents = _parent_keys(tuple(names))
    live = {path: lookup(path) for path in parents}
    return [i for i, ((parent, key), module) in enumerate(zip(keys, modules))
            if (model if parent is None else
                None if live[parent] is None else live[parent]._modules.get(key)) is not module]


@functools.lru_cache(maxsize=32)
def _parent_keys(names: tuple[str, ...]) -> tuple[tuple[tuple[str | None, str], ...],
                                                  tuple[str, ...]]:
    """Per unit name, ``(its container's path, its key there)`` (``(None, "")`` for the
    model itself), and the distinct container paths."""
    keys = tuple((None, "") if not name else (name.rpartition(".")[0], name.rpartition(".")[2])
                 for name in names)
    return keys, tuple(dict.fromkeys(parent for parent, _ in keys if parent is not None))


class PlanGuard:
    """The planned model's forward pre-hook (``with_kwargs``); see the module docstring.

    A plain class, so planned models pickle and deep-copy (the copy's guard checks
    the copy's units).
    """

    # A guard pickled by a remat without the loop checks has none.
    loop_checks: LoopChecks | None = None

    def __init__(self, plan: Plan, modules: list[nn.Module], positional: tuple[str, ...],
                 strict_shapes: bool, loop_checks: LoopChecks | None = None) -> None:
        self.plan = plan
        self.modules = modules
        self.positional = positional
        self.strict_shapes = strict_shapes
        self.recorded = dict(plan.target.input_shapes or ())
        self.warned: set[tuple[tuple[str, Shape], ...]] = set()
        self.loop_checks = loop_checks

    def __call__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and model.training):
            return
        self.check_units(model)
        if self.recorded:
            self.check_shapes(call_shapes(args, kwargs, self.positional))
        if self.loop_checks is not None:
            self.loop_checks.before_forward(model)

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


# --------------------------------------------------------------------------- the loop
def _param_slot(modules: list[nn.Module], model: nn.Module,
                wanted: Callable[[nn.Parameter], bool]) -> tuple[nn.Module, str] | None:
    """``(owning module, name)`` of the first parameter of the units (else of the model)
    that ``wanted(parameter)`` accepts. Read back through the owner at each check, so a
    parameter replaced by a conversion (``swap_tensors``) is still the one read."""
    for root in (*modules, model):
        for owner in root.modules():
            for name, p in owner._parameters.items():
                if p is not None and wanted(p):
                    return owner, name
    return None


def _unit_containers(model: nn.Module, names: tuple[str, ...]) -> tuple[tuple[str, nn.Module,
                                                                              int], ...]:
    """``(name, module, number of children)`` of each module that holds units directly
    (``blocks`` for ``blocks.0``...; ``""``, the model, for an ``nn.Sequential``'s own)."""
    found: dict[str, tuple[str, nn.Module, int]] = {}
    for name in names:
        parent = name.rpartition(".")[0]
        if parent in found:
            continue
        try:
            module = model.get_submodule(parent)
        except AttributeError:
            continue
        found[parent] = (parent, module, len(module._modules))
    return tuple(found.values())


class LoopChecks:
    """The checks that the loop and the model are those the plan was made for (see the
    module docstring). Built by ``apply_plan``; a plain class, so planned models pickle."""

    def __init__(self, plan: Plan, modules: list[nn.Module], model: nn.Module, *,
                 strict: bool) -> None:
        self.plan = plan
        self.strict = strict
        self.loop = plan.target.loop
        self.warned: set[str] = set()
        first = _param_slot(modules, model, lambda p: True)
        device: str | None = (first[0]._parameters[first[1]].device.type if first is not None
                              else "cpu")
        try:
            torch.is_autocast_enabled(device)
        except RuntimeError:  # a device autocast does not know (meta): nothing to check
            device = None
        self.device_type = device
        loop = self.loop
        # Gradients: the loop says none exists when a forward starts.
        self.grad_slot = None
        if loop is not None and not loop.grads_alive_at_start:
            self.grad_slot = _param_slot(modules, model, lambda p: p.requires_grad)
        # Stepped in backward: the loop says each parameter is.
        self.step_slot = None
        if loop is not None and loop.optimizer_in_backward:
            self.step_slot = _param_slot(modules, model, lambda p: p.requires_grad)
        self.autocast = None if loop is None or loop.autocast is None else getattr(
            torch, loop.autocast)
        # The dtype the units' parameters were planned in: checked against their
        # signatures at apply time, so it is the planned one.
        self.dtype_slot = first if plan.target.unit_signatures is not None else None
        self.planned_dtype = (None if first is None
                              else first[0]._parameters[first[1]].dtype)
        self.containers = _unit_containers(model, plan.unit_names)
        self.watch_output = loop is not None and not loop.keep_output

    # -- before each training forward --------------------------------------------------
    def before_forward(self, model: nn.Module) -> None:
        """The cheap reads: one ``.grad``, the autocast state, one dtype, a few lengths.
        A mismatch found is reported once (:meth:`said`): a loop that accumulates does so
        at every step, and its figure costs a pass over every gradient."""
        if self.loop is not None:
            slot = self.grad_slot
            if slot is not None:
                p = slot[0]._parameters.get(slot[1])
                if p is not None and p.grad is not None and not self.said("grads"):
                    self.grads_alive(model)
            slot = getattr(self, "step_slot", None)  # None in guards pickled before it
            if slot is not None:
                p = slot[0]._parameters.get(slot[1])
                if p is not None and not steps_in_backward(p) and not self.said("stepped"):
                    self.not_stepped(model)
        slot = self.dtype_slot
        if slot is not None:
            p = slot[0]._parameters.get(slot[1])
            if p is not None and p.dtype != self.planned_dtype and not self.said("dtype"):
                self.dtype_differs(p.dtype)
        for name, module, children in self.containers:
            if len(module._modules) > children and not self.said("added"):
                self.module_added(name, module, children)

    def at_first_unit(self, module: nn.Module, args: Any) -> None:
        """The first unit's forward pre-hook: the autocast state the units run in. Read
        here, not before the model's forward: a forward wrapped in autocast (accelerate's
        mixed precision, a user's decorator) enters it inside."""
        device = self.device_type
        if (device is None or self.loop is None or not torch.is_grad_enabled()
                or not module.training or torch.compiler.is_compiling()):
            return
        on = torch.is_autocast_enabled(device)
        if (on != (self.autocast is not None) or (
                on and torch.get_autocast_dtype(device) != self.autocast)) \
                and not self.said("autocast"):
            self.autocast_differs(on)

    # -- the mismatches ------------------------------------------------------------------
    def said(self, kind: str) -> bool:
        """Whether this kind of mismatch was warned of already (never, with ``strict``)."""
        return not self.strict and kind in self.warned

    def report(self, kind: str, message: str) -> None:
        """Raise (``strict``) or warn once per kind of mismatch."""
        if self.strict:
            raise PlanMismatchError(message)
        if kind in self.warned:
            return
        self.warned.add(kind)
        warnings.warn(message + "; apply_plan(..., strict=True) makes this an error",
                      RematWarning, stacklevel=4)

    def with_extra(self, extra: int, what: str) -> str:
        """``": up to 3.0 MiB the plan did not count (...), so the step can peak at about
        12.5 MiB against the 9.5 MiB predicted, +29% against the budget of 9.7 MiB"``."""
        text = f": up to {format_bytes(extra)} the plan did not count ({what})"
        peak = self.plan.record.predicted_peak_bytes
        return text + ("" if peak is None else ", so the step can peak at about "
                       + self.peak_figure(peak + extra))

    def peak_figure(self, estimate: int) -> str:
        """``"12.5 MiB against the 9.5 MiB predicted, +29% against the budget of 9.7 MiB"``."""
        text = (f"{format_bytes(estimate)} against the "
                f"{format_bytes(self.plan.record.predicted_peak_bytes or 0)} predicted")
        budget = self.plan.budget_bytes
        if budget:
            text += (f", {100 * (estimate / budget - 1):+.0f}% against the budget of "
                     f"{format_bytes(budget)}")
        return text

    def grads_alive(self, model: nn.Module) -> None:
        loop = self.loop
        assert loop is not None
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        nbytes = storage_bytes(grads)
        # Zeroed in place or accumulated; a sharded gradient (DTensor) is not looked into.
        zeroed = all(type(g) is torch.Tensor and not bool(g.any()) for g in grads)
        if loop.optimizer_in_backward:  # the hooks that free each gradient are missing
            self.report("grads", (
                f"remat: a training forward started with {len(grads)} parameter gradients "
                "alive, and the plan was solved for a loop that steps each parameter in "
                f"backward and frees its gradient ({loop_code(loop)})"
                f"{self.with_extra(nbytes, 'the gradients, alive through the forward pass')}."
                " Set the loop up: remat.optimizer_in_backward(model, optimizer) before "
                "training, or solve again for your loop: remat.solve(..., loop="
                f"{loop_code(loop, optimizer_in_backward=False)})"))
            return
        if zeroed:
            cause = "the loop zeroes them in place (zero_grad(set_to_none=False))"
            fix = loop_code(loop, set_to_none=False)
        else:
            cause = "the loop accumulates them over micro-batches, or does not clear them"
            fix = loop_code(loop, accumulation_steps="N")
        self.report("grads", (
            f"remat: a training forward started with {len(grads)} parameter gradients alive, "
            f"and the plan was solved for a loop that clears them before each forward "
            f"({loop_code(loop)}): {cause}"
            f"{self.with_extra(nbytes, 'the gradients, alive through the forward pass')}. "
            f"Solve again for your loop: remat.solve(..., loop={fix})"
            + (" with N micro-batches per optimizer step" if not zeroed else "")
            + ", or zero the gradients with zero_grad(set_to_none=True) before each forward"))

    def not_stepped(self, model: nn.Module) -> None:
        loop = self.loop
        assert loop is not None
        nbytes = storage_bytes(p for p in model.parameters() if p.requires_grad)
        self.report("stepped", (
            "remat: the planned model's parameters are not stepped in backward, and the plan "
            f"was solved for a loop that steps each as its gradient is complete and frees the "
            f"gradient ({loop_code(loop)})"
            f"{self.with_extra(nbytes, 'the parameter gradients, alive to the end of backward')}"
            " and an optimizer step after backward it did not count either. "
            "Set the loop up: remat.optimizer_in_backward(model, optimizer) before training, "
            f"or solve again for your loop: remat.solve(..., "
            f"loop={loop_code(loop, optimizer_in_backward=False)})"))

    def autocast_differs(self, on: bool) -> None:
        loop = self.loop
        device = self.device_type
        assert loop is not None and device is not None
        now = (f"under torch.autocast({device!r}, dtype={torch.get_autocast_dtype(device)})"
               if on else "without autocast")
        planned = (f"torch.autocast with {loop.autocast}" if loop.autocast
                   else "no autocast")
        dtype = str(torch.get_autocast_dtype(device)).removeprefix("torch.") if on else None
        self.report("autocast", (
            f"remat: the planned model runs its training forward {now}, and the plan was "
            f"solved for a loop with {planned} ({loop_code(loop)}): every activation has another "
            "size than the plan counted, so its figures do not hold. Solve again for the loop "
            f"you run: remat.solve(..., loop={loop_code(loop, autocast=dtype)}), or run "
            "the forward as the plan's loop says"))

    def dtype_differs(self, now: torch.dtype) -> None:
        planned = self.planned_dtype
        assert planned is not None
        ratio = now.itemsize / planned.itemsize
        peak = self.plan.record.predicted_peak_bytes
        figure = ("" if peak is None else
                  f": scaled by x{ratio:.2f}, the predicted peak is about "
                  + self.peak_figure(int(peak * ratio)))
        self.report("dtype", (
            f"remat: the planned model's parameters are {now} now, and the plan was made for "
            f"{planned} ones (the model was converted after apply_plan){figure}. Convert it "
            f"back (model.to({planned})), or profile and solve again in {now}"))

    def module_added(self, name: str, module: nn.Module, children: int) -> None:
        where = f"'{name}'" if name else "the model"
        self.report("added", (
            f"remat: {where} holds {len(module._modules)} modules now and held {children} "
            "when the plan was applied: a module added after apply_plan (a block appended) "
            "runs unplanned, outside the plan's memory figures. Solve again for this model "
            "(remat.solve(model, batch, ...)) and apply that plan"))

    def output_kept(self, nbytes: int) -> None:
        loop = self.loop
        assert loop is not None
        self.report("output", (
            "remat: the model's output is still alive during backward, and the plan was solved "
            f"for a loop that drops it once the loss is taken ({loop_code(loop)})"
            f"{self.with_extra(nbytes, 'the output, alive through the backward pass')}. "
            "Solve again for your loop: remat.solve(..., loop="
            f"{loop_code(loop, keep_output=True)}), or drop the output before backward "
            "(loss = loss_fn(model(x), y))"))


def _watched_output(output: Any) -> torch.Tensor | None:
    """The output tensor whose life tells whether the loop keeps the output: the largest
    one that takes a gradient; ``None`` for a scalar (the loss itself)."""
    if isinstance(output, torch.Tensor):
        candidates = [output]
    else:
        candidates = output_tensors(output)
    best = None
    for t in candidates:
        if t.requires_grad and t.grad_fn is not None and t.numel() > 1 and (
                best is None or t.numel() > best.numel()):
            best = t
    return best


class _OutputHeld:
    """The pre-hook :class:`OutputWatch` puts on the node that made an output: it runs once
    the output's gradient is complete, when its consumers (the loss) have run their
    backward and let go of it, so a live weak reference means the loop holds it."""

    def __init__(self, checks: LoopChecks, ref: weakref.ref[torch.Tensor]) -> None:
        self.checks = checks
        self.ref = ref

    def __call__(self, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        t = self.ref()
        if t is not None:
            self.checks.output_kept(storage_bytes(t))


class OutputWatch:
    """The planned model's forward hook for ``Loop(keep_output=False)`` plans (see the
    module docstring); registered only for them. Stops watching after it warned.

    A loop that keeps its output does so at every step, so one watched forward in
    :attr:`EVERY` (after the first :attr:`FIRST`) finds it as surely as all of them, at
    a fraction of the hook's cost (about 2.6 µs a watched forward, 0.5 µs another, on
    these CPUs).
    """

    FIRST, EVERY = 8, 32
    forwards = 0  # training forwards seen (a class default: guards pickled before it)

    def __init__(self, checks: LoopChecks) -> None:
        self.checks = checks

    def __call__(self, model: nn.Module, args: Any, output: Any) -> None:
        checks = self.checks
        if checks.said("output") or torch.compiler.is_compiling() \
                or not (torch.is_grad_enabled() and model.training):
            return
        self.forwards += 1
        if self.forwards > self.FIRST and self.forwards % self.EVERY:
            return
        t = _watched_output(output)
        if t is not None:
            # On the node, not the tensor (Tensor.register_hook costs 1 µs more per forward).
            t.grad_fn.register_prehook(_OutputHeld(checks, weakref.ref(t)))

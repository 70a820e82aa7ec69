"""Apply a plan to a model, in place, so an ordinary training loop trains under it.

Each unit's ``forward`` is replaced by a small callable (an instance attribute, so
``module(...)`` still runs the module's hooks around it) that runs the original
forward under the unit's option. What remat changed is recorded in one attribute,
``model._remat_state``, so :func:`remove_plan` can undo it exactly. Parameters,
buffers, ``state_dict`` and the module tree are never touched, and the model still
pickles and deep-copies (a copy of a planned model is planned the same way).

Example::

    plan = Plan.checkpoint_all([f"transformer.h.{i}" for i in range(12)])
    apply_plan(model, plan)
    loss = model(**batch).loss
    loss.backward()          # blocks are recomputed here
    remove_plan(model)       # back to the original forwards
"""

from __future__ import annotations

import difflib
import logging
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch.utils import checkpoint as _ckpt

from remat.core.errors import PlanMismatchError, RematError, RematWarning
from remat.core.option import Option
from remat.core.plan import Plan, PlanTarget
from remat.execute.boundary import boundary_input
from remat.execute.head import HeadSite
from remat.execute.inplace import (
    InputWritten,
    NestedBackward,
    WriteProbe,
    argument_versions,
    selective_write_reason,
    tensor_arguments,
    written_arguments,
)
from remat.execute.options import (
    SELECTIVE_SAVE_OPS,
    forward_with_option,
    option_is_active,
    tracking_batchnorms,
)
from remat.execute.planned import STATE_ATTR, unwrap
from remat.execute.sharding import check_world_size
from remat.execute.structure import (
    describe_mismatch,
    holds_a_unit,
    unit_signature,
    unit_type_counts,
)
from remat.runtime.guard import (
    LoopChecks,
    OutputWatch,
    PlanGuard,
    positional_names,
    replaced_units,
)
from remat.runtime.plan_head import check_head, install_plan_head, remove_plan_head
from remat.runtime.segments import SegmentRunner, dynamo_idle, get_eval_frame_callback
from remat.runtime.sequential_links import SequentialLinks
from remat.runtime.sequential_segments import (
    install_sequential_forwards,
    remove_sequential_forwards,
)

__all__ = ["apply_plan", "planned", "remove_plan"]

logger = logging.getLogger(__name__)

ModuleT = TypeVar("ModuleT", bound=nn.Module)

_KEEP = Option.KEEP.value


# --------------------------------------------------------------------------- state
class _RematState:
    """Everything remat changed on one model: the plan, the units and their old forwards."""

    def __init__(
        self,
        plan: Plan,
        modules: list[nn.Module],
        saved_forwards: list[Callable[..., Any] | None],
        runner: SegmentRunner | None,
    ) -> None:
        self.plan = plan
        self.modules = modules
        # The instance-level ``forward`` each unit had before (None: its class's forward).
        self.saved_forwards = saved_forwards
        self.runner = runner
        self.guard_hook_id: int | None = None
        self.plan_guard_id: int | None = None
        self.output_watch_id: int | None = None
        self.first_unit_id: int | None = None  # the loop checks' pre-hook on the first unit
        # Per unit, whether its forward writes into its own arguments: None until its
        # first recomputed call tells (see ``_probe``).
        self.writes_input: list[bool | None] = [None] * len(modules)
        # Per unit, the option it runs as when its first call found that it cannot run
        # the plan's (None: the plan's); see ``_probe``.
        self.runs_as: list[str | None] = [None] * len(modules)
        # Where the plan's chunked head was installed (None: the head as it is).
        self.head_site: HeadSite | None = None
        # The stock nn.Sequential modules given a forward that runs whole segments
        # (runtime.sequential_segments).
        self.sequentials: list[nn.Sequential] = []

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A model unpickled in a fresh process runs its segments eagerly there too.
        # Nothing is filled in for a pickle of another remat version (docs/compatibility.md).
        self.__dict__.update(state)
        if self.runner is not None:
            _disable_compile_for_segments()

    def original_forward(self, index: int) -> Callable[..., Any]:
        """Unit ``index``'s forward as it was before the plan, bound to the module."""
        saved = self.saved_forwards[index]
        if saved is not None:
            return saved
        module = self.modules[index]
        return type(module).forward.__get__(module, type(module))

    def active(self, index: int) -> bool:
        """Whether unit ``index``'s option does anything for a call now (``option_is_active``)."""
        option = self.runs_as[index] or self.plan.options[index]
        return option != _KEEP and torch.is_grad_enabled() and self.modules[index].training

    def call(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run unit ``index`` under its option (or as part of its segment)."""
        runner = self.runner
        option = self.runs_as[index] or self.plan.options[index]
        if option == _KEEP and (runner is None or not runner.is_open):
            return self.original_forward(index)(*args, **kwargs)  # nothing to do, at no cost
        module = self.modules[index]
        active = option_is_active(module, option)
        compiling = torch.compiler.is_compiling()
        if runner is not None:
            if index in runner.segment_of and active:
                if compiling:
                    return runner.call_ahead(index, self.original_forward, args, kwargs)
                if not kwargs and len(args) == 1 and index != runner.segment_of[index][0]:
                    # A later unit called with one argument: it is the chained input
                    # (the runner refuses the call otherwise), which the replay
                    # recomputes, so a write into it is allowed: nothing to watch.
                    return _eager_segment_call(self, index, args, kwargs)
                before = argument_versions(args, kwargs)
                output = _eager_segment_call(self, index, args, kwargs)
                self._refuse_writes_in_segment(index, args, kwargs, before)
                return output
            if runner.is_open:  # anything that does not continue a segment ends it
                _eager_segment_close(runner)
        # offload and derive recompute nothing of the forward: a write into an argument
        # is autograd's to check, as without a plan.
        if not active or compiling or option in (Option.OFFLOAD.value, Option.DERIVE.value):
            return forward_with_option(module, option, self.original_forward(index), args, kwargs)
        writes = self.writes_input[index]
        if writes:
            return self.original_forward(index)(*args, **kwargs)
        if writes is None:
            return self._probe(index, args, kwargs)
        before = argument_versions(args, kwargs)
        output = forward_with_option(module, option, self.original_forward(index), args, kwargs)
        written = written_arguments(before)
        if written:
            raise RematError(
                f"unit {self.plan.unit_names[index]!r} wrote into its {written[0]} in place "
                f"under option {option!r}, which its earlier calls did not; a recomputed unit "
                "cannot change its inputs (its backward would recompute from the changed "
                "values). Give it option 'keep' in a manual plan, or solve again without it "
                "among the units (remat.solve(..., units=[...]))"
            )
        return output

    def _probe(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A unit's first recomputed call, watched for writes into its arguments (and,
        under ``selective``, into the tensors selective keeps for backward).

        The write is stopped before it happens (:class:`WriteProbe`), the checkpoint
        region abandoned, what the forward had done to the RNG and BatchNorm
        statistics undone, and the call run plainly; the unit stays ``keep`` from
        then on, with a warning. Python-level side effects of the abandoned part of
        the forward (a call counter) happen twice on that one call. A write into a
        tensor selective keeps is a plan the unit cannot run: ``PlanMismatchError``. A
        ``selective`` unit whose forward runs a backward of its own
        (``torch.autograd.grad``) runs as ``checkpoint`` from then on, with a warning:
        torch's selective cache cannot serve two backward passes through one forward.
        """
        module = self.modules[index]
        option = self.runs_as[index] or self.plan.options[index]
        forward = self.original_forward(index)
        watched = tensor_arguments(args, kwargs)
        selective = option == Option.SELECTIVE.value
        if not watched and not selective:
            self.writes_input[index] = False
            return forward_with_option(module, option, forward, args, kwargs)
        rng = torch.get_rng_state(), *_ckpt.get_device_states(*(t for _, t in watched))
        stats = [(buf, buf.detach().clone()) for bn in tracking_batchnorms(module)
                 for buf in (bn.running_mean, bn.running_var, bn.num_batches_tracked)
                 if buf is not None]
        saved_ops = SELECTIVE_SAVE_OPS if selective else frozenset()
        nested = None
        try:
            with WriteProbe(watched, saved_ops=saved_ops, stop_nested=selective):
                output = forward_with_option(module, option, forward, args, kwargs)
        except InputWritten as hit:
            written, saved, op = f"{hit.label} ({hit.op})", hit.saved, hit.op
        except NestedBackward as hit:
            nested = hit.op
        else:
            self.writes_input[index] = False
            return output
        # Outside the except block: the abandoned region's contexts are closed by now.
        torch.set_rng_state(rng[0])
        if rng[1]:
            _ckpt.set_device_states(rng[1], rng[2])
        with torch.no_grad():
            for buf, value in stats:
                buf.copy_(value)
        if nested is not None:
            return self._run_as_checkpoint(index, args, kwargs)
        if saved:
            name = self.plan.unit_names[index]
            raise PlanMismatchError(
                f"unit {name!r} cannot run option 'selective': "
                f"{selective_write_reason(written.rpartition(' (')[0], op)}. Give the unit "
                f"'checkpoint' or 'keep' in the plan (Plan.from_options(names, {{{name!r}: "
                "'checkpoint'}})), or solve again: remat.solve() drops the options a unit "
                "cannot run"
            )
        self.writes_input[index] = True
        warnings.warn(
            f"remat: unit {self.plan.unit_names[index]!r} writes into its {written} in place, "
            f"so it cannot be recomputed ({option!r} would recompute it from the changed "
            "values); it runs as 'keep' (unplanned) from now on, so the step can peak above the "
            "plan's prediction. Solve again without it among the units (remat.solve(..., "
            "units=[...])), or give it option 'keep' in a manual plan",
            RematWarning,
            stacklevel=2,
        )
        return forward(*args, **kwargs)

    def _run_as_checkpoint(self, index: int, args: tuple[Any, ...],
                           kwargs: dict[str, Any]) -> Any:
        """Unit ``index`` runs a backward pass inside its forward: ``selective`` cannot
        recompute it, so it runs as ``checkpoint`` (same gradients; it holds less, only
        its inputs, and recomputes all of its forward), probed as such."""
        self.runs_as[index] = Option.CHECKPOINT.value
        warnings.warn(
            f"remat: unit {self.plan.unit_names[index]!r} runs a backward pass inside its "
            "forward (torch.autograd.grad), which 'selective' cannot recompute (torch's "
            "selective cache serves one backward through the region); it runs as 'checkpoint' "
            "from now on: the same gradients, less memory, more recomputation. Give it "
            "'checkpoint' or 'keep' in the plan to silence this",
            RematWarning,
            stacklevel=3,
        )
        return self._probe(index, args, kwargs)

    def _refuse_writes_in_segment(self, index: int, args: tuple[Any, ...],
                                  kwargs: dict[str, Any], before: Any) -> None:
        """A segment unit that wrote into an argument the segment holds or replays.

        Only the chained input of a unit after the segment's first is free to change:
        it is recomputed by the replay; the segment's first input and the other
        arguments are held as they are.
        """
        first = cast(SegmentRunner, self.runner).segment_of[index][0]
        located = boundary_input(args, kwargs)
        chained = [located[1]] if index > first and located is not None else []
        written = written_arguments(before, skip=chained)
        if written:
            raise RematError(
                f"unit {self.plan.unit_names[index]!r} wrote into its {written[0]} in place; "
                "a multi-unit segment holds its first input and replays its units' other "
                "arguments, so it cannot contain this unit. Use a plan without this segment, "
                "with option 'keep' for this unit, or solve again without it among the units "
                "(remat.solve(..., units=[...]))"
            )


class _PlannedForward:
    """A unit's replacement ``forward``: calls the original under the plan.

    A plain class (not a closure) so that planned models pickle and deep-copy.
    """

    def __init__(self, state: _RematState, index: int) -> None:
        self._remat_state = state
        self._index = index

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        # ``inspect.signature(module.forward)`` sees the original signature
        # (Hugging Face's Trainer reads it to pick the batch's columns).
        return self._remat_state.original_forward(self._index)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = self._remat_state
        runner = state.runner
        if runner is not None and len(args) == 1 and not kwargs:
            # The hot paths of a segment a stock nn.Sequential drives, a few calls deep
            # (about 10 us a segment and 5 a unit less than ``call``): a unit called
            # with one tensor continues the open segment over a quiet link (nothing ran
            # since the previous unit, so nothing needs checking: sequential_links.py),
            # or opens its segment.
            index, x = self._index, args[0]
            if runner.expects_quiet(index, x):
                if not torch.compiler.is_compiling():
                    # dynamo_idle(), inline: this runs at every unit of a segment
                    if get_eval_frame_callback is not None and get_eval_frame_callback() is None:
                        return runner.call_quiet(index, state.original_forward(index), x)
                    return _eager_segment_quiet(state, index, x)
            elif (runner.may_start(index, x) and state.active(index)
                  and not torch.compiler.is_compiling()):
                start = _segment_start if dynamo_idle() else _eager_segment_start
                return start(state, index, x)
        return state.call(self._index, args, kwargs)

    def __repr__(self) -> str:
        state = self._remat_state
        return (
            f"<remat forward of {state.plan.unit_names[self._index]!r}: "
            f"{state.plan.options[self._index]}>"
        )


class _SegmentGuard:
    """Forward hook on the model (``always_call``): a segment never outlives the forward.

    A segment normally closes when its last unit returns. If the forward raises
    between two units, or the model skips the segment's last unit, this closes it
    when the model's forward ends, so no saved-tensor hooks are left pushed.
    """

    def __init__(self, runner: SegmentRunner) -> None:
        self.runner = runner

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.runner.is_open:
            _eager_segment_close(self.runner)


# Eagerly, segments drive torch's checkpoint generator and saved-tensor hooks across
# several calls, which torch.compile cannot trace. While compiling, ``call`` takes
# the traceable run-ahead path instead (``SegmentRunner.call_ahead``); these eager
# entry points are still wrapped in ``torch.compiler.disable`` so that a frame dynamo
# falls back on (a segment that cannot run ahead) does not trace them. Wrapped
# lazily: importing torch._dynamo is slow and most plans have no segments.
# The original forward is looked up on the eager side: a bound method handed across
# the compile boundary is rebuilt by torch.compile as ``module.forward``, which is
# the planned wrapper itself.
def _segment_call(
    state: _RematState, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    runner = cast(SegmentRunner, state.runner)  # only called for plans with segments
    return runner.call(index, state.original_forward(index), args, kwargs)


def _segment_quiet(state: _RematState, index: int, x: torch.Tensor) -> Any:
    runner = cast(SegmentRunner, state.runner)
    return runner.call_quiet(index, state.original_forward(index), x)


def _segment_start(state: _RematState, index: int, x: torch.Tensor) -> Any:
    """Unit ``index`` opens its segment on ``x`` alone (``SegmentRunner.start_quiet``);
    the segment holds ``x``, so the unit must not write into it (as in ``call``)."""
    runner = cast(SegmentRunner, state.runner)
    version = x._version
    output = runner.start_quiet(index, state.original_forward(index), x)
    if x._version != version:
        state._refuse_writes_in_segment(index, (x,), {}, [("argument 0", x, version)])
    return output


def _segment_close(runner: SegmentRunner) -> None:
    runner.close()


_eager_segment_call: Callable[..., Any] = _segment_call
_eager_segment_quiet: Callable[..., Any] = _segment_quiet
_eager_segment_start: Callable[..., Any] = _segment_start
_eager_segment_close: Callable[[SegmentRunner], None] = _segment_close


def _disable_compile_for_segments() -> None:
    global _eager_segment_call, _eager_segment_quiet, _eager_segment_start, _eager_segment_close
    if _eager_segment_call is _segment_call:
        _eager_segment_call = torch.compiler.disable(_segment_call)
        _eager_segment_quiet = torch.compiler.disable(_segment_quiet)
        _eager_segment_start = torch.compiler.disable(_segment_start)
        _eager_segment_close = torch.compiler.disable(_segment_close)


# --------------------------------------------------------------------------- API
def apply_plan(model: ModuleT, plan: Plan, *, strict_shapes: bool = False,
               strict: bool = False) -> ModuleT:
    """Change ``model`` in place so that training runs under ``plan``; returns ``model``.

    Each unit's forward runs under its option (``keep``, ``checkpoint``,
    ``selective``, ``offload``), and each segment ``(a, b)`` is one recomputation
    region from unit ``a``'s input to unit ``b``'s output. An ordinary training loop
    needs no change: ``loss.backward()``, any optimizer, DDP, autocast and
    ``torch.compile`` all work. Under ``torch.no_grad()`` or in eval mode nothing
    is checkpointed: plain forwards, at no cost.

    A plan that chose a chunked head (``plan.head``) computes the model's head and
    loss over chunks of the tokens while it is applied (:mod:`remat.execute.head`):
    a Hugging Face causal LM then returns its loss with ``logits=None`` in training
    (with ``labels``; its forward is as before without them, or without grad); a
    model calling :func:`remat.head_loss` gets the same loss from it, chunked.

    Applying a second plan **replaces** the first (it is removed, then the new one
    applied). A model wrapped in ``DistributedDataParallel`` or ``torch.compile``
    is unwrapped: the plan goes on the inner model. ``nn.DataParallel`` is not
    supported (its replicas share the wrappers); use DistributedDataParallel.

    Segments need the units to form a chain at run time: each unit takes the
    previous unit's output (its first tensor) as an argument, and the model's code
    between them saves nothing for backward. ``nn.Sequential`` and
    ``for block in blocks: x = block(x, ...)`` loops (Hugging Face models included)
    do; otherwise a ``RematError`` says which units break the chain.

    Under ``torch.compile`` the whole planned model is one graph: each option and
    each segment becomes a traced checkpoint region. A segment then runs *ahead*
    from its first unit with that unit's other arguments, which the later units'
    calls must repeat (as the loops above do); where they differ, the forward is
    refused while tracing and torch.compile runs it eagerly, with the same result.

    Checkpointed units of Hugging Face models run with ``use_cache=False`` and no
    KV cache in training, as with Hugging Face's own gradient checkpointing.

    What the plan was made for is checked (:mod:`remat.runtime.guard`): a solved
    plan records its units' parameter shapes, and is refused on a model of another
    width with the same unit names; in training, each forward's tensor inputs are
    compared with the shapes the plan was profiled with, and a larger one (a bigger
    batch, a longer sequence) warns once per new shape with the peak scaled to it
    (or raises, with ``strict_shapes``); smaller ones pass silently. A unit module
    replaced after ``apply_plan`` raises ``PlanMismatchError`` at the next training
    forward (apply the plan again). A unit that writes into its own input in place
    cannot be recomputed: its first call finds out, and it runs as ``keep``, with a
    warning (:mod:`remat.execute.inplace`); a ``selective`` unit that writes into a
    tensor selective keeps is refused at its first call.

    The loop and the model are watched too: a solved plan records its loop, and
    gradients alive when a forward starts, the output kept through backward, autocast
    or parameter dtypes other than planned, or a block added after ``apply_plan``
    warn once each with what the plan did not count (or raise, with ``strict``).
    A model deeper than the one profiled (more modules of the units' classes) is
    refused here, and so are parameters in another dtype.

    Recomputation runs as the forward ran: in the train/eval modes the forward had
    (``model.eval()`` before ``backward()`` is fine), and ``selective`` survives
    ``backward(retain_graph=True)`` twice and double backward.

    Args:
        model: the model the plan was made for (same unit names and types).
        plan: a solved plan, or a manual one (``Plan.checkpoint_all(names)``,
            ``Plan.from_options(names, {...})``; checked by unit names and types only).
        strict_shapes: raise ``PlanMismatchError`` instead of warning when a training
            forward gets inputs larger than the plan was profiled with.
        strict: raise ``PlanMismatchError`` instead of warning on every mismatch
            between the plan and the training that runs (the loop, the dtype, an added
            module, larger inputs: ``strict_shapes`` too).

    Raises:
        PlanMismatchError: the plan does not fit the model (missing units, other
            module types or parameter shapes, another device, ``offload`` without
            CUDA...). The model is left unchanged.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"apply_plan() needs a remat Plan, got {type(plan).__name__}")
    target = unwrap(model)
    modules = _validate(target, plan)
    if STATE_ATTR in target.__dict__:
        logger.info("remat: replacing the plan already applied to %s", type(target).__name__)
        remove_plan(target)
    _warn_if_hf_checkpointing(plan, modules)

    runner = None
    if plan.segments:
        _disable_compile_for_segments()
        links = SequentialLinks(target, plan.unit_names, modules, plan.segments)
        runner = SegmentRunner(plan.unit_names, modules, plan.segments, links)
    saved = [m.__dict__.get("forward") for m in modules]
    state = _RematState(plan, modules, saved, runner)
    for i, module in enumerate(modules):
        module.forward = _PlannedForward(state, i)
    state.head_site = install_plan_head(target, plan)
    if runner is not None:
        handle = target.register_forward_hook(_SegmentGuard(runner), always_call=True)
        state.guard_hook_id = handle.id
        state.sequentials = install_sequential_forwards(target, plan.unit_names, modules,
                                                        plan.segments, state)
    checks = LoopChecks(plan, modules, target, strict=strict)
    guard = PlanGuard(plan, modules, positional_names(target), strict_shapes or strict, checks)
    state.plan_guard_id = target.register_forward_pre_hook(guard, with_kwargs=True).id
    if checks.watch_output:
        state.output_watch_id = target.register_forward_hook(OutputWatch(checks)).id
    if modules:
        state.first_unit_id = modules[0].register_forward_pre_hook(checks.at_first_unit).id
    target.__dict__[STATE_ATTR] = state
    logger.debug("remat: applied plan (%s) to %s", plan.summary(), type(target).__name__)
    return model


def remove_plan(model: ModuleT) -> ModuleT:
    """Restore the forwards ``apply_plan`` replaced; returns ``model``.

    Afterwards the model behaves bitwise as if it had never been planned. Removing
    from a model without a plan is a no-op.
    """
    target = unwrap(model)
    state = target.__dict__.get(STATE_ATTR)
    if state is None:
        return model
    if state.runner is not None:
        state.runner.close()
        if getattr(state.runner, "links", None) is not None:
            state.runner.links.remove()
    remove_sequential_forwards(state.sequentials)
    for i, module in enumerate(state.modules):
        current = module.__dict__.get("forward")
        if not (isinstance(current, _PlannedForward) and current._remat_state is state):
            logger.warning(
                "remat: the forward of unit %r was replaced after the plan was applied; "
                "leaving that replacement in place",
                state.plan.unit_names[i],
            )
            continue
        if state.saved_forwards[i] is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = state.saved_forwards[i]
    remove_plan_head(target, state.head_site)
    if state.guard_hook_id is not None:
        target._forward_hooks.pop(state.guard_hook_id, None)
        target._forward_hooks_always_called.pop(state.guard_hook_id, None)
    if state.plan_guard_id is not None:
        target._forward_pre_hooks.pop(state.plan_guard_id, None)
        target._forward_pre_hooks_with_kwargs.pop(state.plan_guard_id, None)
    if state.output_watch_id is not None:
        target._forward_hooks.pop(state.output_watch_id, None)
    if state.first_unit_id is not None and state.modules:
        state.modules[0]._forward_pre_hooks.pop(state.first_unit_id, None)
    del target.__dict__[STATE_ATTR]
    return model


def planned(model: nn.Module) -> Plan | None:
    """The plan applied to ``model``, or ``None`` when it has none.

    Units replaced after ``apply_plan`` (``model.layers[3] = NewBlock()``) run
    unplanned, so they are left out, with any segment they were part of (the
    next training forward raises ``PlanMismatchError`` until the plan is applied
    again); ``None`` when no planned unit is left.
    """
    target = unwrap(model)
    state = target.__dict__.get(STATE_ATTR)
    if state is None:
        return None
    replaced = replaced_units(target, state.plan.unit_names, state.modules)
    return state.plan if not replaced else _without_units(state.plan, set(replaced))


def _without_units(plan: Plan, removed: set[int]) -> Plan | None:
    """A manual plan of ``plan``'s units but ``removed`` (and the segments they were in)."""
    kept = [i for i in range(plan.n) if i not in removed]
    if not kept:
        return None
    new_index = {old: new for new, old in enumerate(kept)}
    segments = tuple((new_index[a], new_index[b]) for a, b in plan.segments
                     if not any(a <= i <= b for i in removed))
    target = plan.target
    return Plan(
        tuple(plan.unit_names[i] for i in kept),
        tuple(plan.options[i] for i in kept),
        segments,
        target=PlanTarget(
            unit_types=None if target.unit_types is None else tuple(target.unit_types[i]
                                                                     for i in kept),
            unit_signatures=(None if target.unit_signatures is None
                             else tuple(target.unit_signatures[i] for i in kept)),
            device=target.device),
    )


# --------------------------------------------------------------------------- checks
def _validate(model: nn.Module, plan: Plan) -> list[nn.Module]:
    """The plan's unit modules, after checking that the plan fits the model."""
    modules = _find_units(model, plan)
    _check_structure(plan, modules)
    _check_types(plan, modules)
    _check_signatures(plan, modules)
    _check_depth(model, plan, modules)
    _check_options(plan)
    _check_device(model, plan)
    check_world_size(model, plan)
    check_head(model, plan)
    return modules


def _find_units(model: nn.Module, plan: Plan) -> list[nn.Module]:
    found: dict[str, nn.Module] = {}
    missing: list[str] = []
    for name in plan.unit_names:
        try:
            found[name] = model.get_submodule(name)
        except AttributeError:
            missing.append(name)
    if missing:
        known = [n for n, _ in model.named_modules() if n]
        hints = {n: difflib.get_close_matches(n, known, n=1) for n in missing[:3]}
        hint_text = "; ".join(f"{n!r}: did you mean {h[0]!r}?" for n, h in hints.items() if h)
        raise PlanMismatchError(
            f"the plan does not fit this {type(model).__name__}: {len(missing)} of its "
            f"{plan.n} units are not submodules of the model: {missing}"
            + (f" ({hint_text})" if hint_text else "")
            + ". A plan is made for one model; profile and solve again for this one "
            "(remat.solve(...))"
        )
    return [found[n] for n in plan.unit_names]


def _check_structure(plan: Plan, modules: list[nn.Module]) -> None:
    names = plan.unit_names
    if len(set(names)) != len(names):
        dups = sorted({n for n in names if names.count(n) > 1})
        raise PlanMismatchError(f"the plan lists units more than once: {dups}")
    seen: dict[int, str] = {}
    for name, module in zip(names, modules):
        if id(module) in seen:
            raise PlanMismatchError(
                f"units {seen[id(module)]!r} and {name!r} are the same module; "
                "a shared module can be one unit only"
            )
        seen[id(module)] = name
    name_set = set(names)
    for name in names:
        parts = name.split(".") if name else []
        ancestors = [".".join(parts[:k]) for k in range(len(parts))]
        nested = [a for a in ancestors if a in name_set]
        if nested:
            raise PlanMismatchError(
                f"unit {name!r} lies inside unit {nested[-1]!r}; units must not be nested"
            )


def _check_types(plan: Plan, modules: list[nn.Module]) -> None:
    if plan.target.unit_types is None:
        return
    if len(plan.target.unit_types) != plan.n:
        raise PlanMismatchError(
            f"the plan has {plan.n} units but {len(plan.target.unit_types)} unit types"
        )
    wrong = [
        f"{name!r} is a {type(m).__name__} in the model but a {expected} in the plan"
        for name, m, expected in zip(plan.unit_names, modules, plan.target.unit_types)
        if type(m).__name__ != expected
    ]
    if wrong:
        raise PlanMismatchError(
            f"the plan was made for another model: unit {'; '.join(wrong[:5])}"
            + (f" (and {len(wrong) - 5} more)" if len(wrong) > 5 else "")
            + "; profile and solve again for this model (remat.solve(...))"
        )


def _check_signatures(plan: Plan, modules: list[nn.Module]) -> None:
    """A solved plan's units have the parameter shapes it was profiled with."""
    if plan.target.unit_signatures is None:
        return  # a manual plan, or one from a profile that did not record them
    wrong = [
        (name, m, expected)
        for name, m, expected in zip(plan.unit_names, modules, plan.target.unit_signatures)
        if unit_signature(m) != expected
    ]
    if wrong:
        name, module, expected = wrong[0]
        more = f" (and {len(wrong) - 1} more units)" if len(wrong) > 1 else ""
        raise PlanMismatchError(
            f"the plan was made for another model: unit {name!r} ({type(module).__name__}) "
            f"{describe_mismatch(module, expected)}{more}. Its memory figures do not hold "
            "here; profile and solve again for this model (remat.solve(model, batch, ...))"
        )


def _check_depth(model: nn.Module, plan: Plan, modules: list[nn.Module]) -> None:
    """A solved plan's model had as many modules of the units' classes as this one.

    More of them (8 blocks under a plan for 6) is a deeper model than the one
    profiled: the others would run unplanned, outside every figure of the plan.
    """
    recorded = plan.target.unit_type_counts
    if recorded is None:
        return  # a manual plan, or one from a profile that did not record them
    live = unit_type_counts(model, [name for name, _ in recorded], plan.unit_names)
    deeper = [(name, live[name], count) for name, count in recorded if live[name] > count]
    if not deeper:
        return
    kind, now, then = deeper[0]
    planned = {id(m) for m in modules}
    others = [name for name, m in model.named_modules()
              if type(m).__name__ == kind and id(m) not in planned
              and not holds_a_unit(name, plan.unit_names)]
    shown = ", ".join(repr(n) for n in others[:5]) + (" ..." if len(others) > 5 else "")
    raise PlanMismatchError(
        f"the model is deeper than the one the plan was made for: it has {now} {kind} modules "
        f"and the profiled model had {then} (besides those holding units); "
        + (f"{shown} are not among the plan's units and" if others else "the others")
        + " would run unplanned, outside the plan's memory figures. Profile and solve "
        "again for this model (remat.solve(model, batch, ...))"
    )


def _check_options(plan: Plan) -> None:
    valid = [o.value for o in Option]
    bad = sorted({o for o in plan.options if o not in valid})
    if bad:
        raise PlanMismatchError(f"unknown options {bad}; valid options: {valid}")
    here = "cuda" if torch.cuda.is_available() else "cpu"
    for option in sorted({Option(o) for o in plan.options}):
        reason = option.unavailable_on(here)
        if reason is not None:
            units = [n for n, o in zip(plan.unit_names, plan.options) if o == option]
            raise PlanMismatchError(f"{reason} (units {units[:5]}); or solve again on this machine")


def _check_device(model: nn.Module, plan: Plan) -> None:
    if plan.target.device is None:
        return
    try:
        expected = torch.device(plan.target.device).type
    except (RuntimeError, ValueError):
        raise PlanMismatchError(
            f"the plan's target device {plan.target.device!r} is not a device torch knows "
            "('cpu', 'cuda', 'mps'...); the plan was edited or written by another tool. Set "
            "its target 'device' to the device type the model trains on, or solve again "
            "(remat.solve(model, batch, ...))"
        ) from None
    tensors = list(model.parameters()) or list(model.buffers())
    found = sorted({t.device.type for t in tensors})
    if found and found != [expected]:
        raise PlanMismatchError(
            f"the plan was measured on device '{expected}' but the model is on {found}; "
            f"move the model (model.to('{expected}')) or profile and solve again on this device"
        )


def _warn_if_hf_checkpointing(plan: Plan, modules: list[nn.Module]) -> None:
    doubled = [
        name
        for name, m, opt in zip(plan.unit_names, modules, plan.options)
        if opt != Option.KEEP.value and getattr(m, "gradient_checkpointing", False) is True
    ]
    if doubled:
        logger.warning(
            "remat: Hugging Face gradient checkpointing is also on for %d units (%s...); "
            "they would be recomputed twice. Call model.gradient_checkpointing_disable()",
            len(doubled),
            doubled[0],
        )

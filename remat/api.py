"""What users call: ``solve`` (profile + optimise), ``pareto`` (the trade-off curve),
and the checked front door of ``apply_plan``.

Budget semantics, everywhere in remat: a memory budget is the **peak of one
training step on the device, everything included** -- parameters, buffers,
gradients, optimizer state (when an optimizer is given), activations and
temporaries. Strings such as ``"8GB"`` (SI), ``"7.5GiB"`` (binary) and ``"60%"``
are accepted. A percentage is a share of the **activation memory**: ``"60%"`` is
the persistent bytes (parameters, buffers, optimizer state, gradients) plus 60% of
what the no-checkpoint peak holds above them; ``"60% of peak"``
(:func:`remat.of_peak`) is 60% of the whole no-checkpoint peak
(:mod:`remat.core.budget`).

Every entry point checks its arguments before it profiles (:mod:`remat.core.checks`):
a wrong argument is a :class:`~remat.core.errors.RematError` that names it and the fix,
and costs no profiling time.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from remat.core.budget import of_activations
from remat.core.bytesize import format_bytes
from remat.core.checks import (
    check_budget_arg,
    check_count,
    check_flag,
    check_head_setting,
    check_inputs,
    check_model,
    check_plan,
    check_profile_args,
    check_timing,
)
from remat.core.errors import ArgumentError, ParameterError, ProfileError, RematError
from remat.core.loop import Loop
from remat.core.plan import Plan
from remat.core.profile import UNIT_TYPE_COUNTS, Profile
from remat.solver.resolve import resolve_budget
from remat.solver.solve import check_method

if TYPE_CHECKING:
    import pandas as pd
    from torch import nn

    from remat.measurement.step import StepMeasurement
    from remat.tune.profile_cache import Lookup

__all__ = ["activation_budget", "apply_plan", "pareto", "profile", "remove_plan", "solve"]

log = logging.getLogger("remat")


def profile(
    model: nn.Module,
    sample_batch: Any,
    *,
    granularity: str = "blocks",
    **settings: Any,
) -> Profile:
    """Measure one training step of ``model`` on ``sample_batch``, unit by unit
    (:func:`remat.profiler.profile`, whose keyword arguments it takes: ``loss_fn``,
    ``units``, ``optimizer``, ``options``, ``loop``, ``warmup``, ``repeats``...).

    ``granularity``: ``"blocks"`` (default) plans the units as found, ``"children"``
    each unit's children instead, and ``"auto"``, where the units are few (under 8) or
    one holds half of their memory, profiles both levels and returns the one whose
    optimal plans are faster over a range of budgets (:mod:`remat.granularity`; it
    costs a second profile).

    A second call on the same model with the same batch shapes, loop and settings takes
    the profile the first made (:mod:`remat.profile_cache`: any change to the model's
    structure, attributes, config, classes' forwards, shapes, dtypes, modes or buffers, to
    torch's kernel flags, or to the settings, measures anew; what it cannot see, and the
    remedy, are in its docstring).

    Inside a ``torch.autocast`` and without ``loop=``, the profile is for
    ``Loop(autocast=<its dtype>)`` (a ``loop=`` that says otherwise is refused):
    :mod:`remat.ambient`.
    """
    from remat.tune.ambient import planning

    with planning(model, settings.pop("loop", None), "profile()") as loop:
        return _profile(model, sample_batch, granularity=granularity, loop=loop,
                        **settings).profile


def _profile(model: nn.Module, sample_batch: Any, *, granularity: str, fresh: bool = False,
             **settings: Any) -> Lookup:
    """:func:`profile`'s work, outside any ambient autocast: the cached profile, or a new one
    (always a new one when ``fresh``), and which it is."""
    from remat.profiler import profile_levels
    from remat.tune.profile_cache import cached_profile

    check_profile_args(model, sample_batch, loss_fn=settings.get("loss_fn"),
                       optimizer=settings.get("optimizer"), loop=settings.get("loop"))
    # Before the cache: a cached profile would otherwise hide a malformed setting.
    check_timing(settings.get("warmup", 1), settings.get("repeats", 3),
                 settings.get("tolerance", 0.05))

    def make() -> Profile:
        blocks, children = profile_levels(model, sample_batch, granularity=granularity,
                                          **settings)
        if children is None:
            return _with_unit_type_counts(blocks, model)
        from remat.tune.granularity import pick_level

        return _with_unit_type_counts(pick_level(blocks, children), model)

    return cached_profile(model, sample_batch, make,
                          settings={**settings, "granularity": granularity}, fresh=fresh)


def _with_unit_type_counts(prof: Profile, model: nn.Module) -> Profile:
    """``prof`` with how many modules of each unit class the model has, in its ``meta``:
    a plan solved from it refuses a deeper model (``PlanTarget.unit_type_counts``)."""
    from remat.execute.structure import unit_type_counts

    counts = unit_type_counts(model, (u.type_name for u in prof.units),
                              [u.name for u in prof.units])
    return dataclasses.replace(prof, meta={**prof.meta, UNIT_TYPE_COUNTS: counts})


def _as_profile(
    model_or_profile: nn.Module | Profile,
    sample_batch: Any,
    *,
    loss_fn: Callable[[Any, Any], Any] | None,
    optimizer: Any,
    units: Any,
    options: Sequence[str] | None,
    loop: Loop | None = None,
    granularity: str = "blocks",
    head: str = "auto",
) -> Profile:
    """``model_or_profile`` itself, or the profile of the model on ``sample_batch``."""
    if isinstance(model_or_profile, Profile):
        return model_or_profile
    return profile(model_or_profile, sample_batch, loss_fn=loss_fn, optimizer=optimizer,
                   units=units, options=options, loop=loop, granularity=granularity, head=head)


def solve(
    model_or_profile: nn.Module | Profile,
    sample_batch: Any = None,
    memory_budget: int | str | None = None,
    *,
    method: str = "optimal",
    loss_fn: Callable[[Any, Any], Any] | None = None,
    optimizer: Any = None,
    units: Any = None,
    options: Sequence[str] | None = None,
    loop: Loop | None = None,
    granularity: str = "blocks",
    head: str = "auto",
    verify: bool = True,
    verify_rounds: int = 3,
    verify_steps: int = 1,
    compiled: bool = False,
    compile_options: Mapping[str, Any] | None = None,
    **solver_params: Any,
) -> Plan:
    """Profile a model and solve for the fastest checkpointing plan that fits a budget.

    Args:
        model_or_profile: the ``nn.Module`` to plan for, or a :class:`Profile`
            measured earlier (then ``sample_batch`` is not needed, and one
            profile serves many budgets: ``remat.solve(profile, memory_budget="4GB")``).
        sample_batch: a representative batch: a tensor, a tuple of positional
            inputs, or a dict of keyword inputs (``model(**batch)``).
        memory_budget: the peak of one training step, everything included
            (parameters, gradients, optimizer state, activations, temporaries):
            bytes as an int, or ``"8GB"``, ``"7.5GiB"``, ``"512MiB"``; ``"60%"`` of the
            activation memory (the persistent bytes plus 60% of the rest of the
            no-checkpoint peak), ``"60% of peak"`` of the whole no-checkpoint peak
            (also :func:`remat.of_activations`, :func:`remat.of_peak`). ``None``: no limit.
        method: ``"optimal"`` (default, exact dynamic programming), ``"dp"``,
            ``"ilp"`` (CP-SAT), ``"chen"``, ``"chen-greedy"``, ``"uniform"``,
            ``"all"`` (checkpoint every unit), ``"none"``.
        loss_fn: ``loss_fn(output, batch) -> scalar``; default: ``output.loss``.
        optimizer: when given, its state and ``step()`` count towards the peak (with
            ``Loop(optimizer_in_backward=True)``, required: each parameter's own step,
            in backward; pass the ``.optimizer`` of ``remat.optimizer_in_backward``).
        units: which modules may be checkpointed (names, a class, or a
            predicate ``(name, module) -> bool``); default: discovered blocks.
        options: the options to consider (default: all the device offers).
        loop: the training loop the budget must hold for
            (:class:`remat.Loop`: gradient accumulation, whether the loop keeps the
            output through backward, autocast, a gradient scaler,
            ``zero_grad(set_to_none=...)``, the optimizer stepped in backward);
            default ``remat.Loop()``, a plain loop that keeps the output.
            ``remat.Loop.hf_trainer(args)`` is Hugging Face's.
        granularity: ``"blocks"`` (default), ``"children"`` or ``"auto"`` (also profile
            the blocks' children when the blocks are few or one dominates, and keep
            the level with the better frontier): see :func:`remat.profile`. Called
            inside a ``torch.autocast`` without ``loop=``, the loop is
            ``Loop(autocast=<its dtype>)`` (logged); a ``loop=`` with another autocast
            is refused (:mod:`remat.ambient`).
        head: the output head and its loss computed over chunks of the tokens, so the
            whole logits never exist, is a decision the solver makes where the budget
            needs it (:mod:`remat.execute.head`). It changes how the loss is summed (not
            bitwise), so it is offered only where remat found a head whose rewrite gives
            the same loss and gradients on one example of the batch, and a plan takes it
            only where the budget needs it. ``"auto"`` (default): offered where the loop
            drops the output (``Loop(keep_output=False)``: a kept output's logits would be
            computed when read), taken only below the smallest peak of the head as
            written; ``"chunked"``: offered whatever the loop keeps and taken wherever
            faster (an error where no head is recognised or its check fails); ``"none"``:
            never.
            With a :class:`Profile`, ``"none"`` plans the head as it was measured as it
            is (a ``ProfileError`` where only its chunked variants were), ``"chunked"``
            needs a profile that measured them.
        verify: with a model and a budget, apply the plan, measure one real step of
            the loop (the higher of the dispatch-level meter and the allocator's
            view), and when it is over the budget solve again for a budget lowered by
            the excess (:mod:`remat.verify`). The plan records the measured peak.
            A plan from a *cached* profile measured more than 1% off its prediction
            means the model changed where the cache's key does not look: that profile
            is dropped, the model profiled once more, and the plan solved on it (logged).
            ``False`` skips it (the plan then carries only its prediction).
        verify_rounds: the most plans verification measures.
        verify_steps: how many consecutive optimizer steps verification measures (the
            peak over all of them); more catches memory that changes after the first
            steps (a branch that turns on at step k), at one measured step's time each.
        compiled: the model will train under ``torch.compile``: choose the fastest
            plan of the optimal frontier, and inductor ``activation_memory_budget``,
            whose *compiled* step, measured with the allocator, fits the budget
            (:mod:`remat.compiled`; compiles a few candidates; needs the model, not a
            profile). Compile the result with :func:`remat.compile_planned`.
        compile_options: keyword arguments for ``torch.compile`` when ``compiled``.
        **solver_params: passed to the algorithm (e.g. ``k`` for ``"uniform"``,
            ``time_limit_s`` for ``"ilp"``), or with ``compiled`` to
            :func:`remat.compiled.solve_compiled` (``partitioner_budgets``,
            ``points``, ``max_compiles``).

    Returns:
        The :class:`Plan`, with its predicted peak and time.

    Raises:
        ArgumentError: an argument of the wrong kind (checked before profiling).
        BudgetError: the budget cannot be parsed (checked before profiling).
        UnknownMethodError, UnknownParameterError: a method or keyword that does not
            exist (checked before profiling).
        InfeasibleBudgetError: no plan fits; it carries the smallest feasible peak.
    """
    if isinstance(model_or_profile, Profile) and memory_budget is None and sample_batch is not None:
        memory_budget, sample_batch = sample_batch, None  # remat.solve(profile, "8GB")
    # Everything that can be wrong without the profile fails before profiling starts.
    check_inputs("solve()", model_or_profile, sample_batch, loss_fn=loss_fn,
                  optimizer=optimizer, loop=loop)
    budget = check_budget_arg(memory_budget)  # read once, passed on
    check_head_setting(head, "solve()")
    if compiled:
        check_method(method, {})
    else:
        check_method(method, solver_params)
    # Checked whether or not verification runs: a malformed count is a mistake either way.
    check_count("verify_rounds", verify_rounds, lo=1, meaning="the most plans verification "
                "measures; verify=False skips it", owner="solve()")
    check_count("verify_steps", verify_steps, lo=1, meaning="the consecutive optimizer "
                "steps verification measures", owner="solve()")
    if compiled and (isinstance(model_or_profile, Profile) or memory_budget is None):
        raise RematError(
            "compiled=True measures candidate plans compiled, so it needs the model, a sample "
            "batch and a budget: remat.solve(model, sample_batch, memory_budget=..., "
            "compiled=True)"
        )
    if isinstance(model_or_profile, Profile):
        prof = profile_for_head(model_or_profile, head, "solve()")
        plan = _solve(prof, sample_batch, _within_device(prof, budget), method=method,
                      verify=False, solver_params=solver_params, head=head)
    else:
        from remat.tune.ambient import planning
        from remat.tune.profile_cache import note_restored
        from remat.tune.sharded import is_sharded, solve_sharded

        model = model_or_profile
        if is_sharded(model):  # FSDP2: every rank calls; one plan for all (remat.tune.sharded)
            if compiled:
                raise RematError("compiled=True is not supported on a model sharded with "
                                 "fully_shard yet; solve without it")
            return solve_sharded(model, sample_batch, budget, method=method, loss_fn=loss_fn,
                                 optimizer=optimizer, units=units, options=options, loop=loop,
                                 granularity=granularity, head=head, verify=verify,
                                 verify_rounds=verify_rounds, verify_steps=verify_steps,
                                 solver_params=solver_params)
        with planning(model, loop, "solve()") as loop:
            settings = {"loss_fn": loss_fn, "optimizer": optimizer, "units": units,
                        "options": options, "loop": loop, "head": head}
            found = _profile(model, sample_batch, granularity=granularity, **settings)
            prof = found.profile
            # Both searches plan within what the device can give (CUDA), eager or compiled.
            budget = _within_device(prof, budget)
            if compiled:
                from remat.tune.compiled import solve_compiled

                try:
                    return solve_compiled(model, sample_batch, prof, budget, method=method,
                                          loss_fn=loss_fn, optimizer=optimizer,
                                          compile_options=compile_options, **solver_params)
                finally:
                    note_restored(model, prof)

            def reprofile() -> Profile:
                return _profile(model, sample_batch, granularity=granularity, fresh=True,
                                **settings).profile

            plan = _solve(prof, sample_batch, budget, method=method, verify=verify,
                          solver_params=solver_params, model=model, loss_fn=loss_fn,
                          optimizer=optimizer, rounds=verify_rounds, steps=verify_steps,
                          reprofile=reprofile if found.cached else None, head=head)
    log.info(
        "remat: %s plan (%s), predicted peak %d B, step %.1f ms",
        plan.record.algorithm,
        plan.summary(),
        plan.record.predicted_peak_bytes or 0,
        plan.record.predicted_time_ms or 0.0,
    )
    return plan


def _within_device(profile: Profile, budget: Any) -> Any:
    """``budget``, or the device's capacity where that is less (CUDA: a plan for more
    than the device can give would run out of memory, whatever budget it was asked for)."""
    if budget is None or not profile.device.startswith("cuda"):
        return budget
    import torch

    from remat.measurement.device import device_capacity_bytes
    from remat.solver.resolve import resolve_budget

    capacity = device_capacity_bytes(torch.device(profile.device))
    asked = resolve_budget(budget, profile)
    if capacity is None or asked <= capacity:
        return budget
    log.warning("remat: memory_budget=%s is more than %s can give (%s free and held by this "
                "process): planning for that instead", format_bytes(asked), profile.device,
                format_bytes(capacity))
    return capacity


class _StaleProfile(Exception):
    """A plan from a cached profile measured off its prediction (never leaves :func:`_solve`)."""

    def __init__(self, plan: Plan, measured_bytes: int) -> None:
        super().__init__()
        self.predicted_bytes = plan.record.predicted_peak_bytes or 0
        self.measured_bytes = measured_bytes


def _solve(prof: Profile, sample_batch: Any, budget: Any, *, method: str, verify: bool,
           solver_params: Mapping[str, Any], model: nn.Module | None = None,
           loss_fn: Callable[[Any, Any], Any] | None = None, optimizer: Any = None,
           rounds: int = 3, steps: int = 1,
           reprofile: Callable[[], Profile] | None = None, head: str = "auto") -> Plan:
    """:func:`solve`'s plan for ``prof``, verified on ``model`` when there is one and a budget.

    ``reprofile``: given where ``prof`` came from the cache. The cache's key cannot see
    everything a step's memory depends on (:mod:`remat.profile_cache`), so a plan measured
    further from its prediction than the predictions go (:func:`remat.verify.off_prediction`)
    drops ``prof``: the model is profiled once more, and solved and verified on that.
    """
    from remat.solver.solve import solve_profile

    plan = solve_profile(prof, budget, method=method, head=head, **solver_params)
    if not verify or plan.budget_bytes is None or model is None:
        return plan
    from remat.tune.profile_cache import note_prediction_off, note_restored
    from remat.tune.verify import measure_plan, off_prediction, verified

    def measure(candidate: Plan) -> StepMeasurement:
        measured = measure_plan(model, sample_batch, candidate, loss_fn=loss_fn,
                                optimizer=optimizer, loop=prof.loop, steps=steps)
        if off_prediction(candidate, measured):
            if reprofile is not None:
                raise _StaleProfile(candidate, measured.worst_peak_bytes)
            note_prediction_off(model, prof)
        return measured

    try:
        return verified(
            plan, plan.budget_bytes,
            lambda target: solve_profile(prof, target, method=method, head=head,
                                         **solver_params)
            .with_(budget_bytes=plan.budget_bytes),
            measure, rounds=rounds,
        )
    except _StaleProfile as err:
        stale = err  # solved again below, outside the handler: no chained traceback
    finally:
        # Verification ran the model and restored it: its profile still describes it.
        note_restored(model, prof)
    assert reprofile is not None
    log.warning("remat: a plan from the cached profile of this %s measured %s against a "
                "prediction of %s: the model changed in a way the cache's key does not see "
                "(remat.profile_cache); profiling it again", type(model).__name__,
                format_bytes(stale.measured_bytes), format_bytes(stale.predicted_bytes))
    return _solve(reprofile(), sample_batch, budget, method=method, verify=True,
                  solver_params=solver_params, model=model, loss_fn=loss_fn,
                  optimizer=optimizer, rounds=rounds, steps=steps, head=head)


def profile_for_head(profile: Profile, head: str, owner: str) -> Profile:
    """``profile`` as ``head`` asks, for a profile given rather than measured: ``"auto"``
    as measured; ``"none"`` without the chunked variants (the head as it is, where it was
    measured so); ``"chunked"`` only where the variants were measured.

    Raises:
        ProfileError: ``head`` asks for what the profile did not measure.
    """
    measured = profile.head
    if head == "none" and measured is not None:
        if not measured.as_is:
            raise ProfileError(
                f"{owner} got head='none' with a profile whose head {measured.name!r} was "
                f"measured only over chunks (the head as it is did not fit the device when "
                f"profiled), so no plan from it computes the head as it is; pass head='auto', "
                f"or profile again with head='none' where the head fits")
        return dataclasses.replace(profile, head=None)
    if head == "chunked" and measured is None:
        raise ProfileError(
            f"{owner} got head='chunked' with a profile that measured no chunked head, so it "
            f"cannot plan one; pass head='auto', or profile with head='chunked' "
            f"(remat.profile(model, sample_batch, head='chunked'))")
    return profile


def pareto(
    model_or_profile: nn.Module | Profile,
    sample_batch: Any = None,
    *,
    points: int = 20,
    method: str = "dp",
    baselines: bool = True,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    optimizer: Any = None,
    units: Any = None,
    options: Sequence[str] | None = None,
    loop: Loop | None = None,
    granularity: str = "blocks",
    head: str = "auto",
) -> pd.DataFrame:
    """The optimal memory/time frontier, from the smallest feasible peak to no checkpointing.

    Returns a DataFrame with one row per point: ``budget_bytes``, ``peak_bytes``,
    ``time_ms``, ``overhead_pct`` (against no checkpointing), ``algorithm``,
    ``plan`` (a summary) and ``kind`` (``"optimal"`` or ``"baseline"``); with
    ``baselines=True`` it also holds the points of no checkpointing, every block,
    uniform segments and Chen's sqrt(n). ``head``: as for :func:`solve` (a chunked head
    extends the frontier below what checkpointing the blocks reaches).
    """
    check_head_setting(head, "pareto()")
    check_inputs("pareto()", model_or_profile, sample_batch, loss_fn=loss_fn,
                  optimizer=optimizer, loop=loop)
    check_count("points", points, lo=1, meaning="how many budgets to solve at",
                owner="pareto()")
    check_method(method, {})
    if isinstance(model_or_profile, Profile):
        prof = profile_for_head(model_or_profile, head, "pareto()")
    else:
        from remat.tune.ambient import planning

        with planning(model_or_profile, loop, "pareto()") as loop:
            prof = _as_profile(model_or_profile, sample_batch, loss_fn=loss_fn,
                               optimizer=optimizer, units=units, options=options, loop=loop,
                               granularity=granularity, head=head)
    from remat.solver.pareto import pareto_frontier

    return pareto_frontier(prof, points=points, method=method, baselines=baselines, head=head)


def activation_budget(profile: Profile, fraction: float) -> int:
    """A budget that leaves ``fraction`` of the step's activation memory, in bytes.

    The same as the budget ``f"{100 * fraction}%"`` (or :func:`remat.of_activations`):
    ``persistent + fraction * (peak_without_checkpointing - persistent)``, where
    persistent is the parameters, buffers, optimizer state and gradients
    (:attr:`remat.Profile.persistent_bytes`).

    Raises:
        ArgumentError: ``profile`` is not a :class:`Profile`.
        ParameterError: ``fraction`` is not a number within ``[0, 1]`` (a string such
            as ``"0.5"`` or ``"50%"`` included: the budget string goes to ``solve``).
    """
    if not isinstance(profile, Profile):
        raise ArgumentError(f"activation_budget() needs a remat Profile (from remat.profile()), "
                            f"got a {type(profile).__name__}")
    number = isinstance(fraction, numbers.Real) and not isinstance(fraction, bool)
    if not number or not math.isfinite(fraction) or not 0.0 <= fraction <= 1.0:
        raise ParameterError(
            f"activation_budget() needs fraction, a number within [0, 1] (the share of the "
            f"activation memory to leave: 0.5 for half), got {fraction!r}; pass "
            f"{_as_fraction(fraction)}, or give remat.solve() the budget string "
            "memory_budget='50%'")
    if fraction == 0:
        return profile.persistent_bytes
    return resolve_budget(of_activations(fraction), profile)


def _as_fraction(value: Any) -> str:
    """What the user probably meant, as a number: ``"0.5"`` -> ``0.5``, ``"50%"`` -> ``0.5``."""
    text = str(value).strip()
    try:
        number = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        return "a float such as 0.5"
    return repr(number) if 0.0 <= number <= 1.0 else "a float such as 0.5"


def apply_plan(model: nn.Module, plan: Plan, *, strict_shapes: bool = False,
               strict: bool = False) -> nn.Module:
    """:func:`remat.runtime.apply_plan` after checking its arguments: change ``model`` in
    place so that training runs under ``plan``; returns ``model``.

    Args:
        model, plan: the model and the plan made for it.
        strict_shapes: a training forward on inputs larger than the plan was profiled
            with raises ``PlanMismatchError`` instead of warning.
        strict: every mismatch between the plan and the training that runs (gradients
            alive at a forward's start, the output kept through backward, another
            autocast or dtype, an added module, larger inputs) raises
            ``PlanMismatchError`` instead of warning once.

    Raises:
        ArgumentError: ``model`` is not a module, or ``plan`` is not a Plan (a path to a
            plan file: load it with ``remat.Plan.from_json(path)``), or ``strict`` or
            ``strict_shapes`` is not a bool.
        PlanMismatchError: the plan does not fit the model (another width, dtype or
            depth, a device it was not made for).
    """
    check_model(model, "apply_plan()")
    check_plan(plan, "apply_plan()")
    check_flag("strict_shapes", strict_shapes, owner="apply_plan()")
    check_flag("strict", strict, owner="apply_plan()")
    from remat.runtime import apply_plan as apply

    return apply(model, plan, strict_shapes=strict_shapes, strict=strict)


def remove_plan(model: nn.Module) -> nn.Module:
    """:func:`remat.runtime.remove_plan` after checking its argument: restore the forwards
    ``apply_plan`` replaced; returns ``model`` (a no-op on a model without a plan).

    Raises:
        ArgumentError: ``model`` is not a module.
    """
    check_model(model, "remove_plan()")
    from remat.runtime import remove_plan as remove

    return remove(model)

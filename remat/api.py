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

Settings are values (:mod:`remat.core.settings`): each entry point builds one
:class:`~remat.core.settings.ProfilingSettings` from its keywords and passes it down
(the profile cache keys by it), verification is one :class:`~remat.core.settings.Verify`,
and the budget is resolved to bytes once, when the profile is known.
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
from remat.core.errors import (
    ArgumentError,
    InfeasibleBudgetError,
    ParameterError,
    ProfileError,
    UnknownParameterError,
)
from remat.core.loop import Loop
from remat.core.plan import Plan
from remat.core.profile import UNIT_TYPE_COUNTS, Profile
from remat.core.settings import ProfilingSettings, Verify, verify_setting
from remat.solver.resolve import resolve_budget
from remat.solver.solve import check_method

if TYPE_CHECKING:
    import pandas as pd
    from torch import nn

    from remat.measurement.step import StepMeasurement
    from remat.tune.profile_cache import Lookup

__all__ = ["activation_budget", "apply_plan", "pareto", "profile", "profile_with",
           "remove_plan", "solve", "solve_compiled", "solve_with"]

log = logging.getLogger("remat")

_VERIFY = Verify()  # verify=True


def profile(
    model: nn.Module,
    sample_batch: Any,
    *,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    optimizer: Any = None,
    units: Any = None,
    options: Sequence[str] | None = None,
    loop: Loop | None = None,
    granularity: str = "blocks",
    head: str = "auto",
    warmup: int = 1,
    repeats: int = 3,
    tolerance: float = 0.05,
    pool_twins: bool = True,
    progress: bool | None = None,
) -> Profile:
    """Measure one training step of ``model`` on ``sample_batch``, unit by unit
    (:func:`remat.profiler.profile`).

    Args:
        model, sample_batch: the model and one micro-batch, as for :func:`solve`.
        loss_fn, optimizer, units, options, loop, head: as for :func:`solve`.
        granularity: ``"blocks"`` (default) plans the units as found, ``"children"``
            each unit's children instead, and ``"auto"``, where the units are few (under
            8) or one holds half of their memory, profiles both levels and returns the
            one whose optimal plans are faster over a range of budgets
            (:mod:`remat.tune.granularity`; it costs a second profile).
        warmup, repeats: un-timed and timed runs for every time figure (medians).
        tolerance: stop a time figure's timed runs once those taken pin the median of
            ``repeats`` to within this fraction (``0``: always ``repeats`` runs).
        pool_twins: time twin units (copies of one module on inputs of one shape) as one.
        progress: a progress line on stderr (``None``: on a terminal only).

    The settings are one :class:`~remat.core.settings.ProfilingSettings` value, which is
    also the profile cache's key: a second call on the same model with the same batch
    shapes and settings takes the profile the first made (:mod:`remat.tune.profile_cache`:
    any change to the model's structure, attributes, config, classes' forwards, shapes,
    dtypes, modes or buffers, to torch's kernel flags, or to the settings, measures anew;
    what it cannot see, and the remedy, are in its docstring).

    Inside a ``torch.autocast`` and without ``loop=``, the profile is for
    ``Loop(autocast=<its dtype>)`` (a ``loop=`` that says otherwise is refused):
    :mod:`remat.tune.ambient`.
    """
    settings = ProfilingSettings(
        loss_fn=loss_fn, optimizer=optimizer, units=units, options=options, loop=loop,
        granularity=granularity, head=head, warmup=warmup, repeats=repeats,
        tolerance=tolerance, pool_twins=pool_twins, progress=progress)
    return profile_with(model, sample_batch, settings, "profile()")


def profile_with(model: nn.Module, sample_batch: Any, settings: ProfilingSettings,
                 owner: str = "profile()") -> Profile:
    """:func:`profile` for settings held as one value (``estimate``, ``pareto`` and the
    trainer callbacks hold them so): the loop is the ambient autocast's where
    ``settings.loop`` is ``None`` (``owner`` names the caller in what it logs or refuses)."""
    from remat.tune.ambient import planning
    from remat.tune.replicated import is_replicated, profile_replicated
    from remat.tune.sharded import is_sharded, profile_sharded

    with planning(model, settings.loop, owner) as loop:
        if is_sharded(model):  # FSDP2: every rank calls; the worst rank's step, on each
            return profile_sharded(model, sample_batch, settings.replace(loop=loop),
                                   call={"owner": owner})
        if is_replicated(model):  # DDP: every rank calls; the buckets counted, worst rank's
            return profile_replicated(model, sample_batch, settings.replace(loop=loop),
                                      call={"owner": owner})
        return _profile(model, sample_batch, settings.replace(loop=loop)).profile


def _profile(model: nn.Module, sample_batch: Any, settings: ProfilingSettings, *,
             fresh: bool = False,
             variants_needed: Callable[[Profile], bool] | None = None) -> Lookup:
    """:func:`profile`'s work, outside any ambient autocast: the cached profile, or a new one
    (always a new one when ``fresh``), and which it is.

    ``variants_needed`` (:func:`_variants_needed`): the head's chunked variants are
    measured only where it says the budget needs them. A profile made without them
    serves from the cache only a caller whose budget does not need them either; any
    other caller gets a new profile with them (which replaces it in the cache)."""
    from remat.profiler import profile_levels
    from remat.tune.profile_cache import cached_profile

    check_profile_args(model, sample_batch, loss_fn=settings.loss_fn,
                       optimizer=settings.optimizer, loop=settings.loop)
    # Before the cache: a cached profile would otherwise hide a malformed setting.
    check_timing(settings.warmup, settings.repeats, settings.tolerance)

    def make(asked: Callable[[Profile], bool] | None = variants_needed) -> Profile:
        # The profiler's signature stays its own: the value becomes its keyword arguments.
        blocks, children = profile_levels(model, sample_batch, variants_needed=asked,
                                          **settings.as_kwargs())
        if children is None:
            return _with_unit_type_counts(blocks, model)
        from remat.tune.granularity import pick_level

        return _with_unit_type_counts(pick_level(blocks, children), model)

    found = cached_profile(model, sample_batch, make, settings=settings, fresh=fresh)
    partial = found.profile.meta.get("head_variants")
    if partial is not None and (variants_needed is None or (
            partial == "not measured" and variants_needed(found.profile))):
        found = cached_profile(model, sample_batch, lambda: make(None), settings=settings,
                               fresh=True)
    return found


def _variants_skipped(prof: Profile) -> bool:
    """Whether ``prof`` was measured without its head's chunked variants (a budget above
    the head as written did not need them)."""
    return prof.meta.get("head_variants") == "not measured"


# How close above the head-as-written floor a budget still has the variants measured:
# verification lowers a budget by what a plan measured above it (about 1%), which must
# not land it below a floor with nothing measured to plan there.
_FLOOR_MARGIN = 1.02


def _variants_needed(budget: Any, head: str) -> Callable[[Profile], bool] | None:
    """The profiler's question for ``budget`` (see :func:`remat.profiler.profile_levels`):
    with ``head="auto"`` a plan chunks the head only below the smallest peak of the head as
    written, so its chunked variants are needed only for a budget under that (with
    :data:`_FLOOR_MARGIN`); ``None`` (measure them all) for ``head="chunked"``, which
    chunks wherever faster, and ``head="none"``, which measures no head."""
    if head != "auto":
        return None

    def needed(prof: Profile) -> bool:
        from remat.solver import min_peak_bytes

        budget_bytes = _within_device(prof, budget)
        return budget_bytes is not None and budget_bytes < _FLOOR_MARGIN * min_peak_bytes(prof)

    return needed


def _with_unit_type_counts(prof: Profile, model: nn.Module) -> Profile:
    """``prof`` with how many modules of each unit class the model has, in its ``meta``:
    a plan solved from it refuses a deeper model (``PlanTarget.unit_type_counts``)."""
    from remat.execute.structure import unit_type_counts

    counts = unit_type_counts(model, (u.type_name for u in prof.units),
                              [u.name for u in prof.units])
    return dataclasses.replace(prof, meta={**prof.meta, UNIT_TYPE_COUNTS: counts})


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
    verify: bool | Verify = True,
    verify_rounds: int | None = None,
    verify_steps: int | None = None,
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
            is refused (:mod:`remat.tune.ambient`).
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
        verify: with a model and a budget, apply the plan, measure a real step of
            the loop (the higher of the dispatch-level meter and the allocator's
            view), and when it is over the budget solve again for a budget lowered by
            the excess (:mod:`remat.tune.verify`). The plan records the measured peak.
            ``True`` (default) is ``remat.Verify()``: one measured step, at most 3
            plans; ``remat.Verify(rounds=..., steps=...)`` says how many of each
            (:class:`remat.Verify`).
            A plan from a *cached* profile measured more than 1% off its prediction
            means the model changed where the cache's key does not look: that profile
            is dropped, the model profiled once more, and the plan solved on it (logged).
            ``False`` skips it (the plan then carries only its prediction).
        verify_rounds, verify_steps: shorthand for ``verify=remat.Verify(rounds=...,
            steps=...)`` (not both spellings at once): the most plans verification
            measures, and how many consecutive optimizer steps it measures (the peak
            over all of them; more catches memory that changes after the first steps,
            a branch that turns on at step k, at one measured step's time each).
        compiled, compile_options: ``compiled=True`` is
            :func:`remat.solve_compiled` (the model will train under ``torch.compile``),
            with ``compile_options`` and, in ``**solver_params``, its
            ``partitioner_budgets``, ``points`` and ``max_compiles``; call
            :func:`remat.solve_compiled` itself, where every keyword has one meaning.
        **solver_params: passed to the algorithm (e.g. ``k`` for ``"uniform"``,
            ``time_limit_s`` for ``"ilp"``).

    Returns:
        The :class:`Plan`, with its predicted peak and time.

    Raises:
        ArgumentError: an argument of the wrong kind, ``verify=`` included (checked
            before profiling).
        BudgetError: the budget cannot be parsed (checked before profiling).
        UnknownMethodError, UnknownParameterError: a method or keyword that does not
            exist (checked before profiling).
        InfeasibleBudgetError: no plan fits; it carries the smallest feasible peak.
    """
    if isinstance(model_or_profile, Profile) and memory_budget is None and sample_batch is not None:
        memory_budget, sample_batch = sample_batch, None  # remat.solve(profile, "8GB")
    settings = ProfilingSettings(loss_fn=loss_fn, optimizer=optimizer, units=units,
                                 options=options, loop=loop, granularity=granularity, head=head)
    # Checked whether or not verification runs: a malformed setting is a mistake either way.
    verification = verify_setting(verify, rounds=verify_rounds, steps=verify_steps,
                                  owner="solve()")
    if compiled:
        unknown = sorted(set(solver_params) - set(COMPILED_SEARCH_PARAMS))
        if unknown:
            raise UnknownParameterError(
                f"solve(compiled=True) does not take {unknown}: the compiled search takes "
                f"{list(COMPILED_SEARCH_PARAMS)} (remat.solve_compiled)")
        return _solve_compiled(model_or_profile, sample_batch, memory_budget, settings,
                               method=method, compile_options=compile_options,
                               search_params=solver_params, owner="solve()")
    return solve_with(model_or_profile, sample_batch, memory_budget, settings, method=method,
                      verify=verification, solver_params=solver_params)


def solve_with(
    model_or_profile: nn.Module | Profile,
    sample_batch: Any,
    memory_budget: int | str | None,
    settings: ProfilingSettings,
    *,
    method: str = "optimal",
    verify: Verify | None = _VERIFY,
    solver_params: Mapping[str, Any] | None = None,
    owner: str = "solve()",
) -> Plan:
    """:func:`solve` for settings held as values (the trainer callbacks hold them so):
    the profiling settings, and the verification (``None``: none).

    Everything that can be wrong without the profile fails before profiling starts, and
    the budget is resolved to bytes once, when the profile is known: that is the number
    solved for, verified against and recorded.
    """
    solver_params = dict(solver_params or {})
    check_inputs(owner, model_or_profile, sample_batch, loss_fn=settings.loss_fn,
                 optimizer=settings.optimizer, loop=settings.loop)
    budget = check_budget_arg(memory_budget)  # read once, passed on
    check_head_setting(settings.head, owner)
    check_method(method, solver_params)
    if isinstance(model_or_profile, Profile):
        prof = profile_for_head(model_or_profile, settings.head, owner)
        plan = _solve(prof, sample_batch, _within_device(prof, budget), settings,
                      method=method, verify=None, solver_params=solver_params)
    else:
        from remat.tune.ambient import planning
        from remat.tune.replicated import is_replicated, solve_replicated
        from remat.tune.sharded import is_sharded, solve_sharded

        model = model_or_profile
        if is_sharded(model):  # FSDP2: every rank calls; one plan for all (remat.tune.sharded)
            return solve_sharded(model, sample_batch, budget, settings, method=method,
                                 verify=verify, solver_params=solver_params)
        if is_replicated(model):  # DDP: every rank calls; one plan for all (tune.replicated)
            return solve_replicated(model, sample_batch, budget, settings, method=method,
                                    verify=verify, solver_params=solver_params)
        with planning(model, settings.loop, owner) as loop:
            settings = settings.replace(loop=loop)
            needed = _variants_needed(budget, settings.head)
            found = _profile(model, sample_batch, settings, variants_needed=needed)

            def reprofile() -> tuple[Profile, int | None]:
                # A percentage budget is of the profile: resolved again for the fresh one.
                fresh = _profile(model, sample_batch, settings, fresh=True,
                                 variants_needed=needed).profile
                return fresh, _within_device(fresh, budget)

            try:
                plan = _solve(found.profile, sample_batch,
                              _within_device(found.profile, budget), settings, method=method,
                              verify=verify, solver_params=solver_params, model=model,
                              reprofile=reprofile if found.cached else None)
            except InfeasibleBudgetError:
                if not _variants_skipped(found.profile):
                    raise
                # Verification lowered the budget below the head as written: measure the
                # chunked head after all (kept in the cache for the next budget).
                log.info("remat: the budget needs the head chunked: measuring its variants")
                full = _profile(model, sample_batch, settings, fresh=True).profile
                plan = _solve(full, sample_batch, _within_device(full, budget), settings,
                              method=method, verify=verify, solver_params=solver_params,
                              model=model)
    log.info(
        "remat: %s plan (%s), predicted peak %d B, step %.1f ms",
        plan.record.algorithm,
        plan.summary(),
        plan.record.predicted_peak_bytes or 0,
        plan.record.predicted_time_ms or 0.0,
    )
    return plan


def solve_compiled(
    model: nn.Module,
    sample_batch: Any,
    memory_budget: int | str,
    *,
    method: str = "optimal",
    loss_fn: Callable[[Any, Any], Any] | None = None,
    optimizer: Any = None,
    units: Any = None,
    options: Sequence[str] | None = None,
    loop: Loop | None = None,
    granularity: str = "blocks",
    head: str = "auto",
    compile_options: Mapping[str, Any] | None = None,
    partitioner_budgets: Sequence[float] = (1.0, 0.7, 0.4),
    points: int = 20,
    max_compiles: int = 6,
) -> Plan:
    """The plan for a model that will train under ``torch.compile``: the fastest plan of
    the optimal frontier, with inductor's ``activation_memory_budget``, whose *compiled*
    step, measured with the allocator, fits the budget (:mod:`remat.tune.compiled`).

    remat's predictions describe eager execution; compiled, a step holds other tensors,
    so this search measures instead of predicting. It compiles a few candidates (seconds
    to minutes), so it needs the model, a sample batch and a budget, never a profile.
    Compile the result with :func:`remat.compile_planned`. (``solve(..., compiled=True)``
    is this function.)

    Args:
        model, sample_batch, memory_budget: as for :func:`solve` (the budget is the
            compiled step's peak, everything included).
        method: the exact algorithm that builds the frontier: ``"optimal"``, ``"dp"``
            or ``"ilp"``.
        loss_fn, optimizer, units, options, loop, granularity, head: the profiling
            settings, as for :func:`solve`.
        compile_options: keyword arguments for ``torch.compile`` (``backend``, ``mode``).
        partitioner_budgets: the ``activation_memory_budget`` values to search with
            (each may cost a binary search; ``(1.0,)``: remat's checkpointing only).
        points: budgets along the eager frontier (its distinct plans are the candidates).
        max_compiles: at most this many candidates are compiled per partitioner budget.

    Returns:
        The plan, ``feasible`` (not ``optimal``), with its compiled peak, step time and
        ``activation_memory_budget`` measured (``plan.compiled``).

    Raises:
        ArgumentError, BudgetError: as for :func:`solve`, or no model, batch or budget.
        InfeasibleBudgetError: no candidate fits compiled.
    """
    settings = ProfilingSettings(loss_fn=loss_fn, optimizer=optimizer, units=units,
                                 options=options, loop=loop, granularity=granularity, head=head)
    return _solve_compiled(
        model, sample_batch, memory_budget, settings, method=method,
        compile_options=compile_options, owner="solve_compiled()",
        search_params={"partitioner_budgets": partitioner_budgets, "points": points,
                       "max_compiles": max_compiles})


# solve_compiled()'s keywords of the search itself (solve(compiled=True) takes them too).
COMPILED_SEARCH_PARAMS = ("partitioner_budgets", "points", "max_compiles")


def _solve_compiled(model: Any, sample_batch: Any, memory_budget: Any,
                    settings: ProfilingSettings, *, method: str,
                    compile_options: Mapping[str, Any] | None,
                    search_params: Mapping[str, Any], owner: str) -> Plan:
    """:func:`solve_compiled`'s work (``owner``: the call the user made, named in errors)."""
    check_inputs(owner, model, sample_batch, loss_fn=settings.loss_fn,
                 optimizer=settings.optimizer, loop=settings.loop)
    budget = check_budget_arg(memory_budget)
    check_head_setting(settings.head, owner)
    check_method(method, {})
    if isinstance(model, Profile) or memory_budget is None:
        raise ArgumentError(
            f"{owner} measures candidate plans compiled, so it needs the model, a sample "
            "batch and a budget: remat.solve_compiled(model, sample_batch, memory_budget=...)")
    from remat.tune.ambient import planning
    from remat.tune.profile_cache import note_restored
    from remat.tune.replicated import is_replicated
    from remat.tune.sharded import is_sharded

    if is_sharded(model):
        raise ArgumentError(f"{owner}: the compiled search does not support a model sharded "
                            "with fully_shard yet; plan it with remat.solve (eager)")
    if is_replicated(model):
        raise ArgumentError(f"{owner}: the compiled search does not support a model wrapped in "
                            "DistributedDataParallel yet; plan it with remat.solve (eager), "
                            "on every rank")
    with planning(model, settings.loop, owner) as loop:
        settings = settings.replace(loop=loop)
        prof = _profile(model, sample_batch, settings).profile
        # Like the eager search, within what the device can give (CUDA).
        budget_bytes = _within_device(prof, budget)
        from remat.tune.compiled import search_compiled as search

        try:
            return search(model, sample_batch, prof, budget_bytes, method=method,
                          loss_fn=settings.loss_fn, optimizer=settings.optimizer,
                          compile_options=compile_options, **search_params)
        finally:
            note_restored(model, prof)


def _within_device(profile: Profile, budget: Any) -> int | None:
    """``budget`` in bytes for ``profile``, resolved once (a percentage is of this
    profile), or the device's capacity where that is less (CUDA: a plan for more than the
    device can give would run out of memory, whatever budget it was asked for)."""
    if budget is None:
        return None
    asked = resolve_budget(budget, profile)
    if not profile.device.startswith("cuda"):
        return asked
    import torch

    from remat.measurement.device import device_capacity_bytes

    capacity = device_capacity_bytes(torch.device(profile.device))
    if capacity is None or asked <= capacity:
        return asked
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


def _solve(prof: Profile, sample_batch: Any, budget_bytes: int | None,
           settings: ProfilingSettings, *, method: str, verify: Verify | None,
           solver_params: Mapping[str, Any], model: nn.Module | None = None,
           reprofile: Callable[[], tuple[Profile, int | None]] | None = None) -> Plan:
    """:func:`solve`'s plan for ``prof`` within ``budget_bytes`` (resolved once, by the
    caller), verified on ``model`` as ``verify`` says when there is a model and a budget.

    ``reprofile``: given where ``prof`` came from the cache. The cache's key cannot see
    everything a step's memory depends on (:mod:`remat.tune.profile_cache`), so a plan
    measured further from its prediction than the predictions go
    (:func:`remat.tune.verify.off_prediction`) drops ``prof``: ``reprofile()`` profiles
    the model once more (and resolves the budget for that profile), and the plan is
    solved and verified on that.
    """
    from remat.solver.solve import solve_profile

    head = settings.head
    plan = solve_profile(prof, budget_bytes, method=method, head=head, **solver_params)
    if verify is None or budget_bytes is None or model is None:
        return plan
    from remat.tune.profile_cache import note_prediction_off, note_restored
    from remat.tune.verify import measure_plan, off_prediction, verified

    def measure(candidate: Plan) -> StepMeasurement:
        measured = measure_plan(model, sample_batch, candidate, loss_fn=settings.loss_fn,
                                optimizer=settings.optimizer, loop=prof.loop,
                                steps=verify.steps, timed=verify.timed)
        if off_prediction(candidate, measured):
            if reprofile is not None:
                raise _StaleProfile(candidate, measured.worst_peak_bytes)
            note_prediction_off(model, prof)
        return measured

    try:
        return verified(
            plan, budget_bytes,
            lambda target: solve_profile(prof, target, method=method, head=head,
                                         **solver_params)
            .with_(budget_bytes=budget_bytes),
            measure, rounds=verify.rounds,
        )
    except _StaleProfile as err:
        stale = err  # solved again below, outside the handler: no chained traceback
    finally:
        # Verification ran the model and restored it: its profile still describes it.
        note_restored(model, prof)
    assert reprofile is not None
    log.warning("remat: a plan from the cached profile of this %s measured %s against a "
                "prediction of %s: the model changed in a way the cache's key does not see "
                "(remat.tune.profile_cache); profiling it again", type(model).__name__,
                format_bytes(stale.measured_bytes), format_bytes(stale.predicted_bytes))
    fresh, fresh_budget_bytes = reprofile()
    return _solve(fresh, sample_batch, fresh_budget_bytes, settings, method=method,
                  verify=verify, solver_params=solver_params, model=model)


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
        settings = ProfilingSettings(loss_fn=loss_fn, optimizer=optimizer, units=units,
                                     options=options, loop=loop, granularity=granularity,
                                     head=head)
        prof = profile_with(model_or_profile, sample_batch, settings, "pareto()")
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

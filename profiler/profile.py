"""``profile()``: measure a model's training step unit by unit, for the solver, without
ever running the step it measures.

People profile because their step does not fit; so no pass runs the unplanned step,
and every pass holds at most what the most frugal plan holds. The passes, in order
(none changes the model: everything is restored at the end, also on error):

0. **units** (:mod:`.saves`, :mod:`.choice`, :mod:`.discovery`, :mod:`.blocks`,
   :mod:`.units`, :mod:`.coverage`): one forward pass records what every module saves
   for backward, as sizes (the tensors are dropped); the units are discovered on it (or
   taken from ``units=``) and their coverage measured;
1. **capture and replays** (:mod:`.capture`, :mod:`.unit_figures`, :mod:`.replay`,
   :mod:`.twins`, :mod:`.released`, :mod:`.recomputed`): one forward pass, saving
   nothing, records the units' order, whether they form a chain and which links the
   model's code keeps; at each unit's call, the unit is replayed alone on its live input
   under each option, metered once and timed (twins, :mod:`.twins`, once);
2. **outside step** (:mod:`.instrument`, :mod:`.grads`): one instrumented step whose
   units are stubs (:mod:`.stub`: their forward under ``no_grad``, a gradient of ones for
   their inputs) gives the prefix/suffix figures, the boundaries and who holds them,
   shared tensors, what the loop keeps, and where the outside code's parameter gradients
   appear; what its units' forwards gave is kept for pass 3, which then never runs them;
3. **outside time** (:mod:`.outside_time`): stub steps with shapes only (zeros of the
   units' outputs) time the code outside the units; with an optimizer (its state put
   back as it was before pass 2), the first two also meter ``optimizer.step()`` (its
   state and its step's peak), and a third each parameter's own step (what stepping it
   in backward adds: ``Loop(optimizer_in_backward=True)``);
4. **head variants** (:mod:`.outside`, :mod:`.heads`, :mod:`.head_check`): passes 2 and
   3 run for the head as it is and, where a head is measured, again with the head and
   its loss over each chunk count, most frugal first (before the head as it is, which
   may not fit the device the user plans for). The head's rewrite is checked on one
   example before pass 0, so that passes 0 and 1 compute it over the most chunks.
   Asked by a budget (``variants_needed``, from ``remat.solve``), the head as it is runs
   first and the most frugal variant only where the budget is below its floor, and the
   rewrite's check runs only then (passes 0 and 1, which save nothing and read no loss,
   compute the head chunked unchecked meanwhile: :func:`~.heads.model_head`);
5. **assembly** (:mod:`.assemble`): the figures become a :class:`Profile` (nothing runs).

The passes hand each other the records of :mod:`.records`, never their own; the tools
several passes use are :mod:`.stub`, :mod:`.timeline` and :mod:`.progress`. Each
module's docstring opens with the pass it belongs to.

The figures of the unplanned step (the no-checkpoint peak, its time) are derived from
these by ``simulate()``, not run; ``meta["outside_step_peak_bytes"]`` is the peak the
outside step measured.

Timed runs stop early once those taken bracket the median of ``repeats`` tightly
enough (``tolerance``): with three repeats, two runs that agree within 5% do.

Units are timed alone, not inside steps: on CPU a unit's time inside a step includes
page faults on memory the allocator gave back between steps, which recomputing it in a
planned step does not pay (timed in the steps, checkpoint's extra time came out about
40% too high on the small MLP and CNN).

How the figures become a :class:`Profile` (and why the step's and the prefix/suffix
times are derived) is in :mod:`.assemble`. :func:`check_chain` runs passes 0 and 1 alone
(the capture without replays).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from remat.core.checks import check_head_setting, check_profile_args, check_timing
from remat.core.errors import DeviceMemoryError, ProfileError, RematError
from remat.core.loop import Loop, loop_or_default
from remat.core.option import Option
from remat.core.profile import Profile
from remat.execute.head import HeadSite
from remat.execute.options import recompute_snapshot_bytes
from remat.execute.planned import has_plan
from remat.execute.sharding import sharded_inside
from remat.measurement.meter import MemoryMeter
from remat.measurement.runner import LossFn, StepRunner, call_model, model_device
from remat.measurement.state import ModelState, clear_grads, training_session
from remat.measurement.storage import batch_bytes, fixed_bytes, storage_bytes
from remat.measurement.timing import Stopwatch
from remat.profiler.assemble import build_profile, input_shapes, model_dtype
from remat.profiler.capture import trace_units
from remat.profiler.choice import UnitChoice, check_granularity, choose
from remat.profiler.coverage import warn_if_low
from remat.profiler.heads import (
    CHECK_DID_NOT_FIT,
    checked_head,
    frugal_forwards,
    head_failed_pass,
    head_profile,
    head_to_measure,
    model_head,
)
from remat.profiler.outside import measure_outside
from remat.profiler.progress import Progress
from remat.profiler.records import (
    ChainCheck,
    HeadFinding,
    Measurements,
    OptionFigures,
    OutsideRun,
    TimedRuns,
    TimingPolicy,
    UnitTrace,
)
from remat.profiler.saves import record_saves
from remat.profiler.unit_figures import UnitMeasurer
from remat.profiler.units import UnitsSpec, discover_units

__all__ = ["check_chain", "default_options", "profile", "profile_levels"]

log = logging.getLogger("remat")

def default_options(device: torch.device) -> tuple[str, ...]:
    """keep, checkpoint, selective, derive; plus offload on CUDA."""
    return tuple(o.value for o in Option if o.unavailable_on(device.type) is None)


def _resolve_options(options: Iterable[str | Option] | None, device: torch.device) -> list[str]:
    if options is None:
        return list(default_options(device))
    valid = [o.value for o in Option]
    chosen = [Option.KEEP.value]  # always measured: the baseline every other option adds to
    for o in options:
        value = o.value if isinstance(o, Option) else str(o)
        if value not in valid:
            raise ProfileError(f"unknown option {o!r}; valid options: {valid}")
        reason = Option(value).unavailable_on(device.type)
        if reason is not None:
            raise ProfileError(f"{reason}: the model is on {device}, leave it out of options=")
        if value not in chosen:
            chosen.append(value)
    return chosen


def profile(
    model: nn.Module,
    sample_batch: Any,
    *,
    loss_fn: LossFn | None = None,
    units: UnitsSpec = None,
    optimizer: torch.optim.Optimizer | None = None,
    options: Iterable[str | Option] | None = None,
    warmup: int = 1,
    repeats: int = 3,
    tolerance: float = 0.05,
    pool_twins: bool = True,
    progress: bool | None = None,
    loop: Loop | None = None,
    granularity: str = "blocks",
    head: str = "auto",
) -> Profile:
    """Measure one training step of ``model`` on ``sample_batch``, unit by unit.

    Args:
        model: the module to plan for; profiled in train mode.
        sample_batch: a Tensor (``model(x)``), a tuple/list (``model(*batch)``) or a dict
            (``model(**batch)``), on the model's device.
        loss_fn: ``loss_fn(output, batch) -> scalar Tensor``; by default the output's ``.loss``
            attribute or ``"loss"`` key (Hugging Face outputs).
        units: which modules are units (see :func:`discover_units`); by default the repeated
            blocks of the whole model, chosen on a recorded forward pass by the activation
            memory they hold (:mod:`remat.profiler.discovery`). The profile's ``coverage`` is
            the share the units hold; below 80% a warning names the largest modules outside
            them.
        optimizer: include ``optimizer.step()``: its state bytes and step peak are measured.
        options: options to measure (``keep`` is always included); default keep, checkpoint,
            selective, derive, and offload on CUDA.
        warmup, repeats: un-timed and timed runs for every time figure (medians); the metered
            run counts as the first warm-up run.
        tolerance: stop a time figure's timed runs early once the runs taken pin the median of
            all ``repeats`` to within this fraction (of the unit's or the step's time): with
            ``repeats=3``, two runs that agree within 5% already bracket the median of three.
            ``0`` always takes ``repeats`` runs.
        pool_twins: time twin units (copies of one module on inputs of one shape, with equal
            bytes under every option: a transformer's blocks) as one, pooling their samples, so
            timing costs about as much for 48 blocks as for 2 (:mod:`remat.profiler.twins`).
            Their bytes are still measured one by one.
        progress: show a progress line on stderr (only when it is a terminal); ``False`` to
            never show it.
        loop: the training loop the plan is for (:class:`~remat.core.loop.Loop`: gradient
            accumulation, whether the output is kept through the backward pass, autocast, a
            gradient scaler, ``zero_grad(set_to_none=...)``); default ``Loop()``, a plain loop
            that keeps the output. The profile measures that loop and records it.
        granularity: ``"blocks"`` plans the units as found; ``"children"`` each unit's children
            instead. ``"auto"`` (both levels, the better kept) compares the levels' optimal
            plans, which takes the solver: :func:`remat.profile` does it, on
            :func:`profile_levels`.
        head: whether to measure the output head and its loss over chunks of the tokens, for the
            solver to choose where the budget needs it (:mod:`.heads`): ``"auto"`` where remat
            recognises the head (a Hugging Face causal LM with ``labels``, or a model calling
            :func:`remat.head_loss`) and the loop drops the output (``Loop(keep_output=False)``:
            a chunked head returns no logits); ``"chunked"`` wherever it recognises one (the
            loop does not read the logits; an error where it recognises none); ``"none"`` never.

    Returns:
        The :class:`Profile`. Byte figures come from the dispatch-level
        :class:`~remat.measurement.meter.MemoryMeter`, times are medians in milliseconds.

    Raises:
        NoUnitsError: no units found; pass ``units=``.
        LossNotFoundError: the output has no loss and no ``loss_fn`` was given.
        ProfileError: units that overlap, do not run exactly once, or bad arguments;
            every option but keep failing on every unit (the message says why).

    Nothing about the model changes: parameters, buffers, ``.grad``, ``requires_grad``,
    train/eval modes, RNG states and the optimizer state are restored.
    """
    _refuse_auto(granularity)
    blocks, _ = profile_levels(
        model, sample_batch, loss_fn=loss_fn, units=units, optimizer=optimizer, options=options,
        warmup=warmup, repeats=repeats, tolerance=tolerance, pool_twins=pool_twins,
        progress=progress, loop=loop, granularity=granularity, head=head)
    return blocks


def _refuse_auto(granularity: str) -> None:
    """``profile()`` returns one profile: comparing two levels takes the solver."""
    if granularity == "auto":
        raise ProfileError(
            "granularity='auto' profiles both levels and keeps the one whose optimal plans are "
            "faster, which takes the solver: call remat.profile(..., granularity='auto'), or "
            "remat.profiler.profile_levels() for both profiles")


def profile_levels(
    model: nn.Module,
    sample_batch: Any,
    *,
    loss_fn: LossFn | None = None,
    units: UnitsSpec = None,
    optimizer: torch.optim.Optimizer | None = None,
    options: Iterable[str | Option] | None = None,
    warmup: int = 1,
    repeats: int = 3,
    tolerance: float = 0.05,
    pool_twins: bool = True,
    progress: bool | None = None,
    loop: Loop | None = None,
    granularity: str = "blocks",
    head: str = "auto",
    variants_needed: Callable[[Profile], bool] | None = None,
) -> tuple[Profile, Profile | None]:
    """The profile at ``granularity`` and, for ``"auto"`` where the blocks are few (under
    8) or one holds half of their memory, the profile of the blocks' children too
    (``None`` otherwise): :func:`profile`'s arguments, for the caller to compare
    (:mod:`remat.tune.granularity` does, with the solver).

    ``variants_needed`` is not a setting but a budget's question, asked by
    ``remat.solve`` (the profiler knows no solver): given the profile with the head as it
    is, whether the budget needs the head's chunked variants. Where it answers no, they
    are not measured (:func:`remat.profiler.outside.measure_outside`), where it answers
    yes only the most frugal is, and the profile's ``meta["head_variants"]`` says which
    (``"not measured"``, ``"most chunks only"``)."""
    check_profile_args(model, sample_batch, loss_fn=loss_fn, optimizer=optimizer, loop=loop)
    check_timing(warmup, repeats, tolerance)
    if has_plan(model):
        raise ProfileError(
            "the model has a plan applied: profile the model without it (a plan changes what "
            "its units save); call remat.remove_plan(model) first, or use remat.measure() to "
            "measure the planned step"
        )
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        log.warning(
            "the model has Hugging Face gradient checkpointing on: the profile measures its "
            "checkpointed layers as 'keep'; call model.gradient_checkpointing_disable() first"
        )
    level = check_granularity(granularity)
    settings = _Settings(loss_fn, optimizer, options, warmup, repeats, tolerance, pool_twins,
                         progress, loop_or_default(loop), check_head_setting(head),
                         variants_needed)
    result, choice = _profile(model, sample_batch, units, level, settings)
    finer = None
    if level == "auto" and choice.children is not None:
        finer, _ = _profile(model, sample_batch, list(choice.children), "blocks", settings)
        finer = replace(finer, meta={**finer.meta, "units_from": "children of the blocks",
                                     "granularity": "children"})
    warn_if_low(result, type(model).__name__)
    return result, finer


@dataclass(frozen=True)
class _Settings:
    """profile()'s arguments besides the model, the batch and the units."""

    loss_fn: LossFn | None
    optimizer: torch.optim.Optimizer | None
    options: Iterable[str | Option] | None
    warmup: int
    repeats: int
    tolerance: float
    pool_twins: bool
    progress: bool | None
    loop: Loop
    head: str = "auto"
    # A budget's question (see profile_levels): None measures every head variant.
    variants_needed: Callable[[Profile], bool] | None = None


@dataclass(frozen=True)
class _Profiling:
    """What every pass of one profile shares: the model and its batch, the settings, and
    the session's tools (the runner of the loop, the state that puts the model back)."""

    model: nn.Module
    batch: Any
    settings: _Settings
    device: torch.device
    options: list[str]
    watch: Stopwatch
    bar: Progress
    runner: StepRunner
    state: ModelState


@dataclass(frozen=True)
class _UnitsFound:
    """Pass 0's result: the units chosen, and what its recorded forward saw that pass 1
    reads (per pair of consecutive units the ops between them; per unit its ops and the
    bytes saved inside it, which tell twins apart)."""

    choice: UnitChoice
    ops_between: dict[tuple[str, str], int]
    recorded: dict[str, tuple[int, int]]


def _recompute_rng_bytes(device: torch.device) -> int:
    """What torch's checkpoint stashes of the RNG state while a region recomputes
    (``torch.random.fork_rng``), on the meter of ``device``'s type: the CPU generator's
    state on CPU. A GPU's states are host tensors, which a GPU's meter does not count,
    so the CPU stash alone is forked here."""
    with MemoryMeter(device_type=device.type) as meter, torch.random.fork_rng(devices=[]):
        return meter.live_bytes


def _profile(
    model: nn.Module, sample_batch: Any, units: UnitsSpec, level: str, settings: _Settings
) -> tuple[Profile, UnitChoice]:
    """One profile of ``model`` at granularity ``level`` (``"auto"`` as ``"blocks"``,
    recording the children to compare), and the choice of its units: the passes of the
    module docstring, in order."""
    given = discover_units(model, units) if units is not None else None
    device = model_device(model)
    opts = _resolve_options(settings.options, device)
    watch = Stopwatch(device)
    bar = Progress(2, settings.progress)
    head, loop = settings.head, settings.loop
    started = time.perf_counter()
    try:
        with training_session(model, settings.optimizer) as state:
            runner = StepRunner(model, sample_batch, settings.loss_fn, settings.optimizer,
                                loop, device.type)
            run = _Profiling(model, sample_batch, settings, device, opts, watch, bar, runner,
                             state)
            # A budget's profile checks the chunked head only where the budget needs it.
            lazy = settings.variants_needed is not None and head == "auto"
            with _out_of_memory_is_named("the check of the chunked head on one example"):
                found = model_head(head, loop, runner, state, check=not lazy)
            try:
                chosen, trace, measurer, through_head_loss = _forward_passes(
                    run, units, given, level, found)
            except (torch.OutOfMemoryError, RematError):
                raise
            except Exception:
                # Whose error: the unchecked rewrite's (its check fails) or the model's.
                state.between_passes()
                with _out_of_memory_is_named("the check of the chunked head on one example"):
                    as_written = head_failed_pass(head, runner, state, found)
                if as_written is None:
                    raise
                found = as_written
                chosen, trace, measurer, through_head_loss = _forward_passes(
                    run, units, given, level, found)
            clear_grads(state.params)
            state.rng.restore()
            state.restore_buffers()
            measurer.check_some_option_runs()
            measurer.log_twins()
            ordered = [(name, trace.calls[name].module) for name in trace.order]
            # In train mode, as the session runs the model: what recomputation snapshots.
            stashed = [recompute_snapshot_bytes(module, device.type) for _, module in ordered]
            found = head_to_measure(head, loop, runner, state, through_head_loss, found,
                                    check=not lazy)
            # Before the outside steps, which give the optimizer its state.
            fixed = fixed_bytes(model, settings.optimizer) + batch_bytes(sample_batch, device)

            def assemble(top_runs: list[OutsideRun], seconds: float) -> Profile:
                measured = _measurements(run, ordered, trace, measurer, top_runs[-1],
                                         fixed=fixed, stashed=stashed)
                return _assembled(run, measured, top_runs, chosen.choice, measurer, found,
                                  seconds)

            asked = settings.variants_needed
            needed = None if asked is None else (lambda top: asked(assemble([top], 0.0)))
            def confirmed() -> HeadSite | None:
                nonlocal found
                found = checked_head(head, runner, state, found)
                return found.site

            runs = _outside_passes(run, ordered, trace.chain.is_chain, measurer, found.site,
                                   needed, confirmed)
    finally:
        bar.close()
    seconds = time.perf_counter() - started
    result = assemble(runs, seconds)
    if found.site is not None and asked is not None:
        # What a budget's question left out (remat.solve reads it: see profile_levels).
        left_out = ("not measured" if all(r.chunks is None for r in runs)
                    else "most chunks only")
        result = replace(result, meta={**result.meta, "head_variants": left_out})
    _log_profiled(result, run, chosen.choice, seconds)
    return result, chosen.choice


def _forward_passes(run: _Profiling, units: UnitsSpec,
                    given: list[tuple[str, nn.Module]] | None, level: str, found: HeadFinding
                    ) -> tuple[_UnitsFound, UnitTrace, UnitMeasurer, dict[int, int]]:
    """Passes 0 and 1, the head computed over the most chunks where one is found
    (:func:`frugal_forwards`); and the heads that went through :func:`remat.head_loss`."""
    settings = run.settings
    why = (_HEAD_NOT_CHECKED if (found.refusal or "").startswith(CHECK_DID_NOT_FIT)
           else _NO_PLAN_FITS)
    with frugal_forwards(settings.head, settings.loop, run.model, found) as through_head_loss:
        chosen = _units_pass(run, units, given, level, why)
        trace, measurer = _capture_pass(run, chosen, why)
    return chosen, trace, measurer, through_head_loss


def _units_pass(run: _Profiling, units: UnitsSpec, given: list[tuple[str, nn.Module]] | None,
                level: str, why: str) -> _UnitsFound:
    """Pass 0: one forward pass records what every module saves; the units are chosen on
    it (or taken as ``given``) and their coverage measured. The record is let go here."""
    with _out_of_memory_is_named("the forward pass that records what modules save", why):
        run.bar.step("units")
        record = record_saves(run.model, lambda: run.runner.forward(autocast_cache=False))
    run.state.rng.restore()
    run.state.restore_buffers()
    choice = choose(run.model, record, units, given, level)
    _check_no_shard_inside(choice.units)
    recorded = {name: (call.ops, record.saved_inside(call.index))
                for name in choice.names if (call := record.call(name)) is not None}
    return _UnitsFound(choice, record.ops_between(choice.names), recorded)


def _check_no_shard_inside(units: list[tuple[str, nn.Module]]) -> None:
    """Refuse a unit holding a module FSDP2 shards on its own (:func:`sharded_inside`):
    every rank refuses at the same unit, after the same collectives."""
    for name, module in units:
        if inner := sharded_inside(module):
            raise ProfileError(
                f"unit {name!r} holds {name + '.' + inner[0]!r}, which FSDP2 shards on its own "
                f"({len(inner)} such module(s) inside it): remat replays a unit inside "
                "FSDP2's window of its gathered parameters and calls its forward itself, so "
                "that module would run on its shards and issue its own collectives. Shard "
                "each block as a whole (fully_shard(block), then fully_shard(model)) with "
                "nothing inside a block sharded apart")


def _capture_pass(run: _Profiling, found: _UnitsFound, why: str
                  ) -> tuple[UnitTrace, UnitMeasurer]:
    """Pass 1: one forward pass, saving nothing, traces the units; each is replayed alone
    at its call under each option (:class:`UnitMeasurer`, which keeps the figures)."""
    settings, choice = run.settings, found.choice
    unit_bytes = dict(choice.coverage.per_unit)
    run.bar.total += len(choice.units)  # now known
    # A unit is timed before it is metered (unit_figures: the timed runs warm its kernels
    # up for the allocator's view), so its first timed round is its first run with grad:
    # no un-timed round comes before it for ``warmup=1``, the cold round is a sample, and
    # where it disagrees a third round is taken, whose median of three discards it.
    # ``warmup`` beyond 1 adds un-timed rounds.
    more_warmup = max(settings.warmup - 1, 0)
    rng_bytes, device_type = _recompute_rng_bytes(run.device), run.device.type
    measurer = UnitMeasurer(
        run.options, run.runner, run.watch,
        TimingPolicy(more_warmup, settings.repeats, settings.tolerance, settings.pool_twins),
        run.bar,
        recompute_stash=lambda module: rng_bytes + recompute_snapshot_bytes(module, device_type),
        needs_bytes=lambda name: unit_bytes.get(name, 0), recorded=found.recorded.get)
    with _out_of_memory_is_named("the forward pass that replays the units", why):
        trace = trace_units(run.model, choice.units,
                            lambda: run.runner.forward(autocast_cache=False),
                            on_unit=measurer, ops_between=found.ops_between)
    return trace, measurer


def _outside_passes(run: _Profiling, ordered: list[tuple[str, nn.Module]], is_chain: bool,
                    measurer: UnitMeasurer, site: HeadSite | None,
                    needed: Callable[[OutsideRun], bool] | None,
                    confirmed: Callable[[], HeadSite | None]) -> list[OutsideRun]:
    """Passes 2 to 4: the code outside the units, timed and instrumented, for the head as
    it is and over each chunk count where one is measured (the runs that fit; ``needed``:
    the variants only where a budget needs them, once ``confirmed()`` says the head's
    rewrite passes its check)."""
    settings = run.settings
    trained = {i: measurer.trained[name] for i, (name, _) in enumerate(ordered)
               if name in measurer.trained}
    # The rest of the step the outside code is part of: the tolerance is of the step.
    units_ms = sum(measurer.timings[name].total_ms.get(Option.KEEP.value, 0.0)
                   for name, _ in ordered)
    with _out_of_memory_is_named("the code outside the units"):
        run.bar.step("outside steps")
        return measure_outside(
            run.runner, ordered, is_chain=is_chain, state=run.state, watch=run.watch,
            timed=TimedRuns(settings.warmup, settings.repeats, settings.tolerance, units_ms),
            trained=trained, site=site,
            unit_figures=[measurer.figures[name] for name, _ in ordered],
            variants_needed=needed, confirmed=confirmed)


def _measurements(run: _Profiling, ordered: list[tuple[str, nn.Module]], trace: UnitTrace,
                  measurer: UnitMeasurer, top: OutsideRun, *, fixed: int,
                  stashed: list[int]) -> Measurements:
    """Everything measured, for :func:`build_profile`: the outside code's figures are
    ``top``'s, the head as it is where it was measured, else with the fewest chunks."""
    return Measurements(
        units=ordered,
        chain=trace.chain,
        base=top.step,
        figures=measurer.figures,
        timings=measurer.timings,
        outside=top.times,
        grads=top.grads,
        steps=top.steps,
        fixed_bytes=fixed,
        param_bytes=storage_bytes(run.model.parameters()),
        buffer_bytes=storage_bytes(run.model.buffers()),
        loop=run.settings.loop,
        batch_bytes=batch_bytes(run.batch, run.device),
        inputs_kept_by_caller=trace.kept_by_caller if trace.chain.is_chain else [],
        recompute_state_bytes=stashed,
        recompute_rng_bytes=_recompute_rng_bytes(run.device),
        recorded_bytes=trace.recorded_bytes,
    )


def _assembled(run: _Profiling, measured: Measurements, runs: list[OutsideRun],
               choice: UnitChoice, measurer: UnitMeasurer, found: HeadFinding,
               seconds: float) -> Profile:
    """Pass 5: the :class:`Profile`, with its coverage and, where a head was measured,
    its variants."""
    settings = run.settings
    result = build_profile(
        measured,
        device=run.device,
        dtype=model_dtype(run.model),
        shapes=input_shapes(run.batch),
        meta={"torch": torch.__version__, "meter": "dispatch", "warmup": settings.warmup,
              "repeats": settings.repeats, "tolerance": settings.tolerance,
              "pool_twins": settings.pool_twins, "profile_s": round(seconds, 3)},
    )
    result = _with_coverage(result, choice, measurer.figures, run.options,
                            measurer.derives_nothing)
    if found.refusal is not None:  # why the head is not chunked, for the estimate and plans
        result = replace(result, meta={**result.meta, "head_not_chunked": found.refusal})
    if found.site is None:
        return result
    variants = {v.chunks: build_profile(
        replace(measured, base=v.step, outside=v.times, grads=v.grads, steps=v.steps),
        device=run.device, dtype=result.dtype, shapes=result.input_shapes, meta={})
        for v in runs if v.chunks is not None}
    return head_profile(result, found.site, run.model.get_submodule(found.site.name),
                        variants, as_is=runs[-1].chunks is None)


def _log_profiled(result: Profile, run: _Profiling, choice: UnitChoice, seconds: float) -> None:
    """One info line a user can compare runs by (what profiling cost, in steps of the
    model), and the time each pass took, for debugging a slow profile."""
    log.info(
        "profiled %d units of %s (%s, coverage %.0f%%) in %.2f s (%.1f steps): step %.2f ms "
        "(derived), outside step peak %d B", result.n, type(run.model).__name__,
        "chain" if result.is_chain else "not a chain", 100 * choice.coverage.fraction, seconds,
        seconds * 1e3 / max(result.step_ms, 1e-9), result.step_ms,
        result.meta["outside_step_peak_bytes"],
    )
    log.debug("profile phases (s): %s",
              {k: round(v, 3) for k, v in run.bar.durations().items()})


def check_chain(model: nn.Module, sample_batch: Any, *, units: Any = None,
                loss_fn: Any = None) -> ChainCheck:
    """Run one forward pass of ``model`` and tell whether its units form a chain.

    ``units`` as for :func:`~remat.profiler.units.discover_units`; by default the units
    ``profile()`` would discover (:func:`~remat.profiler.choice.find_units`, which
    runs the forward pass once more, and the loss: ``loss_fn`` when the output has no
    ``.loss``; a model without a loss is recorded up to its output). The model is
    left as it was (buffers, RNG state, modes; no backward runs).
    """
    found = _units_to_check(model, sample_batch, units, loss_fn)
    with training_session(model):
        trace = trace_units(model, found, lambda: call_model(model, sample_batch))
    return trace.chain


def _units_to_check(model: nn.Module, sample_batch: Any, units: Any,
                    loss_fn: Any) -> list[tuple[str, nn.Module]]:
    """:func:`check_chain`'s units: those given, else pass 0's choice."""
    if units is not None:
        return discover_units(model, units)

    def forward() -> Any:
        output = call_model(model, sample_batch)
        return output if loss_fn is None else loss_fn(output, sample_batch)

    # The loss only adds saves outside the model, which no unit can hold: without
    # one, discovery sees the same modules.
    with training_session(model):
        record = record_saves(model, forward)
    return choose(model, record).units


# Why a pass that ran out of memory means no plan fits, and what to do instead.
_NO_PLAN_FITS = ("profiling holds there no more than the most frugal plan's step would, so "
                 "no plan fits this device: use a smaller batch or a device with more memory")
# Where the head's check did not fit, those passes computed the head as written: a plan
# with it chunked may hold less (found 2026-11-29: a LoRA Qwen2 under DDP at its floor).
_HEAD_NOT_CHECKED = (f"the head was not offered chunked ({CHECK_DID_NOT_FIT}), so this pass "
                     "computed it as written, which a plan with the head chunked may not "
                     "need: give a budget at which one example's unplanned step fits (the "
                     "check's), or plan with a smaller batch")


@contextlib.contextmanager
def _out_of_memory_is_named(what: str, why: str = _NO_PLAN_FITS) -> Iterator[None]:
    """A device running out of memory in ``what`` is a :class:`DeviceMemoryError` saying so
    and ``why`` (by default: the pass already holds no more than the most frugal plan
    would, so it cannot be made to fit by profiling differently)."""
    try:
        yield
    except torch.OutOfMemoryError as err:
        raise DeviceMemoryError(
            f"the device ran out of memory in {what} ({' '.join(str(err).split())[:300]}); "
            f"{why}"
        ) from None


def _with_coverage(
    result: Profile, choice: UnitChoice, figures: dict[str, dict[str, OptionFigures]],
    opts: list[str],
    derives_nothing: set[str] = frozenset(),  # type: ignore[assignment]
) -> Profile:
    """``result`` with its coverage and the units' choice in ``meta``, and the options
    dropped per unit (``meta["dropped_options"]``; not derive where it would be keep)."""
    dropped = {name: [o for o in opts if o not in figures[name]
                      and not (o == Option.DERIVE.value and name in derives_nothing)]
               for name in figures}
    dropped = {name: missing for name, missing in dropped.items() if missing}
    meta = {**result.meta, **choice.to_meta(), **choice.coverage.to_meta()}
    if dropped:
        meta["dropped_options"] = dropped
    return replace(result, coverage=choice.coverage.fraction, meta=meta)

"""``profile()``: measure a model's training step unit by unit, for the solver.

The passes, in order (none changes the model: everything is restored at the end,
also on error):

0. **units** (:mod:`.saves`, :mod:`.choice`): one forward pass records what every
   module saves for backward; the units are discovered on it (or taken from
   ``units=``) and their coverage of the step's activation memory measured;
1. **capture** (:mod:`.capture`): one forward pass records the units' order,
   inputs and RNG states, and whether they form a chain;
2. **optimizer** (when one is given): two steps create its state; the second
   ``optimizer.step()`` is metered (``optimizer_step_peak_bytes``);
3. **baseline** (:mod:`.instrument`): one instrumented training step gives the
   prefix/suffix figures, the boundary flags, the measured peak and, on a chain,
   the units' keep bytes;
4. **step time**: up to ``repeats`` timed plain training steps, no meter, no hooks;
5. **units** (:mod:`.replay`): each unit replayed alone under each option, once
   under the meter (not keep when the baseline step gave its bytes), then
   timed up to ``repeats`` times (twin units, :mod:`.twins`, share one timing).
   An option that fails on a unit (selective checkpointing of a tensor mutated in
   place, a recomputation torch refuses) is dropped for that unit, with a warning
   naming the unit, the option and the reason; the unit's ``options`` lack it.

Timed runs stop early once those taken bracket the median of ``repeats`` tightly
enough (``tolerance``): with three repeats, two runs that agree within 5% do.

Warm-up: a metered run executes the same kernels and allocations as a plain one,
so it is the first of the ``warmup`` un-timed runs (the metered replay for each
unit option, the instrumented step right before for the step time); ``warmup - 1``
more run before timing starts. Where keep is not replayed under the meter, the unit's
other metered replays stand in for it: checkpoint's backward reruns the forward
with autograd saving, as keep does, then keep's backward (timing right after them
gives the same keep times as before, within noise).

Units are timed alone, not inside the timed steps: on CPU a unit's time inside a
step includes page faults on memory the allocator gave back between steps, which
recomputing it in a planned step does not pay (timed in the steps, checkpoint's
extra time came out about 40% too high on the small MLP and CNN).

How the figures become a :class:`Profile` (and why prefix/suffix times are
derived) is in :mod:`.assemble`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from remat.core.checks import check_profile_args
from remat.core.errors import ProfileError
from remat.core.loop import Loop, loop_or_default
from remat.core.option import Option
from remat.core.profile import Profile
from remat.execute.planned import has_plan
from remat.measurement.runner import LossFn, StepRunner, call_model, model_device
from remat.measurement.state import ModelState, clear_grads, training_session
from remat.measurement.step import time_steps
from remat.measurement.storage import batch_bytes, fixed_bytes
from remat.measurement.storage import storage_bytes as tensor_storage_bytes
from remat.measurement.timing import Stopwatch
from remat.profiler.assemble import Measurements, build_profile, input_shapes, model_dtype
from remat.profiler.capture import UnitCall, UnitTrace, trace_units
from remat.profiler.choice import UnitChoice, check_granularity, choose
from remat.profiler.coverage import warn_if_low
from remat.profiler.instrument import instrumented_step
from remat.profiler.links import inputs_kept_by_caller
from remat.profiler.optimizer import optimizer_figures
from remat.profiler.progress import Progress
from remat.profiler.replay import (
    OPTION_ERRORS,
    OptionFailure,
    OptionFigures,
    TimingSamples,
    UnitTiming,
    measure_option,
    time_unit,
)
from remat.profiler.saves import record_saves
from remat.profiler.twins import signature
from remat.profiler.units import UnitsSpec, discover_units

__all__ = ["default_options", "profile", "profile_levels"]

log = logging.getLogger("remat")

def default_options(device: torch.device) -> tuple[str, ...]:
    """keep, checkpoint, selective; plus offload on CUDA."""
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


@dataclass(frozen=True)
class _TimingPolicy:
    """How units are timed: un-timed rounds first, at most ``repeats`` timed rounds,
    early stop within ``tolerance``, twins pooled or not."""

    warmup: int
    repeats: int
    tolerance: float
    pool_twins: bool


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
) -> Profile:
    """Measure one training step of ``model`` on ``sample_batch``, unit by unit.

    Args:
        model: the module to plan for; profiled in train mode.
        sample_batch: a Tensor (``model(x)``), a tuple/list (``model(*batch)``) or a
            dict (``model(**batch)``), on the model's device.
        loss_fn: ``loss_fn(output, batch) -> scalar Tensor``; by default the output's
            ``.loss`` attribute or ``"loss"`` key (Hugging Face outputs).
        units: which modules are units (see :func:`discover_units`); by default the
            repeated blocks of the whole model, chosen on a recorded forward pass by the
            activation memory they hold (:mod:`remat.profiler.discovery`). The profile's
            ``coverage`` is the share the units hold; below 80% a warning names the
            largest modules outside them.
        optimizer: include ``optimizer.step()``: its state bytes and step peak are measured.
        options: options to measure (``keep`` is always included); default keep,
            checkpoint, selective, and offload on CUDA.
        warmup, repeats: un-timed and timed runs for every time figure (medians);
            the metered run counts as the first warm-up run.
        tolerance: stop a time figure's timed runs early once the runs taken pin
            the median of all ``repeats`` to within this fraction (of the unit's or
            the step's time): with ``repeats=3``, two runs that agree within 5%
            already bracket the median of three. ``0`` always takes ``repeats`` runs.
        pool_twins: time twin units (copies of one module on inputs of one shape, with
            equal bytes under every option: a transformer's blocks) as one, pooling
            their samples, so timing costs about as much for 48 blocks as for 2
            (:mod:`remat.profiler.twins`). Their bytes are still measured one by one.
        progress: show a progress line on stderr (only when it is a terminal);
            ``False`` to never show it.
        loop: the training loop the plan is for (:class:`~remat.core.loop.Loop`:
            gradient accumulation, whether the output is kept through the backward
            pass, autocast, a gradient scaler, ``zero_grad(set_to_none=...)``);
            default ``Loop()``, a plain loop that keeps the output. The profile
            measures that loop and records it.
        granularity: ``"blocks"`` plans the units as found; ``"children"`` each
            unit's children instead. ``"auto"`` (both levels, the better kept) compares
            the levels' optimal plans, which takes the solver: :func:`remat.profile`
            does it, on :func:`profile_levels`.

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
    if granularity == "auto":
        raise ProfileError(
            "granularity='auto' profiles both levels and keeps the one whose optimal plans are "
            "faster, which takes the solver: call remat.profile(..., granularity='auto'), or "
            "remat.profiler.profile_levels() for both profiles")
    blocks, _ = profile_levels(model, sample_batch, loss_fn=loss_fn, units=units,
                               optimizer=optimizer, options=options, warmup=warmup,
                               repeats=repeats, tolerance=tolerance, pool_twins=pool_twins,
                               progress=progress, loop=loop, granularity=granularity)
    return blocks


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
) -> tuple[Profile, Profile | None]:
    """The profile at ``granularity`` and, for ``"auto"`` where the blocks are few (under
    8) or one holds half of their memory, the profile of the blocks' children too
    (``None`` otherwise): :func:`profile`'s arguments, for the caller to compare
    (:mod:`remat.granularity` does, with the solver)."""
    check_profile_args(model, sample_batch, loss_fn=loss_fn, optimizer=optimizer, loop=loop)
    if repeats < 1 or warmup < 0 or not 0 <= tolerance < 1:
        raise ProfileError(
            f"need repeats >= 1, warmup >= 0 and 0 <= tolerance < 1, got {repeats=} {warmup=} "
            f"{tolerance=}"
        )
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
                         progress, loop_or_default(loop))
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


def _profile(
    model: nn.Module, sample_batch: Any, units: UnitsSpec, level: str, settings: _Settings
) -> tuple[Profile, UnitChoice]:
    """One profile of ``model`` at granularity ``level`` (``"auto"`` as ``"blocks"``,
    recording the children to compare), and the choice of its units."""
    loss_fn, optimizer, loop = settings.loss_fn, settings.optimizer, settings.loop
    warmup, repeats, tolerance = settings.warmup, settings.repeats, settings.tolerance
    pool_twins = settings.pool_twins
    given = discover_units(model, units) if units is not None else None
    device = model_device(model)
    opts = _resolve_options(settings.options, device)
    watch = Stopwatch(device)
    bar = Progress(4 + (optimizer is not None), settings.progress)
    started = time.perf_counter()
    try:
        with training_session(model, optimizer) as state:
            params = state.params
            runner = StepRunner(model, sample_batch, loss_fn, optimizer, loop, device.type)
            bar.step("units")
            record = record_saves(model, runner.forward)
            state.rng.restore()
            state.restore_buffers()
            choice = choose(model, record, units, given, level)
            del record
            found = choice.units
            bar.total += len(found)  # now known
            bar.step("capture")
            losses = []
            trace = trace_units(model, found, lambda: losses.append(runner.forward()[1]))
            ordered = [(name, trace.calls[name].module) for name in trace.order]
            # Its backward warms the kernels up: a kernel's first run can allocate what
            # later runs reuse (oneDNN's scratch), which no metered run should count.
            runner.backward(losses.pop())
            clear_grads(params)
            state.rng.restore()
            state.restore_buffers()
            kept_inputs = (inputs_kept_by_caller(ordered, lambda: call_model(model, sample_batch))
                           if trace.chain.is_chain else [False] * len(ordered))
            state.rng.restore()
            state.restore_buffers()

            opt_state, opt_peak = 0, 0
            if optimizer is not None:
                bar.step("optimizer")
                opt_state, opt_peak = optimizer_figures(runner)
                state.rng.restore()
                state.restore_buffers()

            bar.step("baseline step")
            watch.sync()
            fixed = fixed_bytes(model, optimizer) + batch_bytes(sample_batch, device)
            base = instrumented_step(runner, ordered, is_chain=trace.chain.is_chain)
            clear_grads(params)
            state.rng.restore()
            state.restore_buffers()

            # Right after the instrumented step, its warm-up (the allocator holds a
            # whole step's memory; after the unit replays it would not).
            more_warmup = max(warmup - 1, 0)  # the metered run was the first
            bar.step("step time")
            step = time_steps(runner, state, watch, warmup=more_warmup, repeats=repeats,
                              tolerance=tolerance)

            policy = _TimingPolicy(more_warmup, repeats, tolerance, pool_twins)
            figures, timings = _measure_units(trace, ordered, opts, base.keep, runner, watch,
                                              state, bar, policy)
    finally:
        bar.close()

    measured = Measurements(
        units=ordered,
        chain=trace.chain,
        base=base,
        figures=figures,
        timings=timings,
        step=step,
        fixed_bytes=fixed,
        param_bytes=tensor_storage_bytes(model.parameters()),
        buffer_bytes=tensor_storage_bytes(model.buffers()),
        optimizer_state_bytes=opt_state,
        optimizer_step_peak_bytes=opt_peak,
        loop=loop,
        batch_bytes=batch_bytes(sample_batch, device),
        inputs_kept_by_caller=kept_inputs,
    )
    seconds = time.perf_counter() - started
    result = build_profile(
        measured,
        device=device,
        dtype=model_dtype(model),
        shapes=input_shapes(sample_batch),
        meta={"torch": torch.__version__, "meter": "dispatch", "warmup": warmup,
              "repeats": repeats, "tolerance": tolerance, "pool_twins": pool_twins,
              "profile_s": round(seconds, 3)},
    )
    result = _with_coverage(result, choice, figures, opts)
    log.info(
        "profiled %d units of %s (%s, coverage %.0f%%) in %.2f s (%.1f steps): step %.2f ms, "
        "peak %d B", result.n, type(model).__name__,
        "chain" if result.is_chain else "not a chain", 100 * choice.coverage.fraction, seconds,
        seconds * 1e3 / max(step.step_ms, 1e-9), step.step_ms, result.measured_peak_bytes,
    )
    log.debug("profile phases (s): %s",
              {k: round(v, 3) for k, v in bar.durations().items()})
    return result, choice


def _with_coverage(
    result: Profile, choice: UnitChoice, figures: dict[str, dict[str, OptionFigures]],
    opts: list[str],
) -> Profile:
    """``result`` with its coverage and the units' choice in ``meta``, and the options
    dropped per unit (``meta["dropped_options"]``)."""
    dropped = {name: [o for o in opts if o not in figures[name]] for name in figures}
    dropped = {name: missing for name, missing in dropped.items() if missing}
    meta = {**result.meta, **choice.to_meta(), **choice.coverage.to_meta()}
    if dropped:
        meta["dropped_options"] = dropped
    return replace(result, coverage=choice.coverage.fraction, meta=meta)


@dataclass
class _Pool:
    """Timing samples shared by twin units (one unit's alone when it has no twin)."""

    samples: TimingSamples
    members: list[str] = field(default_factory=list)
    pending: UnitCall | None = None  # the last member timed, kept while more samples may be due


def _measure_units(
    trace: UnitTrace,
    ordered: list[tuple[str, nn.Module]],
    opts: list[str],
    keep_in_step: list[OptionFigures | None],
    runner: StepRunner,
    watch: Stopwatch,
    state: ModelState,
    bar: Progress,
    timing: _TimingPolicy,
) -> tuple[dict[str, dict[str, OptionFigures]], dict[str, UnitTiming]]:
    """Every unit under every option: metered once, then timed.

    Keep is not metered where the baseline step measured it already
    (``keep_in_step[i]``: the figures the replay gives, read off that step).

    Twin units (:mod:`.twins`: the same signature and the same bytes under every
    option) pool their timed samples: while more units with the signature are to
    come, each is timed for one round right after its metered replays (its
    warm-up), and once the pool's samples settle the remaining twins are only
    metered. A pool still short of samples at the end times its last member more.
    """
    # checkpoint's extra time is by definition its recomputed forward, which the
    # keep timing measures, so it is not timed again (a third of the timing cost).
    timed = tuple(o for o in opts if o != Option.CHECKPOINT.value)
    signatures = {name: signature(trace.calls[name]) if timing.pool_twins else name
                  for name, _ in ordered}
    still_to_come = Counter(signatures.values())
    figures: dict[str, dict[str, OptionFigures]] = {}
    pools: dict[Hashable, _Pool] = {}
    pool_of: dict[str, _Pool] = {}
    failures: list[tuple[str, OptionFailure]] = []
    for i, (name, _module) in enumerate(ordered):
        bar.step(f"unit {name}")
        call = trace.calls[name]
        in_step = keep_in_step[i] if i < len(keep_in_step) else None
        figures[name] = {}
        for o in opts:
            result = in_step if o == Option.KEEP.value and in_step is not None else _try_option(
                call, o, runner)
            if isinstance(result, OptionFailure):
                log.warning("unit %r: option %r dropped, it cannot run on this unit: %s",
                            name, o, result.reason)
                failures.append((name, result))
                state.restore_buffers()
            else:
                figures[name][o] = result
        sig = signatures[name]
        still_to_come[sig] -= 1
        unit_timed = tuple(o for o in timed if o in figures[name])
        pool = pools.setdefault((sig, tuple(figures[name].items())),
                                _Pool(TimingSamples(unit_timed)))
        pool.members.append(name)
        pool_of[name] = pool
        if not pool.samples.settled(timing.repeats, timing.tolerance):
            time_unit(call, pool.samples.options, runner, watch, warmup=timing.warmup,
                      repeats=timing.repeats,
                      tolerance=timing.tolerance, samples=pool.samples,
                      max_rounds=1 if still_to_come[sig] else None)
            if pool.pending is not None:
                pool.pending.release()
                pool.pending = None
            if not pool.samples.settled(timing.repeats, timing.tolerance):
                pool.pending, call = call, None  # kept: its twins may not come
        # Replays ran BatchNorm's training forward again: put the running stats back.
        state.restore_buffers()
        if call is not None:
            call.release()
    for pool in pools.values():
        if pool.pending is not None:
            if not pool.samples.settled(timing.repeats, timing.tolerance):
                time_unit(pool.pending, pool.samples.options, runner, watch,
                          warmup=timing.warmup, repeats=timing.repeats,
                          tolerance=timing.tolerance, samples=pool.samples)
                state.restore_buffers()
            pool.pending.release()
    if len(pools) < len(ordered):
        log.debug("timed %d units as %d groups of twins: %s", len(ordered), len(pools),
                  [p.members for p in pools.values() if len(p.members) > 1])
    _check_some_option_runs(failures, figures, opts)
    timings = {name: pool_of[name].samples.timing() for name, _ in ordered}
    return figures, timings


def _try_option(call: UnitCall, option: str, runner: StepRunner) -> OptionFigures | OptionFailure:
    """The option's metered replay; an option other than keep that fails on the unit is
    an :class:`OptionFailure`. Those options run only after the unit ran under keep in
    the profiler's training steps, so what they raise comes from the option."""
    if option == Option.KEEP.value:
        return measure_option(call, option, runner)
    try:
        return measure_option(call, option, runner)
    except OPTION_ERRORS as err:
        clear_grads(runner.params)
        return OptionFailure.of(option, err)


def _check_some_option_runs(
    failures: list[tuple[str, OptionFailure]],
    figures: dict[str, dict[str, OptionFigures]],
    opts: list[str],
) -> None:
    """Raise when options besides keep were asked for and none ran on any unit."""
    if len(opts) < 2 or any(len(f) > 1 for f in figures.values()):
        return
    reasons = {}
    for name, failure in failures:
        reasons.setdefault(failure.option, f"{failure.reason} (unit {name!r})")
    raise ProfileError(
        "every option but keep failed on every unit, so no plan could save memory: "
        + "; ".join(f"{o}: {r}" for o, r in reasons.items())
        + ". Check that the units' forwards can be recomputed (no in-place change of their "
        "inputs, the same tensors on every call), or pass units= naming other modules"
    )

"""``measure_step`` (``remat.measure``): the real peak and time of one training step of
the model as it is, planned or not, and the timing of plain steps.

The step is the user's loop (:class:`~remat.core.loop.Loop`), run by
:class:`~remat.measurement.runner.StepRunner`::

    out = model(**batch)            # under torch.autocast when the loop says so
    loss = loss_fn(out, batch)      # or out.loss
    loss.backward()                 # through a GradScaler when the loop has one
    ...                             # (accumulation_steps micro-batches)
    optimizer.step(); optimizer.zero_grad()

It is the one measured step of remat: ``remat.measure``, verification in
``remat.solve``, the compiled search (the step of a compiled model, allocator only)
and FSDP's per-rank measurement all call it, and every figure is the instruments'
rise above the step's start plus :func:`~remat.measurement.storage.resident_bytes`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.core.checks import check_count, check_profile_args, check_timing
from remat.core.errors import ProfileError
from remat.core.loop import Loop, loop_or_default
from remat.measurement.allocator import AllocatorRegions
from remat.measurement.meter import MemoryMeter
from remat.measurement.runner import Carry, LossFn, StepRunner, model_device
from remat.measurement.state import ModelState, clear_grads, training_session
from remat.measurement.steady import StateAhead, make_state_ahead
from remat.measurement.storage import resident_bytes
from remat.measurement.timing import Stopwatch, median, parts_settled

__all__ = ["StepMeasurement", "StepTimes", "measure_step", "time_steps"]

log = logging.getLogger("remat")


@dataclass(frozen=True)
class StepMeasurement:
    """A measured training step (one optimizer step of the loop).

    Attributes:
        resident_bytes: what the step holds from its start to its end: parameters,
            buffers, optimizer state, the batch, and the gradients alive when it starts
            (accumulation, ``set_to_none=False``).
        peak_bytes: peak bytes of the step, ``resident_bytes`` included, by the
            dispatch-level meter (live tensor storages); ``None`` when not measured
            (compiled code, which the dispatch level cannot see).
        allocator_peak_bytes: the same peak as the allocator saw it (it also sees
            kernel scratch buffers and tensors made outside the dispatcher, such as
            checkpoint's RNG state): on CUDA ``torch.cuda.max_memory_allocated``, on
            CPU the allocation events of ``torch.profiler``. ``None`` when not measured.
        reserved_peak_bytes: on CUDA, ``torch.cuda.max_memory_reserved`` while the
            allocator instrument ran: what the caching allocator took from the device
            (fragmentation included). ``None`` off CUDA.
        cuda_peak_bytes: ``max_memory_allocated`` during the metered step minus
            ``memory_allocated`` at its start; ``None`` off CUDA.
        held_after_forward_bytes: bytes alive after the last micro-batch's forward
            (loss included), above the bytes alive when the step started (``None``
            without the dispatch-level meter).
        time_ms: median wall time of one optimizer step (``None``: not timed).
    """

    resident_bytes: int
    peak_bytes: int | None = None
    allocator_peak_bytes: int | None = None
    reserved_peak_bytes: int | None = None
    cuda_peak_bytes: int | None = None
    held_after_forward_bytes: int | None = None
    time_ms: float | None = None

    @property
    def worst_peak_bytes(self) -> int:
        """The larger of the instruments' peaks: what a budget must hold."""
        return max(self.peak_bytes or 0, self.allocator_peak_bytes or 0, self.resident_bytes)


@dataclass(frozen=True)
class StepTimes:
    """Median times of plain training steps, in milliseconds (no meter, no hooks).

    ``forward_ms`` and ``backward_ms`` are one micro-batch's; ``step_ms`` is one
    optimizer step of the loop: every micro-batch and the optimizer step.
    """

    step_ms: float
    forward_ms: float
    backward_ms: float


def time_steps(
    runner: StepRunner,
    state: ModelState,
    watch: Stopwatch,
    *,
    warmup: int,
    repeats: int,
    tolerance: float = 0.0,
) -> StepTimes:
    """Time ``warmup + repeats`` micro-batches and optimizer steps; medians of the last ``repeats``.

    Each round runs one micro-batch (forward, backward) and the optimizer step with
    gradients cleared first; one optimizer step of the loop is then
    ``accumulation_steps`` micro-batches and one optimizer step. The timed rounds
    stop early once the samples pin each median to within ``tolerance`` times the
    step time (:func:`~remat.measurement.timing.parts_settled`).

    RNG state and buffers are reset before each, so every round sees the same dropout
    masks and BatchNorm statistics.
    """
    total, fwd, bwd, opt = [], [], [], []
    for r in range(warmup + repeats):
        state.rng.restore()
        state.restore_buffers()
        clear_grads(state.params)
        result, f_ms = watch.time(runner.forward)
        loss = result[1]
        del result  # the output is not held through backward (a planned model's guard would
        # take that for a loop that keeps it); holding it or not changes no time
        _, b_ms = watch.time(lambda loss=loss: runner.backward(loss))
        del loss
        _, o_ms = watch.time(runner.optimizer_step) if runner.optimizer is not None else (None, 0.)
        if r >= warmup:
            total.append(f_ms + b_ms + o_ms)
            fwd.append(f_ms)
            bwd.append(b_ms)
            opt.append(o_ms)
            if parts_settled(total, fwd, bwd, repeats=repeats, tolerance=tolerance):
                break
    clear_grads(state.params)
    steps = runner.loop.accumulation_steps
    f_ms, b_ms = median(fwd), median(bwd)
    return StepTimes(steps * (f_ms + b_ms) + median(opt), f_ms, b_ms)


def _cycles(runner: StepRunner, cycles: int, state: ModelState | None) -> None:
    """``cycles`` optimizer steps of the loop from nothing carried; with ``state``, each
    from the same RNG state and buffers."""
    carry = Carry()
    for _ in range(cycles):
        runner.optimizer_step_cycle(carry)
        if state is not None:
            state.rng.restore()
            state.restore_buffers()


def _repeats_itself(runner: StepRunner, ahead: StateAhead | None) -> bool:
    """Whether a step of the runner's loop leaves nothing but what the loop's variables
    carry (:class:`Carry`) for the next: gradients set to ``None`` by ``zero_grad``
    (zeroed in place, they stay alive into the next step), and no optimizer, or one whose
    state was made ahead (``ahead``, :mod:`.steady`: otherwise its first step creates
    the state, so the second starts with more). From the same RNG state and buffers, the
    next step then runs as this one did, the carry aside."""
    return runner.loop.set_to_none and (runner.optimizer is None or ahead is not None)


def _measured_cycles(runner: StepRunner, steps: int, state: ModelState | None,
                     dispatch: MemoryMeter | None, regions: AllocatorRegions | None,
                     ahead: StateAhead | None) -> None:
    """What an instrument measures: ``steps + 1`` optimizer steps from nothing carried (the
    first gives the next what the loop carries into it). One step runs as
    :func:`_cycles` does; several run consecutively, as training runs them (RNG and
    buffers advance too), so that memory that changes over the steps is seen.

    One step of a loop that repeats itself (:func:`_repeats_itself`), with the
    dispatch-level meter on, runs as one step and, at most, the next one's first forward:
    the carry (the last output and loss, and whatever their graph still holds) differs
    from the first step only until the new output and loss replace it, at the end of that
    forward; from there the second step is the first again, from the same state, so its
    backward (and optimizer step) is not run twice (a planned step's forward is about a
    third of it). That holds where nothing else outlives the loop's variables, which the
    meter tells (nothing made in the region alive once they are dropped); where something
    does (a cache made lazily, a tensor a backward hook keeps), it is alive through the
    second step's backward too, and a whole step runs with it.

    The next forward itself runs only where it can set the peak (:func:`_step_then_forward`)."""
    if (steps == 1 and state is not None and dispatch is not None
            and _repeats_itself(runner, ahead)):
        unseen = _step_then_forward(runner, state, dispatch, regions)
        if _most_over_ranks(dispatch.live_bytes) == 0:
            return
        log.debug("measured step: %d B outlive the loop's variables; one more whole step",
                  dispatch.live_bytes)
        if regions is not None and not regions.active:
            regions.resume(freed_between=unseen)
        _cycles(runner, 1, state)
        return
    _cycles(runner, steps + 1, state if steps == 1 else None)


def _step_then_forward(runner: StepRunner, state: ModelState, dispatch: MemoryMeter,
                       regions: AllocatorRegions | None) -> int:
    """One optimizer step of the loop, then the next one's first forward with the carry
    alive, as the loop holds it, where it can set the peak; everything dropped at the
    end, RNG and buffers put back.

    The next forward runs as the first step's first forward ran, from the same state,
    with the carry alive on top: every live figure of it is the first forward's plus at
    most what the first step left alive. So where the first forward's peak plus that is
    at most the first step's peak, on both instruments, it cannot raise the peak and is
    not run: a third of a planned step less to measure. The dispatch meter tells at once;
    the allocator's view on CPU once its region is ended and read, which this does there
    (where it does not hold, the forward runs in a second region, the carry still alive).
    On CUDA the forward always runs: the caching allocator's reserved memory, which
    verification reports too, is not additive, so no bound covers it; and under several
    ranks (:func:`_other_ranks_step`).

    Returns the bytes freed outside the allocator's view (the carry, where its region
    had ended), for a region that follows (:meth:`AllocatorRegions.resume`)."""
    carry = Carry()
    forward_mark = -1
    first_forward_peak = 0

    def after_first_forward() -> None:
        nonlocal forward_mark, first_forward_peak
        first_forward_peak = dispatch.peak_bytes
        forward_mark = regions.mark() if regions is not None else -1

    runner.optimizer_step_cycle(carry, after_first_forward)
    state.rng.restore()
    state.restore_buffers()
    on_cpu = regions is None or regions.device_type == "cpu"
    cannot_rise = first_forward_peak + dispatch.live_bytes <= dispatch.peak_bytes
    if (on_cpu and not _other_ranks_step() and cannot_rise
            and _allocator_bound_holds(regions, forward_mark)):
        held = dispatch.live_bytes
        del carry
        log.debug("measured step: the next forward cannot set the peak; not run")
        return held - dispatch.live_bytes if regions is not None else 0
    output, loss = runner.forward()
    del output, loss, carry  # the forward's graph with them
    state.rng.restore()
    state.restore_buffers()
    return 0


def _other_ranks_step() -> bool:
    """Whether other ranks run this step beside this one (``torch.distributed`` with more
    than one): the decision on the next forward is each rank's own, and a rank that
    skipped it would leave the others' collectives in it (FSDP's all-gathers, DDP's
    buffer broadcast) waiting, so there it always runs."""
    return _world_size() > 1


def _world_size() -> int:
    """How many ranks run this step (``torch.distributed``'s default group; 1 without it)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _most_over_ranks(nbytes: int) -> int:
    """The largest ``nbytes`` over the ranks that run this step beside this one (one
    ``all_gather_object`` over the default group), ``nbytes`` where none does.

    Whether one more whole step runs is decided on what outlived the loop's variables,
    which differs by rank (a buffer gloo's worker lets go late): a rank that ran it alone
    left the others' collectives waiting, and a CI run hung on it (2026-11-29, the
    tests' GPT under FSDP2: one rank in its extra step's all-gather, the other in
    verification's next collective). Its cost: one small collective per measured step."""
    world = _world_size()
    if world == 1:
        return nbytes
    every: list[int | None] = [None] * world
    torch.distributed.all_gather_object(every, nbytes)
    return max(n for n in every if n is not None)


def _allocator_bound_holds(regions: AllocatorRegions | None, forward_mark: int) -> bool:
    """The bound of :func:`_step_then_forward` on the allocator's view, its region ended to
    read it (and a new one begun where it does not hold, for the forward to run in)."""
    if regions is None:
        return True
    timeline, end = regions.stop()
    holds = timeline.rise(0, forward_mark) + timeline.live[end] <= timeline.rise(0, end)
    if not holds:
        regions.resume()
    return holds


@dataclass(frozen=True)
class _Peaks:
    """What :func:`_instrumented` measured (see :class:`StepMeasurement`)."""

    resident: int
    peak: int | None = None
    allocator_peak: int | None = None
    reserved: int | None = None
    cuda_peak: int | None = None


def _instrumented(runner: StepRunner, model: nn.Module, steps: int, state: ModelState | None,
                  ahead: StateAhead | None, *, allocator: bool, meter: bool) -> _Peaks:
    """The measured steps (:func:`_measured_cycles`) under both instruments at once, each
    figure the instrument's rise plus what the step holds from its start (``model``'s
    state, whose wrapper the runner may call)."""
    device = model_device(model)
    resident = resident_bytes(model, runner.optimizer, batch=runner.batch, device=device)
    # Both instruments watch the same steps: the allocator's view outside, the
    # dispatch-level meter inside it (the meter allocates no tensor of its own).
    regions = AllocatorRegions(device.type) if allocator else None
    dispatch = MemoryMeter(device_type=device.type) if meter else None
    with contextlib.ExitStack() as stack:
        if ahead is not None:
            stack.enter_context(ahead.watching())
        if regions is not None:
            stack.enter_context(regions)
        if dispatch is not None:
            stack.enter_context(dispatch)
        _measured_cycles(runner, steps, state, dispatch, regions, ahead)
    peaks = _Peaks(resident)
    if dispatch is not None:
        peaks = dataclasses.replace(peaks, peak=resident + dispatch.peak_bytes,
                                    cuda_peak=dispatch.cuda_peak_bytes)
    if regions is not None:
        reserved = torch.cuda.max_memory_reserved() if device.type == "cuda" else None
        peaks = dataclasses.replace(peaks, allocator_peak=resident + regions.peak_bytes,
                                    reserved=reserved)
    return peaks


def _measured(runner: StepRunner, model: nn.Module, steps: int, state: ModelState | None, *,
              steady: bool, allocator: bool, meter: bool) -> _Peaks:
    """:func:`_instrumented`, one step from the optimizer's state made ahead where
    ``steady`` allows it and it can be (:mod:`.steady`), else the whole steps. ``steady``
    only with no warm-up: the session's snapshot is then the state before the state made
    ahead, which the fallback puts back (after a warm-up the state is training's own)."""
    ahead = (make_state_ahead(runner, state)
             if steady and steps == 1 and state is not None else None)
    peaks = _instrumented(runner, model, steps, state, ahead, allocator=allocator, meter=meter)
    if ahead is None or ahead.held() or state is None:
        return peaks
    log.debug("measured step: the optimizer state made ahead is not the step's own (a "
              "parameter without a strided gradient of its dtype); two whole steps instead")
    state.restore_params()  # the state made ahead dropped, the parameters put back
    return _instrumented(runner, model, steps, state, None, allocator=allocator, meter=meter)


@contextlib.contextmanager
def _session(model: nn.Module, optimizer: torch.optim.Optimizer | None,
             restore: bool) -> Iterator[ModelState | None]:
    if not restore:
        yield None
        return
    with training_session(model, optimizer) as state:
        yield state


def measure_step(
    model: nn.Module,
    sample_batch: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    loop: Loop | None = None,
    warmup: int = 1,
    repeats: int = 3,
    allocator: bool = True,
    meter: bool = True,
    call: nn.Module | None = None,
    restore: bool = True,
    time_within: int | None = None,
    steps: int = 1,
    held: bool = True,
) -> StepMeasurement:
    """Measure one real training step of ``model`` as it is (with or without a plan applied).

    The step is one optimizer step of ``loop`` (default :class:`~remat.core.loop.Loop`:
    a plain loop that keeps the output): its micro-batches, the optimizer step and the
    loop's ``zero_grad``. The warm-up steps come first (they compile a compiled model);
    then ``steps + 1`` steps run from nothing carried under both instruments at once, the
    dispatch-level meter and, with ``allocator``, the allocator's view
    (:mod:`remat.measurement.allocator`), so that the second sees what the first carries
    into it and everything they see was made inside the region (a dispatch meter counts
    only such storages, and the CPU profiler reports no frees of blocks allocated before
    it started). Without a warm-up the first of them creates the optimizer's state, as a
    training run's first step does: what the step holds from its start
    (``resident_bytes``) is read before it. Or, for one step with no warm-up and an
    optimizer among those measured alike (:mod:`.steady`), the state is made before
    the instruments start, by one optimizer step over zero gradients, so that the first
    measured step is the steady one (``resident_bytes`` then holds the state). Where the
    loop then repeats itself (no optimizer or its state made ahead, gradients set to
    ``None``) and nothing made in the first step outlives the loop's variables, the
    second runs only as far as its first forward, where what the first carries into it is
    let go (:func:`_measured_cycles`), and that forward only where it can set the peak
    (:func:`_step_then_forward`): the same peak, one backward (and optimizer step) less.
    The time is the median of ``repeats`` un-metered steps. Parameters, buffers,
    gradients, RNG state, train/eval modes and the optimizer state are restored
    afterwards, also when the step raises.

    Args:
        model: the module to train.
        sample_batch: one micro-batch: a Tensor (``model(x)``), a tuple/list
            (``model(*batch)``) or a dict (``model(**batch)``).
        loss_fn: ``loss_fn(output, batch) -> scalar``; by default the output's ``.loss``.
        optimizer: include ``optimizer.step()`` in the step.
        loop: the training loop; default ``Loop()``.
        warmup, repeats: un-timed and timed steps for ``time_ms`` (``repeats=0``: not
            timed).
        allocator: also measure the allocator's view (on CPU it replays the step under
            ``torch.profiler``, which is slower).
        meter: measure with the dispatch-level meter (``False`` for compiled code, which
            runs eagerly under it).
        call: the module the step calls, when it is not ``model`` itself (the compiled
            wrapper of ``model``); its state is ``model``'s.
        restore: put the model back afterwards; ``False`` for a step whose model cannot
            be snapshotted (FSDP2's sharded parameters): the steps then train it.
        time_within: time the step only when its worst peak is at most this many bytes
            (a search skips timing what does not fit).
        steps: consecutive optimizer steps each instrument measures, the peak over all of
            them (after the one that carries into the first); more than 1 catches memory
            that changes over training (a branch that turns on at step k). They run as
            training does: RNG and buffers advance from one to the next.
        held: also measure ``held_after_forward_bytes`` (one more forward under the
            dispatch-level meter); ``False`` where only the peak is wanted (verification).

    Raises:
        LossNotFoundError: no ``loss_fn`` and the output has no ``.loss``.
        ProfileError: ``warmup`` or ``repeats`` not a whole count (``repeats=0`` is
            valid: not timed), or ``repeats`` with ``restore=False``.
        ParameterError: ``steps`` or ``time_within`` not a whole count in range.
    """
    check_profile_args(model, sample_batch, loss_fn=loss_fn, optimizer=optimizer, loop=loop,
                       where="measure()")
    check_timing(warmup, repeats, min_repeats=0, where="measure()")
    check_count("steps", steps, lo=1, meaning="consecutive optimizer steps measured",
                owner="measure()")
    if time_within is not None:
        check_count("time_within", time_within, lo=0, meaning="bytes: time the step only when "
                    "its peak is at most this; None times it always", owner="measure()")
    if repeats and not restore:
        raise ProfileError(f"measure(): restore=False trains the model, so its steps cannot be "
                           f"timed from the same state: pass repeats=0, got {repeats=}")
    loop = loop_or_default(loop)
    device = model_device(model)
    watch = Stopwatch(device)
    held_bytes = time_ms = None
    with _session(model, optimizer, restore) as state:
        runner = StepRunner(call if call is not None else model, sample_batch, loss_fn,
                            optimizer, loop, device.type)
        _cycles(runner, warmup, state)
        watch.sync()
        peaks = _measured(runner, model, steps, state, steady=warmup == 0 and meter,
                          allocator=allocator, meter=meter)
        resident, peak, alloc_peak = peaks.resident, peaks.peak, peaks.allocator_peak
        reserved, cuda_peak = peaks.reserved, peaks.cuda_peak
        if meter and held:
            with MemoryMeter(device_type=device.type) as dispatch:
                output, loss = runner.forward()
                if not loop.keep_output:
                    output = None
                held_bytes = dispatch.live_bytes
            # Both go now: the forward's graph (what it saved) lives as long as either.
            del output, loss
            clear_grads(runner.params)
        worst = max(peak or 0, alloc_peak or 0)
        if repeats and state is not None and (time_within is None or worst <= time_within):
            time_ms = time_steps(runner, state, watch, warmup=0, repeats=repeats).step_ms
    result = StepMeasurement(resident, peak, alloc_peak, reserved, cuda_peak, held_bytes,
                             time_ms)
    log.info("measured step (%s): peak %s B (allocator %s B, resident %d B), %s ms",
             loop.describe(), peak, alloc_peak, resident, time_ms)
    return result

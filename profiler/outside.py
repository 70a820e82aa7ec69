"""Pass 4 of :mod:`.profile` (head variants).

The code outside the units, measured: for the head as it is and, where a head is to be
measured (:mod:`.heads`), with it over each chunk count.

Each measurement is the outside time's stub steps (:mod:`.outside_time`) and one
instrumented stub step (:mod:`.instrument`), and where the outside code's parameter
gradients appear (:mod:`.grads`), with each phase's backward peak in a loop that steps
the optimizer in backward (:func:`~.grads.place_steps`, from the per-parameter step peaks
the first run metered: a head changes the micro-batch, not the optimizer). The most
frugal runs first: the head over the most chunks, then fewer, then the head as it is,
which holds the whole logits. On a device too small for the head as it is (the reason
a user plans), a run that runs out of memory after a smaller one was measured ends the
measurements: what it and the ones after would hold does not fit, so no plan may use
them (the profile says the head as it is was not measured:
:attr:`remat.core.profile.HeadProfile.as_is`). Only when the most frugal run does not
fit is it an error. For a budget (``remat.solve``) the order is the head as it is first,
then the variants only where the budget needs them (:func:`_as_is_first`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from remat.execute.head import HeadSite, chunk_counts, chunked_head
from remat.measurement.runner import StepRunner
from remat.measurement.state import ModelState
from remat.measurement.timing import Stopwatch
from remat.profiler.grads import place_grads, place_steps
from remat.profiler.instrument import instrumented_step
from remat.profiler.outside_time import time_outside
from remat.profiler.records import (
    OptionFigures,
    OutsideRun,
    OutsideTimes,
    TimedRuns,
)
from remat.profiler.stub import StubClock

__all__ = ["measure_outside"]

log = logging.getLogger("remat")


def measure_outside(
    runner: StepRunner,
    ordered: list[tuple[str, nn.Module]],
    *,
    is_chain: bool,
    state: ModelState,
    watch: Stopwatch,
    timed: TimedRuns,
    trained: dict[int, frozenset[int]],
    site: HeadSite | None,
    unit_figures: list[dict[str, OptionFigures]],
    variants_needed: Callable[[OutsideRun], bool] | None = None,
    confirmed: Callable[[], HeadSite | None] | None = None,
) -> list[OutsideRun]:
    """The runs that fit, most frugal first (see the module docstring). The optimizer's
    figures are the first run's (a head changes the micro-batch, not the optimizer).

    ``variants_needed`` (a budget's question, see :func:`_as_is_first`): the head as it
    is runs first, and the chunked runs only where it says they are needed and
    ``confirmed()`` (the check of the head's rewrite, run then) gives the site back.

    Raises:
        torch.OutOfMemoryError: the most frugal run does not fit.
    """
    def measure(chunks: int | None, first: OutsideTimes | None) -> OutsideRun:
        return _measure(runner, ordered, is_chain, state, watch, timed, trained, site,
                        chunks, unit_figures, first=first)

    if site is not None and variants_needed is not None:
        return _as_is_first(site, measure, state, variants_needed,
                            confirmed if confirmed is not None else lambda: site)
    return _frugal_first(site, measure, state, first=None)


def _frugal_first(site: HeadSite | None,
                  measure: Callable[[int | None, OutsideTimes | None], OutsideRun],
                  state: ModelState, *, first: OutsideTimes | None,
                  as_is: bool = True, most_only: bool = False) -> list[OutsideRun]:
    """The head over each chunk count (``most_only``: the most), the most first, then
    (``as_is``) as it is, until one runs out of memory."""
    choices: list[int | None] = sorted(chunk_counts(site.tokens), reverse=True) if site else []
    if most_only:
        choices = choices[:1]
    if as_is:
        choices.append(None)
    runs: list[OutsideRun] = []
    for chunks in choices:
        try:
            run = measure(chunks, runs[0].times if runs else first)
        except torch.OutOfMemoryError:
            if not runs:
                raise
            state.between_passes()
            what = "as it is" if chunks is None else f"over {chunks} chunks"
            log.info("remat: the head %s does not fit the device: plans compute it over at "
                     "least %d chunks", what, runs[-1].chunks)
            break
        runs.append(run)
    return runs


def _as_is_first(site: HeadSite,
                 measure: Callable[[int | None, OutsideTimes | None], OutsideRun],
                 state: ModelState,
                 variants_needed: Callable[[OutsideRun], bool],
                 confirmed: Callable[[], HeadSite | None]) -> list[OutsideRun]:
    """The head as it is first; its most frugal chunked variant only where
    ``variants_needed`` says the budget needs it (or the head as it is does not fit the
    device).

    With the head exact first (``head="auto"``: a plan chunks it only below the smallest
    peak of the head as written), the variants serve no budget above that peak, and they
    were most of a profile's outside steps (three chunk counts, each a run of stub steps
    and an instrumented step). Below it, the most chunks reach the lowest floor; fewer
    chunks are a little faster, which is the speed ``head="chunked"`` measures every
    chunk count for. The head as it is holds its whole logits, more than the
    most frugal run: where that is more than the device has it runs out of memory, which
    is caught, and the chunked runs follow, most frugal first (a run that does not fit
    then is an error as before). So the device is asked for no more than it has, and
    a profile without the variants says so (``meta["head_variants"]``). The rewrite's
    check (``confirmed()``, two passes on one example) runs here, and only where a
    variant is to be measured; where it fails, the head as it is is all there is.
    """
    too_big: torch.OutOfMemoryError | None = None
    try:
        as_is: OutsideRun | None = measure(None, None)
    except torch.OutOfMemoryError as err:
        state.between_passes()
        log.info("remat: the head as it is does not fit the device: measuring it chunked")
        as_is, too_big = None, err
    if as_is is not None and not variants_needed(as_is):
        return [as_is]
    if confirmed() is None:  # the rewrite fails its check: the head as it is, or nothing
        if as_is is None:
            assert too_big is not None
            raise too_big
        return [as_is]
    first = as_is.times if as_is is not None else None
    chunked = _frugal_first(site, measure, state, first=first, as_is=False, most_only=True)
    return chunked + ([as_is] if as_is is not None else [])


def _measure(
    runner: StepRunner, ordered: list[tuple[str, nn.Module]], is_chain: bool,
    state: ModelState, watch: Stopwatch, timed: TimedRuns, trained: dict[int, frozenset[int]],
    site: HeadSite | None, chunks: int | None,
    unit_figures: list[dict[str, OptionFigures]], *, first: OutsideTimes | None,
) -> OutsideRun:
    """One run; ``first``: the first run's times, whose optimizer figures (taken once)
    this one reuses."""
    modules = [m for _, m in ordered]
    # The instrumented step runs first: its units run for real, and the clock keeps what
    # they gave, so that the timed steps after it hand out zeros for them from their
    # first on (a whole forward of the model saved). The parameters and the optimizer's
    # state are put back after it, so that the timed steps' first optimizer step creates
    # the state where the user's optimizer has none yet, as it would have.
    clock = StubClock()
    try:
        with chunked_head(runner.model, site, chunks):
            state.between_passes()
            watch.sync()  # the replays' queued work done before the meter starts
            step = instrumented_step(runner, ordered, is_chain=is_chain, clock=clock)
            state.restore_params()
            times = time_outside(runner, modules, state, watch, warmup=timed.warmup,
                                 repeats=timed.repeats, tolerance=timed.tolerance,
                                 optimizer=first is None, units_ms=timed.units_ms,
                                 clock=clock)
    finally:
        state.between_passes()
    if first is not None:
        times = replace(
            times, optimizer_ms=first.optimizer_ms,
            optimizer_state_bytes=first.optimizer_state_bytes,
            optimizer_step_peak_bytes=first.optimizer_step_peak_bytes,
            param_step_peaks=first.param_step_peaks, param_steps=first.param_steps)
    grads = place_grads(state.params, modules, step.param_grads, trained, is_chain=is_chain)
    steps = place_steps(state.params, modules, step.param_grads, trained,
                        times.param_step_peaks, unit_figures=unit_figures,
                        suffix_peak=max(step.suffix.bwd_peak_bytes, 0),
                        prefix_peak=max(step.prefix.bwd_peak_bytes, 0))
    return OutsideRun(chunks, step, times, grads, steps)


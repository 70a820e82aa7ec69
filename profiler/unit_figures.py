"""Pass 1 of :mod:`.profile` (capture and replays).

Each unit's figures under each option, measured at its own call in the capture pass.

:func:`~remat.profiler.capture.trace_units` calls a :class:`UnitMeasurer` at each unit's
call, before the unit runs, with its live inputs: the unit is replayed alone there
(:mod:`.replay`), and nothing is kept for later but the figures, so profiling holds one
unit's replay at a time on top of what the forward itself references.

For each unit: the options are timed first (``checkpoint`` not: its extra time is by
definition its recomputed forward, keep's forward time), which also warms its kernels
up (a kernel's first run can allocate what later runs reuse, oneDNN's scratch, which no
metered run should count); then each option is replayed once under the meter,
``checkpoint`` last and, where selective's replay showed torch's recomputation running
on the unit, its forward alone (its backward is keep's after a recomputation:
:mod:`.recomputed`). A round of timed runs times only the options whose figures have
not settled yet. An
option that fails on the unit (selective checkpointing of a tensor mutated in place, a
recomputation torch refuses, or the device running out of memory for it) is dropped for
that unit, with a warning naming the unit, the option and the reason. ``keep`` failing
for want of memory means the unit cannot run at all: a :class:`DeviceMemoryError`.

**Twins** (:mod:`.twins`: the same computation on inputs of the same kind, a
transformer's blocks) are measured once: the first of them is replayed and timed, the
second replayed once under keep with the meter to confirm that its bytes are the
first's (:meth:`UnitMeasurer._check_twin`), and the rest take the first's figures and
times. Where the second's figures differ, every twin is measured on its own. So
profiling 48 blocks costs about what 1.3 cost.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

import torch

from remat.core.errors import DeviceMemoryError, ProfileError
from remat.core.option import Option
from remat.execute.derive import DeriveFreesNothing, DeriveMismatch
from remat.measurement.runner import StepRunner
from remat.measurement.timing import Stopwatch
from remat.profiler.progress import Progress
from remat.profiler.recomputed import checkpoint_figures
from remat.profiler.records import OptionFigures, TimingPolicy, UnitCall, UnitTiming
from remat.profiler.replay import (
    OPTION_ERRORS,
    OptionFailure,
    OptionRunFailed,
    TimingSamples,
    clear_replay_grads,
    measure_forward,
    measure_option,
    time_unit,
)
from remat.profiler.twins import signature

__all__ = ["UnitMeasurer"]


def _raise(error: BaseException) -> None:
    raise error

log = logging.getLogger("remat")


def _bytes_only(figures: Mapping[str, OptionFigures]) -> dict[str, OptionFigures]:
    """``figures`` without which parameters they trained (twins own other ones) and when
    their gradients were ready (a detail of one run, not what tells twins apart)."""
    return {o: dataclasses.replace(f, params_trained=frozenset(), grads_ready=(),
                                   released_bwd_peak_bytes=None)
            for o, f in figures.items()}


@dataclass
class _Twins:
    """What the first of a group of twins measured, and whether the second agreed."""

    first: str
    figures: dict[str, OptionFigures]
    timing: UnitTiming
    checked: bool = False
    differ: bool = False
    members: list[str] = field(default_factory=list)  # the units that took its timing


@dataclass
class UnitMeasurer:
    """The capture pass's ``on_unit``: every unit's figures and times (module docstring).

    Attributes, filled as the pass runs: ``figures`` and ``timings`` per unit name;
    ``trained`` per unit name, the parameters its own replay gave a gradient (absent for
    a unit that took a twin's figures); ``failures``, the options dropped.
    """

    options: list[str]
    runner: StepRunner
    watch: Stopwatch
    policy: TimingPolicy
    bar: Progress
    # What a region recomputing the unit holds beside its forward (:mod:`.recomputed`).
    recompute_stash: Callable[[torch.nn.Module], int] = lambda _module: 0
    needs_bytes: Callable[[str], int] = lambda _name: 0
    recorded: Callable[[str], Hashable] = lambda _name: None
    figures: dict[str, dict[str, OptionFigures]] = field(default_factory=dict)
    timings: dict[str, UnitTiming] = field(default_factory=dict)
    trained: dict[str, frozenset[int]] = field(default_factory=dict)
    failures: list[tuple[str, OptionFailure]] = field(default_factory=list)
    # Units without derive because they hold nothing it could make again (not dropped:
    # keep is what derive would be there).
    derives_nothing: set[str] = field(default_factory=set)
    _groups: dict[Hashable, _Twins] = field(default_factory=dict)

    def __call__(self, call: UnitCall) -> None:
        self.bar.step(f"unit {call.name}")
        # Twins: the same computation on the same kind of input (the signature), and the
        # same ops and saves where the saves pass recorded them.
        key = ((signature(call), self.recorded(call.name)) if self.policy.pool_twins
               else call.name)
        group = self._groups.get(key)
        own = True  # measured on this very unit (not taken from a twin)
        if group is None:
            timing, figures = self._time_then_meter(call)
            self._groups[key] = _Twins(call.name, figures, timing)
        elif group.differ or not group.checked:
            figures = self._meter(call) if group.checked else self._check_twin(call, group)
            timing = group.timing
            if group.differ:
                timing, dropped = self._time_checked(
                    call, [o for o in figures if o != Option.CHECKPOINT.value])
                figures.pop(dropped, None)
        else:
            figures, timing, own = group.figures, group.timing, False
            if group.first in self.derives_nothing:
                self.derives_nothing.add(call.name)
        if own:
            self.trained[call.name] = figures[Option.KEEP.value].params_trained
        twins = self._groups[key]
        if timing is twins.timing:
            twins.members.append(call.name)
        self.figures[call.name] = figures
        self.timings[call.name] = timing

    def _check_twin(self, call: UnitCall, group: _Twins) -> dict[str, OptionFigures]:
        """The second of a group of twins: keep metered, its bytes compared with the
        first's; the other options metered only where they differ.

        keep runs the unit's own forward and backward, so its figures are what the
        computation holds and frees; the other options run the same computation under a
        policy that decides by op (selective) or holds the same inputs (checkpoint), so
        they differ only where keep does. Metering them on the twin too cost two more
        replays of a unit in every group (a CNN's twin blocks: 0.4 of a step)."""
        keep = Option.KEEP.value
        figures = self._meter(call, [keep])
        group.checked = True
        group.differ = _bytes_only(figures) != _bytes_only(
            {keep: group.figures[keep]} if keep in group.figures else {})
        if group.differ:
            log.debug("twins %r and %r differ in bytes: each is measured",
                      group.first, call.name)
            return {**figures, **self._meter(call, [o for o in self.options if o != keep],
                                             keep=figures[keep])}
        return {**group.figures, **figures}

    # -- metering --------------------------------------------------------------------
    def _time_then_meter(self, call: UnitCall) -> tuple[UnitTiming, dict[str, OptionFigures]]:
        """A new unit: timed first (the timed runs warm its kernels up for the meter),
        then metered; where an option fails in the timed runs, metered first to find
        which, then the others timed."""
        options = [o for o in self.options if o != Option.CHECKPOINT.value]
        dropped: str | None = None
        try:
            timing, dropped = self._time_checked(call, options)
        except OptionRunFailed as failed:
            # keep runs the unit's own forward: what it raises is the model's, as it is.
            if failed.option == Option.KEEP.value or not isinstance(failed.error,
                                                                     OPTION_ERRORS):
                raise failed.error from None
        else:
            return timing, self._meter(call, [o for o in self.options if o != dropped])
        # Metered outside the handler: the failed run's frames (its tensors: an option
        # that ran out of memory held its forward's) are let go of first.
        figures = self._meter(call)
        timing, dropped = self._time_checked(call, [o for o in options if o in figures])
        figures.pop(dropped, None)  # type: ignore[arg-type]
        return timing, figures

    def _time_checked(self, call: UnitCall, options: list[str]
                      ) -> tuple[UnitTiming, str | None]:
        """:meth:`_time`, and the option dropped by the checks only ``derive``'s first timed
        run makes (:mod:`remat.execute.derive`): a recipe that does not repeat its value
        (a failure, logged), or nothing to derive (not one: ``keep`` is that); timed again
        without it."""
        # keep first (what the unit's own forward raises is the model's), derive next:
        # where its check drops it, that is early in the first round, and the samples
        # taken before it are kept.
        keep, derive = Option.KEEP.value, Option.DERIVE.value
        options = sorted(options, key=lambda o: (o != keep, o != derive))
        samples = TimingSamples(tuple(options))
        try:
            return self._time(call, options, samples), None
        except OptionRunFailed as failed:
            if not isinstance(failed.error, (DeriveMismatch, DeriveFreesNothing)):
                raise
            option = failed.option
            # The error's frames hold the failed run's tensors (the unit's input among
            # them) in a cycle with the frame that raised it: cut, so that they are gone
            # before the runs that follow look at what is alive.
            failed.__traceback__ = failed.error.__traceback__ = None
            if isinstance(failed.error, DeriveFreesNothing):
                log.debug("unit %r: %s", call.name, failed.error)
                self.derives_nothing.add(call.name)
            else:
                self._drop(call, option, failed.error)
        rest = [o for o in options if o != option]
        kept = TimingSamples(tuple(rest), {o: samples.fwd[o] for o in rest},
                             {o: samples.bwd[o] for o in rest})
        return self._time(call, rest, kept), option

    def _meter(self, call: UnitCall, options: list[str] | None = None, *,
               keep: OptionFigures | None = None) -> dict[str, OptionFigures]:
        """``call`` replayed once under the meter per option (``options``, or all; ``keep``:
        keep's figures, metered before).

        ``checkpoint`` goes last: where keep's figures are there and selective's replay
        just ran its backward (torch's recomputation works on the unit), only its forward
        is metered and its backward composed of keep's (:mod:`.recomputed`); else it is
        metered in full."""
        asked = self.options if options is None else options
        ckpt = Option.CHECKPOINT.value
        figures: dict[str, OptionFigures] = {}
        for option in [o for o in asked if o != ckpt]:
            if option == Option.KEEP.value:
                figures[option] = self._keep_or_fail(
                    call, lambda o=option: measure_option(call, o, self.runner))
                continue
            try:
                figures[option] = measure_option(call, option, self.runner)
            except OPTION_ERRORS as err:  # an out-of-memory error is a RuntimeError too
                self._drop(call, option, err)
        if ckpt in asked:
            keep = figures.get(Option.KEEP.value, keep)
            recomputes = (keep is not None
                          and keep.recompute_start_bytes is not None
                          and keep.recompute_peak_bytes is not None
                          and Option.SELECTIVE.value in figures)
            try:
                figures[ckpt] = (
                    checkpoint_figures(measure_forward(call, ckpt, self.runner), keep,
                                       stash_bytes=self.recompute_stash(call.module))
                    if recomputes else measure_option(call, ckpt, self.runner))
            except OPTION_ERRORS as err:
                self._drop(call, ckpt, err)
        return {o: figures[o] for o in asked if o in figures}

    def _drop(self, call: UnitCall, option: str, err: BaseException) -> None:
        """``option`` cannot run on ``call``'s unit: one log line and a failure recorded."""
        clear_replay_grads(call, self.runner)
        failure = OptionFailure.of(option, err)
        log.warning("unit %r: option %r dropped, it cannot run on this unit: %s",
                    call.name, option, failure.reason)
        self.failures.append((call.name, failure))

    def _keep_or_fail(self, call: UnitCall, replay: Callable[[], object]) -> object:
        """``replay()`` of the unit under keep; the device running out of memory for it
        is a :class:`DeviceMemoryError`: no option can run a unit that keep cannot."""
        try:
            return replay()
        except torch.OutOfMemoryError as err:
            clear_replay_grads(call, self.runner)
            needs = self.needs_bytes(call.name)
            raise DeviceMemoryError(
                f"unit {call.name!r} does not fit on the device even alone: its replay ran "
                f"out of memory ({' '.join(str(err).split())[:300]}). It saves "
                f"{needs:,} bytes for backward, and its recomputation under any option needs "
                "them all at once; use smaller units (units=[...] naming its children, or "
                "granularity='children'), a smaller batch, or a device with more memory"
            ) from None

    # -- timing ----------------------------------------------------------------------
    def _time(self, call: UnitCall, options: list[str],
              samples: TimingSamples | None = None) -> UnitTiming:
        """Timed replays of ``options`` (without checkpoint: its extra time is its
        recomputed forward, which keep's timing measures), added to ``samples`` when
        given."""
        policy = self.policy
        samples = samples if samples is not None else TimingSamples(tuple(options))
        try:
            time_unit(call, options, self.runner, self.watch, warmup=policy.warmup,
                      repeats=policy.repeats, tolerance=policy.tolerance, samples=samples)
        except OptionRunFailed as failed:
            error = failed.error
            if failed.option == Option.KEEP.value and isinstance(error, torch.OutOfMemoryError):
                self._keep_or_fail(call, lambda: _raise(error))
            raise
        return samples.timing()

    def log_twins(self) -> None:
        """One debug line: how many groups the units were timed as."""
        groups = [g.members for g in self._groups.values()]
        timed = sum(1 for g in groups if g) + sum(
            1 for name, t in self.timings.items()
            if not any(name in g for g in groups))
        pooled = [g for g in groups if len(g) > 1]
        if pooled:
            log.debug("timed %d units as %d groups of twins: %s", len(self.timings), timed,
                      pooled)

    def check_some_option_runs(self) -> None:
        """Raise when options besides keep were asked for and none ran on any unit."""
        if len(self.options) < 2 or any(len(f) > 1 for f in self.figures.values()):
            return
        reasons: dict[str, str] = {}
        for name, failure in self.failures:
            reasons.setdefault(failure.option, f"{failure.reason} (unit {name!r})")
        raise ProfileError(
            "every option but keep failed on every unit, so no plan could save memory: "
            + "; ".join(f"{o}: {r}" for o, r in reasons.items())
            + ". Check that the units' forwards can be recomputed (no in-place change of "
            "their inputs, the same tensors on every call), or pass units= naming other "
            "modules"
        )

"""Pass 2 of :mod:`.profile` (outside step).

The outside step: what the code *outside* the units costs, measured in a real step.

One training step of the loop runs with every unit a stub (:mod:`.stub`: its own
forward under ``no_grad``, nothing saved, a gradient of ones for each of its inputs in
backward), under a :class:`TimelineMeter` with marks at every unit boundary, each kept
by the unit's own record (:class:`_UnitWatch`). The units' own costs are the replays'
(:mod:`.replay`); this step never holds more than the code outside the units and one
unit's forward, so profiling a model that does not fit runs within the memory of the
most frugal plan.

* forward pre/post hooks on the units mark where each unit starts and ends (a unit
  FSDP2 shards starts before FSDP2's pre-forward, whose all-gather is the unit's, as the
  sharded profile counts it; the root is gathered before the first mark);
* tensor hooks on each unit's boundary input and output mark where its backward
  starts (its output's gradient is ready) and ends (its input's gradient is
  ready). Tensor hooks do not change the graph, unlike module backward hooks;
* ``saved_tensors_hooks`` (identity) record which code saved which storage, to
  tell whether the prefix / suffix / code between units holds a boundary;
* post-hooks on the graph nodes that feed a parameter's ``AccumulateGrad`` tell
  in which backward phase its first gradient contribution appears: that is where
  its gradient bytes are counted (:mod:`.grads` adds the units' parameters). A
  parameter used twice (a tied embedding) has its contributions summed before
  ``AccumulateGrad`` runs once, at the earlier user's backward, but a gradient-sized
  buffer is alive from the later user's backward (the first to run) on, and that is
  what the live bytes see. The live bytes when ``.grad`` receives it, above the start of
  that phase, are kept too: stepping the parameter there, in a loop that steps in
  backward, adds its step's own peak to them (:mod:`.grads`).

Figures are then read off the per-storage timeline, so that ``simulate()`` adding
them to the units' isolated figures reproduces the step. In particular
``held_bytes`` of the prefix/suffix are the storages that code allocated and that
are still alive when the forward pass ends; off a chain, what the code between
units holds is the next unit's ``before_held_bytes``, and that code's peaks and
parameter gradients are its too (:class:`UnitInStep`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from remat.core.errors import ProfileError
from remat.execute.boundary import boundary_input, boundary_output
from remat.execute.sharding import (
    all_gather_output_kept,
    root_kept_gathered,
    starts_with_gather,
    unreduced_grad_bytes,
)
from remat.measurement.runner import StepRunner, output_tensors
from remat.measurement.storage import storage_nbytes
from remat.profiler.records import (
    OutsideFigures,
    OutsideStep,
    ParamGrad,
    Phase,
    SharedInStep,
    UnitInStep,
)
from remat.profiler.stub import StubClock, give_missing_grads, stubbed
from remat.profiler.timeline import TimelineMeter

__all__ = ["instrumented_step"]

log = logging.getLogger("remat")


# ---------------------------------------------------------------------------------
# Watching the step
# ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Mark:
    """A meter mark: its position in ``meter.marks``, its tick, and the wall clock."""

    index: int
    tick: int
    live_bytes: int
    clock: float


@dataclass
class _UnitWatch:
    """What the hooks see of one unit while the step runs."""

    index: int
    name: str
    input_record: int | None = None
    input_bytes: int = 0
    output_record: int | None = None
    output_bytes: int = 0
    output_needs_grad: bool = False
    input_grad_bytes: int = 0
    input_grad_record: int | None = None
    fwd_start: _Mark | None = None
    fwd_end: _Mark | None = None
    bwd_start: _Mark | None = None  # its output's gradient is ready
    bwd_end: _Mark | None = None  # its input's gradient is ready


class _StepWatch:
    """The meter, the units' records, and who saved what, for one instrumented step."""

    def __init__(self, meter: TimelineMeter, units: list[tuple[str, nn.Module]],
                 read_unreduced: Callable[[], int] = lambda: 0,
                 read_kept_gather: Callable[[], torch.Tensor | None] = lambda: None) -> None:
        self.meter = meter
        self.units = [_UnitWatch(i, name) for i, (name, _) in enumerate(units)]
        self.by_module = {id(m): self.units[i] for i, (_, m) in enumerate(units)}
        self.phase: Phase = ("prefix",)  # who runs now, in the forward pass
        self.saved: list[tuple[Phase, int]] = []  # (saver, storage record)
        self.backward_marks: list[tuple[str, _UnitWatch, _Mark]] = []  # in the order made
        self.first_grad_tick: dict[int, int] = {}  # id(param) -> clock at its first gradient
        self.accumulated_tick: dict[int, int] = {}  # id(param) -> clock when .grad got it
        self.accumulated_live: dict[int, int] = {}  # id(param) -> live bytes then
        self.side_users: dict[int, list[int]] = {}  # storage record -> units handed it
        self.side_grad: dict[int, int] = {}  # storage record -> bytes of its gradient
        self.handles: list[Any] = []
        # FSDP2's root's unsharded gradients at the units' backward marks (read by
        # ``read_unreduced``; see Profile.unreduced_grad_bytes).
        self.read_unreduced = read_unreduced
        self.unreduced = 0
        # FSDP2's all-gather output alive as the suffix starts (the last unit's, kept to
        # the root's post-forward): the sharded profile counts it, not the suffix
        # (``all_gather_output_kept``).
        self.read_kept_gather = read_kept_gather
        self.kept_gather_record: int | None = None
        self.start = self.forward_end = self.backward_end = self.mark()

    def mark(self) -> _Mark:
        reading = self.meter.mark()
        return _Mark(len(self.meter.marks) - 1, self.meter.clock, reading.live_bytes,
                     time.perf_counter())

    # -- module hooks -------------------------------------------------------------
    def hook_units(self, modules: list[nn.Module]) -> None:
        """Hook each unit's start, inputs and end (removed with :attr:`handles`)."""
        for m in modules:
            # FSDP2's pre-forward all-gathers the unit: its output and the gathered
            # parameters are the unit's (the sharded profile counts them in its forward
            # and the buffers in flight), not the code's before it.
            self.handles.append(m.register_forward_pre_hook(
                self.start_hook, prepend=starts_with_gather(m)))
            self.handles.append(m.register_forward_pre_hook(self.pre_hook, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self.post_hook, with_kwargs=True))

    def start_hook(self, module: nn.Module, args: tuple) -> None:
        """Where unit ``module`` starts: registered before any other hook of a unit whose
        call starts with FSDP2's all-gather (:meth:`hook_units`)."""
        u = self.by_module[id(module)]
        u.fwd_start = self.mark()
        self.phase = ("unit", u.index)

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """What unit ``module`` is called on, as its forward sees it (after its other
        pre-hooks: FSDP2's may cast the inputs)."""
        u = self.by_module[id(module)]
        located = boundary_input(args, kwargs)
        x = located[1] if located is not None else None
        u.input_record = self.meter.record_of(x)
        u.input_bytes = storage_nbytes(x) if u.input_record is not None else 0
        for t in tree_flatten((args, kwargs))[0]:
            rec = self.meter.record_of(t) if isinstance(t, torch.Tensor) else None
            if rec is None:
                continue
            if t.requires_grad:  # its users' backwards sum a gradient for it
                grad = t.numel() * t.element_size()
                self.side_grad[rec] = max(self.side_grad.get(rec, 0), grad)
            if rec != u.input_record:
                users = self.side_users.setdefault(rec, [])
                if u.index not in users:
                    users.append(u.index)
        if x is not None and x.requires_grad:
            self.handles.append(x.register_hook(self._backward_hook(u, "end")))

    def post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        u = self.by_module[id(module)]
        u.fwd_end = self.mark()
        self.phase = ("between", u.index) if u.index < len(self.units) - 1 else ("suffix",)
        y = boundary_output(output)
        u.output_record = self.meter.record_of(y)
        u.output_bytes = storage_nbytes(y) if u.output_record is not None else 0
        u.output_needs_grad = y is not None and y.requires_grad
        if u.index == len(self.units) - 1:
            kept = self.read_kept_gather()
            self.kept_gather_record = None if kept is None else self.meter.record_of(kept)
        if u.output_needs_grad:
            self.handles.append(y.register_hook(self._backward_hook(u, "start")))

    def _backward_hook(self, u: _UnitWatch, which: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if getattr(u, f"bwd_{which}") is not None:
                return
            mark = self.mark()
            setattr(u, f"bwd_{which}", mark)
            # They only grow until the root's post-backward, after every mark: the last
            # reading has them all, the head's whether the suffix or a unit made it.
            self.unreduced = max(self.unreduced, self.read_unreduced())
            self.backward_marks.append((which, u, mark))
            if which == "end":
                u.input_grad_bytes = storage_nbytes(grad)
                u.input_grad_record = self.meter.record_of(grad)

        return hook

    def accumulated(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: when ``param.grad`` received its gradient."""
        self.accumulated_tick.setdefault(id(param), self.meter.clock)
        self.accumulated_live.setdefault(id(param), self.meter.live_bytes)

    # -- saved tensors ------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> torch.Tensor:
        rec = self.meter.record_of(t)
        if rec is not None:  # parameters, buffers and the batch have no record
            self.saved.append((self.phase, rec))
        # A detached alias: same storage, same lifetime, but no reference cycle
        # through grad_fn when an op saves its own output.
        return t.detach()

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def held_outside(self, rec: int | None, own: set[Phase]) -> bool:
        return rec is not None and any(rec == s and p not in own for p, s in self.saved)

    def backward_phase(self, tick: int) -> Phase:
        """The backward phase running at ``tick``: ``("suffix",)``, ``("unit", i)`` or
        ``("outside", i)`` (after unit i's backward: the prefix, or code between units)."""
        phase: Phase = ("suffix",)
        for which, u, mark in self.backward_marks:
            if mark.tick >= tick:
                break
            # On a chain one tensor is unit i's input and unit i-1's output, so "end of
            # unit i" and "start of unit i-1" are marked together, in either order.
            if which == "start":
                phase = ("unit", u.index)
            elif phase == ("unit", u.index):
                phase = ("outside", u.index)
        return phase


def instrumented_step(
    runner: StepRunner,
    units: list[tuple[str, nn.Module]],
    *,
    is_chain: bool,
    clock: StubClock | None = None,
) -> OutsideStep:
    """Run one instrumented micro-batch of the runner's loop and its optimizer step with
    every unit a stub (see the module docstring); ``units`` in execution order. The units
    run for real: ``clock``, where given, keeps what they gave, for stub steps with shapes
    only after this one (:class:`~.stub.StubClock`).

    Gradients must be ``None`` on entry (they are allocated inside the region).
    """
    model, loop = runner.model, runner.loop
    meter = TimelineMeter(device_type=runner.device_type, allocator=True)
    grad_records: dict[int, tuple[int, int]] = {}  # gradient record -> (tick, id(param))
    # FSDP2's root gathered inside the region, before the first mark (root_kept_gathered:
    # no window measures its all-gathers, and its post-backward's free is seen).
    modules = [m for _, m in units]
    with stubbed(modules, clock) as clock, meter, root_kept_gathered(model):
        clock.new_step(shapes_only=False)
        watch = _StepWatch(meter, units, lambda: unreduced_grad_bytes(model),
                           lambda: all_gather_output_kept(model))
        try:
            watch.hook_units(modules)
            with torch.autograd.graph.saved_tensors_hooks(watch.pack, watch.unpack):
                output, loss = runner.forward()
            # The loop keeps the output until the end of the step, or drops it now.
            kept = output_tensors(output) if loop.keep_output else []
            del output
            watch.forward_end = watch.mark()
            loss_storage = meter.record_of(loss)
            output_records = {meter.record_of(t) for t in kept} - {None, loss_storage}
            # The caller's loss (and the seed gradient backward() makes for it) stay
            # alive through the whole backward pass, whatever storage the loss has.
            loss_storage_bytes = storage_nbytes(loss) if loss_storage is not None else 0
            loss_bytes = loss_storage_bytes + loss.numel() * loss.element_size()
            watch.handles.extend(
                _hook_gradient_producers(loss, model, meter, watch.first_grad_tick)
            )
            for p in model.parameters():
                if p.requires_grad:
                    watch.handles.append(p.register_post_accumulate_grad_hook(watch.accumulated))
            runner.backward(loss, release=False)  # plain: the steps are metered apart
            del loss
            watch.backward_end = watch.mark()
            in_flight: dict[int, tuple[int, int]] = {}  # record -> (first tick, tick in .grad)
            for p in model.parameters():
                rec = meter.record_of(p.grad)
                if rec is not None:
                    tick = watch.first_grad_tick.get(id(p), meter.records[rec].born)
                    if rec not in grad_records or tick < grad_records[rec][0]:
                        grad_records[rec] = (tick, id(p))
                    in_flight[rec] = (tick, watch.accumulated_tick.get(id(p), tick))
            give_missing_grads(runner.params)  # the units' own, as a real step has them
            runner.optimizer_step()
            del kept
        finally:
            for h in watch.handles:
                h.remove()

    missing = [u.name for u in watch.units if u.fwd_start is None or u.fwd_end is None]
    if missing:
        raise ProfileError(
            f"units {missing} ran in the first forward pass but not in the second; the "
            "profiler needs the same units to run on every step with this batch"
        )
    step = _figures(watch, is_chain, loss_bytes, output_records)
    # A parameter used in two phases (an embedding tied to the LM head) has its first
    # contribution summed in a buffer until the last phase hands the sum to .grad:
    # when .grad is alive already, that buffer is extra, from one phase to the other.
    grads = tuple(
        ParamGrad(param_id, meter.records[rec].nbytes, watch.backward_phase(tick),
                  watch.backward_phase(in_flight[rec][0])
                  != watch.backward_phase(in_flight[rec][1]),
                  *_ready(watch, param_id))
        for rec, (tick, param_id) in grad_records.items())
    return replace(step, loss_storage_bytes=loss_storage_bytes, param_grads=grads,
                   unreduced_grad_bytes=watch.unreduced)


def _ready(w: _StepWatch, param_id: int) -> tuple[Phase | None, int]:
    """The phase in which the parameter's ``.grad`` received its gradient, and the live
    bytes then above that phase's start (see :class:`ParamGrad`)."""
    tick = w.accumulated_tick.get(param_id)
    if tick is None:
        return None, 0
    phase = w.backward_phase(tick)
    if phase == ("suffix",):
        start = w.forward_end
    elif phase[0] == "unit":
        start = w.units[phase[1]].bwd_start
    else:  # ("outside", i): after unit i's backward
        start = w.units[phase[1]].bwd_end
    if start is None:
        return None, 0
    return phase, max(w.accumulated_live[param_id] - start.live_bytes, 0)


def _hook_gradient_producers(
    loss: torch.Tensor, model: nn.Module, meter: TimelineMeter, first_tick: dict[int, int]
) -> list[Any]:
    """Post-hook every graph node that hands a gradient to a parameter's ``AccumulateGrad``;
    each records the clock when it first produces one for that parameter."""
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    handles = []
    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        feeds = []
        for nxt, _ in node.next_functions:
            var = getattr(nxt, "variable", None) if nxt is not None else None
            if var is not None and id(var) in trainable:
                feeds.append(id(var))
            elif nxt is not None:
                stack.append(nxt)
        if feeds:
            def hook(_grad_inputs: Any, _grad_outputs: Any, feeds: list[int] = feeds) -> None:
                for pid in feeds:
                    first_tick.setdefault(pid, meter.clock)

            handles.append(node.register_hook(hook))
    return handles


# ---------------------------------------------------------------------------------
# Reading the figures off the timeline
# ---------------------------------------------------------------------------------
def _shared(w: _StepWatch, is_chain: bool) -> dict[int, SharedInStep]:
    """The storages handed to units besides their boundary input, by storage record.

    Off a chain, so is a storage that is the boundary input of several units (a
    DenseNet block's input, the first of the features every dense layer takes): its
    users' boundary figures then leave it out, as they do every shared storage.
    """
    meter, units = w.meter, w.units
    outside_savers = {rec for phase, rec in w.saved if phase[0] in ("prefix", "between")}
    users_of = {rec: list(users) for rec, users in w.side_users.items()}
    if not is_chain:
        inputs: dict[int, list[int]] = {}
        for u in units:
            if u.input_record is not None:
                inputs.setdefault(u.input_record, []).append(u.index)
        for rec, readers in inputs.items():
            if len(readers) > 1 or rec in users_of:
                users_of[rec] = sorted({*users_of.get(rec, ()), *readers})
    shared = {}
    for rec, users in users_of.items():
        record = meter.records[rec]
        started = [u.index for u in units if u.fwd_start is not None
                   and u.fwd_start.tick < record.born]
        outlives = record.died is None or record.died > w.backward_end.tick
        maker = max(started, default=-1)
        shared[rec] = SharedInStep(record.nbytes, maker, tuple(sorted(users)),
                                   rec in outside_savers or outlives, w.side_grad.get(rec, 0),
                                   maker >= 0 and units[maker].output_record == rec)
    return shared


def _figures(
    w: _StepWatch,
    is_chain: bool,
    loss_bytes: int,
    output_records: set[int | None] = frozenset(),
) -> OutsideStep:
    """The outside step's figures, read off the timeline ``w`` watched."""
    meter, first, last = w.meter, w.units[0], w.units[-1]
    shared = _shared(w, is_chain)
    modelled = [*shared, *output_records]  # counted on their own, so in no figure below
    held = _held_after_forward(w, is_chain, modelled)
    suffix_forward = _suffix_forward(w, is_chain)
    prefix_bwd_peak, suffix_bwd_peak = _backward_peaks(w)
    step = OutsideStep(
        units=_units_in_step(w, is_chain, shared, held),
        is_chain=is_chain,
        prefix=OutsideFigures(held.prefix, meter.rise(w.start.index, first.fwd_start.index),
                              prefix_bwd_peak),
        suffix=OutsideFigures(held.suffix, suffix_forward.peak, suffix_bwd_peak),
        suffix_fwd_peak_inputs_held=max(suffix_forward.peak_inputs_held, 0),
        units_inputs_dying=suffix_forward.units_inputs_dying,
        peak_bytes=meter.overall_peak_bytes,
        held_after_forward_bytes=w.forward_end.live_bytes,
        forward_transient_bytes=max(
            meter.dying_bytes(u.fwd_start.tick, w.forward_end.tick, exclude=[u.input_record])
            for u in w.units),
        loss_bytes=loss_bytes,
        phase_ms=_phase_ms(w),
        output_bytes=_kept_output_bytes(w, output_records, shared),
        last_output_kept=(last.output_record is not None
                          and last.output_record in output_records),
        shared=tuple(shared.values()),
    )
    log.debug("outside step: held after forward %d B, peak %d B",
              step.held_after_forward_bytes, step.peak_bytes)
    return step


@dataclass(frozen=True)
class _HeldAfterForward:
    """What each outside part allocated and still holds when the forward pass ends.

    ``prefix`` and ``suffix``: the prefix's (with what the code between units holds to
    the end of the step) and the suffix's; per unit, what the code before it holds until
    its backward (``between``) and all it holds (``between_alive``): 0 for unit 0, whose
    code is the prefix, and on a chain, where what a gap leaves is the prefix's.
    """

    prefix: int
    suffix: int
    between: list[int]
    between_alive: list[int]


def _held_after_forward(w: _StepWatch, is_chain: bool,
                        modelled: list[int | None]) -> _HeldAfterForward:
    """Each outside part's held bytes, less the ``modelled`` storages (counted on their
    own); per phase also what the allocator saw it leave alive beyond the dispatch level."""
    meter, units = w.meter, w.units
    first, last, end = units[0], units[-1], w.forward_end.tick
    prefix = meter.alive_bytes(end, born_until=first.fwd_start.tick,
                               exclude=[first.input_record, *modelled])
    prefix += meter.hidden_held(w.start.index, first.fwd_start.index)
    between, between_alive = [0], [0]
    for u, nxt in zip(units, units[1:]):
        held, to_end = _held_between(w, u, nxt, [nxt.input_record, *modelled])
        held, to_end = (0, held + to_end) if is_chain else (held, to_end)
        between.append(held)
        between_alive.append(held + to_end)
        prefix += to_end
    suffix = meter.alive_bytes(end, born_after=last.fwd_end.tick, born_until=end,
                               exclude=modelled)
    suffix += meter.hidden_held(last.fwd_end.index, w.forward_end.index)
    return _HeldAfterForward(prefix, suffix, between, between_alive)


def _kept_output_bytes(w: _StepWatch, output_records: set[int | None],
                       shared: dict[int, SharedInStep]) -> int:
    """What the loop keeps of the model's output, wherever it was made. The last unit's
    output, when it is the model's, is a boundary: the profile marks it kept instead.
    Another unit's output in the model's (all hidden states) is counted twice while held."""
    meter, last = w.meter, w.units[-1]
    return sum(meter.records[r].nbytes for r in output_records if r is not None
               and r not in shared and r != last.output_record
               and meter.records[r].alive_at(w.forward_end.tick))


@dataclass(frozen=True)
class _SuffixForward:
    """The suffix's forward peak (``peak``); the units whose input died in it
    (``units_inputs_dying``), and the peak were those inputs all saved by the units'
    options (``peak_inputs_held``)."""

    peak: int
    peak_inputs_held: int
    units_inputs_dying: tuple[int, ...]


def _suffix_forward(w: _StepWatch, is_chain: bool) -> _SuffixForward:
    """The suffix's forward peak, as ``simulate()`` adds it to what it counts held."""
    meter, units, last, end = w.meter, w.units, w.units[-1], w.forward_end.tick
    # Storages alive when the suffix starts that are not held (the prefix's locals
    # that live until the model's forward returns, say) still weigh on the suffix's
    # peak, while simulate() counts only held bytes there: add them to its peak.
    # On a chain simulate() still counts the last unit's output there; off a chain
    # it has already let it go unless someone holds it.
    # Shared tensors count too: simulate() keeps them alive through the suffix (their
    # first user may hold them), so a death here must not lower the suffix's peak.
    # FSDP2's last all-gather output, which dies here at the root's post-forward where
    # the model's forward holds the suffix (a loss computed inside it), is counted by the
    # sharded profile as a buffer in flight (profiler/sharded.py): counted here too, the
    # suffix's forward stood a unit above its real phase on every Llama-style model.
    transient = meter.dying_bytes(
        last.fwd_end.tick, end,
        exclude=[*([last.output_record] if is_chain else []), w.kept_gather_record])
    peak = meter.rise(last.fwd_end.index, w.forward_end.index) + transient
    # A unit's input may die here too (a local of the model's forward held it until the
    # units returned): counted above as a storage simulate() does not count. Where the
    # unit's options all save it (checkpoint and selective do; keep when it saved it)
    # simulate() counts it through the suffix, so the peak is the one with its death
    # deferred and without it added: assemble picks that figure where it holds.
    inputs = [u.input_record for u in units]
    dying = []
    for r in dict.fromkeys(i for i in inputs if i is not None):
        rec = meter.records[r]
        if (rec.alive_at(last.fwd_end.tick) and rec.died is not None and rec.died <= end
                and not (is_chain and r == last.output_record)):
            dying.append(r)
    peak_inputs_held = peak
    if dying:
        peak_inputs_held += (
            meter.deferred_rise(last.fwd_end.tick, end, defer=dying)
            - meter.deferred_rise(last.fwd_end.tick, end, defer=())
            - sum(meter.records[r].nbytes for r in dying))
    return _SuffixForward(peak, peak_inputs_held,
                          tuple(i for i, r in enumerate(inputs) if r in dying))


def _backward_peaks(w: _StepWatch) -> tuple[int, int]:
    """The prefix's and the suffix's backward peaks, above their starts (0 where the
    backward never reached them)."""
    meter, first, last = w.meter, w.units[0], w.units[-1]
    prefix = suffix = 0
    if last.bwd_start is not None:
        suffix = meter.rise(w.forward_end.index, last.bwd_start.index)
    if first.bwd_end is not None:
        prefix = meter.rise(first.bwd_end.index, w.backward_end.index)
    return prefix, suffix


def _units_in_step(w: _StepWatch, is_chain: bool, shared: dict[int, SharedInStep],
                   held: _HeldAfterForward) -> tuple[UnitInStep, ...]:
    """Every unit's boundaries, who holds them, and off a chain the code before it."""
    records = []
    for u in w.units:
        in_step = _unit_in_step(w, u, is_chain, shared)
        if not is_chain and u.index > 0:
            in_step = replace(in_step, **_code_before(w, u.index, held.between[u.index],
                                                      held.between_alive[u.index]))
        records.append(in_step)
    return tuple(records)


def _unit_in_step(w: _StepWatch, u: _UnitWatch, is_chain: bool,
                  shared: dict[int, SharedInStep]) -> UnitInStep:
    """Unit ``u``'s boundaries as the step saw them (see :class:`UnitInStep`)."""
    i = u.index

    def neighbours(step: int) -> set[Phase]:
        own = {("unit", i)}
        return own | {("unit", i + step)} if is_chain else own

    # Off a chain a shared input is counted as shared only (on a chain it is the
    # previous unit's output too, and stays the boundary).
    input_shared = not is_chain and u.input_record in shared
    # An output the unit did not make (an in-place op's: its input's storage) that
    # is shared is held as long as the shared tensor is (the unit reads it, so it
    # lives until the backward of this unit or an earlier one), and its gradient is
    # the shared one, alive at this unit's backward when a later unit reads it too.
    given = shared.get(u.output_record) if not is_chain else None
    output_given = (given is not None and given.born_after < i and i in given.users
                    and i < given.users[-1]
                    and (given.grad_bytes > 0 or not u.output_needs_grad))
    return UnitInStep(
        input_bytes=0 if input_shared else u.input_bytes,
        output_bytes=0 if output_given else u.output_bytes,
        input_held_outside=(not input_shared
                            and w.held_outside(u.input_record, neighbours(-1))),
        # A shared output's holders (later units, outside code) are the shared
        # tensor's: counted there once.
        output_held_outside=(u.output_record not in shared
                             and w.held_outside(u.output_record, neighbours(+1))),
        input_is_prev_output=(i > 0 and u.input_record is not None and not input_shared
                              and u.input_record == w.units[i - 1].output_record),
        # A shared input's gradient is the shared tensor's (SharedInStep.grad_bytes).
        input_grad_kept_until=(None if is_chain or input_shared
                               else _input_grad_kept_until(w, u)),
    )


def _phase_ms(w: _StepWatch) -> dict[str, float]:
    """Wall time of the outside phases (under instrumentation: proportions only)."""
    units, first, last = w.units, w.units[0], w.units[-1]
    end_fwd = w.forward_end.clock
    return {
        "prefix_fwd": (first.fwd_start.clock - w.start.clock) * 1e3,
        "between_fwd": sum(nxt.fwd_start.clock - u.fwd_end.clock
                           for u, nxt in zip(units, units[1:])) * 1e3,
        "suffix_fwd": (end_fwd - last.fwd_end.clock) * 1e3,
        "suffix_bwd": ((last.bwd_start.clock if last.bwd_start else end_fwd) - end_fwd) * 1e3,
        "prefix_bwd": (w.backward_end.clock - first.bwd_end.clock) * 1e3
        if first.bwd_end else 0.0,
    }


def _held_between(w: _StepWatch, u: _UnitWatch, nxt: _UnitWatch,
                  exclude: list[int | None]) -> tuple[int, int]:
    """What the code between units ``u`` and ``nxt`` holds at the end of the forward pass:
    the bytes it let go before ``u``'s backward started (in its own backward, which
    ``simulate()`` places there), and the rest, which counts with the prefix's to the end
    of the step (a storage nothing frees before then, and those the allocator alone saw,
    whose deaths are not known)."""
    meter, forward_end = w.meter, w.forward_end.tick
    skip = {r for r in exclude if r is not None}
    freed = meter.alive_bytes(forward_end, born_after=u.fwd_end.tick,
                              born_until=nxt.fwd_start.tick, exclude=skip)
    by = u.bwd_start.tick if u.bwd_start is not None else None
    held = sum(r.nbytes for k, r in enumerate(meter.records)
               if k not in skip and u.fwd_end.tick < r.born <= nxt.fwd_start.tick
               and r.alive_at(forward_end) and by is not None and r.died is not None
               and r.died <= by)
    return held, freed - held + meter.hidden_held(u.fwd_end.index, nxt.fwd_start.index)


def _code_before(w: _StepWatch, i: int, held: int, alive: int) -> dict[str, int]:
    """Off a chain, the figures of the code between units i-1 and i
    (``UnitInStep.before_held_bytes``, ``before_fwd_peak_bytes``, ``before_bwd_peak_bytes``).

    Forward: its rise from unit i-1's end to unit i's start, less the bytes it leaves
    alive (``alive``), which ``simulate()`` counts before its forward event: the ``held``
    ones from just before it, the rest with the prefix's from the start of the step.
    Backward: its rise from unit i's input gradient being ready to unit i-1's output
    gradient being ready (its parameters' gradients made in between, unit i's input
    gradient let go); 0 where those come the other way round (nothing runs between
    them, or the code is no link of the two: a concatenation's backward).
    """
    meter, prev, u = w.meter, w.units[i - 1], w.units[i]
    fwd = max(meter.rise(prev.fwd_end.index, u.fwd_start.index) - alive, 0)
    bwd = 0
    start, end = u.bwd_end, prev.bwd_start
    if start is not None and end is not None and start.index < end.index:
        bwd = max(meter.rise(start.index, end.index), 0)
    return {"before_held_bytes": held, "before_fwd_peak_bytes": fwd,
            "before_bwd_peak_bytes": bwd}


def _input_grad_kept_until(w: _StepWatch, u: _UnitWatch) -> int | None:
    """Off a chain, the unit through whose backward unit ``u``'s input gradient stayed
    alive (``-1``: the prefix's), or ``None`` when the code before ``u`` let it go
    before the next unit's backward started."""
    if u.input_grad_record is None:
        return None
    died = w.meter.records[u.input_grad_record].died
    if died is None or died > w.backward_end.tick:
        return -1 if u.index > 0 else None
    phase = w.backward_phase(died)
    if phase[0] not in ("unit", "outside") or phase[1] >= u.index:
        return None  # gone before any earlier unit's backward
    # Freed in unit k's backward (counted through it) or after it; after unit 0's
    # backward is the prefix's.
    k = -1 if phase == ("outside", 0) else phase[1]
    if k == u.index - 1 and u.input_grad_bytes <= w.units[k].output_bytes:
        return None  # passed on as unit k's output gradient, which the model counts
    # A concatenation's backward hands unit k a view of it: more than k's output.
    return k

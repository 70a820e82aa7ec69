"""Pass 1 of :mod:`.profile` (capture and replays).

Isolated replays: one unit, on its captured inputs, under each option.

:func:`measure_option` gives an option's bytes, :func:`measure_forward` those of its
forward alone (checkpoint's, whose backward :mod:`.recomputed` composes of keep's),
:func:`time_unit` its times (samples that twin units pool: :mod:`.twins`).

Each option runs through :func:`forward_with_option`, exactly as the runtime
will run it. The unit's first input is a fresh storage allocated *before* the
meter region (so it is a boundary, not held bytes), and its output's gradient
is produced inside the backward by a tiny autograd function, so autograd owns
it alone, as it owns the gradient flowing in from the next unit in a real step
(a gradient the caller still referenced could not be reused in place).

Per option, in bytes above the live bytes at each point:

* ``fwd_peak_bytes``: peak of the forward (the input is outside the region);
  here and in the backward, the higher of the dispatch-level and the allocator's
  view (which also sees kernels' scratch buffers);
* ``held_bytes``: live after the forward once its other outputs are dropped,
  minus the output's storage;
* ``holds_output`` / ``holds_input``: whether the output's / input's storage
  survives dropping our own references to it (weak references tell);
* ``bwd_peak_bytes``: peak of the backward above its start, where the start
  includes what the unit holds and the gradient of its output;
* for keep, where a recomputation of the unit would start and peak
  (:mod:`.recomputed`): ``recompute_start_bytes``, the live bytes above the backward's
  start, less the output's gradient, when the backward first unpacks a saved tensor (a
  gradient cast down under autocast is made before it), and ``recompute_peak_bytes``,
  the forward's peak up to its last save (torch's early stop ends the recomputation
  there);
* for a loop that steps the optimizer in backward, the same backward with each of the
  unit's parameter gradients freed once complete (:mod:`.released`):
  ``released_bwd_peak_bytes``, and ``grads_ready``, per parameter the live bytes on
  that footing when its ``.grad`` received the gradient, where its step's own peak
  adds (:mod:`.grads`).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from remat.core.errors import RematError
from remat.core.option import Option
from remat.execute.boundary import boundary_output
from remat.execute.inplace import InputWritten, WriteProbe, selective_write_reason
from remat.execute.options import SELECTIVE_SAVE_OPS, forward_with_option
from remat.measurement.runner import StepRunner
from remat.measurement.state import clear_grads
from remat.measurement.storage import storage_nbytes
from remat.measurement.timing import Stopwatch, median, parts_settled
from remat.profiler.records import OptionFigures, UnitCall, UnitTiming
from remat.profiler.released import released_curve
from remat.profiler.timeline import TimelineMeter

__all__ = [
    "OPTION_ERRORS",
    "OptionFailure",
    "ForwardFigures",
    "OptionRunFailed",
    "TimingSamples",
    "clear_replay_grads",
    "measure_forward",
    "measure_option",
    "time_unit",
]

log = logging.getLogger("remat")

_SAVE = "save"  # the label of the marks keep's metered forward takes at each save

_R = TypeVar("_R")  # what a replay gives: its figures, or its times


class _OutputGradSource(torch.autograd.Function):
    """A scalar whose backward hands its input a fresh all-ones gradient.

    Backpropagating from it gives the unit's output a gradient that only the
    autograd engine references, and saves nothing in the forward.
    """

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.spec = (y.shape, y.dtype, y.device)
        return y.new_zeros(())

    @staticmethod
    def backward(ctx, _grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        shape, dtype, device = ctx.spec
        return torch.ones(shape, dtype=dtype, device=device)


def _fresh_input(call: UnitCall, *, clone: bool
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(x_in, leaf)``: the first input to replay on, and the leaf that collects its
    gradient (``None`` when it needs none).

    The replay runs on the live input's own storage (``leaf``, a new leaf on it): a copy
    would hold one more boundary than the step does, at the very unit whose replay may
    set the peak of profiling. With ``clone`` it runs on a new storage
    (``leaf.clone()``, which lives only as long as someone references it): for a unit
    that writes its input in place (torch refuses that on a leaf), and for an option
    whose holding of its input only a weak reference can tell (offload).
    """
    first = call.first_input
    if first is None:
        return None, None
    if first.requires_grad:
        leaf = first.fresh()
        return (leaf.clone() if clone else leaf), leaf
    return (first.tensor.clone() if clone else first.tensor), None


@dataclass
class _Operands:
    """One replay's inputs, made before any meter region (so that the first input is a
    boundary, not held bytes). They are referenced from here alone: once the forward has
    run, :meth:`drop` lets them go, and weak references tell what the unit kept."""

    first: torch.Tensor | None
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def drop(self) -> None:
        self.first, self.args, self.kwargs = None, (), {}


def _operands(call: UnitCall, runner: StepRunner, *, clone: bool
              ) -> tuple[_Operands, torch.Tensor | None]:
    """The inputs of one replay of ``call`` (its RNG state put back, no gradient alive),
    and the leaf that collects its first input's gradient (see :func:`_fresh_input`)."""
    call.rng.restore()
    clear_replay_grads(call, runner)
    first, leaf = _fresh_input(call, clone=clone)
    args, kwargs = call.inputs(first)
    return _Operands(first, args, kwargs), leaf


def clear_replay_grads(call: UnitCall, runner: StepRunner) -> None:
    """No gradient left by a replay of ``call``: on the model's parameters, nor on the
    unit's own.

    They are the same tensors on a model as it is. Under FSDP2 they are not: a replay runs
    inside FSDP2's window, on the unit's gathered parameters, while the model's are the
    sharded ones. A gradient left on the gathered ones outlives the window, and the next
    backward through the unit reduce-scatters it: a collective only the ranks that
    replayed the unit issue. Where one rank measured a twin on its own and another took
    the first twin's figures (a decision each makes on its own bytes), that hung the job
    (CI, 2026-11-28). The next replay's backward also added into it in place, so the
    gradients' bytes were missing from its peak."""
    clear_grads(runner.params)
    clear_grads(list(call.module.parameters()))


def _writes_its_leaf_input(err: RuntimeError) -> bool:
    """torch refusing an in-place write into the replay's leaf input."""
    return "leaf Variable that requires grad" in str(err)


def _cloning_where_refused(call: UnitCall, runner: StepRunner, clone: bool,
                           replay: Callable[[bool], _R]) -> _R:
    """``replay(clone)``; where torch refuses the unit an in-place write into its leaf
    input, again on a clone, and ``call.writes_input`` set so later replays clone at once."""
    try:
        return replay(clone)
    except RuntimeError as err:
        if clone or not _writes_its_leaf_input(err):
            raise
        clear_replay_grads(call, runner)
        call.writes_input = True
        return replay(True)


def _saved_storages(on_pack: Callable[[], None], on_unpack: Callable[[], None]
                    ) -> tuple[set[int], Any]:
    """A set of the storages autograd saves inside the block, and the hooks that fill it
    (identity: autograd keeps the tensors as it would); ``on_pack()`` and ``on_unpack()``
    run at each pack and unpack."""
    saved: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.layout == torch.strided:
            saved.add(id(t.untyped_storage()))
        on_pack()
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        on_unpack()
        return t

    return saved, torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _backward_seed(y: torch.Tensor | None) -> torch.Tensor | None:
    """The scalar whose backward hands ``y`` its gradient (``None``: ``y`` needs none)."""
    return _OutputGradSource.apply(y) if y is not None and y.requires_grad else None


def _root_grad(y: torch.Tensor) -> torch.Tensor:
    """The scalar gradient that starts a replay's backward (the output's dtype and device)."""
    return torch.ones((), dtype=y.dtype, device=y.device)


def _alive(ref: weakref.ref | None) -> bool:
    return ref is not None and ref() is not None


def _storage_ref(t: torch.Tensor | None) -> weakref.ref | None:
    if t is None or t.layout != torch.strided:
        return None
    return weakref.ref(t.untyped_storage())


def measure_option(call: UnitCall, option: str, runner: StepRunner) -> OptionFigures:
    """Replay ``call`` once under ``option`` with the memory meter (see module docstring).

    The runner's model's parameters have their gradients cleared before and after. The
    forward runs inside the runner's autocast (the loop's ``torch.autocast``, or
    nothing), the backward outside it, as in a training loop; what only the autocast
    region kept alive (its cache of weight casts) is ``forward_cache_bytes``.
    """
    return _cloning_where_refused(
        call, runner, _on_a_copy(call, option),
        lambda c: _measure_option(call, option, runner, clone=c))


def _on_a_copy(call: UnitCall, option: str) -> bool:
    """Whether a metered replay of ``call`` under ``option`` runs on a copy of its input:
    a unit that writes its input in place; offload, whose own saved-tensor hooks take
    the place of the recording one, so that whether it holds the input only a weak
    reference can tell, on a copy (derive tells itself)."""
    return call.writes_input or option == Option.OFFLOAD.value


@dataclass(frozen=True)
class ForwardFigures:
    """A metered forward whose backward was not run (:func:`measure_forward`): the forward
    side of :class:`OptionFigures`, and the output's storage (``output_bytes``)."""

    held_bytes: int
    holds_input: bool
    holds_output: bool
    fwd_peak_bytes: int
    forward_cache_bytes: int
    output_bytes: int


def measure_forward(call: UnitCall, option: str, runner: StepRunner) -> ForwardFigures:
    """Replay ``call``'s forward once under ``option`` with the memory meter, and no
    backward: the figures :func:`measure_option` takes of the forward, on the same
    footing (a caller derives the backward's: :mod:`.recomputed`)."""
    return _cloning_where_refused(
        call, runner, _on_a_copy(call, option),
        lambda c: _measure_forward(call, option, runner, clone=c))


def _measure_forward(call: UnitCall, option: str, runner: StepRunner, *,
                     clone: bool) -> ForwardFigures:
    operands, leaf = _operands(call, runner, clone=clone)
    with TimelineMeter(device_type=runner.device_type, allocator=True) as meter:
        begin = len(meter.marks)
        meter.mark("start")
        forward = _metered_forward(meter, call.module, option, runner, operands, clone=clone)
        # Marked with the graph alive, as the backward's start is: what the allocator made
        # outside the dispatcher and the graph holds counts as held, as there.
        meter.mark("backward start")
        fwd_end = len(meter.marks) - 2
        forward.seed = forward.root_grad = None  # the graph goes: no backward runs
        del leaf
        clear_replay_grads(call, runner)
    return ForwardFigures(
        held_bytes=max(forward.held, 0) + meter.hidden_held(begin, fwd_end + 1),
        holds_input=forward.holds_input,
        holds_output=forward.holds_output,
        fwd_peak_bytes=meter.rise(begin, fwd_end),
        forward_cache_bytes=max(forward.cache_bytes, 0),
        output_bytes=forward.output_bytes,
    )


@dataclass
class _AfterForward:
    """What the metered forward leaves: what starts the backward (``seed`` and
    ``root_grad``, let go of once it ran) and the forward's own figures."""

    seed: torch.Tensor | None
    root_grad: torch.Tensor | None
    output_grad_bytes: int  # the gradient the seed hands the unit's output
    output_bytes: int  # the output's storage
    held: int  # live after the forward, less the output's storage
    cache_bytes: int  # what only the autocast region kept alive
    holds_input: bool
    holds_output: bool
    # keep's, on the live input: the live bytes when its backward first unpacked a saved
    # tensor (filled as the backward runs; empty where not recorded).
    first_unpack: list[int] = field(default_factory=list)


def _measure_option(call: UnitCall, option: str, runner: StepRunner, *,
                    clone: bool) -> OptionFigures:
    """One metered replay (:func:`measure_option`): its marks are "start", "forward",
    "backward start" and "backward", read off once the region has ended."""
    operands, leaf = _operands(call, runner, clone=clone)
    with TimelineMeter(device_type=runner.device_type, allocator=True) as meter:
        begin = len(meter.marks)
        meter.mark("start")
        forward = _metered_forward(meter, call.module, option, runner, operands, clone=clone)
        ready = _metered_backward(meter, call.module, forward)
        input_grad = storage_nbytes(leaf.grad) if leaf is not None else 0
        del leaf
        forward.root_grad = None
        trained = frozenset(id(p) for p in runner.params if p.grad is not None)
        clear_replay_grads(call, runner)
    # Read once the region has ended: the allocator's view is complete then.
    return _option_figures(meter, begin, forward, ready, input_grad=input_grad,
                           trained=trained)


def _metered_forward(meter: TimelineMeter, module: torch.nn.Module, option: str,
                     runner: StepRunner, operands: _Operands, *, clone: bool) -> _AfterForward:
    """The forward under ``option``, marked "forward" where it ends; ``operands`` are
    dropped once it ran, so that whether the unit holds its input and output is what it
    kept of them."""
    keep = option == Option.KEEP.value
    # On the live input's storage, whether the unit holds it is what it saved: keep
    # saves what autograd saves (recorded here), derive holds every saved tensor that
    # no op inside the unit made (an input is one: derive records its own), checkpoint
    # and selective hold every tensor argument for their recomputation. On a copy, a
    # weak reference tells.
    first_unpack: list[int] = []  # live bytes when the backward first unpacked a save

    def unpacked() -> None:
        if not first_unpack:
            first_unpack.append(meter.live_bytes)

    # A mark at each save: torch's early stop ends a recomputation at the last one
    # (:mod:`.recomputed`), so the forward's peak up to it is the recomputation's.
    saved, recording = _saved_storages(lambda: meter.mark(_SAVE), unpacked)
    with runner.autocast(), (recording if keep and not clone else contextlib.nullcontext()):
        out = _forward_probed(module, option, operands, saved)
        in_region = meter.live_bytes
    cache_bytes = in_region - meter.live_bytes
    meter.mark("forward")
    y = boundary_output(out)
    del out  # other outputs die unless the unit saved them
    counted = meter.record_of(y) is not None
    output_bytes = storage_nbytes(y) if y is not None else 0
    held = meter.live_bytes - (output_bytes if counted else 0)
    seed = _backward_seed(y)
    grad_bytes = y.numel() * y.element_size() if seed is not None else 0
    # A scalar; live before the backward starts, so not in its rise (a step's loss
    # gradient is not the unit's).
    root_grad = _root_grad(y) if y is not None else None
    x = operands.first
    y_ref, x_ref = _storage_ref(y), _storage_ref(x)
    x_storage = id(x.untyped_storage()) if x is not None and not clone else None
    del y, x
    operands.drop()
    holds_output = _alive(y_ref)
    if clone or x_storage is None:
        holds_input = _alive(x_ref)
    else:
        holds_input = (x_storage in saved if option in (Option.KEEP.value, Option.DERIVE.value)
                       else Option(option).recomputes)
    return _AfterForward(seed, root_grad, grad_bytes, output_bytes, held, cache_bytes,
                         holds_input, holds_output, first_unpack)


def _forward_probed(module: torch.nn.Module, option: str, operands: _Operands,
                    saved: set[int]) -> Any:
    """The unit's forward under ``option``; under ``selective``, refused (a
    :class:`~remat.core.errors.RematError`, which drops the option for the unit) before it
    writes into a tensor selective keeps, as the runtime refuses it
    (:mod:`remat.execute.inplace`): torch's backward notices only where the recomputation
    reads the written tensor, so a replay that trains is no proof. Here, not in the timed
    runs: the probe's dispatch would be timed."""
    if option != Option.SELECTIVE.value:
        return forward_with_option(module, option, module.forward, operands.args,
                                   operands.kwargs, saved=saved)
    try:
        # No argument watched: only what selective keeps (an argument written in place
        # is found by the capture pass, which replays such a unit on a copy).
        with WriteProbe((), saved_ops=SELECTIVE_SAVE_OPS):
            return forward_with_option(module, option, module.forward, operands.args,
                                       operands.kwargs)
    except InputWritten as hit:
        reason = selective_write_reason(hit.label, hit.op)
    raise RematError(reason)  # outside the except: no chained probe exception


def _metered_backward(meter: TimelineMeter, module: torch.nn.Module,
                      forward: _AfterForward) -> dict[int, tuple[int | None, int]]:
    """The backward, between the marks "backward start" and "backward"; per index among
    the unit's parameters, its gradient's record and the tick it was complete at (what
    :func:`released_curve` frees it at)."""
    meter.mark("backward start")
    ready: dict[int, tuple[int | None, int]] = {}

    def when_ready(k: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            ready.setdefault(k, (meter.record_of(param.grad), meter.clock))
        return hook

    hooks = [p.register_post_accumulate_grad_hook(when_ready(k))
             for k, p in enumerate(module.parameters()) if p.requires_grad]
    try:
        if forward.seed is not None:
            forward.seed.backward(forward.root_grad)
            forward.seed = None
    finally:
        for hook in hooks:
            hook.remove()
    meter.mark("backward")
    return ready


def _option_figures(meter: TimelineMeter, begin: int, forward: _AfterForward,
                    ready: dict[int, tuple[int | None, int]], *, input_grad: int,
                    trained: frozenset[int]) -> OptionFigures:
    """The figures of a metered replay whose marks start at ``begin``."""
    labels = [m.label for m in meter.marks]
    fwd_end = labels.index("forward", begin)
    bwd_start, bwd_end = fwd_end + 1, fwd_end + 2
    saves = [i for i in range(begin + 1, fwd_end) if labels[i] == _SAVE]
    grad_bytes = forward.output_grad_bytes
    bwd_rise = meter.rise(bwd_start, bwd_end)
    released = released_curve(meter, meter.ticks["backward start"], meter.ticks["backward"],
                              ready)
    # What the allocator saw above the dispatch level (kernels' scratch) counts here too.
    dispatch_rise = meter.peak_between(bwd_start, bwd_end) - meter.marks[bwd_start].live_bytes
    scratch = max(bwd_rise - dispatch_rise, 0)
    recompute_start = (forward.first_unpack[0] - meter.marks[bwd_start].live_bytes - grad_bytes
                       if forward.first_unpack else None)
    return OptionFigures(
        held_bytes=max(forward.held, 0) + meter.hidden_held(begin, bwd_start),
        holds_input=forward.holds_input,
        holds_output=forward.holds_output,
        fwd_peak_bytes=meter.rise(begin, fwd_end),
        bwd_peak_bytes=max(bwd_rise - grad_bytes, 0),
        input_grad_bytes=input_grad,
        forward_cache_bytes=max(forward.cache_bytes, 0),
        params_trained=trained,
        released_bwd_peak_bytes=(
            max(released.peak_bytes - released.start_bytes - grad_bytes, 0) + scratch
            if ready else None),
        grads_ready=tuple((k, live - released.start_bytes - grad_bytes)
                          for k, live in sorted(released.ready_bytes.items())),
        recompute_start_bytes=recompute_start,
        recompute_peak_bytes=meter.rise(begin, saves[-1]) if saves else None,
    )


@dataclass(frozen=True)
class OptionFailure:
    """An option that could not run on a unit, and why (the error, on one line)."""

    option: str
    reason: str

    @classmethod
    def of(cls, option: str, err: BaseException) -> OptionFailure:
        text = " ".join(str(err).split())
        # One log line: long enough for remat's own reasons (the in-place write's,
        # about 300 characters with the op named), short of a torch traceback's text.
        if len(text) > 320:
            text = text[:317] + "..."
        return cls(option, f"{type(err).__name__}: {text}")


# What an option's machinery raises on a unit it cannot run: torch's checkpoint
# errors (CheckpointError, a mutated tensor under selective checkpointing, a saved
# tensor modified in place: RuntimeError), unsupported inputs or outputs (TypeError,
# ValueError), remat's own refusals (offload without CUDA). Only options other than
# keep are caught: keep runs the unit's own forward, whose errors are the model's.
OPTION_ERRORS = (RuntimeError, TypeError, ValueError, RematError)


@dataclass
class TimingSamples:
    """Timed samples per option, in milliseconds; one unit's, or pooled over twin units."""

    options: tuple[str, ...]
    fwd: dict[str, list[float]] = field(default_factory=dict)
    bwd: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for o in self.options:
            self.fwd.setdefault(o, [])
            self.bwd.setdefault(o, [])

    @property
    def rounds(self) -> int:
        return min((len(v) for v in self.fwd.values()), default=0)

    def add(self, option: str, fwd_ms: float, bwd_ms: float) -> None:
        self.fwd[option].append(fwd_ms)
        self.bwd[option].append(bwd_ms)

    def option_settled(self, option: str, repeats: int, tolerance: float) -> bool:
        """``option``'s figures pin their medians of ``repeats`` to within ``tolerance``
        times its total (:func:`parts_settled`): keep's forward, backward and total
        (checkpoint's extra time is keep's forward); another option's total, whose split
        the profile does not use (an option's extra time is its total less keep's)."""
        fwd, bwd = self.fwd[option], self.bwd[option]
        parts = (fwd, bwd) if option == Option.KEEP.value else ()
        return parts_settled([f + b for f, b in zip(fwd, bwd)], *parts, repeats=repeats,
                             tolerance=tolerance)

    def timing(self) -> UnitTiming:
        """The medians."""
        return UnitTiming(
            fwd_ms={o: median(v) for o, v in self.fwd.items()},
            bwd_ms={o: median(v) for o, v in self.bwd.items()},
            total_ms={o: median([f + b for f, b in zip(self.fwd[o], self.bwd[o])])
                      for o in self.options},
        )


def time_unit(
    call: UnitCall,
    options: Sequence[str],
    runner: StepRunner,
    watch: Stopwatch,
    *,
    warmup: int,
    repeats: int,
    tolerance: float = 0.0,
    samples: TimingSamples | None = None,
    max_rounds: int | None = None,
) -> TimingSamples:
    """Time ``call`` under each option (no meter, no hooks); the samples, for their medians.

    Options are interleaved within each round so slow drifts (other processes,
    clocks) hit them alike. A timed round runs only the options whose samples do not
    yet pin their median of ``repeats`` to within ``tolerance`` times the option's
    total time (:meth:`TimingSamples.option_settled`; ``tolerance=0`` takes ``repeats``
    samples of each); rounds stop once every option's do, or after ``max_rounds`` timed
    rounds. Samples are added to ``samples`` when given
    (twin units pool theirs), else to new ones.
    """
    samples = samples if samples is not None else TimingSamples(tuple(options))
    limit = max_rounds if max_rounds is not None else repeats
    taken = 0
    for round_ in range(warmup + repeats):
        # Past the warm-up, a round times only the options not settled yet (an option
        # whose cold first run was a sample may have three while another has two).
        pending = (list(options) if round_ < warmup else
                   [o for o in options if not samples.option_settled(o, repeats, tolerance)])
        if not pending or (round_ >= warmup and taken >= limit):
            break
        for option in pending:
            try:
                # derive's first run checks its recipes (:mod:`remat.execute.derive`): a
                # cold round, the sample a median of three discards.
                f_ms, b_ms = _timed_replay(call, option, runner, watch,
                                           verify=round_ == 0 and option == Option.DERIVE.value)
            except Exception as err:
                clear_replay_grads(call, runner)
                raise OptionRunFailed(option, err) from err
            if round_ >= warmup:
                samples.add(option, f_ms, b_ms)
        if round_ >= warmup:
            taken += 1
    clear_replay_grads(call, runner)
    return samples


class OptionRunFailed(Exception):
    """A timed replay raised: which option it ran, and the error (``error``)."""

    def __init__(self, option: str, error: Exception) -> None:
        super().__init__(f"option {option!r}: {error}")
        self.option = option
        self.error = error


def _timed_replay(call: UnitCall, option: str, runner: StepRunner,
                  watch: Stopwatch, *, verify: bool = False) -> tuple[float, float]:
    """One timed replay of ``call`` under ``option``: its forward and backward times."""
    return _cloning_where_refused(
        call, runner, call.writes_input,
        lambda clone: _timed_run(call, option, runner, watch, clone=clone, verify=verify))


def _timed_run(call: UnitCall, option: str, runner: StepRunner, watch: Stopwatch, *,
               clone: bool, verify: bool = False) -> tuple[float, float]:
    module, autocast = call.module, runner.autocast
    operands, leaf = _operands(call, runner, clone=clone)
    operands.first = None  # the arguments hold it

    def forward() -> Any:
        with autocast():
            return forward_with_option(module, option, module.forward, operands.args,
                                       operands.kwargs, verify=verify)

    out, f_ms = watch.time(forward)
    operands.drop()
    y = boundary_output(out)
    del out
    seed = _backward_seed(y)
    root_grad = _root_grad(y) if seed is not None else None
    del y
    b_ms = 0.0
    if seed is not None:
        _, b_ms = watch.time(lambda s=seed: s.backward(root_grad))
    del seed, leaf
    return f_ms, b_ms

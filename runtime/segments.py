"""Multi-unit checkpoint segments: one recomputation region across several unit calls.

A segment ``(a, b)`` of a plan holds only unit ``a``'s input and recomputes units
``a..b`` together in the backward pass. The units are called one at a time by the
model's own code (``nn.Sequential``, or a ``for block in self.blocks`` loop in a
Hugging Face model), so the region cannot be one function call the way
``torch.utils.checkpoint.checkpoint(fn, x)`` wants it. Instead torch's
non-reentrant checkpoint *generator* is entered when the segment's first unit
starts and closed when its last unit returns; the units in between run their
ordinary forwards inside it, so everything they save for backward goes to the
checkpoint's hooks. In backward, the recompute function replays the recorded unit
calls from the restored input, chaining each unit's first tensor output into the
next unit, with the other arguments each call had.

That replay is only correct when the units really form a chain, which is checked
while the forward runs:

* one of unit ``k+1``'s top-level arguments must *be* (``is``) unit ``k``'s first
  tensor output, and
* the model's code between two units of a segment must not save tensors for
  backward (those saves would land in the region but would not be replayed).

Either violation raises :class:`~remat.core.errors.RematError`, and the region is
closed so no saved-tensor hooks are left behind.

Under ``torch.compile`` the generator cannot be traced (its saved-tensor hooks
would break the graph at every unit). There the segment runs *ahead*: the call of
its first unit runs all of its units, chained, inside one
``torch.utils.checkpoint.checkpoint`` call, which the compiler traces as one
recomputation region; the model's calls of the later units then receive the
outputs already computed. That is only the same computation when every later unit
is called with the previous unit's output and otherwise the same arguments as the
first, which each later call checks (a ``RematError`` names the unit otherwise).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import checkpoint as _ckpt

from remat.core.errors import RematError
from remat.core.option import Option
from remat.execute.arguments import CallArguments
from remat.execute.boundary import Slot, boundary_input, boundary_output
from remat.execute.kv_cache import drop_kv_cache
from remat.execute.options import autocast_without_cache, checkpoint_context_fn
from remat.runtime.sequential_links import SequentialLinks
from remat.runtime.torch_checkpoint import checkpoint_generator

__all__ = ["SegmentRunner", "autocast_on", "dynamo_idle", "get_eval_frame_callback"]

logger = logging.getLogger(__name__)


RngStates = tuple[torch.Tensor, list[int], list[torch.Tensor]]  # CPU, device ids, device states


_NO_DEVICE_STATE = ("cpu", "meta")


def _rng_states(x: torch.Tensor) -> RngStates:
    # Taken at every unit boundary of a segment, so it must cost about nothing:
    # torch's get_device_states walks its arguments with pytree (about 4 us a call on
    # CPU, a third of the whole per-unit cost); a CPU tensor has no device state.
    if x.device.type in _NO_DEVICE_STATE:
        return torch.default_generator.get_state(), [], []
    devices, states = _ckpt.get_device_states(x)
    return torch.get_rng_state(), devices, states


def _same_rng(a: RngStates, b: RngStates) -> bool:
    return (torch.equal(a[0], b[0]) and a[1] == b[1]
            and all(torch.equal(x, y) for x, y in zip(a[2], b[2])))


@dataclasses.dataclass(slots=True)
class _UnitCall:
    """One recorded unit call of a segment, minus its chained tensor.

    The chained tensor is left out on purpose: holding it would keep every
    intermediate activation of the segment alive, which is what the segment is
    there to avoid. Replay puts the recomputed tensor back at ``slot``.
    """

    forward: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    slot: Slot
    # RNG states at the call's start, restored before replaying it so that dropout
    # draws the same masks when the model's code drew random numbers between units
    # (LayerDrop). None when replaying the previous unit leaves the RNG where this
    # call found it (the usual case: each state is ~5 KB held until backward), and
    # for the segment's first call (the generator restores that one).
    rng: RngStates | None = None
    # The containers among args/kwargs as they were at the call (see .arguments):
    # taken once, kept by dataclasses.replace.
    arguments: CallArguments | None = None

    def __post_init__(self) -> None:
        if self.arguments is None:
            self.arguments = CallArguments(self.args, self.kwargs)

    def call(self, x: torch.Tensor) -> Any:
        args, kwargs = self.arguments.rebuild()
        if isinstance(self.slot, int):
            args = args[: self.slot] + (x,) + args[self.slot + 1 :]
            return self.forward(*args, **kwargs)
        return self.forward(*args, **{**kwargs, self.slot: x})


class _Replay:
    """The segment's recompute function: ``fn`` of the checkpoint generator.

    It references the recorded calls only (never the generator), so closing the
    generator leaves no reference cycle holding the segment's input alive.
    """

    def __init__(self) -> None:
        # A quiet call (.sequential_links) is recorded as its forward alone: it takes the
        # chained tensor and nothing else, and nothing ran before it since the last one.
        self.calls: list[_UnitCall | Callable[[torch.Tensor], Any]] = []

    def __call__(self, x: torch.Tensor) -> None:
        for call in self.calls:
            if not isinstance(call, _UnitCall):
                out = call(x)
                nxt = out if type(out) is torch.Tensor else boundary_output(out)
                if nxt is None:
                    return
                x = nxt
                continue
            if call.rng is not None:
                cpu_state, devices, device_states = call.rng
                torch.set_rng_state(cpu_state)
                if devices:
                    _ckpt.set_device_states(devices, device_states)
            out = call.call(x)
            nxt = boundary_output(out)
            if nxt is None:  # only the last call may return no tensor
                return
            x = nxt


def _any_autocast() -> bool:
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


# Whether any autocast is on, asked at every unit call of a segment: torch's private
# one-call check where it has one (``is_autocast_enabled(device)`` parses the device
# string, twice a unit), else the public two.
autocast_on: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", _any_autocast)

# torch.compiler.disable's wrapper costs about 1.5 us a call (it swaps dynamo's frame
# callback out and back), on every unit of a segment. It only matters where dynamo's
# callback is set on this thread (a frame torch.compile fell back on runs the units);
# where none is set, no frame is ever traced, and the plain function is the same.
# The getter is private to torch: without it, the wrapper is always used.
get_eval_frame_callback: Callable[[], Any] | None = getattr(
    getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None),
    "get_eval_frame_callback", None)


def dynamo_idle() -> bool:
    """Whether no dynamo frame callback is set on this thread: then the eager segment
    entry points may run without their ``torch.compiler.disable`` wrapper. Never
    called while dynamo traces (callers check ``is_compiling`` first)."""
    return get_eval_frame_callback is not None and get_eval_frame_callback() is None


class _OpenSegment:
    """A segment whose checkpoint region is currently entered (during one forward)."""

    def __init__(
        self,
        bounds: tuple[int, int],
        names: Sequence[str],
        context_fn: Callable[[], tuple[Any, Any]],
        first_input: torch.Tensor,
        links: SequentialLinks | None = None,
    ) -> None:
        self.bounds = bounds
        self.names = names
        self.links = links
        # The unit whose call continues the segment over a link that needs no check
        # (see .sequential_links), or None.
        self.quiet_next: int | None = None
        self.last_index: int | None = None
        self.replay = _Replay()
        self._last_output: torch.Tensor | None = None
        self._rng_after_previous: RngStates | None = None
        self._between: torch.autograd.graph.saved_tensors_hooks | None = None
        self._gen = checkpoint_generator(self.replay, first_input, context_fn=context_fn)
        next(self._gen)  # saves the input and pushes the checkpoint's saved-tensor hooks

    # -- running units --------------------------------------------------------------
    def continues_with(self, index: int) -> bool:
        """Whether a call of unit ``index`` continues this segment (rather than ends it)."""
        a, b = self.bounds
        return a <= index <= b and (self.last_index is None or index > self.last_index)

    def chain_slot(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Slot:
        """Where unit ``index``'s call takes the previous unit's output.

        Raises (after closing the region) when no argument *is* that output.
        """
        for slot, arg in (*enumerate(args), *kwargs.items()):
            if arg is self._last_output:
                return slot
        a, b = self.bounds
        prev, name = self.names[self.last_index or 0], self.names[index]
        error = RematError(
            f"units '{prev}' and '{name}' of segment {a}-{b} are not a chain: no argument of "
            f"'{name}' is the output of '{prev}' (the model's code changes it between the "
            "two calls), so segments cannot be used for these units; use a plan without "
            "this segment (e.g. option 'checkpoint' for each unit)"
        )
        self.abort(error)
        raise error

    def run(
        self,
        index: int,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        slot: Slot,
    ) -> Any:
        """Run unit ``index``'s forward inside the region and record the call for replay."""
        self._pop_between()
        self._last_output = None
        rng = None
        if self.quiet_next is not None:
            self.quiet_next = None
        elif self.last_index is not None:
            x = args[slot] if isinstance(slot, int) else kwargs[slot]
            rng = _rng_states(x)
            after_previous, self._rng_after_previous = self._rng_after_previous, None
            if after_previous is not None and _same_rng(rng, after_previous):
                rng = None
        recorded_args = args
        recorded_kwargs = kwargs
        if isinstance(slot, int):
            recorded_args = args[:slot] + (None,) + args[slot + 1 :]
        else:
            recorded_kwargs = {**kwargs, slot: None}
        self.replay.calls.append(_UnitCall(forward, recorded_args, recorded_kwargs, slot, rng))
        self.last_index = index
        try:
            with autocast_without_cache():
                output = forward(*args, **kwargs)
        except BaseException as exc:
            self.abort(exc)
            raise
        return output

    def unit_returned(self, index: int, output: Any) -> bool:
        """Note unit ``index``'s output; close the region after the last unit.

        Returns whether the segment is finished.
        """
        a, b = self.bounds
        if index == b:
            self.close()
            return True
        out = output if type(output) is torch.Tensor else boundary_output(output)
        if out is None:
            error = RematError(
                f"unit '{self.names[index]}' of segment {a}-{b} returned no tensor, so it "
                "cannot be chained into the next unit; segments cannot be used for it"
            )
            self.abort(error)
            raise error
        self._last_output = out
        if self.links is not None and self.links.quiet(index):
            self.quiet_next = index + 1
            return False
        self._rng_after_previous = _rng_states(out)
        self._push_between(index)
        return False

    # -- closing --------------------------------------------------------------------
    def close(self) -> None:
        """End the region normally: what ran so far is what backward will recompute."""
        self._pop_between()
        self._last_output = None
        gen, self._gen = self._gen, None
        if gen is None:
            return
        try:
            next(gen)
        except StopIteration:
            return
        raise RematError("torch's checkpoint generator yielded more than twice")

    def abort(self, exc: BaseException) -> None:
        """End the region because the forward failed; never raises ``exc`` itself."""
        self._pop_between()
        self._last_output = None
        gen, self._gen = self._gen, None
        if gen is None:
            return
        try:
            gen.throw(exc)
        except StopIteration:
            logger.warning("remat: a checkpoint context suppressed %r", exc)
        except BaseException as raised:  # the generator re-raises what it is given
            if raised is not exc:
                logger.warning("remat: closing a segment after %r raised %r", exc, raised)

    # -- between two units of the segment ---------------------------------------------
    def _push_between(self, index: int) -> None:
        a, b = self.bounds
        prev = self.names[index]

        def refuse(tensor: torch.Tensor) -> Any:
            raise RematError(
                f"the model's code after unit '{prev}' of segment {a}-{b} saved a tensor for "
                "backward before the next unit of the segment ran; the units of a segment "
                "must be called back to back as a chain, so segments cannot be used here "
                "(use a plan without this segment, e.g. option 'checkpoint' for each unit)"
            )

        self._between = torch.autograd.graph.saved_tensors_hooks(refuse, _identity)
        self._between.__enter__()

    def _pop_between(self) -> None:
        between, self._between = self._between, None
        if between is not None:
            between.__exit__(None, None, None)


def _identity(x: Any) -> Any:
    return x


class SegmentRunner:
    """Runs the segment units of one planned model; at most one segment is open at a time.

    Picklable and deep-copyable with the model (the open region, which only
    exists during a forward, is not copied).
    """

    def __init__(
        self,
        names: Sequence[str],
        modules: Sequence[nn.Module],
        segments: Sequence[tuple[int, int]],
        links: SequentialLinks | None = None,
    ) -> None:
        self.names = tuple(names)
        self.links = links
        self.modules = list(modules)
        self.segment_of: dict[int, tuple[int, int]] = {
            i: (a, b) for a, b in segments for i in range(a, b + 1)
        }
        # The first unit of each segment, to its segment.
        self._starts: dict[int, tuple[int, int]] = {a: (a, b) for a, b in segments}
        self._open: _OpenSegment | None = None
        self._ahead: _Ahead | None = None
        self._context_fns: dict[tuple[int, int], Callable[[], tuple[Any, Any]]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = None
        state["_ahead"] = None
        state["_context_fns"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("_context_fns", {})  # pickled by a remat without the cache
        state.setdefault("links", None)
        if "_starts" not in state:  # pickled by a remat without it
            state["_starts"] = {a: (a, b) for a, b in set(state["segment_of"].values())}
        self.__dict__.update(state)

    @property
    def is_open(self) -> bool:
        return self._open is not None

    def expects_quiet(self, index: int, x: Any) -> bool:
        """Whether a call of unit ``index`` with ``x`` alone continues the open segment
        over a quiet link (:mod:`.sequential_links`): the unit expected next, called with
        the previous unit's output. Then :meth:`call_quiet` runs it."""
        seg = self._open
        return seg is not None and seg.quiet_next == index and x is seg._last_output

    def may_start(self, index: int, x: Any) -> bool:
        """Whether a call of unit ``index`` with tensor ``x`` alone opens its segment, none
        being open: then :meth:`start_quiet` runs it (the caller checked the option is
        active)."""
        return self._open is None and index in self._starts and isinstance(x, torch.Tensor)

    def call_quiet(self, index: int, forward: Callable[..., Any], x: torch.Tensor) -> Any:
        """Run unit ``index`` on ``x`` after :meth:`expects_quiet` said yes.

        What :meth:`call` does, less what the link makes needless: no chain search (the
        argument is the previous output), no RNG state (nothing drew between the
        units), no container snapshot (the call has none): the record is the forward.
        """
        seg = self._open
        assert seg is not None  # expects_quiet checked it
        seg.quiet_next = None
        seg._last_output = None
        # _run_alone's body, inline: this is the call of every unit but a segment's first.
        seg.replay.calls.append(forward)
        seg.last_index = index
        try:
            if autocast_on():
                with autocast_without_cache():
                    output = forward(x)
            else:  # a null context costs two calls a unit
                output = forward(x)
        except BaseException as exc:
            self._open = None
            seg.abort(exc)
            raise
        try:
            finished = seg.unit_returned(index, output)
        except BaseException:
            self._open = None
            raise
        if finished:
            self._open = None
        return output

    def start_quiet(self, index: int, forward: Callable[..., Any], x: torch.Tensor) -> Any:
        """Open unit ``index``'s segment on ``x`` and run the unit, after :meth:`may_start`.

        What :meth:`call` does for a segment's first unit called with one tensor: the
        region holds ``x`` (slot 0), and the call needs neither an RNG state (the
        generator keeps it) nor a container snapshot: the record is the forward. The
        caller checks that the unit did not write into ``x``.
        """
        bounds = self._starts[index]
        seg = self._open = _OpenSegment(bounds, self.names, self.context_fn(bounds), x,
                                        self.links)
        return self._run_alone(seg, index, forward, x)

    def _run_alone(self, seg: _OpenSegment, index: int, forward: Callable[..., Any],
                   x: torch.Tensor) -> Any:
        """Unit ``index`` run on ``x`` alone inside ``seg``, recorded as its forward.

        The hot path of a segment: one frame around the unit's forward, where
        :meth:`call` runs several (about a microsecond each, per unit).
        """
        seg.replay.calls.append(forward)
        seg.last_index = index
        try:
            if autocast_on():
                with autocast_without_cache():
                    output = forward(x)
            else:  # a null context costs two calls a unit
                output = forward(x)
        except BaseException as exc:
            self._open = None
            seg.abort(exc)
            raise
        try:
            finished = seg.unit_returned(index, output)
        except BaseException:
            self._open = None
            raise
        if finished:
            self._open = None
        return output

    def _ran(self, seg: _OpenSegment, index: int, run: Callable[[], Any]) -> Any:
        """``run()`` (unit ``index`` inside ``seg``), its output noted; the segment is no
        longer open once it finishes or anything raises."""
        try:
            output = run()
            finished = seg.unit_returned(index, output)
        except BaseException:
            self._open = None
            raise
        if finished:
            self._open = None
        return output

    def close(self) -> None:
        """Close the open segment, if any (the forward ended, or something else runs now)."""
        self._ahead = None
        seg, self._open = self._open, None
        if seg is not None:
            logger.debug("remat: segment %s closed after unit %s", seg.bounds, seg.last_index)
            seg.close()

    def call(
        self,
        index: int,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run unit ``index`` (a member of a segment) while the segment is active."""
        bounds = self.segment_of[index]
        a, b = bounds
        args, kwargs = drop_kv_cache(self.modules[index], args, kwargs)
        seg = self._open
        if seg is not None and not (seg.bounds == bounds and seg.continues_with(index)):
            self.close()
            seg = None
        if seg is not None:
            try:
                slot = seg.chain_slot(index, args, kwargs)
            except RematError:
                self._open = None
                raise
        else:
            slot, first_input = self._segment_input(index, args, kwargs)
            seg = self._open = _OpenSegment(bounds, self.names, self.context_fn(bounds),
                                            first_input, self.links)
        return self._ran(seg, index, lambda: seg.run(index, forward, args, kwargs, slot))

    def context_fn(self, bounds: tuple[int, int]) -> Callable[[], tuple[Any, Any]]:
        """The segment's eager checkpoint ``context_fn``, made once per plan.

        BatchNorm statistics are restored after recomputation, for every module of the
        segment, so they update once per step; modes are as in the forward.
        """
        made = self._context_fns.get(bounds)
        if made is None:
            a, b = bounds
            made = (checkpoint_context_fn(self.modules[a : b + 1], Option.CHECKPOINT)
                    or _ckpt.noop_context_fn)
            self._context_fns[bounds] = made
        return made

    def _segment_input(
        self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Slot, torch.Tensor]:
        """Where the call starting a segment takes the tensor the segment holds, and that tensor."""
        located = boundary_input(args, kwargs)
        if located is None or located[0] is None:
            a, b = self.segment_of[index]
            raise RematError(
                f"unit '{self.names[index]}' starts segment {a}-{b} but was called "
                "without a top-level tensor argument to hold and recompute from; segments "
                "cannot be used here"
            )
        return located[0], located[1]

    # -- under torch.compile -------------------------------------------------------
    def call_ahead(
        self,
        index: int,
        forward_of: Callable[[int], Callable[..., Any]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run unit ``index`` of a segment the traceable way (see the module docstring).

        The first unit's call runs the whole segment in one checkpoint region;
        each later unit's call checks that it continues the chain with the same
        other arguments and returns the output computed for it.
        """
        a, b = bounds = self.segment_of[index]
        args, kwargs = drop_kv_cache(self.modules[index], args, kwargs)
        ahead = self._ahead
        if ahead is not None and ahead.bounds == bounds and index == ahead.next_index:
            return self._hand_out(ahead, index, args, kwargs)
        self._ahead = None
        if index != a:
            raise RematError(
                f"unit '{self.names[index]}' of segment {a}-{b} was called without the "
                f"segment's earlier units running just before it; under torch.compile a "
                f"segment runs from its first unit '{self.names[a]}', so it cannot be used "
                "here (use a plan without this segment)"
            )
        slot, first_input = self._segment_input(index, args, kwargs)
        run = functools.partial(
            _run_chained,
            tuple(forward_of(k) for k in range(a, b + 1)),
            tuple(self.names[a : b + 1]),
            _UnitCall(forward_of(a), args, kwargs, slot),
        )
        context_fn = checkpoint_context_fn(self.modules[a : b + 1], Option.CHECKPOINT)
        extra = {} if context_fn is None else {"context_fn": context_fn}
        with autocast_without_cache():
            outputs = _ckpt.checkpoint(run, first_input, use_reentrant=False, **extra)
        if b > a:
            self._ahead = _Ahead(bounds, args, kwargs, slot, outputs)
        return outputs[0]

    def _hand_out(
        self, ahead: _Ahead, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        a, b = ahead.bounds
        expected = boundary_output(ahead.outputs[index - a - 1])
        chained = args[ahead.slot] if isinstance(ahead.slot, int) else kwargs.get(ahead.slot)
        if chained is not expected or not _same_arguments(ahead, args, kwargs):
            self._ahead = None
            raise RematError(
                f"unit '{self.names[index]}' of segment {a}-{b} was not called with the "
                f"output of '{self.names[index - 1]}' and otherwise the same arguments as "
                f"'{self.names[a]}'; under torch.compile a segment's units run ahead with "
                "the first unit's arguments, so this segment cannot be used here (use a plan "
                "without it, e.g. option 'checkpoint' for each unit)"
            )
        ahead.next_index = index + 1
        if index == b:
            self._ahead = None
        return ahead.outputs[index - a]


class _Ahead:
    """A segment run ahead under torch.compile: its units' outputs, handed out in order."""

    def __init__(
        self,
        bounds: tuple[int, int],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        slot: Slot,
        outputs: tuple[Any, ...],
    ) -> None:
        self.bounds = bounds
        self.args = args
        self.kwargs = kwargs
        self.slot = slot
        self.outputs = outputs
        self.next_index = bounds[0] + 1


def _same_value(x: Any, y: Any) -> bool:
    """Tensors and other objects by identity; plain Python values by equality."""
    if x is y:
        return True
    plain = (bool, int, float, str, type(None))
    return isinstance(x, plain) and isinstance(y, plain) and type(x) is type(y) and x == y


def _same_arguments(ahead: _Ahead, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a later unit's call matches the first unit's, its chained slot aside."""
    if len(args) != len(ahead.args) or kwargs.keys() != ahead.kwargs.keys():
        return False
    slot = ahead.slot
    return all(
        _same_value(x, y) for i, (x, y) in enumerate(zip(args, ahead.args)) if i != slot
    ) and all(_same_value(v, ahead.kwargs[k]) for k, v in kwargs.items() if k != slot)


def _run_chained(
    forwards: tuple[Callable[..., Any], ...],
    names: tuple[str, ...],
    first: _UnitCall,
    x: torch.Tensor,
) -> tuple[Any, ...]:
    """The units of a segment run ahead: each takes the previous one's first tensor output."""
    outputs = []
    for k, forward in enumerate(forwards):
        out = dataclasses.replace(first, forward=forward).call(x)
        outputs.append(out)
        nxt = boundary_output(out)
        if nxt is None and k < len(forwards) - 1:
            raise RematError(
                f"unit '{names[k]}' returned no tensor, so it cannot be chained into "
                f"'{names[k + 1]}'; segments cannot be used for it"
            )
        x = nxt
    return tuple(outputs)

"""Pass 1 of :mod:`.profile` (capture and replays).

The capture pass: one forward pass that records how the units run, and replays each
unit where it runs.

It records, without the memory meter:

* the units' execution order, and that each runs exactly once;
* each unit's inputs (detached, so the graph is not kept) and the RNG state it saw,
  handed to the replays (:mod:`.replay`) at the unit's call, on the live input;
* whether the units form a **chain**: unit i+1's first tensor input *is* unit i's
  first tensor output, and no aten op runs between the two (counted by a small
  ``TorchDispatchMode`` that only counts while no unit is running);
* which boundaries the model's own code keeps alive past the next unit's start.

It keeps no saved tensor (no backward runs), so, replays aside, it holds what the
model's code references, as a no-grad forward would: a unit's input lives while its
replays run and is let go with the rest of the forward. Replaying every unit at its
own call, rather than from inputs captured for all units at once, is what keeps
profiling within the memory of the most frugal plan.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from remat.core.errors import ProfileError
from remat.execute.autocast import outside_autocast
from remat.execute.boundary import boundary_input, boundary_output
from remat.execute.kv_cache import is_kv_cache, warn_kv_cache_once
from remat.execute.output_capture import (
    outside_output_capture,
    recorded_lengths,
    recorded_since,
)
from remat.measurement.state import RngState
from remat.measurement.storage import storage_bytes
from remat.profiler.records import Captured, ChainCheck, UnitCall, UnitTrace

__all__ = ["trace_units"]

log = logging.getLogger("remat")


def _capture(value: Any, boundary: torch.Tensor | None) -> Any:
    """Detach every tensor (keeping storage, not graph); drop Hugging Face caches."""
    if is_kv_cache(value):
        # Replays run without the cache (see remat.execute.kv_cache), so what the cache
        # holds in the real step is not in the profile: say so.
        warn_kv_cache_once()
        return None
    leaves, spec = tree_flatten(value)
    leaves = [
        Captured(t.detach(), t.requires_grad, boundary=t is boundary)
        if isinstance(t, torch.Tensor) else t
        for t in leaves
    ]
    return tree_unflatten(leaves, spec)


class _OpCounter(TorchDispatchMode):
    """Counts aten ops that run while no unit is running, per gap between units."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0  # > 0 while a unit (or one of our own hooks) runs
        self.gap = 0  # units finished so far: gap i lies between unit i-1 and unit i
        self.ops: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if self.depth == 0:
            self.ops[self.gap] = self.ops.get(self.gap, 0) + 1
        return func(*args, **(kwargs or {}))


def _drop(_t: torch.Tensor) -> None:
    """Pack hook of the capture pass: nothing is kept (no backward runs)."""
    return None


def _keep(t: torch.Tensor) -> torch.Tensor:
    """Unpack hook of the capture pass (never called: nothing is unpacked)."""
    return t


@contextlib.contextmanager
def saving_as_autograd_does() -> Iterator[None]:
    """Inside the capture pass: the block saves tensors as autograd does on its own, with
    the pass's drop hooks (and any saved-tensor hooks the model's code pushed above them,
    such as its own checkpoint region's) off the stack until it ends.

    Not by pushing identity hooks: a tensor packed by a hook escapes autograd's check
    that it was not changed in place, which a replay must see fail as training would.
    This is torch's private stack of default hooks (``_top`` / ``_pop`` / ``_push``, what
    ``torch.autograd.graph.saved_tensors_hooks`` itself calls): the one place remat
    reaches into it, tested in ``tests/profiler/test_profiler_capture.py``.
    """
    autograd = torch._C._autograd
    popped = []
    while True:
        top = autograd._top_saved_tensors_default_hooks(False)
        if top is None:  # not inside the pass: nothing to take off
            break
        autograd._pop_saved_tensors_default_hooks()
        popped.append(top)
        if top[0] is _drop:
            break
    try:
        yield
    finally:
        for pack, unpack in reversed(popped):
            autograd._push_saved_tensors_default_hooks(pack, unpack)


def trace_units(
    model: nn.Module,
    units: list[tuple[str, nn.Module]],
    run_forward: Callable[[], Any],
    *,
    on_unit: Callable[[UnitCall], None] | None = None,
    ops_between: Mapping[tuple[str, str], int] | None = None,
) -> UnitTrace:
    """Run ``run_forward()`` once with capture hooks on ``units``; check order and chain.

    ``run_forward`` runs the model's forward (and the loss); its result is dropped. The
    pass keeps no saved tensor (no backward runs), so it holds what the model's code
    references and no more. With ``on_unit``, it is called at each unit's first call,
    before the unit runs, with the call's captured inputs (the replays of
    :mod:`.replay` run there, on the live input, under autograd's own saving); the
    captured inputs are released after it, and the RNG and the unit's buffers are put
    back, so the forward goes on as if nothing had run. Without it the calls keep
    their inputs (for a caller that inspects them).

    ``ops_between`` gives, per pair of consecutive units, how many ops run between them
    (:meth:`~remat.profiler.saves.SaveRecord.ops_between` reads them off the pass that
    recorded the saves); without it a dispatch mode counts them here, which would also
    slow the replays it wraps.

    Raises:
        ProfileError: a unit did not run, or ran more than once in one forward.
    """
    tracer = _Tracer(units, on_unit, ops_between)
    tracer.run(run_forward)
    return tracer.trace()


class _Tracer:
    """The capture pass's hooks on the units, and what they saw (:func:`trace_units`)."""

    def __init__(self, units: list[tuple[str, nn.Module]],
                 on_unit: Callable[[UnitCall], None] | None,
                 ops_between: Mapping[tuple[str, str], int] | None) -> None:
        self.modules = [module for _, module in units]
        self.calls = {name: UnitCall(name, module) for name, module in units}
        self.by_module = {id(module): self.calls[name] for name, module in units}
        self.on_unit = on_unit
        self.ops_between = ops_between
        self.counter = _OpCounter()
        self.order: list[str] = []
        self.breaks: list[str] = []
        # The last unit's boundary output, to tell whether the next unit's input is it.
        self.prev_output: torch.Tensor | None = None
        self.inputs: list[weakref.ref | None] = []  # per unit in order, its input's storage
        self.kept: list[bool] = []
        # transformers' output collector (remat.execute.output_capture): its lists' lengths
        # as each unit's own call starts, and the bytes the units' calls appended to it.
        self.lengths: dict[str, int] | None = None
        self.recorded_bytes = 0

    def run(self, run_forward: Callable[[], Any]) -> None:
        """The forward pass, hooked, saving nothing; the hooks are removed after it."""
        handles = []
        try:
            for module in self.modules:
                handles.append(module.register_forward_pre_hook(self.pre_hook, with_kwargs=True))
                handles.append(module.register_forward_hook(self.post_hook, with_kwargs=True))
            counting = self.counter if self.ops_between is None else contextlib.nullcontext()
            with counting, torch.autograd.graph.saved_tensors_hooks(_drop, _keep):
                result = run_forward()
            del result
            self.prev_output = None
            if self.inputs:
                self._check_kept(len(self.inputs) - 1)
        finally:
            for h in handles:
                h.remove()
            self.prev_output = None

    def trace(self) -> UnitTrace:
        """What the pass learned, once every unit ran exactly once."""
        missing = [name for name, c in self.calls.items() if c.calls == 0]
        if missing:
            raise ProfileError(
                f"units {missing} did not run in the forward pass; every unit must run exactly "
                "once (choose units= among the modules the forward calls)"
            )
        repeated = {name: c.calls for name, c in self.calls.items() if c.calls > 1}
        if repeated:
            raise ProfileError(
                f"units ran more than once in one forward pass: {repeated}; a unit must run "
                "exactly once (recurrent reuse of a module is unsupported): choose other units="
            )
        chain = ChainCheck(not self.breaks, tuple(self.breaks))
        if self.breaks:
            log.info("units do not form a chain: %s", "; ".join(self.breaks[:3]))
        kept = self.kept if self.on_unit is not None else [False] * len(self.order)
        return UnitTrace(self.order, self.calls, chain, kept, self.recorded_bytes)

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        call = self.by_module[id(module)]
        self.counter.depth += 1  # our own detach() calls are not model code
        call.calls += 1
        if call.calls > 1:
            return
        self.order.append(call.name)
        located = boundary_input(args, kwargs)
        first = located[1] if located is not None else None
        if len(self.order) > 1:
            self._check_kept(len(self.order) - 2)
            self._check_link(call.name, first)
        # Unit 0's input is the batch or the prefix's: no link of the chain leads to it.
        track = first is not None and len(self.order) > 1 and first.layout == torch.strided
        self.inputs.append(weakref.ref(first.untyped_storage()) if track else None)
        call.args = tuple(_capture(a, first) for a in args)
        call.kwargs = {k: _capture(v, first) for k, v in kwargs.items()}
        call.rng = RngState.capture()
        if self.on_unit is not None:
            self._measure_here(call, module)
        self.lengths = recorded_lengths()  # after the replays, which record nothing

    def post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        call = self.by_module[id(module)]
        self.counter.depth -= 1
        self.counter.gap += 1
        if call.calls > 1:
            return
        self.recorded_bytes += storage_bytes(recorded_since(self.lengths))
        self.lengths = None
        out = boundary_output(output)
        self.prev_output = out
        if out is not None:
            call.out_shape = tuple(out.shape)
            call.out_dtype = out.dtype
            call.out_device = out.device
            call.out_requires_grad = out.requires_grad

    def _check_kept(self, i: int) -> None:
        """Whether the model's code still keeps unit ``i``'s input (the next unit started,
        or the forward ended): the capture let go of it, so any reference is the model's."""
        ref = self.inputs[i]
        self.kept.append(ref is not None and ref() is not None)
        self.inputs[i] = None

    def _check_link(self, name: str, first: torch.Tensor | None) -> None:
        """The chain's link into unit ``name``: its input is the previous unit's output,
        and no op ran between the two."""
        prev = self.order[-2]
        if first is None or first is not self.prev_output:
            self.breaks.append(f"{name!r}'s first input is not {prev!r}'s output")
        ops = (self.counter.ops.get(self.counter.gap, 0) if self.ops_between is None
               else self.ops_between.get((prev, name), 1))
        if ops:
            self.breaks.append(f"{ops} op(s) run between {prev!r} and {name!r}")

    def _measure_here(self, call: UnitCall, module: nn.Module) -> None:
        """``on_unit(call)`` on the live inputs, under autograd's own saving and outside
        the loop's autocast; then the captured inputs are let go, and the RNG and the
        unit's buffers put back, so the forward goes on as if nothing had run."""
        buffers = [(b, b.detach().clone()) for b in module.buffers()]
        try:
            with outside_autocast(), saving_as_autograd_does(), outside_output_capture():
                self.on_unit(call)
        finally:
            call.release()
            call.rng.restore()
            with torch.no_grad():
                for b, value in buffers:
                    b.copy_(value)

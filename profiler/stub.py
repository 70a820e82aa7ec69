"""A tool of passes 2 and 3 of :mod:`.profile`.

The outside step: one training step in which every unit is a stub.

What the code outside the units costs (the prefix before the first unit, the suffix
after the last, the code between units), which boundaries it holds, what the loop
keeps, the shared tensors and the parameter gradients of the outside code are read off
a real training step. The units themselves are measured alone, by the replays, so the
step need not run them for real, and must not: run unplanned, they are the memory the
user could not fit (a plan that checkpoints every unit still holds every boundary).

So each unit runs as a **stub**: its own forward, unchanged, under ``torch.no_grad()``
inside an autograd function that saves nothing, whose backward hands each of the unit's
inputs that needs one a gradient of ones of its shape (the unit's real backward would
hand a gradient of that size; its values do not matter to memory). Its outputs are the
unit's real outputs, so the code after it runs as in training. The step then holds,
at every moment, what the code outside the units holds and one unit's forward, less
than any plan holds at the same moment; the units' parameters get no gradient from it
(:func:`give_missing_grads` allocates them where a step's figures need them all, before
``optimizer.step()``).

**Shapes only.** A step that only times the outside code (:mod:`.outside_time`) needs the
units' outputs to be tensors of the right kind, not their values: with
:attr:`StubClock.shapes_only` set, a stub whose call was seen running for real in an
earlier step (the same call of the step, inputs of the same shapes and kinds) hands out
zeros of the outputs it gave then, and skips the unit's forward, most of a stub step's
time (a CNN's units are 99% of its forward). What it costs: the outside code runs on
zeros, so code whose time or path depends on the values of what a unit returns would be
timed on another path. A unit runs for real where what it computes could reach the
outside code otherwise than through its outputs' tensors: an output that its structure
does not describe (a dataclass, an object holding tensors), or a forward hook on a module
inside it (``transformers`` records a router's logits so). A step with shapes only that
fails anyway runs again with every unit (:mod:`.outside_time`). The instrumented step
(:mod:`.instrument`) always runs the units.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from remat.execute.options import autocast_without_cache

__all__ = ["Layout", "StubClock", "give_missing_grads", "layout_of", "stubbed", "zeros_laid_out"]

Rebuild = Callable[[list[torch.Tensor]], Any]


def _flatten(value: Any) -> tuple[list[torch.Tensor], Rebuild]:
    """The tensors in a unit's output and how to put others in their places: pytree
    containers (tuples, lists, dicts, Hugging Face outputs) and dataclasses."""
    leaves, spec = tree_flatten(value)
    tensors: list[torch.Tensor] = []
    parts: list[tuple[str, Any]] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append(("tensor", len(tensors)))
            tensors.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            fields = {f.name: getattr(leaf, f.name) for f in dataclasses.fields(leaf) if f.init}
            inner, rebuild = _flatten(fields)
            parts.append(("dataclass", (leaf, len(tensors), len(inner), rebuild)))
            tensors += inner
        else:
            parts.append(("value", leaf))

    def rebuild(new: list[torch.Tensor]) -> Any:
        out = []
        for kind, part in parts:
            if kind == "tensor":
                out.append(new[part])
            elif kind == "dataclass":
                leaf, start, count, inner_rebuild = part
                out.append(dataclasses.replace(leaf, **inner_rebuild(new[start:start + count])))
            else:
                out.append(part)
        return tree_unflatten(out, spec)

    return tensors, rebuild


_PLAIN = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.Size)


class _Run:
    """The unit's forward to run inside the stub, and how to rebuild its output."""

    def __init__(self, forward: Callable[[], Any]) -> None:
        self.forward = forward
        self.rebuild: Rebuild | None = None
        self.plain = False  # its output: tensors in containers, and plain values


def _plain_structure(value: Any) -> bool:
    """Whether ``value`` is tensors in pytree containers and plain values only (nothing
    that could hold a tensor the structure does not show)."""
    return all(isinstance(leaf, (torch.Tensor, *_PLAIN)) for leaf in tree_flatten(value)[0])


def _kind(value: Any) -> Hashable:
    """What a stub's call is told apart by: its tensors' shapes and kinds, its plain
    values, and the types of anything else."""
    out: list[Hashable] = []
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            out.append((tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad))
        elif isinstance(leaf, _PLAIN):
            out.append(leaf)
        else:
            out.append(type(leaf))
    return tuple(out)


def _hooked_inside(module: nn.Module) -> bool:
    """Whether a module inside ``module`` (not itself: its hooks run around the stub) has
    forward hooks, or any module has: a hook sees what the unit computes and may hand it
    to the outside code (``transformers`` collects a router's logits so, for the
    auxiliary loss the outside code adds)."""
    if _global_forward_hooks or _global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks
               for m in module.modules() if m is not module)


Layout = tuple[torch.Size, tuple[int, ...], torch.dtype, torch.device]


def layout_of(t: torch.Tensor) -> Layout:
    """What zeros standing for ``t`` need: its shape, strides, dtype and device."""
    return t.shape, t.stride(), t.dtype, t.device


def zeros_laid_out(layout: Layout) -> torch.Tensor:
    """Zeros laid out as ``layout`` says (:func:`layout_of`)."""
    size, stride, dtype, device = layout
    return torch.empty_strided(size, stride, dtype=dtype, device=device).zero_()


@dataclasses.dataclass(frozen=True)
class _Outputs:
    """What a real call of a stub gave, without its tensors: their layouts, the
    structure to rebuild, and the kind of the inputs it was called on."""

    inputs: Hashable
    layouts: tuple[Layout, ...]
    rebuild: Rebuild

    def zeros(self) -> Any:
        return self.rebuild([zeros_laid_out(layout) for layout in self.layouts])


_register_hook = torch.Tensor.register_hook


def _register_hook_where_tracked(self: torch.Tensor, hook: Callable[..., Any]) -> Any:
    """``Tensor.register_hook`` inside a stub: on a tensor that requires grad as it is; on
    one the stub's ``no_grad`` left without grad (which would refuse it), a no-op that
    returns a handle, as it would be had the unit run with grad (the hook would then run
    in the unit's backward, which the stub does not run: the replays measure it)."""
    if self.requires_grad:
        return _register_hook(self, hook)
    return RemovableHandle(OrderedDict())


@contextlib.contextmanager
def _hooks_on_untracked_tensors_ignored() -> Iterator[None]:
    """Inside the block, ``register_hook`` on a tensor without grad is a no-op: a unit's
    forward may hook what it computes (``y.register_hook(...)``), valid with grad on, and
    its stub runs it under ``no_grad``. Patched on the class for the block's length only
    (a stub's forward), since the unit's code calls the method, not a function remat
    could hand it."""
    before = torch.Tensor.register_hook
    torch.Tensor.register_hook = _register_hook_where_tracked  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.register_hook = before  # type: ignore[method-assign]


class _Stub(torch.autograd.Function):
    """Runs the unit without saving anything; its backward hands out gradients of ones."""

    @staticmethod
    def forward(ctx, run: _Run, anchored: bool,  # noqa: ANN001
                *needing_grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs = needing_grad[:-1] if anchored else needing_grad
        ctx.specs = [(t.shape, t.dtype, t.device) for t in inputs]
        ctx.anchored = anchored
        # Grad is off inside forward(); under autocast, no weight cast is cached either, as
        # for a checkpointed unit (the cache would hold every unit's casts to the end).
        with autocast_without_cache(), _hooks_on_untracked_tensors_ignored():
            out = run.forward()
            run.plain = _plain_structure(out)
            tensors, run.rebuild = _flatten(out)
            del out
        return tuple(tensors)

    @staticmethod
    def backward(ctx, *_grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        grads = [torch.ones(shape, dtype=dtype, device=device)
                 for shape, dtype, device in ctx.specs]
        return (None, None, *grads, *([None] if ctx.anchored else []))


@dataclasses.dataclass
class StubClock:
    """Wall time the stubs' forwards took, in milliseconds (the outside step's time
    less this is the outside code's), how they run in the step under way, and what each
    unit's calls gave when they last ran for real.

    One clock passed to several :func:`stubbed` blocks carries what the units gave from
    one to the next: the instrumented step (:mod:`.instrument`), whose units run for real,
    teaches the timed steps after it (:mod:`.outside_time`) the outputs they hand out as
    zeros, so none of those runs the units (a whole forward of the model saved)."""

    ms: float = 0.0
    shapes_only: bool = False  # see the module docstring
    step: int = 0  # which step runs: a stub counts its calls per step
    # id(unit) -> per call of a step, what its last real run gave (kept by the unit's stub)
    seen: dict[int, list[_Outputs | None]] = dataclasses.field(default_factory=dict)

    def new_step(self, *, shapes_only: bool) -> None:
        """A new step starts: the time back to 0, and how its stubs run."""
        self.ms = 0.0
        self.step += 1
        self.shapes_only = shapes_only


class _StubForward:
    """A unit's replacement ``forward`` while the outside step runs."""

    def __init__(self, module: nn.Module, original: Callable[..., Any], clock: StubClock):
        self.original = original
        self.clock = clock
        self.module = module
        trainable = any(p.requires_grad for p in module.parameters())
        # Its outputs require grad when its parameters do, whatever its inputs.
        self.anchor = (torch.zeros((), requires_grad=True) if trainable else None)
        # Per call of a step, its last real run: the clock's, so that it outlives this stub.
        self.seen = clock.seen.setdefault(id(module), [])
        self._step, self._calls = -1, 0

    def _call_index(self) -> int:
        """Which call of the unit this is in the clock's current step."""
        if self._step != self.clock.step:
            self._step, self._calls = self.clock.step, 0
        self._calls += 1
        return self._calls - 1

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        index, inputs = self._call_index(), _kind((args, kwargs))
        known = self.seen[index] if index < len(self.seen) else None
        seen: set[int] = set()
        needing = []
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in seen:
                seen.add(id(t))
                needing.append(t)
        anchored = self.anchor is not None
        if anchored:
            needing.append(self.anchor)
        real = not (self.clock.shapes_only and known is not None and known.inputs == inputs
                    and not _hooked_inside(self.module))
        run = _Run((lambda: self.original(*args, **kwargs)) if real else known.zeros)
        start = time.perf_counter()
        tensors = _Stub.apply(run, anchored, *needing)
        self.clock.ms += (time.perf_counter() - start) * 1e3
        assert run.rebuild is not None
        if real:
            self._remember(index, inputs, run, tensors)
        return run.rebuild(list(tensors))

    def _remember(self, index: int, inputs: Hashable, run: _Run,
                  tensors: tuple[torch.Tensor, ...]) -> None:
        """Keep what call ``index`` gave, for steps with shapes only (never its tensors)."""
        self.seen.extend([None] * (index + 1 - len(self.seen)))
        assert run.rebuild is not None
        self.seen[index] = _Outputs(
            inputs, tuple(layout_of(t) for t in tensors),
            run.rebuild) if run.plain else None


@contextlib.contextmanager
def stubbed(modules: list[nn.Module], clock: StubClock | None = None) -> Iterator[StubClock]:
    """Inside the block each of ``modules`` runs as a stub (see the module docstring)."""
    clock = clock if clock is not None else StubClock()
    saved = [m.__dict__.get("forward") for m in modules]
    try:
        for m in modules:
            m.forward = _StubForward(m, m.forward, clock)
        yield clock
    finally:
        for m, before in zip(modules, saved):
            if before is None:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = before


def give_missing_grads(params: list[nn.Parameter]) -> None:
    """A zero gradient for every trainable parameter without one: the units' parameters,
    which the stubs left out, allocated as the real backward would have them by the end
    of the step (so ``optimizer.step()`` runs, and creates its state, for all of them)."""
    for p in params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)

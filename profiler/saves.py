"""Pass 0 of :mod:`.profile` (units).

One measured forward pass: what every module call saves for backward, and how calls connect.

Unit discovery and coverage are decided on this record, not guessed from names or
list lengths. While the model's forward (and the loss) runs once:

* module hooks on **every** module keep the stack of running module calls;
* ``saved_tensors_hooks`` see each tensor autograd saves for backward, and the
  stack it was saved under. Only storages allocated during the pass count (a
  small dispatch mode tells them apart): parameters, buffers and the batch are
  not activations;
* the same dispatch mode counts aten ops, so the ops that run between any two
  module calls are known (``enter_op`` / ``exit_op``), which is what the
  capture pass's chain check counts;
* each call's boundary input (:mod:`remat.execute.boundary`) is matched, by
  identity, with the calls whose boundary output it is (``input_from``).

A storage is *held by* a set of disjoint modules when every save of it happened
inside one of them: only then can a plan of those modules drop it. No backward
runs (what is saved is known at the end of the forward), so the pass costs about
one forward, and the saves are recorded as sizes and dropped: the pack hook keeps
nothing, so the pass holds only what the model's code references, as a no-grad
forward does, never the unplanned step's activations. The model is left as it was
(the caller runs it inside :func:`~remat.measurement.state.training_session`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from remat.execute.boundary import boundary_input, boundary_output
from remat.measurement.meter import returns_alias

__all__ = ["ModuleCall", "SaveRecord", "Saved", "record_saves"]

@dataclass
class ModuleCall:
    """One module's call in the pass (its first, when it ran more than once).

    Attributes:
        index: calls are numbered in the order they started (the model is 0).
        name: the module's qualified name (``""`` for the model).
        module: the module.
        parent: the call that was running when it started (``None`` for the model).
        calls: how many times the module ran (a unit must run exactly once).
        enter_op, exit_op: the op counter when its first call started and ended.
        input_from: calls whose boundary output is this call's boundary input.
        input_saved: the index in :attr:`SaveRecord.saved` of its boundary input's
            storage, when that storage is an activation saved for backward.
    """

    index: int
    name: str
    module: nn.Module
    parent: int | None
    calls: int = 1
    enter_op: int = 0
    exit_op: int = 0
    input_from: tuple[int, ...] = ()
    input_saved: int | None = None
    input_fresh_bytes: int = 0

    @property
    def ops(self) -> int:
        """Aten ops run inside the call."""
        return self.exit_op - self.enter_op


@dataclass
class Saved:
    """A storage saved for backward: its bytes and the call stacks of its saves."""

    nbytes: int
    stacks: list[tuple[int, ...]] = field(default_factory=list)

    def held_by(self, units: set[int]) -> bool:
        """Every save of it happened inside one of ``units`` (call indices): only then can
        a plan of those units drop it."""
        return bool(self.stacks) and all(any(i in units for i in stack)
                                         for stack in self.stacks)


@dataclass
class SaveRecord:
    """What :func:`record_saves` saw (see the module docstring)."""

    calls: list[ModuleCall]
    saved: list[Saved]
    ops: int  # aten ops in the whole pass

    def __post_init__(self) -> None:
        self.by_name = {c.name: c for c in self.calls}

    @property
    def activation_bytes(self) -> int:
        """Bytes of every storage saved for backward: the step's activation memory."""
        return sum(s.nbytes for s in self.saved)

    def call(self, name: str) -> ModuleCall | None:
        return self.by_name.get(name)

    def ancestors(self, index: int) -> list[int]:
        """The calls enclosing call ``index``, innermost first (the model last)."""
        out = []
        parent = self.calls[index].parent
        while parent is not None:
            out.append(parent)
            parent = self.calls[parent].parent
        return out

    def held_bytes(self, units: Iterable[int]) -> int:
        """Bytes of the storages held by ``units`` (call indices of disjoint modules)."""
        chosen = set(units)
        return sum(s.nbytes for s in self.saved if s.held_by(chosen))

    def held_per_unit(self, units: Iterable[int]) -> dict[int, int]:
        """Per unit, the held bytes it saved first (a boundary held by two units counts
        once, for the earlier one); the values sum to :meth:`held_bytes`."""
        chosen = list(units)
        out = dict.fromkeys(chosen, 0)
        members = set(chosen)
        for s in self.saved:
            if s.held_by(members):
                owner = next(i for i in s.stacks[0] if i in members)
                out[owner] += s.nbytes
        return out

    def saved_inside(self, index: int) -> int:
        """Bytes of storages every save of which happened inside call ``index``."""
        return self.held_bytes([index])

    def ops_between(self, names: list[str]) -> dict[tuple[str, str], int]:
        """Per pair of the named calls that ran one after the other, how many ops ran
        between the first's end and the second's start (what the capture pass's chain
        check counts, here without a dispatch mode slowing its replays)."""
        calls = sorted((c for c in (self.call(n) for n in names) if c is not None),
                       key=lambda c: c.index)
        return {(a.name, b.name): b.enter_op - a.exit_op for a, b in zip(calls, calls[1:])}




class _Pass(TorchDispatchMode):
    """Counts aten ops and remembers the storages they allocate (weakly)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.quiet = 0  # > 0 while our own hooks run: their ops are not the model's
        self.fresh: dict[int, weakref.ref] = {}  # id(storage) -> the storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if self.quiet:
            return out
        self.ops += 1
        aliases = returns_alias(func)
        for k, t in enumerate(tree_flatten(out)[0]):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and not (
                    k < len(aliases) and aliases[k]):
                st = t.untyped_storage()
                self.fresh[id(st)] = weakref.ref(st)
        return out

    def is_fresh(self, t: torch.Tensor) -> bool:
        if t.layout != torch.strided:
            return False
        st = t.untyped_storage()
        ref = self.fresh.get(id(st))
        return ref is not None and ref() is st


class _Recorder:
    """The hooks of one pass."""

    def __init__(self, model: nn.Module, mode: _Pass) -> None:
        self.mode = mode
        self.names = {id(m): n for n, m in model.named_modules()}
        self.calls: list[ModuleCall] = []
        self.by_module: dict[int, ModuleCall] = {}
        self.stack: list[int] = []
        self.producers: dict[int, list[tuple[weakref.ref, int]]] = {}  # id(tensor) -> calls
        self.saved: list[Saved] = []
        self.saved_at: dict[int, tuple[weakref.ref, int]] = {}  # id(storage) -> saved index
        # id(storage) -> the calls whose boundary input it is (while it lives)
        self.input_of: dict[int, list[tuple[weakref.ref, int]]] = {}

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        known = self.by_module.get(id(module))
        if known is not None:
            known.calls += 1
            self.stack.append(known.index)
            return
        parent = self.stack[-1] if self.stack else None
        call = ModuleCall(len(self.calls), self.names[id(module)], module, parent,
                          enter_op=self.mode.ops)
        located = boundary_input(args, kwargs)
        if located is not None:
            x = located[1]
            call.input_from = tuple(i for ref, i in self.producers.get(id(x), ()) if ref() is x)
            if x.layout == torch.strided:
                st = x.untyped_storage()
                self.input_of.setdefault(id(st), []).append((weakref.ref(st), call.index))
                known = self.saved_at.get(id(st))
                if known is not None and known[0]() is st:  # saved before this call
                    call.input_saved = known[1]
                if self.mode.is_fresh(x):
                    call.input_fresh_bytes = st.nbytes()
        self.calls.append(call)
        self.by_module[id(module)] = call
        self.stack.append(call.index)

    def post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self.stack:
            return
        index = self.stack.pop()
        call = self.calls[index]
        if call.calls > 1:
            return
        call.exit_op = self.mode.ops
        y = boundary_output(output)
        if y is not None:
            self.producers.setdefault(id(y), []).append((weakref.ref(y), index))

    def pack(self, t: torch.Tensor) -> None:
        self.mode.quiet += 1
        try:
            if self.mode.is_fresh(t):
                st = t.untyped_storage()
                known = self.saved_at.get(id(st))
                if known is None or known[0]() is not st:
                    known = (weakref.ref(st), len(self.saved))
                    self.saved_at[id(st)] = known
                    self.saved.append(Saved(st.nbytes()))
                self.saved[known[1]].stacks.append(tuple(self.stack))
                for ref, index in self.input_of.get(id(st), ()):
                    if ref() is st and self.calls[index].input_saved is None:
                        self.calls[index].input_saved = known[1]
            # Nothing is kept: the pass runs no backward, so the forward holds only what
            # its code references, as a no-grad forward does (see the module docstring).
            return None
        finally:
            self.mode.quiet -= 1

    @staticmethod
    def unpack(packed: None) -> torch.Tensor:
        raise AssertionError("the saves pass runs no backward")


def record_saves(model: nn.Module, run_forward: Callable[[], Any]) -> SaveRecord:
    """Run ``run_forward()`` (the model's forward and the loss) once and record its saves.

    The result of ``run_forward`` is dropped without a backward pass. The caller
    restores what the forward changed (RNG, BatchNorm statistics).
    """
    mode = _Pass()
    rec = _Recorder(model, mode)
    handles = []
    try:
        for m in model.modules():
            handles.append(m.register_forward_pre_hook(rec.pre_hook, with_kwargs=True))
            handles.append(m.register_forward_hook(rec.post_hook, with_kwargs=True,
                                                   always_call=True))
        with mode, torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
            result = run_forward()
        del result
    finally:
        for h in handles:
            h.remove()
    return SaveRecord(rec.calls, rec.saved, mode.ops)

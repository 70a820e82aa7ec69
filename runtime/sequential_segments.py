"""Whole segments inside a stock ``nn.Sequential``, run the way ``checkpoint_sequential`` runs them.

A segment normally runs unit by unit (:mod:`.segments`): each unit's planned forward
opens, continues or closes torch's checkpoint region, and checks the link to the next
unit. That is a few Python frames around every unit, about 0.5% of a step where the
units are small convolutions (``checkpoint_sequential``'s own 100-layer experiment,
``benchmarks/overhead.py``), against nothing for ``checkpoint_sequential``, which runs
one ``checkpoint`` call over a function that calls the segment's modules in turn.

Where a segment's units are all children of one stock ``nn.Sequential``, side by side
(its class keeps torch's ``forward``, and it has no ``forward`` of its own installed),
remat gives that ``Sequential`` a forward (:class:`SequentialForward`): torch's loop,
except that each such segment runs as one ``torch.utils.checkpoint.checkpoint`` call
over its units' original forwards, as ``checkpoint_sequential`` does. The recomputation
is the same as the unit-by-unit path's (same region, same ``context_fn``, RNG state
preserved at the region's start, nothing drawn between the units), so gradients are
bitwise the same.

It is taken only where the unit-by-unit path would do nothing more: grad enabled, every
unit of the segment training, its option active, no segment open, not compiling and no
dynamo frame on the thread, a tensor input, no hook on any unit of the segment and no
global module hook (remat's own first-unit check excepted: this forward runs it).
Anything else runs torch's loop, and each unit's planned forward as before.

The price: at each call of such a ``Sequential``, one look at each of its segment
units' hook dicts and training flags (tens of nanoseconds a unit), and a frame per
segment instead of several per unit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module
from torch.utils import checkpoint as _ckpt

from remat.execute.options import autocast_without_cache
from remat.runtime.segments import autocast_on, dynamo_idle

__all__ = ["SequentialForward", "install_sequential_forwards", "remove_sequential_forwards"]

@dataclasses.dataclass(frozen=True)
class _Span:
    """A segment ``(first, last)`` of the plan whose units are children ``start..stop``
    (inclusive) of one ``Sequential``."""

    first: int
    last: int
    start: int
    stop: int


class SequentialForward:
    """The planned forward of one stock ``nn.Sequential`` (see the module docstring).

    A plain class, so that a planned model pickles and deep-copies.
    """

    def __init__(self, parent: nn.Sequential, spans: Sequence[_Span], state: Any) -> None:
        self.parent = parent
        self.spans = {s.start: s for s in spans}
        self.state = state  # the plan's _RematState (runtime.apply)
        self._chains: dict[int, _Chain] = {}

    def __call__(self, input: Any) -> Any:
        parent = self.parent
        if not self._may_run_segments(input):
            return nn.Sequential.forward(parent, input)
        children = list(parent._modules.values())
        j = 0
        while j < len(children):
            span = self.spans.get(j)
            if span is not None and type(input) is torch.Tensor and self._quiet(span, children):
                input = self._run(span, input)
                j = span.stop + 1
            else:
                input = children[j](input)
                j += 1
        return input

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_chains": {}}

    # -- when --------------------------------------------------------------------------
    def _may_run_segments(self, input: Any) -> bool:
        runner = self.state.runner
        return (torch.is_grad_enabled() and type(input) is torch.Tensor
                and runner is not None and not runner.is_open
                and not torch.compiler.is_compiling() and dynamo_idle()
                and not torch._C._get_tracing_state()  # jit.trace records module calls
                and not (_module._global_forward_hooks or _module._global_forward_pre_hooks
                         or _module._global_backward_hooks
                         or _module._global_backward_pre_hooks))

    def _quiet(self, span: _Span, children: list[nn.Module]) -> bool:
        """Whether the segment's units are still the container's children there, run the
        plan's forward (nothing installed over it since), are training and active, and
        run no hook of their own (remat's first-unit check aside)."""
        state = self.state
        if not state.active(span.first):
            return False
        first_check = state.first_unit_id if span.first == 0 else None
        for k, i in enumerate(range(span.first, span.last + 1)):
            m = state.modules[i]
            pre = m._forward_pre_hooks
            if (children[span.start + k] is not m
                    or getattr(m.__dict__.get("forward"), "_remat_state", None) is not state
                    or not m.training or m._forward_hooks or m._backward_hooks
                    or m._backward_pre_hooks
                    or (pre and not (len(pre) == 1 and first_check in pre and i == 0))):
                return False
        return True

    # -- how ---------------------------------------------------------------------------
    def _run(self, span: _Span, x: torch.Tensor) -> Any:
        state = self.state
        chain = self._chains.get(span.start)
        if chain is None:
            chain = self._chains[span.start] = _Chain(
                [state.original_forward(i) for i in range(span.first, span.last + 1)])
        if span.first == 0 and state.first_unit_id is not None:
            hook = state.modules[0]._forward_pre_hooks.get(state.first_unit_id)
            if hook is not None:
                hook(state.modules[0], (x,))
        version = x._version
        context_fn = state.runner.context_fn((span.first, span.last))
        if autocast_on():
            with autocast_without_cache():
                out = _ckpt.checkpoint(chain, x, use_reentrant=False, context_fn=context_fn)
        else:
            out = _ckpt.checkpoint(chain, x, use_reentrant=False, context_fn=context_fn)
        if x._version != version:
            state._refuse_writes_in_segment(span.first, (x,), {},
                                            [("argument 0", x, version)])
        return out


class _Chain:
    """The segment's units' original forwards, called in turn (``checkpoint``'s function)."""

    def __init__(self, forwards: list[Callable[..., Any]]) -> None:
        self.forwards = forwards

    def __call__(self, x: Any) -> Any:
        for forward in self.forwards:
            x = forward(x)
        return x


def install_sequential_forwards(root: nn.Module, names: Sequence[str],
                                modules: Sequence[nn.Module],
                                segments: Sequence[tuple[int, int]],
                                state: Any) -> list[nn.Sequential]:
    """Give each stock ``Sequential`` that holds whole segments of the plan a
    :class:`SequentialForward`; returns the ``Sequential`` modules changed."""
    by_parent: dict[int, tuple[nn.Sequential, list[_Span]]] = {}
    for a, b in segments:
        found = _children_span(root, names, modules, a, b)
        if found is not None:
            parent, span = found
            by_parent.setdefault(id(parent), (parent, []))[1].append(span)
    changed = []
    for parent, spans in by_parent.values():
        parent.forward = SequentialForward(parent, spans, state)  # type: ignore[method-assign]
        changed.append(parent)
    return changed


def remove_sequential_forwards(parents: Sequence[nn.Sequential]) -> None:
    """Undo :func:`install_sequential_forwards` (``remove_plan``)."""
    for parent in parents:
        if isinstance(parent.__dict__.get("forward"), SequentialForward):
            del parent.__dict__["forward"]


def _children_span(root: nn.Module, names: Sequence[str], modules: Sequence[nn.Module],
                   a: int, b: int) -> tuple[nn.Sequential, _Span] | None:
    """The stock ``Sequential`` whose consecutive children are units ``a..b``, if any."""
    parent_name = names[a].rpartition(".")[0]
    if any(n.rpartition(".")[0] != parent_name for n in names[a : b + 1]):
        return None
    try:
        parent = root.get_submodule(parent_name) if parent_name else root
    except AttributeError:
        return None
    if (not isinstance(parent, nn.Sequential)
            or type(parent).forward is not nn.Sequential.forward
            or "forward" in parent.__dict__):
        return None
    children = list(parent._modules.values())
    for start, child in enumerate(children):
        if child is modules[a]:
            stop = start + (b - a)
            if stop < len(children) and all(children[start + k] is modules[a + k]
                                            for k in range(b - a + 1)):
                return parent, _Span(a, b, start, stop)
            return None
    return None

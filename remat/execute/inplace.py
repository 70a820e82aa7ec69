"""Units that write into their own inputs, found before a recomputation depends on them.

A unit whose forward modifies an argument in place (``x += 1.0``, ``mask.masked_fill_``)
trains fine unplanned, but cannot be recomputed: ``checkpoint`` and ``selective``
hold the argument to rerun the forward from it in backward, and by then the forward
has overwritten it (torch fails in backward: "one of the variables needed for gradient
computation has been modified by an inplace operation"). Such a unit can only be
``keep``.

Two ways to tell, one for each side of remat:

* :func:`argument_versions` / :func:`written_arguments`: compare the tensors'
  version counters before and after a call. Cheap; for the profiler's capture pass,
  which runs each unit plainly once (a unit that writes its input is offered
  ``keep`` only), and as the runtime's check on later calls.
* :class:`WriteProbe`: a dispatch mode that raises :class:`InputWritten` *before* an
  op writes into the storage of a watched tensor. The runtime runs a unit's first
  recomputed call under it, so the write never happens inside a checkpoint region:
  the region is abandoned and the call runs plainly instead (:mod:`remat.runtime.apply`).

A forward that writes into a tensor ``selective`` keeps (an ``nn.ReLU(inplace=True)``
after a Linear, Falcon's ``mlp_output += attention_output``) is one ``selective``
cannot run, whether or not torch notices: it notices only where the recomputation
reads the written tensor, and stops it early where nothing after the write is needed
(Falcon's case). Both sides refuse it with :func:`selective_write_reason`, by the
probe: the profiler's metered ``selective`` replay runs under it (the option is
dropped for the unit, so no plan takes it) and so does the runtime's first call (a
hand-made plan that forces it gets a ``PlanMismatchError``). Used by
:mod:`remat.runtime.apply` and :mod:`remat.profiler.replay`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "InputWritten",
    "NestedBackward",
    "WriteProbe",
    "argument_versions",
    "selective_write_reason",
    "tensor_arguments",
    "written_arguments",
]

Versions = list[tuple[str, torch.Tensor, int]]


def tensor_arguments(
    args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a call takes, nested ones included, with a label for messages
    (``"argument 0"``, ``"keyword 'attention_mask'"``)."""
    found: list[tuple[str, torch.Tensor]] = []
    labelled = [(f"argument {i}", a) for i, a in enumerate(args)]
    labelled += [(f"keyword {k!r}", v) for k, v in kwargs.items()]
    for label, value in labelled:
        if isinstance(value, torch.Tensor):
            found.append((label, value))
            continue
        leaves = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        found.extend((f"{label}[{k}]", t) for k, t in enumerate(leaves))
    return found


def argument_versions(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Versions:
    """The version counter of every tensor argument, to compare after the call."""
    return [(label, t, t._version) for label, t in tensor_arguments(args, kwargs)]


def written_arguments(before: Versions, skip: Iterable[torch.Tensor] = ()) -> list[str]:
    """Labels of the arguments written in place since :func:`argument_versions` (``skip``:
    tensors whose writes do not matter, by identity)."""
    skipped = {id(t) for t in skip}
    return [label for label, t, version in before
            if t._version != version and id(t) not in skipped]


class InputWritten(Exception):  # noqa: N818 - control flow between the probe and its caller
    """Raised by :class:`WriteProbe` before ``op`` writes into watched tensor ``label``:
    an argument, or (``saved``) the output of an op that ``selective`` keeps for backward."""

    def __init__(self, label: str, op: str, *, saved: bool = False) -> None:
        super().__init__(f"{op} writes into {label}")
        self.label = label
        self.op = op
        self.saved = saved


def selective_write_reason(written: str, op: str) -> str:
    """Why ``selective`` cannot run a unit whose forward wrote (``op``) into ``written``,
    a tensor it keeps for backward (:attr:`InputWritten.label` of a ``saved`` hit)."""
    return (f"its forward writes in place ({op}) into {written}: the recomputation would "
            "start from the written value (an in-place activation such as "
            "nn.ReLU(inplace=True) after a Linear, or `out += x` on a Linear's output)")


class NestedBackward(Exception):  # noqa: N818 - control flow between the probe and its caller
    """Raised by :class:`WriteProbe` (``stop_nested``) when the forward it watches runs a
    backward pass of its own (``torch.autograd.grad`` inside the forward), at ``op``."""

    def __init__(self, op: str) -> None:
        super().__init__(f"a backward pass inside the forward ({op})")
        self.op = op


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less tensors
        return None


class WriteProbe(TorchDispatchMode):
    """Raises :class:`InputWritten` before any op writes into a watched tensor's storage
    (the tensor itself or a view of it: ``add_``, ``copy_``, ``out=``...).

    With ``stop_nested`` it raises :class:`NestedBackward` at the first op of a backward
    pass the forward runs itself (``torch.autograd.grad`` inside it): that backward
    recomputes the region it is in, which uses up ``selective``'s cache of saved tensors
    before the real backward needs it (torch then fails there).

    With ``saved_ops`` (``selective``'s :data:`~remat.execute.options.SELECTIVE_SAVE_OPS`),
    the outputs of those ops are watched too from when they are made: ``selective``
    keeps them for backward, and torch refuses one written since ("Tensor cached during
    selective activation checkpoint has been mutated"), in backward, where it is too
    late to say which unit did it (an ``nn.ReLU(inplace=True)`` after a Linear).
    """

    def __init__(self, watched: Iterable[tuple[str, torch.Tensor]], *,
                 saved_ops: frozenset[Any] = frozenset(), stop_nested: bool = False) -> None:
        super().__init__()
        self.watched: dict[int, str] = {}
        self.saved_ops = saved_ops
        # With ``stop_nested``: the backward pass the forward runs in (none: -1); an op of
        # another one is a backward the forward runs itself (NestedBackward).
        self.task = torch._C._current_graph_task_id() if stop_nested else None
        self.saved: set[int] = set()
        # The watched outputs, held so that their storages' keys stay theirs (selective
        # holds them until backward anyway: no extra memory).
        self.held: list[torch.Tensor] = []
        for label, t in watched:
            key = _storage_key(t)
            if key is not None:
                self.watched.setdefault(key, label)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if self.task is not None and torch._C._current_graph_task_id() != self.task:
            raise NestedBackward(str(func))
        for k, arg in enumerate(func._schema.arguments):
            info = arg.alias_info
            if info is None or not info.is_write:
                continue
            value = args[k] if k < len(args) else kwargs.get(arg.name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor):
                    key = _storage_key(t)
                    label = self.watched.get(key)  # type: ignore[arg-type]
                    if label is not None:
                        raise InputWritten(label, str(func), saved=key in self.saved)
        out = func(*args, **kwargs)
        if self.saved_ops and func.overloadpacket in self.saved_ops:
            self._watch_output(str(func.overloadpacket), out)
        return out

    def _watch_output(self, op: str, out: Any) -> None:
        for t in tree_flatten(out)[0]:
            key = _storage_key(t) if isinstance(t, torch.Tensor) else None
            if key is not None and key not in self.watched:
                self.watched[key] = f"the output of {op}, which selective keeps for backward"
                self.saved.add(key)
                self.held.append(t)

"""The links of a segment that a stock ``nn.Sequential`` drives: nothing runs between.

Between two units of a segment the model's own code runs, so the segment checks each
link (:mod:`.segments`): saved-tensor hooks refuse a save between the units, and the
RNG state is read on both sides of the link, to replay a random draw made there
(LayerDrop). That is about 8 us a link on CPU: nothing beside a transformer block,
as much as a small convolution (the 100-layer ``nn.Sequential`` of
``checkpoint_sequential``'s own experiment has 200 units).

Where two consecutive units of a segment are consecutive children of an
``nn.Sequential`` whose class keeps torch's ``forward``, and that ``Sequential`` is
the one running (its ``forward`` is on the stack: a pre-hook and an always-called
forward hook count it), the code between them is ``Sequential.forward``'s loop:
``input = module(input)``. It saves nothing and draws nothing, so the link skips
both checks. Hooks run between the units too, so a link with a forward hook on the
first unit, a pre-hook on the second, a backward hook on either, or any global
module hook is checked as usual. A ``Sequential`` iterated by the model's own code
(``for layer in self.seq: ...``) is not running its ``forward``: checked as usual.

The price: two hook calls per call of each such ``Sequential`` (per step, not per
unit). The check errs on the safe side: anything it does not recognise is checked.

Where every unit of a segment is such a child, the ``Sequential`` usually runs the
segment whole (:mod:`.sequential_segments`) and these links are not reached; they serve
the calls that path declines (a unit with a hook, a segment crossing the container).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.nn.modules import module as _module

__all__ = ["SequentialLinks"]


def _runs_torch_forward(parent: nn.Module) -> bool:
    return isinstance(parent, nn.Sequential) and type(parent).forward is nn.Sequential.forward


class _Running:
    """How many calls of one ``Sequential`` are running (its pre-hook and forward hook).

    A plain class with bound-method hooks, so a planned model still pickles and
    deep-copies.
    """

    def __init__(self) -> None:
        self.depth = 0

    def enter(self, module: nn.Module, args: Any) -> None:
        self.depth += 1

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1


class SequentialLinks:
    """For the segments of one planned model: which links ``i -> i+1`` need no check now."""

    def __init__(self, root: nn.Module, names: Sequence[str], modules: Sequence[nn.Module],
                 segments: Sequence[tuple[int, int]]) -> None:
        self.modules = list(modules)
        self._parents: dict[int, tuple[nn.Module, _Running]] = {}  # link i -> its Sequential
        running: dict[int, tuple[nn.Module, _Running]] = {}
        for a, b in segments:
            for i in range(a, b):
                parent = _driving_sequential(root, names[i], names[i + 1], modules[i],
                                             modules[i + 1])
                if parent is not None:
                    self._parents[i] = running.setdefault(id(parent), (parent, _Running()))
        self._handles = []
        for parent, counter in running.values():
            self._handles.append(parent.register_forward_pre_hook(counter.enter))
            self._handles.append(parent.register_forward_hook(counter.leave, always_call=True))

    def quiet(self, i: int) -> bool:
        """Whether nothing but the running ``Sequential``'s loop runs between units i and i+1."""
        found = self._parents.get(i)
        if found is None or found[1].depth <= 0:
            return False
        # No hook of either unit, nor a global module hook, can run between their calls
        # (inline: asked at every unit of a segment).
        first, second = self.modules[i], self.modules[i + 1]
        return not (first._forward_hooks or second._forward_pre_hooks
                    or first._backward_hooks or first._backward_pre_hooks
                    or second._backward_hooks or second._backward_pre_hooks
                    or _module._global_forward_hooks or _module._global_forward_pre_hooks
                    or _module._global_backward_hooks or _module._global_backward_pre_hooks)

    def remove(self) -> None:
        """Take the counting hooks off the ``Sequential`` modules (``remove_plan``)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for _, counter in self._parents.values():
            counter.depth = 0


def _driving_sequential(root: nn.Module, name: str, next_name: str, module: nn.Module,
                        next_module: nn.Module) -> nn.Module | None:
    """The stock ``Sequential`` holding ``module`` and ``next_module`` side by side, if any."""
    parent_name, _, _ = name.rpartition(".")
    if next_name.rpartition(".")[0] != parent_name:
        return None
    parent = root.get_submodule(parent_name) if parent_name else root
    if not _runs_torch_forward(parent):
        return None
    children = list(parent._modules.values())
    for k in range(len(children) - 1):
        if children[k] is module:
            return parent if children[k + 1] is next_module else None
    return None

"""Boundaries the model's own code keeps: which links of a chain no segment may span.

A multi-unit segment frees the activations handed from one of its units to the
next: the region saves only its first input. That saves memory only if nothing
else holds them, and the model's code may: ``x = self.stem(x); x = self.blocks(x)``
keeps the stem's output in ``x`` until the whole ``nn.Sequential`` of blocks
returns, so a segment from the stem into the first block frees nothing there
while the prediction would count it freed. A forward pass without autograd shows
it, since there only Python references keep a tensor alive: the input of unit
``i`` is *kept by the caller* when it is still alive as unit ``i + 1`` starts (or,
for the last unit, when the forward pass ends). No segment spans the link into
such a unit.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from remat.execute.boundary import boundary_input

__all__ = ["inputs_kept_by_caller"]


def inputs_kept_by_caller(
    units: list[tuple[str, nn.Module]], run_forward: Callable[[], Any]
) -> list[bool]:
    """Per unit (in execution order), whether the model's code keeps its boundary input
    alive past the unit's own forward; ``run_forward`` runs the model once."""
    index = {id(m): i for i, (_, m) in enumerate(units)}
    inputs: list[weakref.ref | None] = [None] * len(units)
    kept = [False] * len(units)

    def check(i: int) -> None:
        ref = inputs[i]
        kept[i] = ref is not None and ref() is not None
        inputs[i] = None

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        i = index[id(module)]
        located = boundary_input(args, kwargs)
        # Unit 0's input is the batch or the prefix's: no link of the chain leads to it.
        tensor = located[1] if located is not None else None
        if tensor is not None and i > 0:
            inputs[i] = weakref.ref(tensor.untyped_storage())
        if i > 0:
            check(i - 1)

    handles = [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for _, m in units]
    try:
        with torch.no_grad():
            result = run_forward()
        del result
        if units:
            check(len(units) - 1)
    finally:
        for h in handles:
            h.remove()
    return kept

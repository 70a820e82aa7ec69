"""The tensors a unit takes and hands on: one definition for the profiler and the runtime.

A unit is fed and returns arbitrary structures (a tensor, a tuple, keyword
arguments, a Hugging Face ``ModelOutput``). remat follows one tensor on each side:

* the **boundary input**: the first tensor among the call's top-level arguments
  (positional, then keyword), Hugging Face KV caches skipped; when no top-level
  argument is a tensor, the first tensor nested in them (then it has no slot, and
  no segment can chain through it);
* the **boundary output**: the output itself when it is a tensor; in a tuple or
  list the first such tensor; in a mapping, dataclass or ``ModelOutput`` its
  ``last_hidden_state`` when it has one, else its first tensor field.

On a chain one unit's boundary output is the next unit's boundary input, which
is what the profiler's chain check, its per-unit bytes and the runtime's
multi-unit segments all rely on; so they all read these two functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from remat.execute.kv_cache import is_kv_cache

__all__ = ["Slot", "boundary_input", "boundary_output"]

Slot = int | str  # where a call takes its boundary input: a positional index or a keyword


def boundary_input(
    args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> tuple[Slot | None, torch.Tensor] | None:
    """``(slot, tensor)`` of a call's boundary input (see the module docstring), or ``None``."""
    for slot, value in (*enumerate(args), *kwargs.items()):
        if isinstance(value, torch.Tensor):
            return slot, value
    for value in (*args, *kwargs.values()):
        if is_kv_cache(value):
            continue
        for leaf in tree_flatten(value)[0]:
            if isinstance(leaf, torch.Tensor):
                return None, leaf
    return None


def boundary_output(output: Any) -> torch.Tensor | None:
    """The tensor a unit hands on (see the module docstring), or ``None``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        items: list[Any] = list(output)
    elif isinstance(output, Mapping):
        items = list(output.values())
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        items = [getattr(output, f.name) for f in dataclasses.fields(output)]
    else:
        # Other pytree containers (namedtuples are tuples already): their first tensor.
        return next((t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)), None)
    hidden = getattr(output, "last_hidden_state", None)
    if isinstance(hidden, torch.Tensor):
        return hidden
    for item in items:
        found = boundary_output(item)
        if found is not None:
            return found
    return None

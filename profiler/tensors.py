"""Finding "the" tensor in a module's inputs and outputs, and swapping it.

A unit is fed and returns arbitrary structures (a tensor, a tuple, keyword
arguments, a Hugging Face ``ModelOutput``). The profiler follows one tensor on
each side: the *first tensor input* (in ``args`` then ``kwargs`` order) and the
*first tensor output* (the tensor itself, the first element of a tuple, the
``last_hidden_state`` or first tensor field of a dataclass-like output).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = [
    "first_tensor",
    "first_tensor_input",
    "first_tensor_output",
    "is_hf_cache",
    "storage_nbytes",
]


def storage_nbytes(t: torch.Tensor | None) -> int:
    """Bytes of the storage behind ``t`` (0 for ``None``), in bytes."""
    if t is None or t.layout != torch.strided:
        return 0
    return t.untyped_storage().nbytes()


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in a (nested) structure, in pytree order; ``None`` if there is none."""
    if isinstance(value, torch.Tensor):
        return value
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf
    return None


def first_tensor_input(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """The first tensor among the positional, then the keyword arguments.

    Hugging Face KV caches are skipped (the profiler's replays run without them).
    """
    for value in (*args, *kwargs.values()):
        if not is_hf_cache(value):
            found = first_tensor(value)
            if found is not None:
                return found
    return None


def first_tensor_output(output: Any) -> torch.Tensor | None:
    """The tensor a unit hands on: itself, a tuple's first, or a model output's hidden state."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for item in output:
            found = first_tensor_output(item)
            if found is not None:
                return found
        return None
    hidden = getattr(output, "last_hidden_state", None)
    if isinstance(hidden, torch.Tensor):
        return hidden
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        for f in dataclasses.fields(output):
            found = first_tensor_output(getattr(output, f.name))
            if found is not None:
                return found
        return None
    if isinstance(output, Mapping):
        for item in output.values():
            found = first_tensor_output(item)
            if found is not None:
                return found
        return None
    return first_tensor(output)


def is_hf_cache(value: Any) -> bool:
    """Whether ``value`` is a Hugging Face ``Cache`` (a key/value cache the layers mutate)."""
    return any(
        c.__name__ == "Cache" and c.__module__.startswith("transformers")
        for c in type(value).__mro__
    )

"""Pass 1 of :mod:`.profile` (capture and replays).

Twin units: the same computation on the same kind of input, so one timing serves all.

A transformer's blocks (or an MLP's layers) are copies of one module run on
inputs of one shape: their replays take the same time up to noise. The
profiler pools the timed samples of twins instead of timing each one
``repeats`` times, which makes the cost of timing independent of depth.

Two units are twins when their :func:`signature` is equal *and* the bytes
measured for them under every option are equal (the caller adds those). The
signature holds what decides the computation:

* per submodule: its type, ``forward`` function, ``extra_repr()`` (the
  hyperparameters PyTorch modules print), train/eval flag, number of hooks,
  and its plain attributes (numbers, strings, flags: ``sliding_window``,
  ``attention_type``...), except index attributes such as ``layer_idx``,
  which only say where the module sits;
* its parameters' and buffers' shapes, dtypes and ``requires_grad``;
* its inputs: for the first tensor input (the previous unit's output, on a
  chain) shape, stride, dtype, device and ``requires_grad``; every other
  tensor must be the *same* tensor (an attention mask, rotary tables shared by
  all blocks); other values must be equal.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from remat.profiler.records import Captured, UnitCall

__all__ = ["signature"]

# Attributes that number a module rather than configure it (Hugging Face sets
# layer_idx on every block and attention module).
_INDEX_ATTRS = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx"})
_PLAIN = (bool, int, float, str, type(None))
_MODULE_DICTS = ("_parameters", "_buffers", "_modules", "training")


def _plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    return isinstance(value, tuple | list) and all(isinstance(v, _PLAIN) for v in value)


def _module_part(name: str, module: nn.Module) -> tuple[Hashable, ...]:
    forward = module.forward
    attrs = tuple(sorted(
        (k, tuple(v) if isinstance(v, list) else v)
        for k, v in vars(module).items()
        if k not in _INDEX_ATTRS and not k.startswith("_") and k not in _MODULE_DICTS
        and _plain(v)
    ))
    hooks = tuple(len(getattr(module, h, ())) for h in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))
    return (name, type(module), getattr(forward, "__func__", forward), module.extra_repr(),
            module.training, hooks, attrs)


def _tensor_part(name: str, t: torch.Tensor | None) -> tuple[Hashable, ...]:
    if t is None:
        return (name, None)
    return (name, tuple(t.shape), t.dtype, t.device, t.requires_grad)


def _input_part(value: Any, first: bool) -> Hashable:
    if isinstance(value, Captured):
        t = value.tensor
        if first:
            return ("first", tuple(t.shape), t.stride(), t.dtype, t.device, value.requires_grad)
        # The very same tensor (storage, view and all), not just an equal shape.
        ptr = t.untyped_storage().data_ptr() if t.layout == torch.strided else id(t)
        return ("same", ptr, t.storage_offset() if t.layout == torch.strided else 0,
                tuple(t.shape), t.stride() if t.layout == torch.strided else (), t.dtype,
                value.requires_grad)
    if _plain(value):
        return ("value", type(value), tuple(value) if isinstance(value, list) else value)
    return ("object", id(value))


def signature(call: UnitCall) -> Hashable:
    """What decides ``call``'s computation and its cost (see the module docstring)."""
    module = call.module
    parts: list[Hashable] = []
    for name, sub in module.named_modules():
        parts.append(_module_part(name, sub))
        parts.extend(_tensor_part(f"{name}.{p}", t) for p, t in sub.named_parameters(recurse=False))
        parts.extend(_tensor_part(f"{name}.{b}", t)
                     for b, t in sub._buffers.items())  # named_buffers skips None ones
    leaves, spec = tree_flatten((call.args, call.kwargs))
    inputs = [_input_part(leaf, isinstance(leaf, Captured) and leaf.boundary) for leaf in leaves]
    parts.append(("inputs", str(spec), tuple(inputs)))
    parts.append(("output", call.out_shape, call.out_dtype, call.out_device,
                  call.out_requires_grad))
    return tuple(parts)

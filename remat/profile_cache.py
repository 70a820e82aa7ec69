"""Profiles kept for the model they measured: trying another budget costs only the solve.

``remat.solve``, ``remat.pareto``, ``remat.estimate`` and ``remat.profile`` profile the
model first; a second call on the same model, with the same batch shapes, loop and
options, takes the profile the first one made. Anything a profile's figures depend on
is in the key, so any change measures anew:

* the model itself (the same object), its module tree, each module's class, train/eval
  flag and plain attributes (numbers, strings, flags: ``use_cache``, ``dropout``...), its
  Hugging Face ``config`` when it has one, and its parameters' and buffers' names,
  shapes, dtypes, devices and ``requires_grad`` (not their values: training changes
  them, and memory does not follow them);
* the batch's structure and its tensors' shapes, dtypes and devices;
* the loss function, the optimizer (the object, and whether it has state yet), the
  loop, the units, the options and the granularity.

A profile timed with fewer ``repeats`` than asked for is not reused. The cache holds one
profile per model, and lets the model go when the user does (weak references).
:func:`forget_profiles` empties it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

from remat.core.profile import Profile

__all__ = ["cached_profile", "forget_profiles"]

_PLAIN = (bool, int, float, str, type(None))
_cache: weakref.WeakKeyDictionary[Any, tuple[Hashable, Profile]] = weakref.WeakKeyDictionary()


def forget_profiles() -> None:
    """Drop every cached profile."""
    _cache.clear()


def _plain_attrs(module: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, v) for k, v in vars(module).items()
                        if not k.startswith("_") and isinstance(v, _PLAIN)))


def _model_key(model: Any) -> Hashable:
    import torch

    modules = tuple((name, type(m).__qualname__, m.training, _plain_attrs(m))
                    for name, m in model.named_modules())
    tensors = tuple((name, tuple(t.shape), t.dtype, t.device, t.requires_grad)
                    for name, t in (*model.named_parameters(), *model.named_buffers())
                    if isinstance(t, torch.Tensor))
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    return modules, tensors, to_json() if callable(to_json) else None


def _batch_key(batch: Any) -> Hashable:
    import torch
    from torch.utils._pytree import tree_flatten

    leaves, spec = tree_flatten(batch)
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append(("tensor", tuple(leaf.shape), leaf.dtype, leaf.device))
        elif isinstance(leaf, _PLAIN):
            parts.append(("value", leaf))
        else:
            parts.append(("object", leaf))
    return str(spec), tuple(parts)


def _units_key(units: Any) -> Hashable:
    if units is None or isinstance(units, (str, type)):
        return units
    if isinstance(units, (list, tuple)):
        return tuple(units)
    return units


def cached_profile(model: Any, batch: Any, make: Callable[[], Profile], *, loss_fn: Any,
                   optimizer: Any, loop: Any, units: Any, options: Any, granularity: str,
                   repeats: int, head: str = "auto") -> Profile:
    """The profile of ``model`` on ``batch`` for these settings: the cached one when every
    part of the key is unchanged (see the module docstring), else ``make()``'s, kept."""
    # Objects (the loss function, the optimizer) by identity: the key holds them, so an
    # id cannot be reused by another while the entry lives.
    key = (_model_key(model), _batch_key(batch), loss_fn,
           (optimizer, bool(getattr(optimizer, "state", None))),
           loop, _units_key(units), None if options is None else tuple(map(str, options)),
           granularity, head)
    try:
        known = _cache.get(model)
    except TypeError:  # not weakly referenceable: no cache
        return make()
    if known is not None and known[0] == key and known[1].meta.get("repeats", 0) >= repeats:
        return known[1]
    profile = make()
    _cache[model] = (key, profile)
    return profile

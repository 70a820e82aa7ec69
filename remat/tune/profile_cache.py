"""Profiles kept for the model they measured: trying another budget costs only the solve.

``remat.solve``, ``remat.pareto``, ``remat.estimate`` and ``remat.profile`` profile the
model first; a second call on the same model, with the same batch shapes, loop and
settings, takes the profile the first one made. The key is what can be read cheaply on
every call (about 3 ms for a 124M-parameter GPT-2's 164 modules, a thousandth of its
profile); any change to it measures anew:

* the model itself (the same object), its module tree, each module's class and that
  class's ``forward`` (the function object: a patched class measures anew), its
  train/eval flag, its hooks, and every other attribute (numbers, strings, flags, and
  tuples, lists and dicts of them such as a convolution's ``stride``; a tensor
  attribute by its shape, dtype and device; any other object by identity); each
  Hugging Face ``config`` by its whole ``__dict__``, private attributes included
  (``_attn_implementation``, which ``to_json_string()`` leaves out); its parameters'
  and buffers' names, shapes, dtypes, devices and ``requires_grad``, and its buffers'
  version counters (a buffer written in place, a flag a forward reads, measures anew;
  parameters' values are not in the key: training changes them, and memory does not
  follow them);
* the ``torch.backends`` flags that choose kernels (cuDNN, oneDNN, TF32, the scaled
  dot-product attention kernels), the default dtype, deterministic algorithms and the
  number of intra-op threads (oneDNN keeps scratch per thread);
* the batch's structure and its tensors' shapes, dtypes and devices;
* every profiling setting, as one tuple (:func:`settings_key`, built from every field
  of the one :class:`~remat.core.settings.ProfilingSettings` value, so a setting added
  there is in the key: the loss function and the optimizer by identity, whether the
  optimizer has state yet, the loop, the units, the options, the granularity, the head,
  ``warmup``, ``tolerance``, ``pool_twins``...), each at its default where it is not
  given. A profile timed with fewer ``repeats`` than asked for is not reused;
  ``progress`` changes no figure and is not in the key
  (:data:`~remat.core.settings.UNKEYED`).

What the key cannot see: globals and other objects the forward or the loss reads
(a module-level flag, a function the forward calls replaced in its module), objects
mutated in place (a list attribute appended to, an object attribute changed inside:
objects are keyed by identity, not content), and state outside torch's flags. After
such a change call :func:`forget_profiles` (or pass the model afresh: a copy is another
model). ``remat.solve`` backstops it: verifying a plan from a cached profile, a step
measured further from the prediction than :data:`remat.tune.verify.PREDICTION_TOLERANCE`
drops that profile, profiles once more and solves on the fresh one (where a plan from a
fresh profile misses too, the miss is the prediction's, and is not taken for staleness).
``remat.estimate`` and ``remat.pareto`` measure no step, so they have no backstop.

The cache holds one profile per model, and lets the model go when the user does (weak
references: the model's attributes are keyed without holding them; the settings, such
as the loss function and the optimizer, are held).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import weakref
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from remat.core.profile import Profile
from remat.core.settings import UNKEYED, ProfilingSettings

__all__ = ["Lookup", "cached_profile", "forget_profiles", "note_prediction_off", "note_restored",
           "settings_key"]

_PLAIN = (bool, int, float, complex, str, bytes, type(None))
# Nested values deeper than this are keyed by identity (and a cycle cannot recurse).
_MAX_DEPTH = 6


@dataclass
class _Entry:
    key: Hashable
    versions: tuple[int, ...]
    profile: Profile
    # A plan from this profile, fresh, measured off its prediction: the miss is the
    # prediction's, so a later one is no sign of staleness.
    prediction_off: bool = False


class Lookup(NamedTuple):
    """A profile, and whether it came from the cache with its predictions holding so far
    (``solve`` takes a plan from it measuring off its prediction for staleness)."""

    profile: Profile
    cached: bool


_cache: weakref.WeakKeyDictionary[Any, _Entry] = weakref.WeakKeyDictionary()


def forget_profiles() -> None:
    """Drop every cached profile."""
    _cache.clear()


def cached_profile(model: Any, batch: Any, make: Callable[[], Profile], *,
                   settings: ProfilingSettings, fresh: bool = False) -> Lookup:
    """The profile of ``model`` on ``batch`` for ``settings``: the cached one when every
    part of the key is unchanged (see the module docstring), else ``make()``'s, kept.
    ``fresh``: make it whatever the cache holds."""
    try:
        known = _cache.get(model)
    except TypeError:  # not weakly referenceable: no cache
        return Lookup(make(), False)
    key = (settings_key(settings), _batch_key(batch), _model_key(model), _backends_key())
    if (not fresh and known is not None and known.key == key
            and known.versions == _buffer_versions(model)
            and known.profile.meta.get("repeats", 0) >= settings.repeats):
        return Lookup(known.profile, not known.prediction_off)
    profile = make()
    # The versions after profiling: restoring the buffers it ran moved their counters.
    _cache[model] = _Entry(key, _buffer_versions(model), profile)
    return Lookup(profile, False)


def note_restored(model: Any, profile: Profile) -> None:
    """``model`` ran steps that remat restored (verification, compiled candidates): its
    buffers' values are as ``profile`` measured them, their version counters are not, so
    keep the entry of ``profile`` valid."""
    try:
        entry = _cache.get(model)
    except TypeError:
        return
    if entry is not None and entry.profile is profile:
        entry.versions = _buffer_versions(model)


def note_prediction_off(model: Any, profile: Profile) -> None:
    """A plan from ``profile`` measured off its prediction although nothing changed since
    it was measured: later calls reuse it without taking such a miss for staleness (else
    every solve would profile again)."""
    try:
        entry = _cache.get(model)
    except TypeError:
        return
    if entry is not None and entry.profile is profile:
        entry.prediction_off = True


# --------------------------------------------------------------------- the settings
def settings_key(settings: ProfilingSettings) -> tuple[tuple[str, Hashable], ...]:
    """Every profiling setting that changes a figure, as one tuple of ``(name, value)``:
    read from the value's fields, so a setting added to :class:`ProfilingSettings` enters
    the key without a change here (all but :data:`~remat.core.settings.UNKEYED`)."""
    return tuple((f.name, _setting(f.name, getattr(settings, f.name)))
                 for f in dataclasses.fields(settings) if f.name not in UNKEYED)


def _setting(name: str, value: Any) -> Hashable:
    from remat.core.loop import loop_or_default

    if name == "optimizer":
        # By identity (the key holds it, so its id cannot pass to another), and whether it
        # has state: its first step creates the state, which the profile then measures.
        return value, bool(getattr(value, "state", None))
    if name == "loop":
        return loop_or_default(value)
    if name == "options":
        return None if value is None else tuple(map(str, value))
    if name == "units" and isinstance(value, (list, tuple)):
        return tuple(value)
    return value  # the loss function by identity, plain values as they are


# --------------------------------------------------------------------- the model
class _Identity:
    """An object by identity, without keeping it alive: equal only to a key of the same
    living object (a dead one's address may pass to another)."""

    __slots__ = ("ident", "ref")

    def __init__(self, obj: object) -> None:
        self.ident = id(obj)
        try:
            self.ref: weakref.ref[Any] | None = weakref.ref(obj)
        except TypeError:  # builtins and the like: they live as long as the process
            self.ref = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Identity) or self.ident != other.ident:
            return False
        if self.ref is None or other.ref is None:
            return self.ref is other.ref
        return self.ref() is not None and self.ref() is other.ref()

    def __hash__(self) -> int:
        return self.ident


def _freeze(value: Any, configs: dict[int, Hashable], depth: int = 0) -> Hashable:
    """``value`` as a comparable key: plain values as they are, containers by content,
    Hugging Face configs by their ``__dict__``, tensors by their metadata, any other
    object by identity."""
    import torch

    if isinstance(value, _PLAIN) or isinstance(value, enum.Enum):
        return value
    if depth > _MAX_DEPTH:
        return _Identity(value)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(_freeze(v, configs, depth + 1) for v in value))
    if isinstance(value, dict):
        return ("dict", *((_freeze(k, configs, depth + 1), _freeze(v, configs, depth + 1))
                          for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(_freeze(v, configs, depth + 1) for v in value))
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return value
    if callable(getattr(type(value), "to_json_string", None)) and hasattr(value, "__dict__"):
        return _config_key(value, configs, depth)
    return _Identity(value)


def _config_key(config: Any, configs: dict[int, Hashable], depth: int) -> Hashable:
    """A Hugging Face config by every attribute, private ones included (which kernel
    attention runs is ``_attn_implementation``); once per call however many modules
    hold it."""
    if id(config) not in configs:
        configs[id(config)] = None  # a config reaching itself: keyed once, no recursion
        configs[id(config)] = ("config", _Identity(type(config)),
                               *((k, _freeze(v, configs, depth + 1))
                                 for k, v in sorted(vars(config).items())))
    return configs[id(config)]


@functools.cache
def _module_internals() -> frozenset[str]:
    """``nn.Module``'s own ``__dict__`` entries: parameters, buffers, children and hook
    dicts are keyed apart (the rest, such as the state-dict hooks, change no step)."""
    from torch import nn

    return frozenset(vars(nn.Module()))


def _module_attrs(module: Any, configs: dict[int, Hashable]) -> tuple[Hashable, ...]:
    import torch

    internals = _module_internals()
    attrs: list[Hashable] = []
    for k, v in vars(module).items():
        if k in internals:
            if "hooks" in k and isinstance(v, dict) and v:
                attrs.append((k, *v))  # the handles' ids: unique for the process
        elif isinstance(v, torch.Tensor):
            attrs.append((k, "tensor", tuple(v.shape), v.dtype, v.device))
        else:
            attrs.append((k, _freeze(v, configs)))
    return tuple(attrs)


def _forward_of(cls: type) -> _Identity:
    """The ``forward`` function ``cls`` runs, found without binding (a descriptor would
    make a new object each call)."""
    for klass in cls.__mro__:
        if "forward" in vars(klass):
            return _Identity(vars(klass)["forward"])
    return _Identity(None)


def _model_key(model: Any) -> Hashable:
    """The model's modules, one walk of the tree (each module with its own parameters and
    buffers: walking the tree again for them cost as much as all the rest)."""
    configs: dict[int, Hashable] = {}
    classes: dict[type, Hashable] = {}
    modules = []
    for name, m in model.named_modules():
        cls = type(m)
        if cls not in classes:
            classes[cls] = (_Identity(cls), _forward_of(cls))
        modules.append((name, classes[cls], m.training, _module_attrs(m, configs),
                        _tensors_key(m._parameters), _tensors_key(m._buffers)))
    return tuple(modules), _freeze(getattr(model, "config", None), configs)


def _tensors_key(tensors: Mapping[str, Any]) -> Hashable:
    return tuple((name, tuple(t.shape), t.dtype, t.device, t.requires_grad)
                 for name, t in tensors.items() if t is not None)


def _buffer_versions(model: Any) -> tuple[int, ...]:
    """Each buffer's version counter: a write in place moves it (a BatchNorm's running
    statistics, a flag a forward reads); cheaper than reading the values."""
    return tuple(b._version for b in model.buffers())


# (module path under torch.backends, attribute): read when present, called when a function.
_BACKEND_FLAGS = (
    ("cudnn", "enabled"), ("cudnn", "benchmark"), ("cudnn", "deterministic"),
    ("cudnn", "allow_tf32"), ("mkldnn", "enabled"), ("cuda.matmul", "allow_tf32"),
    ("cuda.matmul", "allow_fp16_reduced_precision_reduction"),
    ("cuda.matmul", "allow_bf16_reduced_precision_reduction"),
    ("cuda", "flash_sdp_enabled"), ("cuda", "mem_efficient_sdp_enabled"),
    ("cuda", "math_sdp_enabled"), ("cuda", "cudnn_sdp_enabled"),
)


def _backends_key() -> Hashable:
    """The process-wide switches that choose kernels, whose memory differs (on the CPU the
    scaled dot-product attention without its flash kernel holds the attention weights;
    without oneDNN a convolution holds its unfolded input)."""
    import torch

    flags: list[Any] = []
    for path, attr in _BACKEND_FLAGS:
        owner: Any = torch.backends
        for part in path.split("."):
            owner = getattr(owner, part, None)
        value = getattr(owner, attr, None)
        flags.append(value() if callable(value) else value)
    return (*flags, torch.get_default_dtype(), torch.get_num_threads(),
            torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision())


# --------------------------------------------------------------------- the batch
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

"""Hugging Face KV caches in training: recognised once, dropped for recomputed layers.

A decoder layer writes its keys and values into the cache during its forward, so
recomputing the layer would write them a second time (the cache grows and later
reads see the wrong length), and an isolated replay of the layer would attend over
keys an earlier run appended. Training never reads the cache it builds, so remat
runs recomputed layers (and the profiler's replays) without one, as Hugging Face's
own gradient checkpointing does (``use_cache=False``). The cache's memory is then
not what the plan measured, so remat says so once.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from torch import Tensor, nn

__all__ = ["drop_kv_cache", "is_kv_cache", "warn_kv_cache_once"]

log = logging.getLogger("remat")

_warned = False


def is_kv_cache(value: Any) -> bool:
    """Whether ``value`` is a Hugging Face ``Cache``.

    Only checked when transformers is already imported: a model holding a cache has
    imported it, and remat never imports transformers itself.
    """
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache_type = getattr(cache_utils, "Cache", None)
    return cache_type is not None and isinstance(value, cache_type)


def warn_kv_cache_once() -> None:
    """Log, once per process, that a training step passes a KV cache to its layers."""
    global _warned
    if not _warned:
        _warned = True
        log.warning(
            "remat: the model passes a KV cache to its layers during a training step "
            "(use_cache=True). The cache is useless in training, recomputed layers run "
            "without it, and its memory is not in the profile, so predictions can be low: "
            "set model.config.use_cache = False for training (Hugging Face's gradient "
            "checkpointing does the same)."
        )


def drop_kv_cache(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with KV caches replaced by ``None`` and ``use_cache=False``.

    Unchanged when the layer declares ``_can_checkpoint_with_cache`` (it only reads
    the cache). Gradients are unchanged; the model's returned cache stays empty.
    """
    if not kwargs and all(isinstance(a, Tensor) for a in args):
        return args, kwargs  # the usual unit call, checked at every unit: no cache in it
    if getattr(module, "_can_checkpoint_with_cache", False):
        return args, kwargs
    dropped = any(is_kv_cache(v) for v in (*args, *kwargs.values()))
    if dropped:
        args = tuple(None if is_kv_cache(a) else a for a in args)
        kwargs = {k: None if is_kv_cache(v) else v for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs = {**kwargs, "use_cache": False}
        dropped = True
    if dropped:
        warn_kv_cache_once()
    return args, kwargs

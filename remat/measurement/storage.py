"""Bytes of tensors as the device holds them: distinct storages, counted once.

Every byte figure remat reads off live objects comes from here: a view or an alias
shares its base's storage, so counting tensors would count memory twice; a storage
is counted once, whole (a view of one row keeps all of it alive). A ``DTensor`` (a
parameter sharded with FSDP2) counts its local shard, what this rank holds.

:func:`resident_bytes` is what a measured step starts with and holds throughout
(parameters, buffers, optimizer state, gradients alive at its start, the batch): the
profiler, ``remat.measure``, verification, the compiled search, FSDP and the trainer
callbacks all add it to the peak their instruments see above the step's start.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = [
    "batch_bytes",
    "fixed_bytes",
    "grad_bytes",
    "local_shard",
    "optimizer_state_bytes",
    "resident_bytes",
    "storage_bytes",
    "storage_nbytes",
]


def storage_nbytes(t: torch.Tensor | None) -> int:
    """Bytes of the storage behind ``t`` (0 for ``None`` or a non-strided tensor)."""
    if t is None or t.layout != torch.strided:
        return 0
    return t.untyped_storage().nbytes()


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local shard (``t`` itself otherwise): the memory this rank holds. A
    ``DTensor`` is a wrapper whose own storage reports its global size, which no rank
    allocates."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # imported by whoever made one
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        return t.to_local()
    return t


def _tensors(tensors: Any) -> Iterator[torch.Tensor]:
    if isinstance(tensors, (torch.Tensor, tuple, list, dict)):
        leaves: Iterable[Any] = tree_flatten(tensors)[0]
    elif isinstance(tensors, Iterable) and not isinstance(tensors, (str, bytes)):
        leaves = (leaf for item in tensors for leaf in tree_flatten(item)[0])
    else:
        leaves = ()
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            yield local_shard(leaf)


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors``: a tensor, a (nested) tuple,
    list or dict of them, or any iterable of tensors (other values are skipped)."""
    seen: dict[int, int] = {}
    for t in _tensors(tensors):
        if t.layout == torch.strided:
            st = t.untyped_storage()
            seen[st.data_ptr() or id(st)] = st.nbytes()
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the distinct tensors held in ``optimizer.state``."""
    if optimizer is None:
        return 0
    return storage_bytes(v for state in optimizer.state.values() for v in state.values())


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the gradients alive now (``.grad`` that is not ``None``)."""
    return storage_bytes(p.grad for p in model.parameters() if p.grad is not None)


def batch_bytes(batch: Any, device: torch.device) -> int:
    """Bytes of the distinct storages of ``batch``'s tensors on ``device`` (a tensor, or
    tensors in tuples, lists and dicts): made before the step, alive through it."""
    return storage_bytes(t for t in tree_flatten(batch)[0]
                         if isinstance(t, torch.Tensor) and t.device.type == device.type)


def fixed_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Parameters + buffers + optimizer state: the bytes alive for the whole step."""
    return (storage_bytes(model.parameters()) + storage_bytes(model.buffers())
            + optimizer_state_bytes(optimizer))


def resident_bytes(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    batch: Any = None,
    device: torch.device | None = None,
    grads: bool = True,
) -> int:
    """What a measured step holds from its start to its end: parameters, buffers and
    optimizer state (:func:`fixed_bytes`), the gradients alive now (unless ``grads`` is
    false: a step that frees them first), and ``batch``'s tensors on ``device``."""
    total = fixed_bytes(model, optimizer) + (grad_bytes(model) if grads else 0)
    if batch is not None and device is not None:
        total += batch_bytes(batch, device)
    return total

"""Bytes of tensors as the device holds them: distinct storages, counted once.

Every byte figure remat reads off live objects comes from here: a view or an alias
shares its base's storage, so counting tensors would count memory twice; a storage
is counted once, whole (a view of one row keeps all of it alive). A ``DTensor`` (a
parameter sharded with FSDP2) counts its local shard, what this rank holds.

:func:`resident_bytes` is what a measured step starts with and holds throughout
(parameters, buffers, optimizer state, gradients alive at its start, the batch): the
profiler, ``remat.measure``, verification, the compiled search, FSDP and the trainer
callbacks all add it to the peak their instruments see above the step's start. For a
model wrapped in ``DistributedDataParallel`` it includes the Reducer's gradient buckets
(:func:`bucket_bytes`), which are no parameter, buffer or gradient of the model but are
held from the wrapping on.
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
    "bucket_bytes",
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


def _reducer(model: nn.Module) -> Any:
    """The ``DistributedDataParallel`` Reducer of ``model`` (``None``: not DDP-wrapped).

    ``model`` may be a trainer's step that runs through a DDP wrapper it does not hold as
    a submodule (``remat.tune.replicated.ReplicatedStep``): it names the wrapper as its
    ``replicated_by``."""
    ddp = getattr(torch.nn.parallel, "DistributedDataParallel", None)
    if ddp is None:
        return None
    model = getattr(model, "replicated_by", None) or model
    if not isinstance(model, ddp):
        return None
    return getattr(model, "reducer", None)


def _already_counted(bucket: Any, nbytes: int, as_view: bool) -> bool:
    """Whether ``bucket``'s storage is already counted as its parameters' gradients:
    with ``gradient_as_bucket_view`` the gradients alive are views of the bucket."""
    if not as_view:
        return False
    grads = [p.grad for p in bucket.parameters() if p.grad is not None]
    storages = {id(g.untyped_storage()) for g in grads}
    return len(storages) == 1 and storage_nbytes(grads[0]) == nbytes


def bucket_bytes(model: nn.Module, *, grads: bool = True) -> int:
    """Bytes of ``model``'s ``DistributedDataParallel`` gradient buckets (0 for any other
    model), read off the Reducer's live buckets; with ``grads``, those not already counted
    as the gradients alive (with ``gradient_as_bucket_view=True`` the gradients are views
    of the buckets, so a bucket whose gradients are alive is theirs).

    Why read them: DDP's Reducer allocates one flat buffer per bucket of parameters when
    it wraps the model (rebuilt in gradient order after the first step), the size of the
    gradients, and holds them for the whole run. They are no parameter, buffer or
    gradient, so nothing else here sees them, and a step's dispatch-level meter started
    after the wrapping does not either. The Reducer lends no view of them, only copies
    (``_get_zeros_like_grad_buckets``): one is made and dropped here, a transient of the
    buckets' size, taken before any measured region.
    """
    reducer = _reducer(model)
    if reducer is None:
        return 0
    wrapper = getattr(model, "replicated_by", None) or model
    as_view = bool(getattr(wrapper, "gradient_as_bucket_view", False))
    total = 0
    for bucket in reducer._get_zeros_like_grad_buckets():
        nbytes = storage_nbytes(bucket.buffer())
        if not (grads and _already_counted(bucket, nbytes, as_view)):
            total += nbytes
    return total


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
    false: a step that frees them first), DDP's gradient buckets (:func:`bucket_bytes`),
    and ``batch``'s tensors on ``device``."""
    total = (fixed_bytes(model, optimizer) + (grad_bytes(model) if grads else 0)
             + bucket_bytes(model, grads=grads))
    if batch is not None and device is not None:
        total += batch_bytes(batch, device)
    return total

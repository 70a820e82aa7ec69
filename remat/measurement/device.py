"""How much memory the device can give the training step: a ceiling on any budget.

On CUDA, what this process may still take (``torch.cuda.mem_get_info``'s free bytes,
within ``set_per_process_memory_fraction`` when one is set) plus what its tensors hold
now: a plan for more than that cannot run there, whatever budget it was asked for. On
the CPU there is no such figure (the machine's memory is the limit): ``None``.
"""

from __future__ import annotations

import torch

__all__ = ["device_capacity_bytes"]


def device_capacity_bytes(device: torch.device) -> int | None:
    """The bytes a step on ``device`` can use at most (see the module docstring)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    allocated = torch.cuda.memory_allocated(index)
    reserved = torch.cuda.memory_reserved(index)
    # Reserved but unallocated blocks are the caching allocator's to hand out again.
    capacity = free + allocated + (reserved - allocated)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if callable(fraction):
        capacity = min(capacity, int(fraction(index) * total))
    return capacity

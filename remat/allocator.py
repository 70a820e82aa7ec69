"""An allocator-level memory instrument: what the allocator hands out during a step.

remat's own meter (:class:`remat.meter.MemoryMeter`) counts live tensor storages
at the dispatch level. Two things escape it:

* scratch buffers that kernels allocate internally without going through the
  dispatcher (e.g. the contiguous copy a backward matmul makes of a broadcast
  gradient), and
* compiled code: under an active ``TorchDispatchMode`` a ``torch.compile``\\ d
  model falls back to eager, so a dispatch-level meter measures the eager model,
  not the compiled one.

The allocator sees both, so :func:`remat.measure` reports this figure beside the
meter's; for a compiled model it is the one to trust. On CPU this module reads the
allocation and free events that ``torch.profiler.profile(profile_memory=True)``
records and sums them in time order; the highest running sum is the peak above the
bytes allocated when the step started. On CUDA the caching allocator keeps the figure itself, so
``torch.cuda.max_memory_allocated`` deltas are used instead (no profiler).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

__all__ = ["AllocationEvent", "allocation_events", "allocator_peak", "peak_of"]


@dataclass(frozen=True)
class AllocationEvent:
    """One allocator event: ``nbytes`` > 0 is an allocation, < 0 a free."""

    time_ns: int
    nbytes: int
    device_type: str


def _walk_allocations(roots: Iterable[object]) -> list[AllocationEvent]:
    """Collect the allocation events of a profiler event tree (depth first)."""
    found: list[AllocationEvent] = []
    stack = list(roots)
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            found.append(
                AllocationEvent(event.start_time_ns, fields.alloc_size, fields.device.type)
            )
        stack.extend(event.children)
    return found


def allocation_events(step_fn: Callable[[], object]) -> list[AllocationEvent]:
    """Run ``step_fn()`` under the profiler; its allocator events, in time order."""
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, profile_memory=True) as prof:
        step_fn()
    events = _walk_allocations(prof.profiler.kineto_results.experimental_event_tree())
    events.sort(key=lambda e: e.time_ns)  # stable: ties keep the recorded order
    return events


def peak_of(events: Iterable[AllocationEvent], device_type: str = "cpu") -> int:
    """Highest running sum of ``events`` on ``device_type`` (bytes above the start, >= 0)."""
    running = peak = 0
    for event in events:
        if event.device_type == device_type:
            running += event.nbytes
            peak = max(peak, running)
    return peak


def _cuda_peak(step_fn: Callable[[], object]) -> int:
    """``max_memory_allocated`` delta over ``step_fn()`` on the current CUDA device."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    step_fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def allocator_peak(step_fn: Callable[[], object], device_type: str = "cpu") -> int:
    """Peak bytes the allocator hands out while ``step_fn()`` runs, above its start.

    Args:
        step_fn: the code to measure (e.g. one forward and backward pass).
        device_type: ``"cpu"`` (default): sum the profiler's allocation/free events
            for CPU memory in time order. ``"cuda"``: the caching allocator's
            ``max_memory_allocated`` delta.

    Bytes that were allocated before the call and freed during it lower the
    running sum, so the figure is the step's own peak above what it started with.
    """
    if device_type == "cuda":
        return _cuda_peak(step_fn)
    return peak_of(allocation_events(step_fn), device_type)

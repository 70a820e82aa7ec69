"""An allocator-level memory instrument: what the allocator hands out during a step.

remat's own meter (:class:`remat.measurement.meter.MemoryMeter`) counts live tensor storages
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

**Frees the profiler does not record.** The CPU profiler records a thread's events only
while that thread carries the profiling state: a collective's work on gloo's threads
does while it runs, but a tensor whose last reference the work drops afterwards (FSDP's
all-gather output, its reduce-scatter input) is freed there unrecorded, in some steps and
not in others, as the threads race. Summed as recorded, such a block would count as
live to the end of the region, and one step's peak would vary by several such blocks
from run to run (on two gloo ranks, 0.2 to 0.65 MB on a 4-block GPT of 0.85 MB of
parameters). Where a dispatch-level meter runs beside the timeline, it saw the storage
die, on whichever thread: the block is freed then (:mod:`remat.measurement.deaths`).
A collective's own buffer, which no meter counts (gloo's clone of a reduce-scatter's
input), is freed when its work ended (:mod:`remat.measurement.collective_buffers`).
Otherwise a block cannot be handed out again before it is freed, so an allocation at an
address still live by the record frees the earlier block first
(:func:`unrecorded_frees_closed`): the latest time it can have gone. (Profiling every
thread, ``_ExperimentalConfig(profile_all_threads=True)`` in torch 2.13, records the
other threads' ops but no memory event on any thread: tried, no help.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, record_function

from remat.measurement.collective_buffers import Release, collective_releases
from remat.measurement.deaths import Death, recording
from remat.measurement.torch_profiler import memory_profile

__all__ = [
    "AllocationEvent",
    "AllocatorRegions",
    "AllocatorTimeline",
    "allocation_events",
    "allocator_peak",
    "peak_of",
    "unrecorded_frees_closed",
]


@dataclass(frozen=True)
class AllocationEvent:
    """One allocator event: ``nbytes`` > 0 is an allocation, < 0 a free; ``ptr`` its
    address (0: unknown)."""

    time_ns: int
    nbytes: int
    device_type: str
    ptr: int = 0


def unrecorded_frees_closed(events: Iterable[AllocationEvent],
                            deaths: Iterable[Death] = (),
                            released: Iterable[Release] = ()) -> list[AllocationEvent]:
    """``events`` (in time order) with a free added for each block no recorded free
    released (see the module docstring): at its storage's death where the meter saw it
    (``deaths``: :mod:`remat.measurement.deaths`), else when its collective's work ended
    where it was a collective's own buffer (``released``:
    :mod:`remat.measurement.collective_buffers`), else before the next allocation at its
    address. No block counts twice, and none outlives the reuse of its address."""
    # Deaths sort after an event of the same time: a recorded free goes first. The events
    # are sorted; deaths are noted nearly in order (two threads may interleave), so they
    # are sorted, then merged.
    stream = heapq.merge(((e.time_ns, 0, e) for e in events),
                         sorted(((d.time_ns, 1, d) for d in deaths), key=lambda item: item[0]),
                         key=lambda item: item[:2])
    live: dict[tuple[str, int], tuple[int, int]] = {}  # -> (bytes, allocated at)
    died: set[tuple[str, int]] = set()  # closed at a death: their late recorded free goes
    bound: dict[tuple[str, int, int], int] = {}  # closed at its address's reuse -> index
    out: list[AllocationEvent] = []
    for time_ns, kind, item in stream:
        key = (item.device_type, item.ptr)
        if kind == 1:
            block = live.get(key)
            # Only the block the dead storage was counted in: one allocated since (after
            # a recorded free) is another storage's.
            if block is not None and block[1] <= item.born_ns:
                del live[key]
                out.append(AllocationEvent(time_ns, -block[0], item.device_type, item.ptr))
                died.add(key)
            continue
        event = item
        if event.ptr and event.nbytes > 0:
            earlier = live.pop(key, None)
            if earlier is not None:
                bound[(*key, earlier[1])] = len(out)
                out.append(AllocationEvent(event.time_ns, -earlier[0], event.device_type,
                                           event.ptr))
            died.discard(key)
            live[key] = (event.nbytes, event.time_ns)
        elif event.ptr and event.nbytes < 0:
            if live.pop(key, None) is None and key in died:
                died.discard(key)
                continue  # already closed at its death, a moment before
        out.append(event)
    return _released_earlier(out, bound, live, released)


def _released_earlier(out: list[AllocationEvent], bound: dict[tuple[str, int, int], int],
                      live: dict[tuple[str, int], tuple[int, int]],
                      released: Iterable[Release]) -> list[AllocationEvent]:
    """``out`` with each block that only the bound closed (at the reuse of its address,
    ``bound``: its close's index; or never, still ``live``) closed instead when its
    collective's work released it, where that was earlier."""
    when = {("cpu", r.ptr, r.allocated_ns): r.time_ns for r in released}
    if not when:
        return out
    for block, index in bound.items():
        time_ns = when.get(block)
        if time_ns is not None and time_ns < out[index].time_ns:
            out[index] = dataclasses.replace(out[index], time_ns=time_ns)
    for (device_type, ptr), (nbytes, allocated_ns) in live.items():
        time_ns = when.get((device_type, ptr, allocated_ns))
        if time_ns is not None:
            out.append(AllocationEvent(time_ns, -nbytes, device_type, ptr))
    out.sort(key=lambda e: e.time_ns)  # stable: ties keep their order
    return out


def _walk_allocations(roots: Iterable[object]) -> list[AllocationEvent]:
    """Collect the allocation events of a profiler event tree (depth first)."""
    found: list[AllocationEvent] = []
    stack = list(roots)
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            found.append(
                AllocationEvent(event.start_time_ns, fields.alloc_size, fields.device.type,
                                int(fields.ptr or 0))
            )
        stack.extend(event.children)
    return found


def allocation_events(step_fn: Callable[[], object]) -> list[AllocationEvent]:
    """Run ``step_fn()`` under the profiler; its allocator events, in time order."""
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with memory_profile(activities) as prof, recording() as deaths:
        step_fn()
    roots = list(prof.profiler.kineto_results.experimental_event_tree())
    events = _walk_allocations(roots)
    events.sort(key=lambda e: e.time_ns)  # stable: ties keep the recorded order
    return unrecorded_frees_closed(events, deaths, collective_releases(roots))


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


_MARK = "remat.measurement.allocator.mark."


@dataclass
class AllocatorTimeline:
    """The allocator's view of a region, cut at marks: live bytes at each mark and the
    highest live bytes between two marks, relative to the region's start.

    It sees what a dispatch-level meter cannot: kernels' scratch buffers (oneDNN and
    cuDNN workspaces, a loss kernel's temporaries) and tensors made outside the
    dispatcher. On CUDA each :meth:`mark` reads the caching allocator's counters and
    resets its peak; on CPU the region runs under ``torch.profiler`` with memory
    profiling, each mark is a ``record_function`` event, and the figures are read from
    the event stream when the region ends. Only one ``torch.profiler`` may run at a
    time, so CPU timelines do not nest.
    """

    device_type: str = "cpu"
    live: list[int] = field(default_factory=list)  # at each mark, above the start
    peak: list[int] = field(default_factory=list)  # since the previous mark (or the start)
    _prof: Any = None
    _deaths: list[Death] = field(default_factory=list)  # what a meter saw freed meanwhile
    _stack: contextlib.ExitStack | None = None
    _cuda_start: int = 0

    def __enter__(self) -> AllocatorTimeline:
        if self.device_type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._cuda_start = torch.cuda.memory_allocated()
        else:
            self._stack = contextlib.ExitStack()
            self._prof = self._stack.enter_context(memory_profile())
            self._deaths = self._stack.enter_context(recording())
        return self

    def mark(self) -> int:
        """Record a mark; returns its index (the order of :meth:`mark` calls)."""
        index = len(self.live)
        if self.device_type == "cuda":
            torch.cuda.synchronize()
            self.live.append(torch.cuda.memory_allocated() - self._cuda_start)
            self.peak.append(torch.cuda.max_memory_allocated() - self._cuda_start)
            torch.cuda.reset_peak_memory_stats()
        else:
            with record_function(f"{_MARK}{index}"):
                pass
            self.live.append(0)
            self.peak.append(0)
        return index

    def __exit__(self, *exc: object) -> None:
        if self._stack is None:
            return
        self._stack.close()
        self._read_cpu_events()

    def _read_cpu_events(self) -> None:
        roots = list(self._prof.profiler.kineto_results.experimental_event_tree())
        allocations = [e for e in _walk_allocations(roots) if e.device_type == "cpu"]
        allocations.sort(key=lambda e: e.time_ns)
        # (time, 0 = allocation / 1 = mark, value), allocations in their recorded order
        stream = [(e.time_ns, 0, e.nbytes)
                  for e in unrecorded_frees_closed(allocations, self._deaths,
                                                   collective_releases(roots))]
        stack = roots
        while stack:
            event = stack.pop()
            if event.tag != _EventType.Allocation and event.name.startswith(_MARK):
                stream.append((event.start_time_ns, 1, int(event.name[len(_MARK):])))
            stack.extend(event.children)
        running = peak = 0
        for _, kind, value in sorted(stream, key=lambda item: item[:2]):
            if kind == 0:
                running += value
                peak = max(peak, running)
            elif value < len(self.live):
                self.live[value], self.peak[value] = running, peak
                peak = running

    def rise(self, start: int, end: int) -> int:
        """Highest live bytes after mark ``start`` up to mark ``end``, above mark ``start``."""
        return max([self.live[start]] + self.peak[start + 1 : end + 1]) - self.live[start]


class AllocatorRegions:
    """An :class:`AllocatorTimeline` that can be ended and begun again: on CPU the view is
    read only when its region ends, so a measurement that decides on what it has seen so
    far (verification's next forward: :func:`remat.measurement.step._step_then_forward`)
    ends one region and, where it goes on, begins another. Figures are above the first
    region's start: the peak over the regions, each region's rise counted above the live
    bytes the one before ended with, less what was freed between them
    (``freed_between``, as the dispatch meter counted it: the same storages)."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.peak_bytes = 0
        self._base = 0  # live bytes above the first start where the current region began
        self._timeline: AllocatorTimeline | None = None

    @property
    def active(self) -> bool:
        return self._timeline is not None

    def __enter__(self) -> AllocatorRegions:
        self.resume()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timeline is not None:
            self.stop()

    def resume(self, *, freed_between: int = 0) -> None:
        """A new region, from where the last one ended less ``freed_between``."""
        self._base -= freed_between
        self._timeline = AllocatorTimeline(self.device_type).__enter__()
        self._timeline.mark()

    def mark(self) -> int:
        assert self._timeline is not None
        return self._timeline.mark()

    def stop(self) -> tuple[AllocatorTimeline, int]:
        """End the region; its timeline (read) and its last mark."""
        timeline, self._timeline = self._timeline, None
        assert timeline is not None
        end = timeline.mark()
        timeline.__exit__(None, None, None)
        self.peak_bytes = max(self.peak_bytes, self._base + timeline.rise(0, end))
        self._base += timeline.live[end]
        return timeline, end

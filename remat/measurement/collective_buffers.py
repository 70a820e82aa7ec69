"""When a collective's own buffers were released, for the allocator's view on CPU.

gloo makes buffers of its own for some collectives, below the dispatcher: its
``reduce_scatter_tensor`` clones the whole input on the caller's thread (inside the
``c10d::_reduce_scatter_base_`` call) and all-reduces the clone on a worker thread; its
``all_gather_into_tensor`` stages the output on the worker. The work holds them, and
whichever of the caller and the worker drops the work last frees them. When it is the
worker, it does so outside the profiler's state and the free goes unrecorded. No
dispatch-level meter counted these blocks, so :mod:`remat.measurement.deaths` cannot
close them either, and :func:`remat.measurement.allocator.unrecorded_frees_closed` kept
them live until their address was handed out again or the region ended. On two gloo
ranks of an FSDP2 Llama-style model under bf16 mixed precision, that was one unit's
float32 gradient clone (2.99 MiB) or the root's (4.0 MiB) live at the step's peak in
some runs and not others: the allocator's view of one plan varied by 13% from run to run
while its live tensors varied by 0.2%.

:func:`collective_releases` says when such a block went: when its work ended, the
worker's ``gloo:*`` event, matched to the call that enqueued it (the calls and the works
in the order they started: gloo's workers take the work in the order it was queued).
:func:`~remat.measurement.allocator.unrecorded_frees_closed` uses it only for a block no
recorded free and no meter closed: where the caller held the work longer, its free was
recorded and stands. The worker releases the work right after that event, before it
takes the next, so the close **errs low by those moments**: an allocation the caller
makes in them is counted without the buffer. A block whose call matches no work
(another backend, a work that started before the region) keeps the bound. The price:
one more walk of the profiler's event tree, when the region ends.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch._C._profiler import _EventType

__all__ = ["Release", "collective_releases"]


@dataclass(frozen=True)
class Release:
    """A collective's buffer at CPU address ``ptr``, allocated at ``allocated_ns``, was
    released by ``time_ns`` (profiler clock)."""

    ptr: int
    allocated_ns: int
    time_ns: int

_CALL = "c10d::"  # a collective's op on the caller's thread (c10d's dispatcher ops)
_WORK = "gloo:"  # the work on gloo's worker thread (its record_function)


def collective_releases(roots: Iterable[Any]) -> list[Release]:
    """When every CPU block allocated inside a collective's call or work, as the
    profiler's event tree (``roots``) shows them, was released: at the end of the gloo
    work that held it."""
    calls: list[Any] = []  # outermost collective calls, each with its allocations
    works: list[Any] = []
    allocated: dict[int, list[Any]] = {}  # id(call or work) -> its CPU allocations
    stack: list[tuple[Any, Any]] = [(root, None) for root in roots]
    while stack:
        event, owner = stack.pop()
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            if owner is not None and fields.alloc_size > 0 and fields.device.type == "cpu":
                allocated.setdefault(id(owner), []).append(event)
            continue
        if owner is None and event.name.startswith(_CALL):
            calls.append(event)
            owner = event
        elif event.name.startswith(_WORK):
            works.append(event)
            owner = event
        stack.extend((child, owner) for child in event.children)
    calls.sort(key=lambda e: e.start_time_ns)
    works.sort(key=lambda e: e.start_time_ns)
    held_by = {id(work): work for work in works}  # a work's own buffers end with it
    for call, work in _matched(calls, works):
        held_by[id(call)] = work
    releases = []
    for owner_id, events in allocated.items():
        work = held_by.get(owner_id)
        if work is None:
            continue
        for event in events:
            fields = event.extra_fields
            if fields.ptr and work.end_time_ns > event.start_time_ns:
                releases.append(Release(int(fields.ptr), event.start_time_ns,
                                        work.end_time_ns))
    return releases


def _matched(calls: list[Any], works: list[Any]) -> list[tuple[Any, Any]]:
    """Each call (in order) with the first work not yet matched that started after it:
    the work it enqueued. A call with no such work is left out."""
    starts = [work.start_time_ns for work in works]
    pairs, taken = [], 0
    for call in calls:
        index = max(taken, bisect.bisect_left(starts, call.start_time_ns))
        if index >= len(works):
            break
        pairs.append((call, works[index]))
        taken = index + 1
    return pairs

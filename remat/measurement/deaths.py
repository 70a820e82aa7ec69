"""When the storages a meter counts were freed, for the allocator's view on CPU.

The CPU profiler records an allocator event only on a thread that carries its state. A
tensor whose last reference goes on another thread (gloo's workers drop FSDP's
all-gather outputs and reduce-scatter inputs there, after the collective) is freed
unrecorded, and :func:`remat.measurement.allocator.unrecorded_frees_closed` can only
close such a block at the latest moment it can have gone: when its address is handed
out again, or the region's end. That bound swung one plan's peak by whole units from
run to run on gloo ranks (5% to 18%).

The dispatch-level meter (:class:`~remat.measurement.meter.MemoryMeter`) sees those
frees: its weak reference to a storage dies with the storage's last reference, on
whichever thread drops it. While an allocator timeline is read (:func:`recording`), the
meter notes each death here with its address and the wall clock; the profiler's event
times are on the same clock (unix nanoseconds), so the block is closed when it went.
Blocks the meter never counted (a collective's own buffers, made below the dispatcher)
keep the bound. The price, while a CPU timeline runs: one ``time.time_ns()`` per storage the meter
counts and a note per storage freed; nothing otherwise.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Death", "note_death", "now_if_recording", "recording"]


@dataclass(frozen=True)
class Death:
    """A storage the meter counted was freed: its device type and address, when the
    meter counted it at that address (``born_ns``) and when it was freed (``time_ns``).

    ``born_ns`` tells this storage's block from a later one at the same address: a free
    the profiler did record can be followed by a new block there before the death's note
    (the weak reference dies a moment after the memory goes back), and that note must
    not close the new block.
    """

    device_type: str
    ptr: int
    born_ns: int
    time_ns: int


_logs: list[list[Death]] = []  # one per active recording, innermost last


@contextlib.contextmanager
def recording() -> Iterator[list[Death]]:
    """Note every counted storage's death while the block runs; yields the list.

    On every thread, this one included: on FSDP2 ranks the profiler also missed frees
    on the recording thread (two gloo ranks, one rank's unplanned step: 4 runs the same
    with this thread's deaths, spread 8% with only the other threads')."""
    log: list[Death] = []
    _logs.append(log)
    try:
        yield log
    finally:
        _logs.remove(log)


def now_if_recording() -> int:
    """The wall clock in ns while a recording runs, else 0 (a meter's ``born_ns``)."""
    return time.time_ns() if _logs else 0


def note_death(device_type: str, ptr: int, born_ns: int) -> None:
    """Called by a meter when a storage it counted is freed (on any thread)."""
    if _logs and ptr and born_ns:
        death = Death(device_type, ptr, born_ns, time.time_ns())
        for log in _logs:
            log.append(death)

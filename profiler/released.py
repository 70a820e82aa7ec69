"""Pass 1 of :mod:`.profile` (capture and replays).

A backward's live bytes as they would be with each parameter gradient freed as soon as it
is complete, read off a plain backward's timeline.

In a loop that steps the optimizer in backward (``Loop(optimizer_in_backward=True)``) a
parameter's gradient is freed right after its ``.grad`` receives it (its step runs
then), instead of living to the end of the step. The replays run a plain backward, whose
:class:`~remat.profiler.timeline.TimelineMeter` records every storage's birth and death;
moving the gradients' deaths to the moments they were complete gives that loop's curve
from the same run, so one replay serves both loops. The curve is the dispatch-level
view (the allocator's, which also sees kernels' scratch, has no per-storage record).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from remat.profiler.timeline import TimelineMeter

__all__ = ["ReleasedCurve", "released_curve"]


@dataclass(frozen=True)
class ReleasedCurve:
    """Live bytes between two ticks with the gradients freed early (region-relative).

    Attributes:
        start_bytes: live at the first tick.
        peak_bytes: the highest live figure from the first tick to the last.
        ready_bytes: per key, live at the tick its gradient was complete (the gradient
            itself still alive: its step runs then).
    """

    start_bytes: int
    peak_bytes: int
    ready_bytes: Mapping[Hashable, int]


def released_curve(
    meter: TimelineMeter,
    start: int,
    end: int,
    ready: Mapping[Hashable, tuple[int | None, int]],
) -> ReleasedCurve:
    """The curve from tick ``start`` to tick ``end`` with each ``ready`` gradient freed just
    after its tick.

    Args:
        meter: the meter whose records cover the ticks (after its region has ended).
        start, end: the window, in the meter's clock ticks.
        ready: per key, ``(record of the gradient's storage, tick it was complete)``; a
            ``None`` record (storage not made in the region) is not freed.
    """
    early = {rec: tick + 1 for rec, tick in ready.values() if rec is not None}
    base = 0
    deltas: dict[int, int] = {}
    for index, record in enumerate(meter.records):
        died = record.died
        if index in early:
            died = early[index] if died is None else min(died, early[index])
        if record.born > end or (died is not None and died <= start):
            continue
        if record.born <= start:
            base += record.nbytes
        else:
            deltas[record.born] = deltas.get(record.born, 0) + record.nbytes
        if died is not None and died <= end:
            deltas[died] = deltas.get(died, 0) - record.nbytes
    ticks = sorted(deltas)
    lives = []
    live = peak = base
    for tick in ticks:
        live += deltas[tick]
        lives.append(live)
        peak = max(peak, live)

    def at(tick: int) -> int:
        k = bisect.bisect_right(ticks, tick)
        return lives[k - 1] if k else base

    return ReleasedCurve(base, peak, {key: at(tick) for key, (_, tick) in ready.items()})

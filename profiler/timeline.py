"""A tool of passes 1 and 3 of :mod:`.profile`.

A memory meter that also remembers when each storage was born and when it died.

:class:`MemoryMeter` gives live and peak bytes at marks. Attributing bytes to the
code that *holds* them needs more: which storages a phase allocated and whether
they are still alive when the forward pass ends. :class:`TimelineMeter` keeps one
record per storage (bytes, allocation tick, free tick) on a logical clock that
advances at every allocation and free; each mark records the clock too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from remat.measurement.allocator import AllocatorTimeline
from remat.measurement.meter import MemoryMeter, MeterMark

__all__ = ["StorageRecord", "TimelineMeter"]


@dataclass
class StorageRecord:
    """One storage allocated in the region: ``nbytes``, alive on ticks ``[born, died)``."""

    nbytes: int
    born: int
    died: int | None = None

    def alive_at(self, tick: int) -> bool:
        return self.born <= tick and (self.died is None or self.died > tick)


class TimelineMeter(MemoryMeter):
    """:class:`MemoryMeter` plus a per-storage birth/death record.

    ``record_of(t)`` names the record of a live tensor's storage (``None`` when the
    storage was not allocated in the region: parameters, the batch...), and
    ``ticks[label]`` the clock at each mark, so figures like "bytes allocated
    before mark A that are alive at mark B" can be computed after the fact.

    With ``allocator=True`` the allocator's view is recorded at the same marks
    (:class:`~remat.measurement.allocator.AllocatorTimeline`), and :meth:`rise` takes the higher
    of the two views of a transient peak: the allocator also sees kernels' scratch
    buffers, the storages the dispatch level sees tell who holds what.
    """

    def __init__(self, *, device_type: str | None = None, allocator: bool = False) -> None:
        super().__init__(device_type=device_type)
        self.allocator = AllocatorTimeline(device_type or "cpu") if allocator else None
        self.clock = 0
        self.records: list[StorageRecord] = []
        self._live_record: dict[int, int] = {}  # id(storage) -> index into records
        self.ticks: dict[str, int] = {}
        self.readings: dict[str, MeterMark] = {}

    # -- bookkeeping hooks into MemoryMeter -----------------------------------------
    def _track(self, t: torch.Tensor, *, aliased: bool) -> None:
        key = id(t.untyped_storage()) if t.layout == torch.strided else None
        known = key in self._sizes
        super()._track(t, aliased=aliased)
        if key is not None and not known and key in self._sizes:
            with self._lock:
                self.clock += 1
                self._live_record[key] = len(self.records)
                self.records.append(StorageRecord(self._sizes[key], self.clock))

    def _release(self, key: int) -> None:
        super()._release(key)
        with self._lock:
            index = self._live_record.pop(key, None)
            if index is not None:
                self.clock += 1
                self.records[index].died = self.clock

    def __enter__(self) -> TimelineMeter:
        if self.allocator is not None:
            self.allocator.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self.allocator is not None:
            self.allocator.__exit__(*exc)

    def mark(self, label: str = "") -> MeterMark:
        """As :meth:`MemoryMeter.mark`; also remembers the clock and the reading by label."""
        if self.allocator is not None:
            self.allocator.mark()
        reading = super().mark(label)
        self.ticks[label] = self.clock
        self.readings[label] = reading
        return reading

    # -- queries ----------------------------------------------------------------
    def record_of(self, t: torch.Tensor | None) -> int | None:
        """Index of the record of ``t``'s storage, if it was allocated in the region and lives."""
        if t is None or t.layout != torch.strided:
            return None
        return self._live_record.get(id(t.untyped_storage()))

    def alive_bytes(
        self,
        at: int,
        *,
        born_after: int = -1,
        born_until: int | None = None,
        exclude: Iterable[int | None] = (),
    ) -> int:
        """Bytes of records born in ``(born_after, born_until]`` and alive at tick ``at``."""
        skip = {i for i in exclude if i is not None}
        until = at if born_until is None else born_until
        return sum(
            r.nbytes
            for i, r in enumerate(self.records)
            if born_after < r.born <= until and r.alive_at(at) and i not in skip
        )

    def dying_bytes(self, at: int, by: int, *, exclude: Iterable[int | None] = ()) -> int:
        """Bytes of records alive at tick ``at`` that die at or before tick ``by``."""
        skip = {i for i in exclude if i is not None}
        return sum(
            r.nbytes
            for i, r in enumerate(self.records)
            if r.alive_at(at) and r.died is not None and r.died <= by and i not in skip
        )

    @property
    def overall_peak_bytes(self) -> int:
        """The region's peak above its start: the higher of the two views."""
        peak = self.peak_bytes
        if self.allocator is not None and self.allocator.peak:
            peak = max(peak, *self.allocator.peak)
        return peak

    def deferred_rise(self, start: int, end: int, *, defer: Iterable[int | None]) -> int:
        """Highest dispatch-level live bytes after tick ``start`` up to tick ``end``, above
        those at ``start``, with the records in ``defer`` kept alive past ``end``: storages
        that die in the window here but that a model of the step counts as held
        through it (a unit's input that its option saves)."""
        keep = {i for i in defer if i is not None}
        deltas: dict[int, int] = {}
        for i, r in enumerate(self.records):
            if start < r.born <= end:
                deltas[r.born] = deltas.get(r.born, 0) + r.nbytes
            if r.died is not None and start < r.died <= end and i not in keep:
                deltas[r.died] = deltas.get(r.died, 0) - r.nbytes
        live = peak = 0
        for tick in sorted(deltas):
            live += deltas[tick]
            peak = max(peak, live)
        return peak

    def hidden_held(self, start: int, end: int) -> int:
        """Bytes the allocator saw made between marks ``start`` and ``end`` (by index) and
        still alive at ``end`` that the dispatch level did not: tensors made outside the
        dispatcher, such as the wrapped Python numbers an op saves for backward (0 without
        the allocator's view, and before the region ends)."""
        if self.allocator is None or not self.allocator.live:
            return 0
        hidden = [a - m.live_bytes for a, m in zip(self.allocator.live, self.marks)]
        return max(hidden[end] - hidden[start], 0)

    def rise(self, start: int, end: int) -> int:
        """Highest live bytes after mark ``start`` up to mark ``end``, above the live bytes
        at ``start`` (marks by index): the higher of the dispatch-level and, once the
        region has ended, the allocator's view."""
        rise = self.peak_between(start, end) - self.marks[start].live_bytes
        if self.allocator is not None:
            rise = max(rise, self.allocator.rise(start, end))
        return rise

    def peak_between(self, start: str | int, end: str | int) -> int:
        """Highest live bytes after mark ``start`` up to mark ``end`` (marks in between count).

        Marks are named by label or by their index in :attr:`marks`.
        """
        labels = [m.label for m in self.marks]
        i = start if isinstance(start, int) else labels.index(start)
        j = end if isinstance(end, int) else labels.index(end)
        return max([self.marks[i].live_bytes] + [m.peak_bytes for m in self.marks[i + 1 : j + 1]])

"""A CPU run that behaves like a device of ``capacity_bytes``: it runs out of memory.

remat's promise is that a budget holds from the first byte: planning a model that does
not fit must itself fit. Tests (and users without a GPU at hand) check it on the CPU
with :class:`SimulatedDevice`, a dispatch mode that counts the live bytes of the tensor
storages allocated inside it, on top of the bytes resident when it was entered (the
model, the batch, an optimizer's state: given by the caller, or
:func:`~remat.measurement.storage.resident_bytes`), and raises
``torch.OutOfMemoryError`` when an allocation takes the total above the capacity, as a
CUDA device would. The tensor just made is dropped, so its memory goes back.

What it counts is the dispatch-level view (:class:`~remat.measurement.meter.MemoryMeter`):
kernels' internal scratch buffers are not seen, and storages freed inside that existed
before it was entered are not subtracted (an over-count, never an under-count). Copies
remat keeps off the device (:func:`~remat.measurement.host.host_copies`) are not counted.
Its ``peak_bytes`` is the highest total it saw: what a device needed, everything
included. On CUDA, ``torch.cuda.set_per_process_memory_fraction`` is the real thing.
"""

from __future__ import annotations

import torch

from remat.core.bytesize import format_bytes
from remat.measurement.host import making_host_copies
from remat.measurement.meter import MemoryMeter
from remat.measurement.storage import local_shard, storage_nbytes

__all__ = ["SimulatedDevice"]


class SimulatedDevice(MemoryMeter):
    """A device of ``capacity_bytes`` with ``resident_bytes`` already in use (see the
    module docstring). ``capacity_bytes=None`` never runs out: it only measures.

    Example::

        with SimulatedDevice(budget, resident_bytes=resident_bytes(model, batch=x, ...)) as dev:
            plan = remat.solve(model, x, memory_budget=budget)
        print(dev.peak_bytes / budget)
    """

    def __init__(self, capacity_bytes: int | None, *, resident_bytes: int = 0,
                 device_type: str = "cpu") -> None:
        super().__init__(device_type=device_type)
        self.capacity_bytes = capacity_bytes
        self.resident_bytes = resident_bytes
        self.out_of_memory = 0  # how many allocations it refused

    @property
    def used_bytes(self) -> int:
        """Resident plus live bytes now."""
        return self.resident_bytes + self.live_bytes

    @property
    def peak_bytes(self) -> int:  # type: ignore[override]
        """The highest resident plus live bytes seen."""
        return self.resident_bytes + super().peak_bytes

    def _track(self, t: torch.Tensor, *, aliased: bool) -> None:
        if making_host_copies():
            return
        t = local_shard(t)  # a DTensor by what this rank holds (MemoryMeter._track)
        capacity = self.capacity_bytes
        if capacity is not None and not aliased and t.layout == torch.strided \
                and t.device.type != "meta" and self._counts(t):
            wanted = storage_nbytes(t)
            if id(t.untyped_storage()) not in self._sizes and self.used_bytes + wanted > capacity:
                self.out_of_memory += 1
                # Not counted: the caller drops the tensor as the error unwinds.
                raise torch.OutOfMemoryError(
                    f"simulated device out of memory: tried to allocate {format_bytes(wanted)} "
                    f"with {format_bytes(self.used_bytes)} of {format_bytes(capacity)} in use")
        super()._track(t, aliased=aliased)

    def _resizing(self, storage: torch.UntypedStorage, before: int, after: int) -> None:
        """Refuse an in-place growth (FSDP gathering a unit's parameters again into their
        freed storage) that takes the total above the capacity, before it happens."""
        if making_host_copies() or self.capacity_bytes is None or after <= before \
                or not self._counts_device(storage.device):
            return
        counted = self._sizes.get(id(storage))
        if counted is None and before != 0:
            return  # memory from before the region: not counted (MemoryMeter)
        grows = after - (counted if counted is not None else 0)
        if self.used_bytes + grows > self.capacity_bytes:
            self.out_of_memory += 1
            raise torch.OutOfMemoryError(
                f"simulated device out of memory: tried to allocate {format_bytes(grows)} "
                f"with {format_bytes(self.used_bytes)} of {format_bytes(self.capacity_bytes)} "
                "in use")

    def _counts(self, t: torch.Tensor) -> bool:
        return self.device_type is None or t.device.type == self.device_type

"""Measure one real optimizer step of a trainer's own loop, from its callbacks.

Trainers call back at the start and the end of an optimizer step, so the meter is
entered in one callback and left in another. It reads both of remat's views (the
dispatch-level :class:`~remat.measurement.meter.MemoryMeter` and the allocator's
:class:`~remat.measurement.allocator.AllocatorTimeline`) and adds what was resident when the
step started (parameters, buffers, gradients, optimizer state), so its figure
compares with a plan's predicted and verified peaks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.measurement.allocator import AllocatorTimeline
from remat.measurement.meter import MemoryMeter
from remat.measurement.runner import model_device
from remat.measurement.storage import resident_bytes

__all__ = ["StepMeter", "TrainerStepPeak", "unwrap_optimizer"]

log = logging.getLogger("remat")


@dataclass(frozen=True)
class TrainerStepPeak:
    """A trainer's step, measured: ``peak_bytes`` is the higher of the two views."""

    peak_bytes: int
    meter_peak_bytes: int
    allocator_peak_bytes: int
    resident_bytes: int


class StepMeter:
    """``start()`` at a step's beginning, ``stop()`` at its end; one step at a time.

    ``count_grads=False``: the trainer's step frees the gradients alive at its start
    before its forward pass (``zero_grad(set_to_none=True)`` inside the step, as
    Lightning's automatic optimization does), so they are not part of its peak.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *,
                 count_grads: bool = True) -> None:
        self.model = model
        self.optimizer = optimizer
        self.count_grads = count_grads
        self._meter: MemoryMeter | None = None
        self._timeline: AllocatorTimeline | None = None
        self._resident = 0

    @property
    def running(self) -> bool:
        return self._meter is not None

    def start(self) -> None:
        device = model_device(self.model).type
        self._resident = resident_bytes(self.model, self.optimizer, grads=self.count_grads)
        self._timeline = AllocatorTimeline(device)
        self._timeline.__enter__()
        self._timeline.mark()
        self._meter = MemoryMeter(device_type=device)
        self._meter.__enter__()

    def stop(self) -> TrainerStepPeak | None:
        """The step's peak; ``None`` when :meth:`start` was not called."""
        if self._meter is None or self._timeline is None:
            return None
        meter, timeline = self._meter, self._timeline
        self._meter = self._timeline = None
        # Leave in the reverse order of entering: the meter is the innermost mode.
        meter.__exit__(None, None, None)
        timeline.mark()
        timeline.__exit__(None, None, None)
        alloc = timeline.rise(0, 1)
        peak = TrainerStepPeak(
            peak_bytes=self._resident + max(meter.peak_bytes, alloc),
            meter_peak_bytes=self._resident + meter.peak_bytes,
            allocator_peak_bytes=self._resident + alloc,
            resident_bytes=self._resident,
        )
        log.debug("remat: trainer step measured: %s", peak)
        return peak

    def abandon(self) -> None:
        """Leave the instruments without a reading (training ended mid-step)."""
        self.stop()


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The ``torch.optim.Optimizer`` inside a trainer's wrapper (accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``), or ``None``."""
    seen = 0
    while optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None or seen > 4:
            return None
        optimizer, seen = inner, seen + 1
    return optimizer

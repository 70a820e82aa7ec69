"""Wall-clock timing of device work: ``perf_counter`` on CPU, CUDA events on GPU.

Timing never runs under the memory meter or profiling hooks: both add Python
work to every op and would inflate the figures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

__all__ = ["Stopwatch", "median"]

T = TypeVar("T")


def median(values: Sequence[float]) -> float:
    """Median of ``values`` (0.0 for an empty sequence)."""
    return float(statistics.median(values)) if values else 0.0


class Stopwatch:
    """Times callables on one device, in milliseconds.

    On CUDA it records events around the work and synchronises on the end
    event, so the figure is the device time of the queued kernels, not the
    (asynchronous) launch time.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        """Wait for queued device work (a no-op on CPU)."""
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], T]) -> tuple[T, float]:
        """Run ``fn`` and return its result and its duration in milliseconds."""
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            return result, float(start.elapsed_time(end))
        t0 = time.perf_counter()
        result = fn()
        return result, (time.perf_counter() - t0) * 1000.0

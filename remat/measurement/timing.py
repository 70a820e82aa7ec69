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

__all__ = ["Stopwatch", "median", "parts_settled", "settled"]

T = TypeVar("T")


def median(values: Sequence[float]) -> float:
    """Median of ``values`` (0.0 for an empty sequence)."""
    return float(statistics.median(values)) if values else 0.0


def settled(samples: Sequence[float], *, repeats: int, tolerance: float, scale: float) -> bool:
    """Whether ``samples`` already pin the median of ``repeats`` samples to within ``tolerance``.

    Any ``repeats // 2 + 1`` samples bracket the median of all ``repeats``: at
    most ``repeats - (repeats // 2 + 1)`` of the others can fall below their
    minimum (or above their maximum), too few to move the median outside. So
    once that many are taken and their spread is at most ``tolerance * scale``,
    their own median is within that of the median the remaining runs would give,
    and the remaining runs can be skipped. ``tolerance=0`` never stops early
    (unless the samples are identical).
    """
    if len(samples) >= repeats:
        return True
    if len(samples) < repeats // 2 + 1:
        return False
    return max(samples) - min(samples) <= tolerance * scale


def parts_settled(totals: Sequence[float], *parts: Sequence[float], repeats: int,
                  tolerance: float, scale: float | None = None) -> bool:
    """A total and its parts (forward, backward...) all :func:`settled`, each to within
    ``tolerance`` times the smallest total (so a small part is judged against the whole),
    or times ``scale`` where given (a figure that is part of a larger whole: the code
    outside the units, judged against the step it is part of)."""
    if not totals:
        return False
    scale = min(totals) if scale is None else scale
    return all(settled(v, repeats=repeats, tolerance=tolerance, scale=scale)
               for v in (totals, *parts))


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

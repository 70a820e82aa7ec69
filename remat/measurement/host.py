"""Copies remat keeps off the device: the snapshot that leaves a model as it was.

Profiling and verification run real training steps, so they snapshot what a step
changes (parameters, when an optimizer steps them; the optimizer's state) and put it
back afterwards. Those copies belong in host memory: on a GPU whose memory is the
budget, a second copy of the weights or of Adam's state on the device would be the
out-of-memory error remat is there to prevent. On CUDA they go to the CPU; on CPU, where
host and device are one memory, :func:`host_copies` marks them, so that a simulated
device (:class:`~remat.measurement.simulated_device.SimulatedDevice`) does not count them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["host_copies", "making_host_copies"]

_state = threading.local()


@contextlib.contextmanager
def host_copies() -> Iterator[None]:
    """Tensors made inside the block are host-memory copies (see the module docstring)."""
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield
    finally:
        _state.depth = depth


def making_host_copies() -> bool:
    """Whether this thread is inside :func:`host_copies`."""
    return getattr(_state, "depth", 0) > 0

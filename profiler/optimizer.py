"""The optimizer's figures: the bytes of its state and the peak of its step.

Measured on the loop's real steps: the profile counts the state as fixed bytes and the
step's peak as the last event of a training step.
"""

from __future__ import annotations

from remat.measurement.meter import MemoryMeter
from remat.measurement.runner import Carry, StepRunner
from remat.measurement.state import clear_grads
from remat.measurement.storage import optimizer_state_bytes

__all__ = ["optimizer_figures"]


def optimizer_figures(runner: StepRunner) -> tuple[int, int]:
    """``(state bytes, step peak bytes)`` of the runner's optimizer.

    Two optimizer steps of the loop. The first creates the optimizer's state (unless it
    has some already) and the second is steady; each ``optimizer.step()`` is metered,
    its peak taken above the bytes alive when it starts. The first step's start has no
    state yet, so its peak counts against a steady start as ``first - state``: the
    figure is the larger of that and the steady step's.
    """
    params = runner.params
    peaks = []
    for _ in range(2):
        clear_grads(params)
        carry = Carry()
        for _ in range(runner.loop.accumulation_steps):
            runner.micro_batch(carry)
        del carry
        with MemoryMeter(device_type=runner.device_type) as meter:
            runner.optimizer_step()
        peaks.append(meter.peak_bytes)
    clear_grads(params)
    state = optimizer_state_bytes(runner.optimizer)
    return state, max(peaks[1], peaks[0] - state)

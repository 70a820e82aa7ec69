"""Measuring real training steps: the instruments, the runner of the user's loop, and
the one measured step.

The dispatch-level meter (:mod:`.meter`) and the allocator's view (:mod:`.allocator`),
timing (:mod:`.timing`), the snapshot that leaves a model as it was (:mod:`.state`),
the runner of a :class:`~remat.core.loop.Loop` (:mod:`.runner`), bytes of storages
(:mod:`.storage`), and :func:`~remat.measurement.step.measure_step`, which
``remat.measure``,
verification, the compiled search and FSDP use (the trainer callbacks measure the
trainer's own step with the same instruments: :mod:`.step_meter`). A simulated device
(:mod:`.simulated_device`) makes a CPU run run out of memory as a device of a given size
would; copies remat keeps off the device are marked by :mod:`.host`.
"""

from importlib import import_module

# The names this package offers outside it (benchmarks, notebooks, users' scripts): each
# from the module that defines it, imported on first use (no import cycles, no cost).
# tests/test_architecture.py holds benchmarks, examples and notebooks to these faces.
_NAMES = {
    "SimulatedDevice": "remat.measurement.simulated_device",
    "resident_bytes": "remat.measurement.storage",
    "Stopwatch": "remat.measurement.timing",
    "clear_grads": "remat.measurement.state",
    "model_device": "remat.measurement.runner",
    "call_model": "remat.measurement.runner",
    "compute_loss": "remat.measurement.runner",
    "forward_loss": "remat.measurement.runner",
    "measure_step": "remat.measurement.step",
    "StepMeasurement": "remat.measurement.step",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str):  # noqa: ANN202 - PEP 562 lazy attributes
    if name in _NAMES:
        return getattr(import_module(_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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

from remat.core.faces import lazy_names

# The names this package offers outside it (benchmarks, notebooks, users' scripts), by
# the module that defines them: loaded on first use (remat.core.faces).
__all__, __getattr__ = lazy_names(__name__, {
    "simulated_device": ("SimulatedDevice",),
    "storage": ("resident_bytes",),
    "timing": ("Stopwatch",),
    "op_count": ("OpCounter",),
    "state": ("clear_grads",),
    "runner": ("call_model", "compute_loss", "forward_loss", "model_device"),
    "step": ("StepMeasurement", "measure_step"),
})

"""Measuring real training steps: the instruments, the runner of the user's loop, and
the one measured step.

The dispatch-level meter (:mod:`.meter`) and the allocator's view (:mod:`.allocator`),
timing (:mod:`.timing`), the snapshot that leaves a model as it was (:mod:`.state`),
the runner of a :class:`~remat.core.loop.Loop` (:mod:`.runner`), bytes of storages
(:mod:`.storage`), and :func:`~remat.measurement.step.measure_step`, which the profiler,
verification, the compiled search, FSDP and the trainer callbacks (:mod:`.step_meter`)
all use.
"""

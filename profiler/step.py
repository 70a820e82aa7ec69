"""Measuring whole training steps: the step's time, the optimizer's figures, and
``measure_step`` (``remat.measure``): the real peak and time of a step as the model is.

The step is the user's loop (:class:`~remat.solver.loop.Loop`), run by
:class:`~remat.profiler.loop.StepRunner`::

    out = model(**batch)            # under torch.autocast when the loop says so
    loss = loss_fn(out, batch)      # or out.loss
    loss.backward()                 # through a GradScaler when the loop has one
    ...                             # (accumulation_steps micro-batches)
    optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.allocator import allocator_peak
from remat.errors import ProfileError
from remat.meter import MemoryMeter
from remat.profiler.loop import Carry, LossFn, StepRunner, call_model, compute_loss
from remat.profiler.state import ModelState, clear_grads, training_session
from remat.profiler.timing import Stopwatch, median, parts_settled
from remat.solver.loop import Loop
from remat.validate import check_profile_args

__all__ = [
    "LossFn",
    "StepMeasurement",
    "StepTimes",
    "call_model",
    "compute_loss",
    "fixed_bytes",
    "forward_loss",
    "batch_bytes",
    "grad_bytes",
    "measure_step",
    "model_device",
    "optimizer_figures",
    "optimizer_state_bytes",
    "tensor_storage_bytes",
    "time_steps",
]

log = logging.getLogger("remat")


def forward_loss(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """Run the forward pass and return the loss; the output itself is not kept."""
    return compute_loss(call_model(model, batch), batch, loss_fn)


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); CPU for an empty model."""
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def tensor_storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (an iterable of tensors)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            st = t.untyped_storage()
            seen[st.data_ptr() or id(st)] = st.nbytes()
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the distinct tensors held in ``optimizer.state``."""
    if optimizer is None:
        return 0
    return tensor_storage_bytes(
        v for state in optimizer.state.values() for v in state.values()
    )


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the gradients alive now (``.grad`` that is not ``None``)."""
    return tensor_storage_bytes(p.grad for p in model.parameters() if p.grad is not None)


def batch_bytes(batch: Any, device: torch.device) -> int:
    """Bytes of the distinct storages of ``batch``'s tensors on ``device`` (a tensor, or
    tensors in tuples, lists and dicts): made before the step, alive through it."""
    from torch.utils._pytree import tree_flatten

    return tensor_storage_bytes(t for t in tree_flatten(batch)[0]
                                if isinstance(t, torch.Tensor) and t.device.type == device.type)


def fixed_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Parameters + buffers + optimizer state: the bytes alive for the whole step."""
    return (
        tensor_storage_bytes(model.parameters())
        + tensor_storage_bytes(model.buffers())
        + optimizer_state_bytes(optimizer)
    )


@dataclass(frozen=True)
class StepMeasurement:
    """A measured training step (one optimizer step of the loop).

    Attributes:
        peak_bytes: peak bytes of the step, ``fixed_bytes`` included, by the
            dispatch-level meter (live tensor storages).
        held_after_forward_bytes: bytes alive after the last micro-batch's forward
            (loss included), above the bytes alive when the step started.
        fixed_bytes: parameters + buffers + optimizer state and the batch, plus the
            gradients alive when the step starts (accumulation, ``set_to_none=False``).
        allocator_peak_bytes: the same peak as the allocator saw it (it also sees
            kernel scratch buffers and tensors made outside the dispatcher, such as
            checkpoint's RNG state): on CUDA ``torch.cuda.max_memory_allocated``, on
            CPU the allocation events of ``torch.profiler``. ``None`` when not measured.
        reserved_peak_bytes: on CUDA, ``torch.cuda.max_memory_reserved`` while the
            allocator instrument ran: what the caching allocator took from the device
            (fragmentation included). ``None`` off CUDA.
        cuda_peak_bytes: ``max_memory_allocated`` during the metered step minus
            ``memory_allocated`` at its start; ``None`` off CUDA.
        time_ms: median wall time of one optimizer step over ``repeats`` runs.
    """

    peak_bytes: int
    held_after_forward_bytes: int
    fixed_bytes: int
    cuda_peak_bytes: int | None
    time_ms: float
    allocator_peak_bytes: int | None = None
    reserved_peak_bytes: int | None = None

    @property
    def activation_peak_bytes(self) -> int:
        """The peak above the fixed bytes."""
        return self.peak_bytes - self.fixed_bytes

    @property
    def worst_peak_bytes(self) -> int:
        """The larger of the two instruments' peaks: what a budget must hold."""
        return max(self.peak_bytes, self.allocator_peak_bytes or 0)


@dataclass(frozen=True)
class StepTimes:
    """Median times of plain training steps, in milliseconds (no meter, no hooks).

    ``forward_ms`` and ``backward_ms`` are one micro-batch's; ``step_ms`` is one
    optimizer step of the loop: every micro-batch and the optimizer step.
    """

    step_ms: float
    forward_ms: float
    backward_ms: float


def time_steps(
    runner: StepRunner,
    state: ModelState,
    watch: Stopwatch,
    *,
    warmup: int,
    repeats: int,
    tolerance: float = 0.0,
) -> StepTimes:
    """Time ``warmup + repeats`` micro-batches and optimizer steps; medians of the last ``repeats``.

    Each round runs one micro-batch (forward, backward) and the optimizer step with
    gradients cleared first; one optimizer step of the loop is then
    ``accumulation_steps`` micro-batches and one optimizer step. The timed rounds
    stop early once the samples pin each median to within ``tolerance`` times the
    step time (:func:`~remat.profiler.timing.parts_settled`).

    RNG state and buffers are reset before each, so every round sees the same dropout
    masks and BatchNorm statistics.
    """
    total, fwd, bwd, opt = [], [], [], []
    for r in range(warmup + repeats):
        state.rng.restore()
        state.restore_buffers()
        clear_grads(state.params)
        (_, loss), f_ms = watch.time(runner.forward)
        _, b_ms = watch.time(lambda loss=loss: runner.backward(loss))
        del loss
        _, o_ms = watch.time(runner.optimizer_step) if runner.optimizer is not None else (None, 0.)
        if r >= warmup:
            total.append(f_ms + b_ms + o_ms)
            fwd.append(f_ms)
            bwd.append(b_ms)
            opt.append(o_ms)
            if parts_settled(total, fwd, bwd, repeats=repeats, tolerance=tolerance):
                break
    clear_grads(state.params)
    steps = runner.loop.accumulation_steps
    f_ms, b_ms = median(fwd), median(bwd)
    return StepTimes(steps * (f_ms + b_ms) + median(opt), f_ms, b_ms)


def optimizer_figures(runner: StepRunner, params: list[nn.Parameter], device_type: str
                      ) -> tuple[int, int]:
    """``(state bytes, step peak bytes)`` of the runner's optimizer.

    Two optimizer steps of the loop. The first creates the optimizer's state (unless it
    has some already) and the second is steady; each ``optimizer.step()`` is metered,
    its peak taken above the bytes alive when it starts. The first step's start has no
    state yet, so its peak counts against a steady start as ``first - state``: the
    figure is the larger of that and the steady step's.
    """
    peaks = []
    for _ in range(2):
        clear_grads(params)
        carry = Carry()
        for _ in range(runner.loop.accumulation_steps):
            runner.micro_batch(carry)
        del carry
        with MemoryMeter(device_type=device_type) as meter:
            runner.optimizer_step()
        peaks.append(meter.peak_bytes)
    clear_grads(params)
    state = optimizer_state_bytes(runner.optimizer)
    return state, max(peaks[1], peaks[0] - state)


def _cycles(runner: StepRunner, carry: Carry, cycles: int, state: ModelState) -> None:
    """``cycles`` optimizer steps of the loop, each from the same RNG state and buffers."""
    for _ in range(cycles):
        runner.optimizer_step_cycle(carry)
        state.rng.restore()
        state.restore_buffers()


def measure_step(
    model: nn.Module,
    sample_batch: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    loop: Loop | None = None,
    warmup: int = 1,
    repeats: int = 3,
    allocator: bool = True,
) -> StepMeasurement:
    """Measure one real training step of ``model`` as it is (with or without a plan applied).

    The step is one optimizer step of ``loop`` (default :class:`~remat.solver.loop.Loop`:
    a plain loop that keeps the output): its micro-batches, the optimizer step and the
    loop's ``zero_grad``. The warm-up steps come first (they create the optimizer's
    state, and what the loop's variables carry into the next step); then two steps run
    under the dispatch-level meter, so the second sees what the first carried into it,
    and, with ``allocator``, two more under the allocator instrument
    (:mod:`remat.allocator`). The time is the median of ``repeats`` un-metered steps.
    Parameters, buffers, gradients, RNG state, train/eval modes and the optimizer
    state are restored afterwards, also when the step raises.

    Args:
        model: the module to train.
        sample_batch: one micro-batch: a Tensor (``model(x)``), a tuple/list
            (``model(*batch)``) or a dict (``model(**batch)``).
        loss_fn: ``loss_fn(output, batch) -> scalar``; by default the output's ``.loss``.
        optimizer: include ``optimizer.step()`` in the step.
        loop: the training loop; default ``Loop()``.
        warmup, repeats: un-timed and timed steps for ``time_ms``.
        allocator: also measure the allocator's view (on CPU it replays the step under
            ``torch.profiler``, which is slower).

    Raises:
        LossNotFoundError: no ``loss_fn`` and the output has no ``.loss``.
    """
    check_profile_args(model, sample_batch, loss_fn=loss_fn, optimizer=optimizer, loop=loop,
                       where="measure()")
    if repeats < 1 or warmup < 0:
        raise ProfileError(f"need repeats >= 1 and warmup >= 0, got {repeats=} {warmup=}")
    loop = loop if loop is not None else Loop()
    device = model_device(model)
    watch = Stopwatch(device)
    with training_session(model, optimizer) as state:
        runner = StepRunner(model, sample_batch, loss_fn, optimizer, loop, device.type)
        _cycles(runner, Carry(), max(warmup, 1), state)
        watch.sync()
        # Alive across the whole step: the fixed bytes and the gradients zero_grad keeps.
        # Each instrument then runs two steps from an empty carry, so that everything the
        # second step sees (what the first carries into it) was made inside the region:
        # a dispatch meter counts only such storages, and the CPU profiler reports no
        # frees of blocks allocated before it started.
        fixed = (fixed_bytes(model, optimizer) + grad_bytes(model)
                 + batch_bytes(sample_batch, device))
        with MemoryMeter(device_type=device.type) as meter:
            _cycles(runner, Carry(), 2, state)
            peak = meter.peak_bytes
        cuda_peak = meter.cuda_peak_bytes
        alloc_peak = reserved = None
        if allocator:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            alloc_peak = fixed + allocator_peak(lambda: _cycles(runner, Carry(), 2, state),
                                                device_type=device.type)
            if device.type == "cuda":
                reserved = torch.cuda.max_memory_reserved()
        with MemoryMeter(device_type=device.type) as meter:
            output, loss = runner.forward()
            if not loop.keep_output:
                del output
            held = meter.live_bytes
        del loss
        clear_grads(state.params)
        times = time_steps(runner, state, watch, warmup=0, repeats=repeats)
    result = StepMeasurement(
        peak_bytes=fixed + peak,
        held_after_forward_bytes=held,
        fixed_bytes=fixed,
        cuda_peak_bytes=cuda_peak,
        time_ms=times.step_ms,
        allocator_peak_bytes=alloc_peak,
        reserved_peak_bytes=reserved,
    )
    log.info("measured step (%s): peak %d B (allocator %s B, fixed %d B), %.2f ms",
             loop.describe(), result.peak_bytes, result.allocator_peak_bytes, fixed,
             result.time_ms)
    return result

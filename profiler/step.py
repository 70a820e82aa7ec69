"""One training step, and ``measure_step``: the real peak and time of a step as the model is.

The step is what a training loop does::

    loss = loss_fn(model(batch), batch)   # or model(**batch).loss
    loss.backward()
    optimizer.step()                      # only when an optimizer is given

Only the loss is kept through the backward pass (the output is dropped once the
loss is computed, as ``loss = criterion(model(x), y)`` does), so what is alive
after the forward pass is what autograd saved plus the loss.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.errors import LossNotFoundError, ProfileError
from remat.meter import MemoryMeter
from remat.profiler.state import ModelState, clear_grads, training_session
from remat.profiler.timing import Stopwatch, median, parts_settled

__all__ = [
    "LossFn",
    "StepMeasurement",
    "StepTimes",
    "call_model",
    "compute_loss",
    "fixed_bytes",
    "forward_loss",
    "measure_step",
    "model_device",
    "optimizer_figures",
    "optimizer_state_bytes",
    "tensor_storage_bytes",
    "time_steps",
]

log = logging.getLogger("remat")

LossFn = Callable[[Any, Any], torch.Tensor]

_LOSS_HELP = (
    "pass loss_fn=fn, where fn(output, batch) -> scalar Tensor computes the loss from the "
    "model's output and the sample batch"
)


def call_model(model: nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a dict, ``model(*batch)`` for a tuple/list, else ``model(batch)``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def compute_loss(output: Any, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """The scalar loss: ``loss_fn(output, batch)``, else the output's ``.loss`` / ``["loss"]``.

    Raises:
        LossNotFoundError: no ``loss_fn`` and the output carries no loss.
        ProfileError: the loss is not a scalar tensor that requires grad.
    """
    if loss_fn is not None:
        loss = loss_fn(output, batch)
    else:
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, Mapping):
            loss = output.get("loss")
        if loss is None:
            raise LossNotFoundError(
                f"cannot find the loss: the model returned {type(output).__name__}, which has "
                f"no non-None .loss attribute or 'loss' key; {_LOSS_HELP}"
            )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ProfileError(f"the loss must be a scalar tensor, got {shape}; {_LOSS_HELP}")
    if not loss.requires_grad:
        raise ProfileError(
            "the loss does not require grad: no trainable parameter contributes to it "
            "(are all parameters frozen, or is grad disabled?)"
        )
    return loss


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


def fixed_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Parameters + buffers + optimizer state: the bytes alive for the whole step."""
    return (
        tensor_storage_bytes(model.parameters())
        + tensor_storage_bytes(model.buffers())
        + optimizer_state_bytes(optimizer)
    )


@dataclass(frozen=True)
class StepMeasurement:
    """A measured training step.

    Attributes:
        peak_bytes: peak live bytes of the step, ``fixed_bytes`` included (dispatch-level
            meter: storages allocated during the step, plus the fixed bytes).
        held_after_forward_bytes: bytes alive when the forward pass (loss included) ends,
            above the fixed bytes.
        fixed_bytes: parameters + buffers + optimizer state, in bytes.
        cuda_peak_bytes: ``torch.cuda.max_memory_allocated()`` during the step minus
            ``memory_allocated()`` at its start (the allocator's view, which also sees
            kernel scratch buffers); ``None`` off CUDA.
        time_ms: median wall time of a step over ``repeats`` runs without the meter.
    """

    peak_bytes: int
    held_after_forward_bytes: int
    fixed_bytes: int
    cuda_peak_bytes: int | None
    time_ms: float

    @property
    def activation_peak_bytes(self) -> int:
        """The peak above the fixed bytes."""
        return self.peak_bytes - self.fixed_bytes


@dataclass(frozen=True)
class StepTimes:
    """Median times of plain training steps, in milliseconds (no meter, no hooks)."""

    step_ms: float  # forward + backward (+ optimizer step)
    forward_ms: float  # forward and loss
    backward_ms: float


def time_steps(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None,
    optimizer: torch.optim.Optimizer | None,
    state: ModelState,
    watch: Stopwatch,
    *,
    warmup: int,
    repeats: int,
    tolerance: float = 0.0,
) -> StepTimes:
    """Time ``warmup + repeats`` plain steps (grads cleared first); medians of the last ``repeats``.

    The timed steps stop early once the samples pin each median to within
    ``tolerance`` times the step time (:func:`~remat.profiler.timing.parts_settled`).

    RNG state and buffers are reset before each, so every step sees the same dropout
    masks and BatchNorm statistics.
    """
    total, fwd, bwd = [], [], []
    for r in range(warmup + repeats):
        state.rng.restore()
        state.restore_buffers()
        clear_grads(state.params)
        loss, f_ms = watch.time(lambda: forward_loss(model, batch, loss_fn))
        _, b_ms = watch.time(loss.backward)
        del loss
        o_ms = 0.0
        if optimizer is not None:
            _, o_ms = watch.time(optimizer.step)
        if r >= warmup:
            total.append(f_ms + b_ms + o_ms)
            fwd.append(f_ms)
            bwd.append(b_ms)
            if parts_settled(total, fwd, bwd, repeats=repeats, tolerance=tolerance):
                break
    clear_grads(state.params)
    return StepTimes(median(total), median(fwd), median(bwd))


def optimizer_figures(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None,
    optimizer: torch.optim.Optimizer,
    params: list[nn.Parameter],
    device_type: str,
) -> tuple[int, int]:
    """``(state bytes, step peak bytes)`` of ``optimizer`` in steady state.

    Two training steps: the first creates the state, the second's ``optimizer.step()``
    is metered (its peak above the bytes alive when it starts, gradients included).
    """
    peak = 0
    for k in range(2):
        clear_grads(params)
        forward_loss(model, batch, loss_fn).backward()
        if k == 0:
            optimizer.step()
        else:
            with MemoryMeter(device_type=device_type) as meter:
                optimizer.step()
            peak = meter.peak_bytes
    clear_grads(params)
    return optimizer_state_bytes(optimizer), peak


def _train_step(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None,
    optimizer: torch.optim.Optimizer | None,
    params: list[nn.Parameter],
    meter: MemoryMeter | None = None,
) -> int:
    """One step with grads cleared first; returns live meter bytes after forward (0 without)."""
    clear_grads(params)
    loss = forward_loss(model, batch, loss_fn)
    held = meter.mark("forward").live_bytes if meter is not None else 0
    loss.backward()
    del loss
    if optimizer is not None:
        optimizer.step()
    return held


def measure_step(
    model: nn.Module,
    sample_batch: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    warmup: int = 1,
    repeats: int = 3,
) -> StepMeasurement:
    """Measure one real training step of ``model`` as it is (with or without a plan applied).

    The model runs in train mode with gradients cleared (``set_to_none``). With an
    optimizer, the warm-up steps create its state first, so the measured step is a
    steady-state one. The peak comes from one step under the dispatch-level meter;
    the time is the median of ``repeats`` un-metered steps after ``warmup`` more.
    Parameters, buffers, gradients, RNG state, train/eval modes and the optimizer
    state are restored afterwards, also when the step raises.

    Args:
        model: the module to train.
        sample_batch: a Tensor (``model(x)``), a tuple/list (``model(*batch)``) or a
            dict (``model(**batch)``).
        loss_fn: ``loss_fn(output, batch) -> scalar``; by default the output's ``.loss``.
        optimizer: include ``optimizer.step()`` in the step.
        warmup, repeats: un-timed and timed steps for ``time_ms``.

    Raises:
        LossNotFoundError: no ``loss_fn`` and the output has no ``.loss``.
    """
    if repeats < 1 or warmup < 0:
        raise ProfileError(f"need repeats >= 1 and warmup >= 0, got {repeats=} {warmup=}")
    device = model_device(model)
    watch = Stopwatch(device)
    with training_session(model, optimizer) as state:
        params = state.params
        # Warm-up first: it creates the optimizer state, which is part of the
        # fixed bytes of every later step, not of the measured one.
        for _ in range(max(warmup, 1 if optimizer is not None else 0)):
            _train_step(model, sample_batch, loss_fn, optimizer, params)
            state.rng.restore()
            state.restore_buffers()
        clear_grads(params)
        watch.sync()
        fixed = fixed_bytes(model, optimizer)
        with MemoryMeter(device_type=device.type) as meter:
            held = _train_step(model, sample_batch, loss_fn, optimizer, params, meter)
            clear_grads(params)  # before the meter exits: the grads die inside it
        peak = meter.peak_bytes
        cuda_peak = meter.cuda_peak_bytes
        times = time_steps(model, sample_batch, loss_fn, optimizer, state, watch, warmup=0,
                           repeats=repeats)
    result = StepMeasurement(
        peak_bytes=fixed + peak,
        held_after_forward_bytes=held,
        fixed_bytes=fixed,
        cuda_peak_bytes=cuda_peak,
        time_ms=times.step_ms,
    )
    log.info("measured step: peak %d B (fixed %d B), %.2f ms", result.peak_bytes, fixed,
             result.time_ms)
    return result

"""The training step remat measures is the step the user runs: one runner for a :class:`Loop`.

:class:`StepRunner` runs the loop a :class:`~remat.core.loop.Loop` describes on
one model and batch, in pieces the profiler instruments (the forward under
autocast, the backward through a gradient scaler, the optimizer step) and whole
(:meth:`StepRunner.optimizer_step_cycle`: every micro-batch of one optimizer step,
with what the loop's variables keep alive from one iteration to the next). The
profiler, ``remat.measure`` and the compiled search all call it, so what is
profiled, predicted and measured is one loop.

With ``Loop(optimizer_in_backward=True)`` its backward steps each parameter as its
gradient is complete and frees the gradient (:mod:`.in_backward`: the hooks are
installed for that backward only), and its optimizer step is only ``zero_grad``. The
profiler's passes ask for a plain backward (``release=False``) and meter the steps
themselves, so that its figures serve both loops.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.core.errors import LoopError, LossNotFoundError, ProfileError
from remat.core.loop import Loop, loop_code
from remat.measurement.in_backward import ParamSteps, installed_on

__all__ = ["Carry", "LossFn", "StepRunner", "call_model", "compute_loss", "forward_loss",
           "model_device", "output_tensors"]

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


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); CPU for an empty model."""
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def forward_loss(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """Run the forward pass and return the loss; the output itself is not kept."""
    return compute_loss(call_model(model, batch), batch, loss_fn)


def compute_loss(output: Any, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """The scalar loss: ``loss_fn(output, batch)``, else the output's ``.loss`` / ``["loss"]``.

    Raises:
        LossNotFoundError: no ``loss_fn`` and the output carries no loss.
        ProfileError: the loss is not a real scalar tensor that requires grad.
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
    if loss.is_complex():
        raise ProfileError(
            f"the loss must be a real scalar tensor, got a {str(loss.dtype).removeprefix('torch.')}"
            " one (backward needs a real loss); return a real number from the loss, e.g. "
            "loss.abs() or loss.real"
        )
    if not loss.requires_grad:
        raise ProfileError(
            "the loss does not require grad: no trainable parameter contributes to it "
            "(are all parameters frozen, or is grad disabled?)"
        )
    return loss


def output_tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor in a model's output: a tensor, tuples, lists, dicts, dataclasses
    (Hugging Face ``ModelOutput`` is both a dict and a dataclass), depth first."""
    found: list[torch.Tensor] = []
    stack = [output]
    seen: set[int] = set()
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            found.append(value)
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, Mapping):
            stack.extend(reversed(list(value.values())))
        elif isinstance(value, (tuple, list)):
            stack.extend(reversed(value))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            stack.extend(reversed([getattr(value, f.name) for f in dataclasses.fields(value)]))
    return found


@dataclass
class Carry:
    """What the loop's own variables hold between iterations: the last output (when
    the loop keeps it) and the last loss. Alive during the next forward pass."""

    output: Any = None
    loss: torch.Tensor | None = None


class StepRunner:
    """Runs ``loop`` on ``model`` and ``batch``: one micro-batch at a time, or whole steps.

    Args:
        model, batch, loss_fn: the model, one micro-batch, and how to get its loss
            (``None``: the output's ``.loss``).
        optimizer: stepped after the last micro-batch (``None``: no optimizer step), or
            in backward, one parameter at a time (``loop.optimizer_in_backward``).
        loop: the training loop (:class:`~remat.core.loop.Loop`).
        device_type: the model's device type, for autocast and the gradient scaler.

    Raises:
        LoopError: the loop steps the optimizer in backward without an optimizer, or
            with trainable parameters it does not step; or the model's parameters are
            stepped in backward (``remat.optimizer_in_backward``) under a loop that says
            they are not.
        ArgumentError: an optimizer that cannot be stepped one parameter at a time.
    """

    def __init__(
        self,
        model: nn.Module,
        batch: Any,
        loss_fn: LossFn | None,
        optimizer: torch.optim.Optimizer | None,
        loop: Loop,
        device_type: str,
    ) -> None:
        self.model = model
        self.batch = batch
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.loop = loop
        self.device_type = device_type
        # Scale 1: the measured memory does not depend on the scale, and a large one
        # would overflow the first steps in float16 and skip the optimizer step
        # (whose state and peak are part of what is measured).
        self.scaler = (torch.amp.GradScaler(device_type, init_scale=1.0)
                       if loop.grad_scaler and optimizer is not None else None)
        self.params = [p for p in model.parameters()]
        # The per-parameter optimizers a loop that steps in backward runs.
        self.in_backward = self._param_steps() if loop.optimizer_in_backward else None
        if self.in_backward is None and installed_on(self.params):
            raise LoopError(
                "the model's parameters are stepped in backward (remat.optimizer_in_backward"
                f" installed its hooks), but loop={loop_code(loop)} steps the optimizer after"
                " backward; pass loop="
                f"{loop_code(loop, optimizer_in_backward=True)}, or remove the hooks "
                "(handle.remove())")

    def _param_steps(self) -> ParamSteps:
        """The loop's per-parameter optimizers (see :mod:`.in_backward`)."""
        if self.optimizer is None:
            raise LoopError(
                f"loop={loop_code(self.loop)} steps the optimizer in backward, and no "
                "optimizer was given: pass optimizer=, the optimizer you train with (the one "
                "remat.optimizer_in_backward(model, optimizer) splits)")
        steps = ParamSteps(self.optimizer)
        missed = [n for n, p in self.model.named_parameters()
                  if p.requires_grad and not steps.covers(p)]
        if missed:
            raise LoopError(
                f"loop={loop_code(self.loop)}: the trainable parameters {missed[:3]}"
                f"{'...' if len(missed) > 3 else ''} are not in the optimizer, so nothing "
                "would step or free their gradients in backward; add them to the optimizer, "
                "or set requires_grad=False on them")
        return steps

    # -- the pieces ---------------------------------------------------------------
    @contextlib.contextmanager
    def autocast(self, *, cache: bool = True) -> Iterator[None]:
        """``torch.autocast`` with the loop's dtype, or nothing. ``cache=False``: without
        autocast's cache of weight casts (the same values; a pass that must not hold every
        weight's cast until its forward ends)."""
        if self.loop.autocast is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=getattr(torch, self.loop.autocast),
                            cache_enabled=cache):
            yield

    def forward(self, *, autocast_cache: bool = True) -> tuple[Any, torch.Tensor]:
        """``(output, loss)`` of one micro-batch, under the loop's autocast."""
        with self.autocast(cache=autocast_cache):
            output = call_model(self.model, self.batch)
            loss = compute_loss(output, self.batch, self.loss_fn)
        return output, loss

    def backward(self, loss: torch.Tensor, *, release: bool = True) -> None:
        """``loss.backward()``, through the gradient scaler when the loop has one; with
        ``loop.optimizer_in_backward`` (and ``release``) each parameter is stepped as its
        gradient is complete, and the gradient freed. ``release=False``: a plain backward
        that leaves every gradient (the profiler's passes, which meter the steps apart)."""
        scaled = self.scaler.scale(loss) if self.scaler is not None else loss
        if release and self.in_backward is not None:
            with self.in_backward.hooked():
                scaled.backward()
        else:
            scaled.backward()

    def optimizer_step(self, *, whole: bool = False) -> None:
        """``optimizer.step()`` (through the scaler), then the loop's ``zero_grad``. A loop
        that steps in backward has stepped already: ``zero_grad`` only, unless ``whole``
        (the optimizer's whole step after a plain backward, which the profiler meters)."""
        if self.optimizer is not None and (whole or self.in_backward is None):
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        """As ``optimizer.zero_grad(set_to_none=loop.set_to_none)`` does, for every parameter."""
        for p in self.params:
            if p.grad is None:
                continue
            if self.loop.set_to_none:
                p.grad = None
            else:
                # As torch's zero_grad: a gradient that is a view (of a DDP bucket, with
                # gradient_as_bucket_view) cannot be detached in place, nor needs it.
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    # -- whole steps ----------------------------------------------------------------
    def micro_batch(self, carry: Carry, after_forward: Callable[[], None] | None = None
                    ) -> None:
        """Forward and backward of one micro-batch (``after_forward()`` called between).

        ``carry`` (the previous iteration's output and loss) stays referenced until
        the new output and loss exist, as a loop's variables do until they are
        reassigned; then it names them instead.
        """
        output, loss = self.forward()
        if after_forward is not None:
            after_forward()
        carry.output = output if self.loop.keep_output else None
        carry.loss = loss
        del output
        self.backward(loss)

    def optimizer_step_cycle(self, carry: Carry,
                             after_first_forward: Callable[[], None] | None = None) -> None:
        """Every micro-batch of one optimizer step, then the step and ``zero_grad``
        (``after_first_forward()`` called once the first micro-batch's forward ran)."""
        for k in range(self.loop.accumulation_steps):
            self.micro_batch(carry, after_first_forward if k == 0 else None)
        self.optimizer_step()

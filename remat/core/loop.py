"""The training loop a plan is made for: what it keeps alive, and when.

A plan's peak is the peak of the step the user really runs, and two loops over
the same model can differ by gigabytes: one keeps the logits alive through the
backward pass, another accumulates gradients over micro-batches, a third runs
under ``torch.autocast``. :class:`Loop` says which loop it is; the profiler runs
that loop when it measures, ``simulate()`` counts what it keeps alive, and
``remat.measure`` runs it again to check.

The default is a plain PyTorch loop::

    for batch in loader:
        optimizer.zero_grad()                 # set_to_none=True, torch's default
        out = model(**batch)                  # `out` lives until the next iteration
        loss = out.loss                       # (or loss_fn(out, batch))
        loss.backward()
        optimizer.step()

which keeps the output alive through the backward pass and into the next
iteration's forward (``keep_output=True``). Hugging Face's ``Trainer`` drops the
output once the loss is taken: :meth:`Loop.hf_trainer` builds its loop from its
``TrainingArguments``.

With ``optimizer_in_backward=True`` each parameter's optimizer step runs in the
backward pass, as soon as its gradient is complete, and the gradient is freed at
once (``remat.optimizer_in_backward`` sets it up)::

    handle = remat.optimizer_in_backward(model, optimizer)
    for batch in loader:
        loss = loss_fn(model(**batch), batch)
        loss.backward()                       # steps every parameter, frees its gradient
        # no optimizer.step(), no zero_grad()
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from remat.core.errors import LoopError

__all__ = ["AUTOCAST_DTYPES", "Loop", "loop_code", "loop_or_default"]

AUTOCAST_DTYPES = ("bfloat16", "float16")
_AUTOCAST_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16"}


@dataclass(frozen=True)
class Loop:
    """How the training loop around the model runs one optimizer step.

    Attributes:
        accumulation_steps: micro-batches whose gradients are summed before each
            ``optimizer.step()``. From the second on, every parameter's gradient is
            alive through the whole forward and backward pass.
        keep_output: the loop holds the model's output in a variable (``out =
            model(x)``; ``logits = model(x)``) through the backward pass and until
            the next iteration's forward returns. ``False``: the output is dropped
            once the loss is computed (``loss = loss_fn(model(x), y)``, Hugging
            Face's Trainer).
        set_to_none: ``zero_grad(set_to_none=True)`` (torch's default) frees the
            gradients between steps; ``False`` zeroes them in place, so they are
            alive through every step.
        autocast: ``None``, ``"bfloat16"`` or ``"float16"``: the forward pass and
            the loss run under ``torch.autocast`` with that dtype (the backward runs
            outside it, as ``torch.autocast``'s documentation prescribes).
        grad_scaler: the loss is scaled with ``torch.amp.GradScaler`` and the
            optimizer stepped through it (usual with float16).
        optimizer_in_backward: each parameter's optimizer step runs in the backward
            pass as soon as its gradient is complete, and the gradient is then freed
            (``Tensor.register_post_accumulate_grad_hook``; set up by
            ``remat.optimizer_in_backward``): no parameter gradient lives beyond the
            backward phase that made it, and there is no ``optimizer.step()`` after
            backward. It cannot hold with gradient accumulation (the step would run at
            every micro-batch), ``zero_grad(set_to_none=False)`` (nothing to zero),
            a gradient scaler (unscaling and the inf check need every gradient at once),
            or **gradient clipping over all parameters**
            (``clip_grad_norm_(model.parameters())`` needs every gradient at once:
            remat cannot see clipping in your loop, so leave it out or clip each
            gradient alone in its own hook). The first three are refused here.
    """

    accumulation_steps: int = 1
    keep_output: bool = True
    set_to_none: bool = True
    autocast: str | None = None
    grad_scaler: bool = False
    optimizer_in_backward: bool = False

    def __post_init__(self) -> None:
        steps = self.accumulation_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise LoopError(f"Loop(accumulation_steps={steps!r}): need an int >= 1")
        for name in ("keep_output", "set_to_none", "grad_scaler", "optimizer_in_backward"):
            if not isinstance(getattr(self, name), bool):
                raise LoopError(f"Loop({name}={getattr(self, name)!r}): need True or False")
        if self.autocast is not None:
            dtype = _AUTOCAST_ALIASES.get(str(self.autocast), str(self.autocast))
            dtype = dtype.removeprefix("torch.")
            if dtype not in AUTOCAST_DTYPES:
                raise LoopError(
                    f"Loop(autocast={self.autocast!r}): valid values are None, "
                    f"{', '.join(repr(d) for d in AUTOCAST_DTYPES)} (or 'bf16', 'fp16')"
                )
            object.__setattr__(self, "autocast", dtype)
        if self.optimizer_in_backward:
            self._check_in_backward()

    def _check_in_backward(self) -> None:
        """Refuse what cannot hold when each gradient is stepped and freed in backward."""
        why = None
        if self.accumulation_steps > 1:
            why = (f"accumulation_steps={self.accumulation_steps}: gradient accumulation sums "
                   "every micro-batch's gradient before one optimizer step, and a gradient "
                   "stepped and freed in backward is gone before the next micro-batch adds "
                   "to it; use accumulation_steps=1 (a larger micro-batch), or "
                   "optimizer_in_backward=False")
        elif not self.set_to_none:
            why = ("set_to_none=False: gradients are freed in backward, so none is left to "
                   "zero in place; use set_to_none=True (torch's default)")
        elif self.grad_scaler:
            why = ("grad_scaler=True: a GradScaler unscales every gradient and checks them "
                   "all for infs before one optimizer step, which a step per parameter in "
                   "backward cannot wait for; use bfloat16 autocast without a scaler, or "
                   "optimizer_in_backward=False")
        if why is not None:
            raise LoopError(f"Loop(optimizer_in_backward=True) with {why}")

    @property
    def grads_alive_at_start(self) -> bool:
        """Whether gradients from before are alive when a forward pass starts."""
        return self.accumulation_steps > 1 or not self.set_to_none

    def describe(self) -> str:
        """One line for logs and reports: ``'accumulate 4, keep output, bfloat16'``."""
        parts = [f"accumulate {self.accumulation_steps}" if self.accumulation_steps > 1
                 else "one micro-batch",
                 "keep output" if self.keep_output else "drop output"]
        if not self.set_to_none:
            parts.append("zero_grad(set_to_none=False)")
        if self.autocast:
            parts.append(f"autocast {self.autocast}" + (" + GradScaler" if self.grad_scaler
                                                         else ""))
        if self.optimizer_in_backward:
            parts.append("optimizer in backward")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Loop:
        if not isinstance(d, dict):
            raise LoopError(f"a loop is a JSON object, got {type(d).__name__}")
        unknown = set(d) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise LoopError(f"unknown loop fields {sorted(unknown)}; "
                            f"valid: {sorted(cls.__dataclass_fields__)}")
        return cls(**d)

    @classmethod
    def hf_trainer(cls, args: Any) -> Loop:
        """The loop of Hugging Face's ``Trainer`` for its ``TrainingArguments`` ``args``.

        The Trainer drops the model's output once the loss is taken, accumulates
        ``gradient_accumulation_steps`` micro-batches, zeroes gradients with
        ``set_to_none=True``, and runs under autocast with ``bf16`` / ``fp16`` (the
        latter with a gradient scaler).
        """
        steps = getattr(args, "gradient_accumulation_steps", 1) or 1
        bf16, fp16 = bool(getattr(args, "bf16", False)), bool(getattr(args, "fp16", False))
        autocast = "bfloat16" if bf16 else "float16" if fp16 else None
        if isinstance(steps, float) and math.isfinite(steps) and steps.is_integer():
            steps = int(steps)
        return cls(accumulation_steps=steps, keep_output=False, set_to_none=True,
                   autocast=autocast, grad_scaler=fp16)


def loop_or_default(loop: Loop | None) -> Loop:
    """``loop``, or the default :class:`Loop` (a plain loop that keeps the output) for
    ``None``: the one place the default is made, for every entry point that takes a loop."""
    return Loop() if loop is None else loop


def loop_code(loop: Loop, **changes: Any) -> str:
    """``loop`` with ``changes``, as the code that makes it, for messages:
    ``remat.Loop(accumulation_steps=N, keep_output=False)`` (the fields that differ from
    the default). A string given for a field other than ``autocast`` is written as it is,
    a placeholder for the user to fill in (``accumulation_steps="N"``)."""
    default = Loop()
    parts: dict[str, str] = {}
    for f in fields(Loop):
        value = changes.get(f.name, getattr(loop, f.name))
        if isinstance(value, str) and f.name != "autocast":
            parts[f.name] = value
        elif value != getattr(default, f.name):
            parts[f.name] = repr(value)
    return "remat.Loop(" + ", ".join(f"{k}={v}" for k, v in parts.items()) + ")"

"""Snapshot and restore everything a measured training step could change.

The profiler runs real forward/backward passes (and optimizer steps when given
an optimizer), so it must leave no trace: parameters, buffers (BatchNorm running
statistics), ``.grad`` (``None`` or the same tensor objects), ``requires_grad``
flags, train/eval mode of every module, the CPU and CUDA RNG states, and the
optimizer's state are put back exactly as they were.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["ModelState", "RngState", "clear_grads", "training_session"]

log = logging.getLogger("remat")


@dataclass
class RngState:
    """The CPU RNG state and, when CUDA is initialised, every CUDA device's RNG state."""

    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None

    @classmethod
    def capture(cls) -> RngState:
        cuda = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = torch.cuda.get_rng_state_all()
        return cls(torch.get_rng_state(), cuda)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def clear_grads(params: list[nn.Parameter]) -> None:
    """Set every ``.grad`` to ``None``, as ``optimizer.zero_grad(set_to_none=True)`` does."""
    for p in params:
        p.grad = None


@dataclass
class ModelState:
    """A restorable snapshot of a model (and optionally its optimizer).

    Parameter values are copied (to host memory) only when ``copy_params`` (an
    optimizer step will change them); forward and backward never write to parameters. Gradients are
    kept as the same tensor objects, so restoring them is exact and free.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    copy_params: bool = False
    params: list[nn.Parameter] = field(default_factory=list)
    _param_values: list[torch.Tensor] | None = None
    _grads: list[torch.Tensor | None] = field(default_factory=list)
    _requires_grad: list[bool] = field(default_factory=list)
    _buffers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _training: list[tuple[nn.Module, bool]] = field(default_factory=list)
    _rng: RngState | None = None
    _optimizer_state: dict[str, Any] | None = None

    @classmethod
    def capture(
        cls, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> ModelState:
        """Snapshot ``model`` (and ``optimizer``); params are copied when there is an optimizer."""
        s = cls(model, optimizer, copy_params=optimizer is not None)
        s.params = list(model.parameters())
        s._grads = [p.grad for p in s.params]
        s._requires_grad = [p.requires_grad for p in s.params]
        if s.copy_params:
            # On the host: profiling must not need a second copy of the weights on the device.
            s._param_values = [p.detach().to("cpu", copy=True) for p in s.params]
        s._buffers = [(b, b.detach().clone()) for b in model.buffers()]
        s._training = [(m, m.training) for m in model.modules()]
        s._rng = RngState.capture()
        if optimizer is not None:
            # The state_dict references the live state tensors: copy them now,
            # before a step updates them in place.
            s._optimizer_state = copy.deepcopy(optimizer.state_dict())
        return s

    @property
    def rng(self) -> RngState:
        assert self._rng is not None
        return self._rng

    def restore_buffers(self) -> None:
        """Put back every buffer's value (BatchNorm running stats, ``num_batches_tracked``)."""
        with torch.no_grad():
            for buf, value in self._buffers:
                buf.copy_(value)

    def restore_params(self) -> None:
        """Put back parameter values and the optimizer state (after optimizer steps)."""
        with torch.no_grad():
            if self._param_values is not None:
                for p, value in zip(self.params, self._param_values):
                    p.copy_(value)
        if self.optimizer is not None and self._optimizer_state is not None:
            # load_state_dict may keep references to the tensors it is given, so it
            # gets a fresh copy each time: the snapshot must survive later steps.
            self.optimizer.load_state_dict(copy.deepcopy(self._optimizer_state))

    def restore(self) -> None:
        """Put everything back as it was at :meth:`capture`."""
        self.restore_params()
        self.restore_buffers()
        for p, grad, flag in zip(self.params, self._grads, self._requires_grad):
            p.grad = grad
            if p.requires_grad != flag:
                p.requires_grad_(flag)
        for m, training in self._training:
            m.training = training
        self.rng.restore()
        log.debug("restored model state (%d params, %d buffers)", len(self.params),
                  len(self._buffers))


@contextlib.contextmanager
def training_session(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> Iterator[ModelState]:
    """Run measured training steps on ``model`` and leave no trace of them.

    On entry: snapshot the model (and optimizer), clear ``.grad``, switch to train
    mode and enable grad. On exit, also on error: put everything back
    (:meth:`ModelState.restore`). Yields the snapshot, whose ``rng`` and
    ``restore_buffers()`` reset the state between steps.
    """
    state = ModelState.capture(model, optimizer)
    try:
        clear_grads(state.params)
        model.train()
        with torch.enable_grad():
            yield state
    finally:
        state.restore()

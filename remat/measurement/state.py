"""Snapshot and restore everything a measured training step could change.

The profiler runs real forward/backward passes (and optimizer steps when given
an optimizer), so it must leave no trace: parameters, buffers (BatchNorm running
statistics), ``.grad`` (``None`` or the same tensor objects), ``requires_grad``
flags, train/eval mode of every module, the CPU and CUDA RNG states, Python's
``random`` and NumPy's global RNG states, and the optimizer's state are put back
exactly as they were.

A forward can also *rebind* state rather than write into it: ``self.ema = 0.9 *
self.ema + ...`` replaces the module's ``_buffers`` entry with a new tensor, and
``self.calls += 1`` rebinds a plain attribute. Every submodule's ``__dict__`` is
therefore snapshotted by identity (its attributes, its ``_parameters``, ``_buffers``
and ``_modules`` entries and its forward and backward hooks) and put back: attributes
and hooks the steps added are removed, rebound ones get their old objects back.
Objects changed *in place* other than parameters and buffers (a list attribute appended
to) are not copied, so they are not restored; nor are state-dict hooks (``_HOOK_DICTS``
says why).

Lazy modules (``nn.LazyLinear`` before its first forward) are refused: a measured
step would create their parameters, which the model would keep (and an optimizer
made before would not know), so the model could not be left as it was.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from remat.core.checks import check_not_lazy
from remat.measurement.host import host_copies
from remat.measurement.in_backward import suspended
from remat.measurement.recovery import ddp_wrappers, fsdp_roots, recover_ddp, recover_fsdp

__all__ = ["ModelState", "RngState", "check_not_lazy", "clear_grads", "training_session"]

log = logging.getLogger("remat")


@dataclass
class RngState:
    """torch's CPU RNG state and, when CUDA is initialised, every CUDA device's RNG
    state; Python's ``random`` and NumPy's global RNG states (a forward may draw from
    them: data-dependent augmentation, stochastic depth written with ``random``)."""

    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None
    python: Any = None
    numpy: Any = None

    @classmethod
    def capture(cls) -> RngState:
        cuda = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = torch.cuda.get_rng_state_all()
        # Host memory (CUDA's states are CPU tensors too): on a CPU run a simulated device
        # must not count remat's own copy (5,056 bytes) against the step it measures.
        with host_copies():
            cpu = torch.get_rng_state()
        return cls(cpu, cuda, random.getstate(), np.random.get_state())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        if self.python is not None:
            random.setstate(self.python)
        if self.numpy is not None:
            np.random.set_state(self.numpy)


_MISSING = object()
_ENTRY_DICTS = ("_parameters", "_buffers", "_modules")
# The hooks that run in a step, put back with the attributes: a library that installs
# them on its first call and marks that with an attribute (``transformers``' output
# capturing: ``_output_capturing_hooks_installed``) found its mark removed and its hooks
# left, installed them again on the next call, and captured each MoE router's logits
# three times (its load-balancing loss and gradients changed in the last bits; a loss
# that sums what it captured would have tripled its term). Found 2026-11-28. State-dict
# hooks are not put back: FSDP2 registers its own on its first forward and marks that
# in its own state, not the module's, so removing them would lose them for good.
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
               "_backward_pre_hooks")


@dataclass
class _ModuleDict:
    """One module's ``__dict__`` and its parameter/buffer/child entries, by identity."""

    module: nn.Module
    attrs: dict[str, Any]
    entries: dict[str, dict[str, Any]]  # "_parameters", "_buffers", "_modules" -> copy

    @classmethod
    def capture(cls, module: nn.Module) -> _ModuleDict:
        d = module.__dict__
        entries = {key: dict(d[key]) for key in _ENTRY_DICTS + _HOOK_DICTS
                   if isinstance(d.get(key), dict)}
        return cls(module, dict(d), entries)

    def restore_entries(self, keys: tuple[str, ...] = _ENTRY_DICTS + _HOOK_DICTS) -> None:
        d = self.module.__dict__
        for key in keys:
            saved = self.entries.get(key)
            live = d.get(key)
            if saved is None or not isinstance(live, dict):
                continue
            if live.keys() != saved.keys() or any(live[k] is not v for k, v in saved.items()):
                # In place: the dict object itself is shared with hooks and state_dict code.
                live.clear()
                live.update(saved)

    def restore(self) -> None:
        d = self.module.__dict__
        for key in [k for k in d if k not in self.attrs]:
            del d[key]
        for key, value in self.attrs.items():
            if d.get(key, _MISSING) is not value:
                d[key] = value
        self.restore_entries()


def clear_grads(params: list[nn.Parameter]) -> None:
    """Set every ``.grad`` to ``None``, as ``optimizer.zero_grad(set_to_none=True)`` does."""
    for p in params:
        p.grad = None


@dataclass(frozen=True)
class _HostTensor:
    """A state tensor's copy in host memory, and the device it came from."""

    tensor: torch.Tensor
    device: torch.device


@dataclass
class OptimizerSnapshot:
    """An optimizer's state and hyperparameters, its tensors copied to host memory
    (:mod:`remat.measurement.host`), put back in place.

    ``optimizer.load_state_dict`` would build every state tensor anew on the device
    before the old ones go: twice Adam's state at once, on the device remat plans for.
    :meth:`restore` copies into the live tensors instead, drops the state the steps
    created for parameters that had none, and rebuilds (on their parameter's device)
    only the tensors that are gone.
    """

    optimizer: torch.optim.Optimizer
    # id(param) -> its state; a tensor as (its copy on the host, the device it was on)
    state: dict[int, dict[str, Any]]
    groups: list[dict[str, Any]]  # the param groups' hyperparameters

    @classmethod
    def capture(cls, optimizer: torch.optim.Optimizer) -> OptimizerSnapshot:
        with host_copies():
            state = {id(p): {k: (_HostTensor(v.detach().to("cpu", copy=True), v.device)
                                 if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                             for k, v in s.items()}
                     for p, s in optimizer.state.items()}
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                  for g in optimizer.param_groups]
        return cls(optimizer, state, groups)

    def restore(self) -> None:
        opt = self.optimizer
        for group, saved in zip(opt.param_groups, self.groups):
            for key, value in saved.items():
                group[key] = copy.deepcopy(value)
        params = [p for g in opt.param_groups for p in g["params"]]
        with torch.no_grad():
            for p in params:
                saved = self.state.get(id(p))
                if saved is None:
                    opt.state.pop(p, None)
                    continue
                live = opt.state.setdefault(p, {})
                for key in [k for k in live if k not in saved]:
                    del live[key]
                for key, value in saved.items():
                    now = live.get(key)
                    if not isinstance(value, _HostTensor):
                        live[key] = copy.deepcopy(value)
                        continue
                    host, device = value.tensor, value.device
                    if (isinstance(now, torch.Tensor) and now.shape == host.shape
                            and now.dtype == host.dtype and now.device == device):
                        now.copy_(host)
                    else:
                        live[key] = host.to(device, copy=True)


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
    _dicts: list[_ModuleDict] = field(default_factory=list)
    _rng: RngState | None = None
    _optimizer_state: OptimizerSnapshot | None = None
    _sharded: list[nn.Module] = field(default_factory=list)  # FSDP2 modules sharded then
    _fsdp_roots: list[nn.Module] = field(default_factory=list)  # outermost FSDP2 modules
    _ddp: list[nn.Module] = field(default_factory=list)  # DDP wrappers of the model

    @classmethod
    def capture(
        cls, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> ModelState:
        """Snapshot ``model`` (and ``optimizer``); params are copied when there is an optimizer.

        Raises:
            ProfileError: the model has lazy modules that were never run
                (:func:`check_not_lazy`).
        """
        check_not_lazy(model)
        s = cls(model, optimizer, copy_params=optimizer is not None)
        s.params = list(model.parameters())
        s._grads = [p.grad for p in s.params]
        s._requires_grad = [p.requires_grad for p in s.params]
        if s.copy_params:
            # On the host: profiling must not need a second copy of the weights on the device.
            with host_copies():
                s._param_values = [p.detach().to("cpu", copy=True) for p in s.params]
        with host_copies():
            # On the host, as the parameters' copies: a second copy of a buffer (a causal
            # mask, a rotary table) on the device is memory no plan predicts.
            s._buffers = [(b, b.detach().clone() if b.is_meta else b.detach().to("cpu", copy=True))
                          for b in model.buffers()]
        s._training = [(m, m.training) for m in model.modules()]
        s._dicts = [_ModuleDict.capture(m) for m in model.modules()]
        s._sharded = _sharded_fsdp(model)
        s._fsdp_roots = fsdp_roots(model)
        s._ddp = ddp_wrappers(model)
        s._rng = RngState.capture()
        if optimizer is not None:
            # Copied now, before a step updates the live state tensors in place.
            s._optimizer_state = OptimizerSnapshot.capture(optimizer)
        return s

    @property
    def rng(self) -> RngState:
        assert self._rng is not None
        return self._rng

    def restore_buffers(self) -> None:
        """Put back every buffer: the tensor each module had (a forward that reassigns a
        buffer, ``self.ema = ...``, replaced it) and its value (BatchNorm running
        stats, ``num_batches_tracked``)."""
        for module_dict in self._dicts:
            module_dict.restore_entries(("_buffers",))
        with torch.no_grad():
            for buf, value in self._buffers:
                buf.copy_(value)

    def between_passes(self) -> None:
        """What every measured pass starts from: no gradient, the RNG state and the
        buffers as captured (the profiler's passes; ``outside``, ``outside_time`` and
        ``profile`` call it between theirs)."""
        self.recover_wrappers()
        clear_grads(self.params)
        self.rng.restore()
        self.restore_buffers()

    def recover_wrappers(self) -> None:
        """FSDP2's and DDP's per-iteration state put back where an error ended a step
        mid-way (:mod:`remat.measurement.recovery`); nothing to do after a step that
        completed, or off both. :meth:`between_passes` and :meth:`restore` call it; so
        does a pass that goes on after catching an error from a step of its own."""
        recover_fsdp(self._fsdp_roots)
        recover_ddp(self._ddp)

    def restore_param_values(self) -> None:
        """Put back the parameters' values (copied only with an optimizer: without one,
        nothing writes to them), not the optimizer's state."""
        with torch.no_grad():
            if self._param_values is not None:
                for p, value in zip(self.params, self._param_values):
                    p.copy_(value)

    def restore_params(self) -> None:
        """Put back parameter values and the optimizer state (after optimizer steps)."""
        self.restore_param_values()
        if self._optimizer_state is not None:
            self._optimizer_state.restore()

    def restore(self) -> None:
        """Put everything back as it was at :meth:`capture`."""
        self.recover_wrappers()
        _reshard_fsdp(self._sharded)
        # Module dicts first: they put back the original parameter and buffer objects,
        # whose values are restored next.
        for module_dict in self._dicts:
            module_dict.restore()
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


def _sharded_fsdp(model: nn.Module) -> list[nn.Module]:
    """``model``'s FSDP2 modules whose own parameters are registered sharded (DTensors)."""
    # Not imported: no module can be an FSDP2 one (and importing it costs ~1 s).
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if fsdp is None:
        return []
    from torch.distributed.tensor import DTensor

    def managed(module: nn.Module) -> Iterator[nn.Parameter]:
        """The parameters ``module``'s FSDP2 group manages: its own and its children's,
        but for children with groups of their own."""
        yield from module.parameters(recurse=False)
        for child in module.children():
            if not isinstance(child, fsdp):
                yield from managed(child)

    return [m for m in model.modules() if isinstance(m, fsdp)
            and any(isinstance(p, DTensor) for p in managed(m))]


def _reshard_fsdp(modules: list[nn.Module]) -> None:
    """Reshard FSDP2 ``modules`` (``FSDPModule.reshard``: a no-op where sharded), the ones
    registered sharded when the snapshot was taken, so that their module dicts, put back
    next, agree with FSDP2's state.

    Why: FSDP2 registers a module's unsharded parameters while they are gathered, and
    its root keeps them gathered from its forward to the end of its backward. A measured
    region that ends after a forward (the bytes held after it, the next step's forward)
    leaves the root gathered; putting its module dict back then registers the sharded
    parameters under a group that thinks itself unsharded, whose next forward gathers
    nothing and fails ("mixed torch.Tensor and DTensor"). Modules gathered at the
    snapshot are left as they are (their dicts hold the gathered parameters). The price:
    the root gathers again at its next forward, as after any backward."""
    for module in modules:
        module.reshard()


@contextlib.contextmanager
def training_session(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> Iterator[ModelState]:
    """Run measured training steps on ``model`` and leave no trace of them.

    On entry: snapshot the model (and optimizer), clear ``.grad``, switch to train
    mode and enable grad, and suspend the hooks that step its parameters in backward
    (``remat.optimizer_in_backward``: remat runs the loop it was told). On exit, also on
    error: put everything back (:meth:`ModelState.restore`), hooks active again. Yields
    the snapshot, whose ``rng`` and ``restore_buffers()`` reset the state between steps.
    """
    state = ModelState.capture(model, optimizer)
    try:
        clear_grads(state.params)
        model.train()
        with torch.enable_grad(), suspended(state.params):
            yield state
    finally:
        state.restore()

"""A head whose logits are computed only if something needs them: the model's own loss
over chunks, everything else as written.

Why not replace the model's ``forward`` with one that computes the loss over chunks
(what this replaced): the forward is the user's. A mixture-of-experts model adds its
router's load-balancing loss there, a subclass adds a z-loss, accelerate wraps it in
autocast, peft wraps the model around it; a replacement drops all of that, silently.
Here the forward runs as written, and only the head's output changes: the head
(:class:`DeferredHead`, installed on the head module) returns :class:`LazyLogits`, a
tensor of the logits' shape and dtype that holds no logits (four bytes, expanded) but
the hidden states they would be computed from. Then:

* the model's cross entropy on them (``F.cross_entropy(logits.view(-1, V), target)``,
  what ``transformers``' ``ForCausalLMLoss``, T5's and most models' losses come down to,
  after ``.float()`` and a reshape that keeps the rows) is computed over chunks of the
  tokens (:func:`remat.execute.linear_cross_entropy.linear_cross_entropy`): the whole
  logits never exist;
* anything else done with them (a soft-cap, a bias added, a loss with label smoothing,
  a caller reading ``output.logits``) computes the real logits first, from the hidden
  states, as the head would have: the values are always the model's, only the memory
  saving is lost. Such a forward is one whose head remat does not chunk: the profiler's
  check (:mod:`remat.profiler.head_check`) runs the forward both ways on one example and
  offers the chunked head only where the loss went through the chunked path and loss and
  gradients agree.

The price: the lazy tensor keeps the hidden states alive as long as the model's output
is (in a loop that drops the output, until the loss is taken); a forward under grad
whose loss is never backpropagated wasted the chunked gradients' products (see
:mod:`remat.execute.linear_cross_entropy`). Under ``torch.compile`` the head runs as
written (a tracing compiler sees a plain tensor).

Used by :mod:`remat.execute.head` (install and remove) and the profiler's check.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_map

from remat.core.errors import RematWarning
from remat.execute.linear_cross_entropy import chunked_cross_entropy

__all__ = ["DeferredHead", "HeadUse", "LazyLogits", "deferred_head", "remove_deferred_head",
           "watching_use"]

log = logging.getLogger("remat")

# Reading these computes nothing: metadata the fake data answers as the real would (the
# storage's: four bytes, which is what the lazy logits hold).
_METADATA = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "is_floating_point",
    "is_complex", "element_size", "get_device", "is_contiguous", "__len__", "stride",
    "data_ptr", "untyped_storage", "storage_offset", "__hash__",
})
# Attributes read through a descriptor (``Tensor.shape.__get__``) that are metadata too;
# any other (``.data``, ``.T``, ``.mT``) is the logits' values and computes them.
_METADATA_ATTRIBUTES = frozenset({
    "shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "grad", "ndim",
    "layout", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn",
    "names", "itemsize", "nbytes", "output_nr", "_version", "_base", "is_nested",
})
# Row-preserving reshapes: the result's rows are the hidden states' rows, reshaped alike.
_RESHAPES = frozenset({"view", "reshape", "flatten"})


@dataclass
class HeadUse:
    """What the logits of a deferred head were used for since :meth:`reset`.

    Attributes:
        fused: cross entropies computed over chunks (the whole logits never existed).
        materialized: why the real logits were computed, one entry per time (the
            operation applied to them), in order.
    """

    fused: int = 0
    materialized: list[str] = field(default_factory=list)

    def reset(self) -> None:
        self.fused = 0
        self.materialized.clear()


class LazyLogits(torch.Tensor):
    """The logits of a :class:`DeferredHead`, computed only when an operation other than
    the model's own cross entropy needs them (see the module docstring)."""

    _remat_hidden: torch.Tensor
    _remat_head: DeferredHead
    _remat_autocast: tuple[bool, torch.dtype]
    _remat_real: torch.Tensor | None
    _remat_bias: torch.Tensor | None

    @staticmethod
    def make(hidden: torch.Tensor, head: DeferredHead, autocast: tuple[bool, torch.dtype],
             bias: torch.Tensor | None = None) -> LazyLogits:
        shape = (*hidden.shape[:-1], head.module.out_features)
        fake = torch.zeros((), dtype=torch.float32, device=hidden.device).expand(shape)
        # Requires grad where the real logits would (callers read the flag).
        grad = torch.is_grad_enabled() and (hidden.requires_grad
                                            or head.module.weight.requires_grad)
        lazy = torch.Tensor._make_subclass(LazyLogits, fake, grad)
        lazy._remat_hidden = hidden
        lazy._remat_head = head
        lazy._remat_autocast = autocast
        lazy._remat_real = None
        lazy._remat_bias = bias  # added to the logits after the head (BART's final_logits_bias)
        return lazy

    def _real(self, why: str) -> torch.Tensor:
        """The real logits (computed once, as the head computes them)."""
        if self._remat_real is None:
            self._remat_head.materializing(why)
            module = self._remat_head.module
            enabled, dtype = self._remat_autocast
            device = self._remat_hidden.device.type
            with torch.autocast(device, dtype=dtype, enabled=enabled):
                logits = F.linear(self._remat_hidden, module.weight, module.bias)
                if self._remat_bias is not None:
                    logits = logits + self._remat_bias
            # The model's head returned the head's dtype; .float() is the caller's.
            self._remat_real = logits
        return self._remat_real

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        lazy = args[0] if args and isinstance(args[0], LazyLogits) else None
        if name in _METADATA or (name == "__get__" and _descriptor(func) in _METADATA_ATTRIBUTES):
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if lazy is not None and lazy._remat_real is None:
            if name == "register_hook" and _fsdp_pre_backward(args, kwargs):
                # FSDP2's root marks the backward's start on its outputs; the logits never
                # join the graph, so the mark goes where their gradient would have led.
                return lazy._remat_hidden.register_hook(*args[1:], **kwargs)
            if func is F.cross_entropy:
                loss = lazy._fused_cross_entropy(*args[1:], **kwargs)
                if loss is not None:
                    return loss
            elif _keeps_float32(name, args, kwargs):
                return lazy
            elif name in ("add", "__add__", "__radd__") and not kwargs:
                added = lazy._with_bias(args[1] if len(args) == 2 else None)
                if added is not None:
                    return added
            elif name in _RESHAPES:
                reshaped = lazy._reshaped(func, args, kwargs)
                if reshaped is not None:
                    return reshaped
        why = _describe(name, func, args, kwargs)
        real_args, real_kwargs = tree_map(_realise(why), (args, kwargs))
        with DisableTorchFunctionSubclass():
            return func(*real_args, **real_kwargs)

    def _reshaped(self, func: Callable[..., Any], args: Any, kwargs: Any) -> LazyLogits | None:
        with DisableTorchFunctionSubclass():
            shape = func(*args, **kwargs).shape  # on the fake data: no logits made
        if not shape or shape[-1] != self.shape[-1]:
            return None  # the vocabulary is no longer the last dimension
        hidden = self._remat_hidden
        return LazyLogits.make(hidden.reshape(*shape[:-1], hidden.shape[-1]), self._remat_head,
                               self._remat_autocast, self._remat_bias)

    def _with_bias(self, other: Any) -> LazyLogits | None:
        """``self + other`` where ``other`` is one score per class, the same for every row
        (a bias over the vocabulary); ``None`` for anything else."""
        vocab = self.shape[-1]
        if (not isinstance(other, torch.Tensor) or isinstance(other, LazyLogits)
                or other.numel() != vocab or other.shape[-1] != vocab
                or other.dim() > self.dim()):
            return None
        row = other.reshape(vocab).to(self._remat_hidden.device)
        bias = row if self._remat_bias is None else self._remat_bias + row
        return LazyLogits.make(self._remat_hidden, self._remat_head, self._remat_autocast, bias)

    def _fused_cross_entropy(self, target: Any = None, weight: Any = None,
                             size_average: Any = None, ignore_index: int = -100,
                             reduce: Any = None, reduction: str = "mean",
                             label_smoothing: float = 0.0) -> torch.Tensor | None:
        """The cross entropy over chunks, or ``None`` where it is not the plain one over
        rows of class scores (the caller then computes it on the real logits)."""
        plain = (isinstance(target, torch.Tensor) and not target.is_floating_point()
                 and self.dim() == 2 and tuple(target.shape) == tuple(self.shape[:1])
                 and weight is None and size_average is None and reduce is None
                 and reduction in ("mean", "sum") and label_smoothing == 0.0)
        if not plain or not torch.is_grad_enabled():
            return None
        head = self._remat_head
        enabled, dtype = self._remat_autocast
        with torch.autocast(self._remat_hidden.device.type, dtype=dtype, enabled=enabled):
            loss = chunked_cross_entropy(self._remat_hidden, head.module, target,
                                         chunks=head.chunks, ignore_index=ignore_index,
                                         divide_by=None if reduction == "mean" else 1.0,
                                         bias_add=self._remat_bias)
        head.use.fused += 1
        return loss


def _fsdp_pre_backward(args: Any, kwargs: Any) -> bool:
    """Whether ``logits.register_hook(hook)`` registers FSDP2's pre-backward hook, which
    its root's post-forward puts on every output that requires grad.

    That hook reads nothing of the gradient (it returns it as it came) and only marks the
    start of the root's backward: it unshards the root's parameters (gathered since its
    forward: the root does not reshard after it) and queues the callback that ends
    FSDP2's backward. On lazy logits it is registered on the hidden states instead, whose
    gradient the chunked loss's backward gives next: the mark comes there, or earlier
    where another output (the model's own loss) carries it. Any other hook computes the
    real logits, as before: it may read or change their gradient."""
    hook = args[1] if len(args) > 1 else kwargs.get("hook")
    owner = getattr(hook, "__self__", None)
    return (getattr(hook, "__name__", "") == "_pre_backward"
            and type(owner).__name__ == "FSDPState"
            and type(owner).__module__.startswith("torch.distributed.fsdp"))


def _descriptor(func: Callable[..., Any]) -> str:
    """The attribute a descriptor's ``__get__`` reads (``"shape"`` for ``Tensor.shape``)."""
    return getattr(getattr(func, "__self__", None), "__name__", "")


def _keeps_float32(name: str, args: Any, kwargs: Any) -> bool:
    """``logits.float()``, ``logits.to(torch.float32)``, ``.contiguous()``: no change to
    what the lazy logits stand for."""
    if name in ("float", "contiguous"):
        return len(args) == 1 and not kwargs
    if name == "to":
        targets = [a for a in (*args[1:], *kwargs.values())]
        return all(a is torch.float32 or (isinstance(a, bool) and not a) for a in targets)
    return False


def _describe(name: str, func: Callable[..., Any], args: Any, kwargs: Any) -> str:
    if name == "__get__":
        return _descriptor(func)
    if func is F.cross_entropy:
        extra = {k: v for k, v in kwargs.items()
                 if k in ("weight", "label_smoothing", "reduction") and v not in (None, 0.0)}
        return "cross_entropy(" + ", ".join(f"{k}={v!r}" for k, v in extra.items()) + ")"
    return name


def _realise(why: str) -> Callable[[Any], Any]:
    def real(value: Any) -> Any:
        return value._real(why) if isinstance(value, LazyLogits) else value
    return real


class DeferredHead:
    """A ``nn.Linear`` head's ``forward`` that returns :class:`LazyLogits` under grad
    (its own forward otherwise, and under ``torch.compile``). A plain class, so a model
    with it installed pickles."""

    def __init__(self, module: nn.Linear, chunks: int, *, planned: bool = False) -> None:
        self.module = module
        self.chunks = chunks
        self.planned = planned  # installed by a plan: computing the logits breaks its figures
        self.use = HeadUse()
        self._warned = False

    def materializing(self, why: str) -> None:
        """The real logits are being computed, for ``why``: recorded, and under a plan
        said once (the plan's figures assumed they never exist)."""
        self.use.materialized.append(why)
        if self.planned and not self._warned:
            self._warned = True
            warnings.warn(
                f"remat: the plan computes the head and its loss over {self.chunks} chunks, and "
                f"this step computed the head's whole logits ({why}): the plan's peak does not "
                "count them. The step's values are the model's; solve again for this step "
                "(remat checks the chunked head on the step it is given)", RematWarning,
                stacklevel=3)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if (not torch.is_grad_enabled() or torch.compiler.is_compiling()
                or not isinstance(hidden, torch.Tensor)):
            return type(self.module).forward(self.module, hidden)
        device = hidden.device.type
        autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        return LazyLogits.make(hidden, self, autocast)

    def __getstate__(self) -> dict[str, Any]:
        return {"module": self.module, "chunks": self.chunks, "planned": self.planned}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["module"], state["chunks"],  # type: ignore[misc]
                      planned=state["planned"])


def deferred_head(head: nn.Linear, chunks: int, *, planned: bool = False) -> DeferredHead:
    """Install a :class:`DeferredHead` over ``chunks`` chunks on ``head`` (``planned``: by
    a plan, which warns where its logits are computed after all)."""
    deferred = DeferredHead(head, chunks, planned=planned)
    head.forward = deferred  # type: ignore[method-assign]
    return deferred


def remove_deferred_head(head: nn.Module) -> None:
    """Undo :func:`deferred_head` (a no-op where none is installed)."""
    if isinstance(head.__dict__.get("forward"), DeferredHead):
        del head.__dict__["forward"]


@contextlib.contextmanager
def watching_use(head: nn.Module) -> Iterator[HeadUse]:
    """The :class:`HeadUse` of the deferred head installed on ``head``, reset on entry."""
    deferred = head.__dict__.get("forward")
    assert isinstance(deferred, DeferredHead), "no deferred head installed"
    deferred.use.reset()
    yield deferred.use

"""Run one module's forward under one option: keep, checkpoint, selective, derive or offload.

This is the single place where an option becomes torch machinery. The runtime
calls it from the wrapped forwards of a planned model, and the profiler calls it
to measure what each option costs, so what is measured is what runs.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from remat.core.errors import RematError
from remat.core.option import Option
from remat.execute.arguments import CallArguments
from remat.execute.derive import forward_deriving
from remat.execute.kv_cache import drop_kv_cache
from remat.execute.random_draws import DrawReplay, Draws, recording_policy

__all__ = [
    "SELECTIVE_SAVE_OPS",
    "RecomputeAsForward",
    "RetainableCache",
    "autocast_without_cache",
    "checkpoint_context_fn",
    "forward_with_option",
    "frozen_batchnorm_stats",
    "option_is_active",
    "recompute_snapshot_bytes",
    "selective_policy",
    "tracking_batchnorms",
]

logger = logging.getLogger(__name__)
_aten = torch.ops.aten

# The ops whose outputs ``selective`` keeps: matmuls, convolutions and attention,
# the expensive ones. Everything else (norms, activations, dropout, adds) is
# recomputed, which is cheap in time and often large in memory.
SELECTIVE_SAVE_OPS = frozenset(
    op
    for op in (
        _aten.mm,
        _aten.bmm,
        _aten.addmm,
        _aten.baddbmm,
        _aten.convolution,
        _aten._scaled_dot_product_flash_attention,
        _aten._scaled_dot_product_efficient_attention,
        getattr(_aten, "_scaled_dot_product_cudnn_attention", None),
        getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None),
        _aten._flash_attention_forward,
        _aten._efficient_attention_forward,
    )
    if op is not None
)


def selective_policy(ctx: Any, func: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    """Selective-checkpoint policy: save matmul/conv/attention outputs, recompute the rest."""
    if func.overloadpacket in SELECTIVE_SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def tracking_batchnorms(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The BatchNorms in ``module`` whose training forward updates running statistics."""
    return [
        m
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats and m.training
    ]


@contextlib.contextmanager
def frozen_batchnorm_stats(modules: list[nn.modules.batchnorm._BatchNorm]) -> Iterator[None]:
    """Undo, on exit, whatever the block did to BatchNorm running statistics.

    Recomputation runs BatchNorm's training forward a second time, which would
    update the running mean/var and ``num_batches_tracked`` twice per step. The
    op itself must run unchanged (it saves the running buffers for backward, and
    checkpoint checks that recomputation saves the same tensors), so the
    buffers are snapshotted and written back instead.
    """
    saved = [[(buf, buf.detach().clone()) for buf in _running_stats(m)] for m in modules]
    try:
        yield
    finally:
        with torch.no_grad():
            for pairs in saved:
                for buf, value in pairs:
                    buf.copy_(value)


def _running_stats(m: nn.modules.batchnorm._BatchNorm) -> list[torch.Tensor]:
    """The buffers :func:`frozen_batchnorm_stats` snapshots and writes back."""
    return [buf for buf in (m.running_mean, m.running_var, m.num_batches_tracked)
            if buf is not None]


def recompute_snapshot_bytes(module: nn.Module, device_type: str) -> int:
    """Bytes on ``device_type`` that recomputing ``module`` under ``checkpoint`` holds
    beyond its forward: :func:`frozen_batchnorm_stats`' copies of its BatchNorm
    statistics, alive from the start of the region's recomputation to its end."""
    return sum(buf.numel() * buf.element_size()
               for bn in tracking_batchnorms(module) for buf in _running_stats(bn)
               if buf.device.type == device_type)


def checkpoint_context_fn(
    modules: list[nn.Module], option: str
) -> Callable[[], tuple[Any, Any]] | None:
    """The ``context_fn`` for ``torch.utils.checkpoint`` under ``option`` (None: torch's default).

    Eagerly, recomputation runs as the forward ran (:class:`RecomputeAsForward`):
    in the train/eval modes the modules had in the forward (a loop may call
    ``model.eval()`` before ``backward()``), with BatchNorm statistics restored
    after it, and for ``selective`` with a cache that survives a second backward
    of a retained graph. Under ``torch.compile`` it is torch's selective policy or
    nothing (see below).
    """
    # Under torch.compile, recomputation comes from the compiled graph, which applies
    # the running-statistics update once (in the forward) and fixes the modes at
    # trace time; and a context_fn there must be a pair of dispatch modes that torch
    # recognises, which the restoring contexts are not.
    selective = option == Option.SELECTIVE.value
    if torch.compiler.is_compiling():
        if not selective:
            return None
        # A partial of module-level functions (not a closure): torch.compile accepts
        # only that as a checkpoint context_fn.
        return functools.partial(create_selective_checkpoint_contexts, selective_policy)
    return RecomputeAsForward(tuple(modules), selective)


class RecomputeAsForward:
    """Eager ``context_fn``: recomputation sees the state the forward saw.

    Called by ``torch.utils.checkpoint`` when the forward starts, so it records the
    modules' train/eval flags then. Its recompute context:

    * sets those flags for the recomputation and puts the current ones back after:
      ``model.eval()`` between forward and backward would otherwise recompute with
      dropout off (other tensors: torch's ``CheckpointError``, or wrong gradients);
    * restores BatchNorm running statistics after it (:func:`frozen_batchnorm_stats`),
      so they update once per step;
    * for ``selective``, wraps torch's cache (:class:`RetainableCache`) so that
      ``backward(retain_graph=True)`` twice and double backward work, and replays the
      forward's dropout masks instead of drawing them again
      (:mod:`remat.execute.random_draws`).
    """

    def __init__(self, modules: tuple[nn.Module, ...], selective: bool) -> None:
        self.modules = modules
        self.selective = selective
        # Every module of the units, and the BatchNorms among them, walked once: a
        # segment's context is made once per plan and called at every step, where
        # walking each unit's tree again cost about 3 us a unit. A submodule added
        # inside a unit after apply_plan is not seen (the plan was made for the units
        # as they were).
        self._members: list[nn.Module] | None = None
        self._batchnorms: list[nn.modules.batchnorm._BatchNorm] = []

    def __call__(self) -> tuple[Any, Any]:
        members = self._members
        if members is None:
            members = self._members = [m for unit in self.modules for m in unit.modules()]
            self._batchnorms = [m for m in members
                                if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        flags = [m.training for m in members]
        bns = [m for m in self._batchnorms if m.track_running_stats and m.training]
        if self.selective:
            draws = Draws()
            fwd_ctx, cached = create_selective_checkpoint_contexts(
                recording_policy(selective_policy, draws))
            # The replay below torch's cache: the cache sees the Bernoulli op (and counts
            # it) before the replay answers it.
            return fwd_ctx, _AsInForward(members, flags, bns,
                                         _Both(DrawReplay(draws, _graph_is_kept),
                                               RetainableCache(cached)))
        return _NO_CONTEXT, _AsInForward(members, flags, bns, None)


class _Both:
    """``outer`` entered, then ``inner``; left in the reverse order (no ``ExitStack``:
    entered once per selective unit per pass)."""

    def __init__(self, outer: Any, inner: Any) -> None:
        self.outer = outer
        self.inner = inner

    def __enter__(self) -> None:
        self.outer.__enter__()
        try:
            self.inner.__enter__()
        except BaseException:
            self.outer.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            self.inner.__exit__(*exc)
        finally:
            self.outer.__exit__(*exc)


class _AsInForward:
    """The recompute context of :class:`RecomputeAsForward`. A class, not a generator:
    torch enters the one recompute context once per recomputation, and a retained
    graph is recomputed once per backward.

    Entered once per segment in every backward, so the usual case (the modes as in
    the forward, no BatchNorm, no selective cache) does nothing at all: an
    ``ExitStack`` and a generator-based context cost about 10 us a segment.
    """

    def __init__(
        self,
        members: list[nn.Module],
        flags: list[bool],
        bns: list[nn.modules.batchnorm._BatchNorm],
        inner: Any,
    ) -> None:
        self.members = members
        self.flags = flags  # each member's ``training`` in the forward
        self.bns = bns
        self.inner = inner
        self._stack: list[contextlib.ExitStack | None] = []

    def __enter__(self) -> None:
        changed = [(m, m.training) for m, training in zip(self.members, self.flags)
                   if m.training != training]
        if not (changed or self.bns or self.inner is not None):
            self._stack.append(None)
            return
        stack = contextlib.ExitStack()
        for m, now in changed:
            m.training = not now

        def put_back() -> None:
            for m, now in changed:
                m.training = now

        stack.callback(put_back)
        try:
            stack.enter_context(frozen_batchnorm_stats(self.bns))
            if self.inner is not None:
                stack.enter_context(self.inner)
        except BaseException:
            stack.close()
            raise
        self._stack.append(stack)

    def __exit__(self, *exc: Any) -> Any:
        stack = self._stack.pop()
        return None if stack is None else stack.__exit__(*exc)


def _graph_is_kept() -> bool:
    """Whether the backward pass running now keeps its graph (``retain_graph=True``, or
    ``create_graph=True`` for a double backward). True where torch cannot tell."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep_graph is None else bool(keep_graph())


class RetainableCache:
    """torch's selective-checkpoint recompute mode, whose cache outlives a retained backward.

    torch's cache hands each saved tensor out once and then drops it, so a second
    backward through the region (``loss.backward(retain_graph=True)`` then
    ``loss.backward()``; a gradient penalty's double backward) fails with "Trying to
    backward an extra time". When the running backward keeps its graph, the cache's
    entries are copied before the recomputation and put back after it; an ordinary
    backward frees them as torch does, so memory is unchanged there. The cache is
    torch's private ``storage`` mapping (``{op: entries}``); where a torch keeps it
    differently this falls back to torch's own behaviour.
    """

    def __init__(self, mode: Any) -> None:
        self.mode = mode
        self._saved: dict[Any, Any] | None = None

    def __enter__(self) -> Any:
        storage = getattr(self.mode, "storage", None)
        if isinstance(storage, dict) and _graph_is_kept():
            self._saved = {op: copy.copy(entries) for op, entries in storage.items()}
        return self.mode.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.mode.__exit__(*exc)
        finally:
            saved, self._saved = self._saved, None
            if saved is not None:
                storage = self.mode.storage
                storage.clear()
                storage.update(saved)


_AUTOCAST_DEVICES = ("cuda", "cpu")


_NO_CONTEXT = contextlib.nullcontext()


def autocast_without_cache() -> contextlib.AbstractContextManager[Any]:
    """Inside a recomputed region: the active ``torch.autocast``, without its weight cache.

    Under autocast every weight a forward uses is cast (to bfloat16, say) and the
    cast is cached until the outermost autocast region ends, the end of the forward
    pass: for a checkpointed unit that is memory the checkpoint was meant to free
    (casts of a 1B-parameter model are 2 GB). Without the cache each cast lives as
    long as the op that needs it; the values are the same (casting is exact and
    deterministic), and recomputation casts again anyway. torch's checkpoint
    records the cache setting with the autocast state, so recomputation matches.

    Entered around every unit call of a segment: without autocast it is one shared
    null context (a generator-based context manager cost several microseconds a
    unit, as much as a small convolution).
    """
    if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
        return _NO_CONTEXT
    enabled = [d for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
    stack = contextlib.ExitStack()
    for device_type in enabled:
        stack.enter_context(torch.autocast(
            device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False))
    return stack


def option_is_active(module: nn.Module, option: str) -> bool:
    """Whether ``option`` does anything for this call.

    Nothing is saved for backward under ``torch.no_grad()``, and in eval mode no
    training step is running, so both run the plain forward at no cost.
    """
    return option != Option.KEEP.value and torch.is_grad_enabled() and module.training


class _Recomputable:
    """A unit's forward for torch's checkpoint. Its first call (the forward pass) gets
    the caller's own argument objects, so whatever the unit does to them is seen; each
    recomputation gets the arguments as they were at that call (:mod:`.arguments`).
    Compiled code traces the forward once and recomputes in its graph: not used there."""

    def __init__(self, forward: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        self.forward, self.kwargs = forward, kwargs
        self.arguments = CallArguments(args, kwargs)
        self.called = False

    def __call__(self, *args: Any) -> Any:
        if not self.called:
            self.called = True
            return self.forward(*args, **self.kwargs)
        args, kwargs = self.arguments.rebuild()
        return self.forward(*args, **kwargs)


def forward_with_option(
    module: nn.Module,
    option: str,
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    verify: bool = False,
    saved: set[int] | None = None,
) -> Any:
    """Call ``forward(*args, **kwargs)`` (the module's own forward) under ``option``.

    ``checkpoint`` and ``selective`` use non-reentrant ``torch.utils.checkpoint``,
    which preserves the RNG state (dropout draws the same masks in recomputation)
    and accepts keyword arguments, inputs without ``requires_grad`` and any output
    structure. ``derive`` lets go of saved tensors that cheap ops make again from
    other saved ones (:mod:`remat.execute.derive`; ``verify``: each recipe checked
    against the tensor it replaces, as the profiler does; ``saved``: the storages autograd
    saved, for the profiler). ``offload`` moves saved
    tensors to pinned CPU memory (CUDA only).
    """
    if not option_is_active(module, option):
        return forward(*args, **kwargs)
    if option in (Option.CHECKPOINT.value, Option.SELECTIVE.value):
        args, kwargs = drop_kv_cache(module, args, kwargs)
        context_fn = checkpoint_context_fn([module], option)
        extra = {} if context_fn is None else {"context_fn": context_fn}
        # kwargs go through the callable so they can never collide with checkpoint's own.
        fn = (functools.partial(forward, **kwargs) if torch.compiler.is_compiling()
              else _Recomputable(forward, args, kwargs))
        with autocast_without_cache():
            return checkpoint(fn, *args, use_reentrant=False, **extra)
    if option == Option.DERIVE.value:
        return forward_deriving(module, forward, args, kwargs, verify=verify, saved=saved)
    if option == Option.OFFLOAD.value:
        reason = Option.OFFLOAD.unavailable_on("cuda" if torch.cuda.is_available() else "cpu")
        if reason is not None:
            raise RematError(reason)
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return forward(*args, **kwargs)
    raise RematError(f"unknown option {option!r}; valid options: {[o.value for o in Option]}")

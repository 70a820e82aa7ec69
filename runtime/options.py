"""Run one module's forward under one option: keep, checkpoint, selective or offload.

This is the single place where an option becomes torch machinery. The runtime
calls it from the wrapped forwards of a planned model, and the profiler calls it
to measure what each option costs, so what is measured is what runs.
"""

from __future__ import annotations

import contextlib
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

from remat.errors import RematError
from remat.runtime.kv_cache import drop_kv_cache
from remat.solver.profile import Option

__all__ = [
    "SELECTIVE_SAVE_OPS",
    "autocast_without_cache",
    "checkpoint_context_fn",
    "forward_with_option",
    "frozen_batchnorm_stats",
    "option_is_active",
    "selective_policy",
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


def _tracking_batchnorms(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
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
    saved = [
        [(buf, buf.detach().clone()) for buf in (m.running_mean, m.running_var,
                                                 m.num_batches_tracked) if buf is not None]
        for m in modules
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for pairs in saved:
                for buf, value in pairs:
                    buf.copy_(value)


def checkpoint_context_fn(
    modules: list[nn.Module], option: str
) -> Callable[[], tuple[Any, Any]] | None:
    """The ``context_fn`` for ``torch.utils.checkpoint`` under ``option`` (None: torch's default).

    Composes the selective-checkpoint policy (for ``selective``) with frozen
    BatchNorm statistics during recomputation (when the modules have BatchNorm).
    """
    # Under torch.compile, recomputation comes from the compiled graph, which applies
    # the running-statistics update once (in the forward); and a context_fn there
    # must be a pair of dispatch modes, which the restoring context is not.
    compiling = torch.compiler.is_compiling()
    bns = [] if compiling else [bn for m in modules for bn in _tracking_batchnorms(m)]
    selective = option == Option.SELECTIVE.value
    if not bns and not selective:
        return None
    if not bns:
        # A partial of module-level functions (not a closure): torch.compile accepts
        # only that as a checkpoint context_fn.
        return functools.partial(create_selective_checkpoint_contexts, selective_policy)

    def context_fn() -> tuple[Any, Any]:
        if selective:
            fwd_ctx, recompute_ctx = create_selective_checkpoint_contexts(selective_policy)
        else:
            fwd_ctx, recompute_ctx = contextlib.nullcontext(), contextlib.nullcontext()
        if not bns:
            return fwd_ctx, recompute_ctx

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            with frozen_batchnorm_stats(bns), recompute_ctx:
                yield

        return fwd_ctx, recompute()

    return context_fn


_AUTOCAST_DEVICES = ("cuda", "cpu")


@contextlib.contextmanager
def autocast_without_cache() -> Iterator[None]:
    """Inside a recomputed region: the active ``torch.autocast``, without its weight cache.

    Under autocast every weight a forward uses is cast (to bfloat16, say) and the
    cast is cached until the outermost autocast region ends, the end of the forward
    pass: for a checkpointed unit that is memory the checkpoint was meant to free
    (casts of a 1B-parameter model are 2 GB). Without the cache each cast lives as
    long as the op that needs it; the values are the same (casting is exact and
    deterministic), and recomputation casts again anyway. torch's checkpoint
    records the cache setting with the autocast state, so recomputation matches.
    """
    with contextlib.ExitStack() as stack:
        for device_type in _AUTOCAST_DEVICES:
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(
                    device_type, dtype=torch.get_autocast_dtype(device_type),
                    cache_enabled=False))
        yield


def option_is_active(module: nn.Module, option: str) -> bool:
    """Whether ``option`` does anything for this call.

    Nothing is saved for backward under ``torch.no_grad()``, and in eval mode no
    training step is running, so both run the plain forward at no cost.
    """
    return option != Option.KEEP.value and torch.is_grad_enabled() and module.training


def forward_with_option(
    module: nn.Module,
    option: str,
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Call ``forward(*args, **kwargs)`` (the module's own forward) under ``option``.

    ``checkpoint`` and ``selective`` use non-reentrant ``torch.utils.checkpoint``,
    which preserves the RNG state (dropout draws the same masks in recomputation)
    and accepts keyword arguments, inputs without ``requires_grad`` and any output
    structure. ``offload`` moves saved tensors to pinned CPU memory (CUDA only).
    """
    if not option_is_active(module, option):
        return forward(*args, **kwargs)
    if option in (Option.CHECKPOINT.value, Option.SELECTIVE.value):
        args, kwargs = drop_kv_cache(module, args, kwargs)
        context_fn = checkpoint_context_fn([module], option)
        extra = {} if context_fn is None else {"context_fn": context_fn}
        # kwargs go through a partial so they can never collide with checkpoint's own.
        fn = functools.partial(forward, **kwargs) if kwargs else forward
        with autocast_without_cache():
            return checkpoint(fn, *args, use_reentrant=False, **extra)
    if option == Option.OFFLOAD.value:
        reason = Option.OFFLOAD.unavailable_on("cuda" if torch.cuda.is_available() else "cpu")
        if reason is not None:
            raise RematError(reason)
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return forward(*args, **kwargs)
    raise RematError(f"unknown option {option!r}; valid options: {[o.value for o in Option]}")

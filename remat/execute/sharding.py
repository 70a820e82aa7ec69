"""What remat needs to know of a model sharded with FSDP2 (``fully_shard``), below both the
profiler (which turns a sharded profile into one rank's) and the runtime (which refuses a
plan solved for another world size).

Only FSDP2's public surface is read where it has one (``FSDPModule``, DTensor parameters and
their device mesh); whether a module reshards after its forward is FSDP2 state without a
public accessor, read defensively (``True``, FSDP2's default, when it cannot be read).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.core.errors import PlanMismatchError
from remat.core.plan import Plan

__all__ = ["ShardedUnit", "all_gather_output_kept", "check_world_size", "is_sharded",
           "freed_optimizer_params", "refusal_on_every_rank", "resharded_at_rest",
           "root_kept_gathered", "root_owned_grad_bytes", "sharded_inside", "sharded_unit",
           "starts_with_gather", "unreduced_grad_bytes", "world_size"]


def _fsdp_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2 (or without distributed)
        return None
    return FSDPModule


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` (or a module inside it) is wrapped by FSDP2's ``fully_shard``."""
    cls = _fsdp_module_class()
    # Not a module: not sharded (the caller's own checks name what it is).
    return (cls is not None and isinstance(model, nn.Module)
            and any(isinstance(m, cls) for m in model.modules()))


def sharded_inside(module: nn.Module) -> list[str]:
    """The modules strictly inside ``module`` that FSDP2 shards on their own
    (``fully_shard``-ed), by name relative to it, in module order; empty where none.

    The profiler replays a unit inside FSDP2's window of the unit's gathered parameters,
    calling its ``forward`` itself; a module inside it that FSDP2 shards apart (an MoE's
    experts in torchtitan's expert-parallel recipe, or a block's attention and MLP sharded
    and the block not) keeps its own window, so a replay would run it on its shards and
    issue its collectives."""
    cls = _fsdp_module_class()
    if cls is None:
        return []
    return [name for name, m in module.named_modules() if name and isinstance(m, cls)]


def refusal_on_every_rank(model: nn.Module, refusal: str | None) -> str | None:
    """On a model FSDP2 shards, with more than one rank: the first rank's refusal of those
    that gave one, named by rank (``"rank 1: ..."``), or ``None`` where none did; the same
    answer on every rank. Elsewhere ``refusal`` as it is.

    A check each rank runs on its own micro-batch (the chunked head's) can pass on one rank
    and refuse on another; the ranks would then go on to measure different variants,
    whose steps issue different collectives (a gloo rank aborted on the mismatch). One
    ``all_gather_object`` over the default group, which every rank of a sharded
    ``remat.profile`` calls: its cost is one small collective per check."""
    if not is_sharded(model):
        return refusal
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return refusal
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, refusal)
    return next((f"rank {rank}: {text}" for rank, text in enumerate(found) if text is not None),
                None)


def _local_bytes(p: nn.Parameter) -> int:
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.numel() * local.element_size()


def world_size(model: nn.Module) -> int:
    """How many ranks ``model``'s parameters are sharded over: the size of the first DTensor
    parameter's device mesh, 1 for a model with none (unsharded)."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            return int(mesh.size())
    return 1


@dataclass(frozen=True)
class ShardedUnit:
    """One module's FSDP2 figures, in bytes on one rank.

    Attributes:
        gathered_bytes: its parameters all-gathered (unsharded), as FSDP2 holds them
            between its unshard and reshard: every parameter, frozen ones included (a
            LoRA model's base weights are all-gathered as its adapters are), in the
            dtype they are gathered in (0 where the module is no ``fully_shard``-ed
            module of its own: its parameters belong to an enclosing one).
        grad_bytes: the unsharded gradients of its trainable parameters, which its
            reduce-scatter takes as input, in the dtype it reduces in (0 likewise;
            ``gathered_bytes`` where every parameter trains and no mixed-precision
            policy is set).
        shard_bytes: this rank's local shards of its trainable parameters (what its
            sharded gradients take).
        reshard_after_forward: whether FSDP2 frees the gathered parameters after the
            forward (and all-gathers them again for the backward).
        frees_before_reduce: whether FSDP2's post-backward frees the gathered
            parameters and reclaims the reduce-scatter input of the unit reduced before
            (the next one in the forward's order) before it makes this unit's (its
            defaults: ``reshard_after_backward`` and one reduce-scatter input buffer
            kept); ``False`` where either was changed
            (``set_reshard_after_backward(False)``,
            ``set_reduce_scatter_max_input_buffers``), and all three live together.
    """

    gathered_bytes: int
    grad_bytes: int
    shard_bytes: int
    reshard_after_forward: bool = True
    frees_before_reduce: bool = True


def sharded_unit(module: nn.Module) -> ShardedUnit:
    """``module``'s :class:`ShardedUnit` (its own parameters, all of its submodules')."""
    cls = _fsdp_module_class()
    own = cls is not None and isinstance(module, cls)
    params = list(module.parameters())
    trainable = [p for p in params if p.requires_grad]
    shard = sum(_local_bytes(p) for p in trainable)
    if not own:
        return ShardedUnit(0, 0, shard, True)
    # Found 2026-11-28 (peft LoRA on Qwen2 under FSDP2): counting the trainable
    # parameters alone left the frozen base weights FSDP2 all-gathers out of every
    # prediction, 8 MiB (27%) below the measured step on one rank.
    param_dtype, reduce_dtype = _mixed_precision(module)
    gathered = sum(_bytes(p, param_dtype) for p in params)
    # FSDP2 reduce-scatters the gradients in reduce_dtype, or else in the dtype they were
    # computed in (param_dtype's).
    grads = sum(_bytes(p, reduce_dtype or param_dtype) for p in trainable)
    return ShardedUnit(gathered, grads, shard, _reshards_after_forward(module),
                       _frees_before_reduce(module))


def _bytes(p: nn.Parameter, dtype: torch.dtype | None) -> int:
    """``p`` unsharded, in ``dtype`` (``None``: its own)."""
    return p.numel() * (dtype.itemsize if dtype else p.element_size())


def _fsdp_state(module: nn.Module) -> Any:
    """``module``'s own FSDP2 state (``None`` where ``module`` is no ``fully_shard``-ed
    module or a torch keeps the state elsewhere). The one reader of FSDP2's private
    state: its users read what they need off it with ``getattr`` defaults."""
    cls = _fsdp_module_class()
    if cls is None or not isinstance(module, cls):
        return None
    try:
        return module._get_fsdp_state()  # type: ignore[operator]
    except AttributeError:
        return None


def _param_group(module: nn.Module) -> Any:
    """``module``'s FSDP2 parameter group (``None`` where it has none or it cannot be read:
    no ``fully_shard``-ed module, or a torch whose FSDP2 keeps it elsewhere)."""
    return getattr(_fsdp_state(module), "_fsdp_param_group", None)


def _mixed_precision(module: nn.Module) -> tuple[torch.dtype | None, torch.dtype | None]:
    """The ``param_dtype`` and ``reduce_dtype`` of ``module``'s FSDP2 mixed-precision
    policy (``None`` where unset or unreadable: the parameters' own)."""
    policy = getattr(_param_group(module), "mp_policy", None)
    return getattr(policy, "param_dtype", None), getattr(policy, "reduce_dtype", None)


def _reshards_after_forward(module: nn.Module) -> bool:
    """FSDP2's ``reshard_after_forward`` for ``module`` (``post_forward_mesh_info`` is
    ``None`` when it keeps the parameters gathered to the backward)."""
    group = _param_group(module)
    if group is None:
        return True
    return getattr(group, "post_forward_mesh_info", True) is not None


def _frees_before_reduce(module: nn.Module) -> bool:
    """Whether ``module``'s FSDP2 post-backward frees its gathered parameters and the
    reduce-scatter input of the unit reduced before it, before it makes its own
    (``False`` where it cannot be read: the three counted together, the larger figure)."""
    group = _param_group(module)
    if group is None:
        return False
    # FSDP2 keeps one reduce-scatter input by default; the cap is set per module and
    # resolved, the largest, for all of them at its first forward.
    buffers = max(getattr(group, "reduce_scatter_max_input_buffers", 1),
                  getattr(getattr(group, "comm_ctx", None),
                          "reduce_scatter_max_input_buffers", 1))
    return getattr(group, "reshard_after_backward", False) is True and buffers == 1


def unreduced_grad_bytes(model: nn.Module) -> int:
    """The bytes of the unsharded gradients ``model``'s own FSDP2 parameters (the root's:
    embeddings, the head) hold now, waiting for the root's reduce-scatter; 0 where
    ``model`` is no ``fully_shard``-ed module or its state cannot be read.

    FSDP2 reduce-scatters the root's gradients in its post-backward, which for a root
    whose inputs need no gradient runs at the end of the backward: a head's gradient,
    made in the suffix's backward, stays unsharded through every unit's backward (8 MiB,
    the head of a Llama with a vocabulary of 8192, on every rank)."""
    try:
        groups = getattr(_fsdp_state(model), "_fsdp_param_groups", ())
        params = [fp._unsharded_param for g in groups for fp in g.fsdp_params
                  if hasattr(fp, "_unsharded_param")]
    except AttributeError:
        return 0
    return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)


def resharded_at_rest(model: nn.Module) -> list[str]:
    """Reshard each ``fully_shard``-ed module of ``model`` that a forward left gathered
    without its backward; the names of those it resharded ("" for ``model`` itself).

    Between training steps FSDP2's modules hold their sharded parameters, the DTensors
    the optimizer steps. After a forward with no backward (an evaluation under
    ``torch.no_grad()``, say) the root stays gathered (``reshard_after_forward=False``
    is the root's default, and only its post-backward reshards it), its unsharded
    tensors standing as its parameters: remat's passes, which snapshot
    ``model.parameters()`` and step the optimizer, then ran on both, and AdamW's step
    crashed the process (a segmentation fault, a Llama-style model from ``transformers``
    on 2 gloo ranks, torch 2.13; 2026-11-29). Resharding is what the backward would have
    done, and the parameters' values are unchanged; FSDP2 gathers them again at the next
    forward. Its price: that all-gather, which the next forward makes anyway. Local to
    the rank: no collective."""
    return [name for name, module in model.named_modules() if _reshard_if_gathered(module)]


def _reshard_if_gathered(module: nn.Module) -> bool:
    """Reshard ``module``'s own FSDP2 parameters if they are gathered now; whether it did
    (local to the rank: a reshard frees, it issues no collective)."""
    if not getattr(_param_group(module), "is_unsharded", False):
        return False
    module.reshard()  # type: ignore[operator]
    return True


def freed_optimizer_params(optimizer: Any) -> int:
    """How many of ``optimizer``'s parameters have no storage left: the unsharded tensors
    of a module FSDP2 held gathered when the optimizer was built (after a forward with
    no backward), freed since by its reshard. Stepping them reads freed memory; and the
    sharded parameters they stood for are in no optimizer, so they never train."""
    if optimizer is None:
        return 0
    return sum(1 for group in optimizer.param_groups for p in group["params"]
               if isinstance(p, torch.Tensor) and p.numel() > 0
               and p.untyped_storage().nbytes() == 0)


def all_gather_output_kept(model: nn.Module) -> torch.Tensor | None:
    """The all-gather output ``model``'s FSDP2 keeps alive now for the next copy-out
    (``comm_ctx.all_gather_state``: in the forward, a unit's output stays until the next
    unit's copy-out, the last unit's until the root's post-forward); ``None`` where none
    is kept, ``model`` is no ``fully_shard``-ed root, or its state cannot be read.

    For the profiler's outside step (:mod:`remat.profiler.instrument`): the last unit's
    stays into the suffix's forward, where the sharded profile counts it as a buffer in
    flight (:mod:`remat.profiler.sharded`), so the suffix's own figure must not."""
    kept = getattr(getattr(_fsdp_state(model), "_comm_ctx", None), "all_gather_state", None)
    return None if kept is None else kept.all_gather_result.all_gather_output


def root_owned_grad_bytes(module: nn.Module, root: nn.Module) -> int:
    """The unsharded gradients of ``module``'s trainable parameters, a module that is no
    ``fully_shard``-ed module of its own (its parameters are ``root``'s): as the backward
    makes them, in ``root``'s ``param_dtype`` where its mixed-precision policy sets one.
    They wait for ``root``'s reduce-scatter (:func:`unreduced_grad_bytes`)."""
    param_dtype, _ = _mixed_precision(root)
    return sum(_bytes(p, param_dtype) for p in module.parameters() if p.requires_grad)


@contextmanager
def root_kept_gathered(model: nn.Module) -> Iterator[None]:
    """Within: ``model``'s own FSDP2 parameters (the root's: embeddings, the head, in no
    unit) gathered from the start and kept gathered to the end of the backward, where
    FSDP2's post-backward reshards them as usual; outside, as they were.

    For the profiler's outside step (:mod:`remat.profiler.outside`), whose windows are to
    measure the code outside the units and not FSDP2's traffic, which
    :func:`remat.profiler.sharded.sharded_profile` counts where FSDP2 makes it. Where the
    root reshards after its forward (``reshard_after_forward=True`` given to the root),
    the step all-gathers its parameters in the prefix's forward and again in the
    suffix's backward: those windows measured both, over what the sharded profile counts
    of the root (16 MiB twice, the root's size, on a Llama-style model with a vocabulary
    of 8192 on 2 ranks); it is kept gathered (its ``reshard_after_forward`` set to
    ``False`` within). With FSDP2's default the root keeps them gathered from its
    pre-forward on, but it is sharded when the step starts (its post-backward resharded
    it), so the prefix's window held its all-gather output and its parameters: the
    Llama's with a vocabulary of 8192 (4 ranks, 4.00 MiB each) stood its prefix's forward
    13.6 units above its real phase with the first unit's (below; scratch ``slack2.py``,
    2026-11-29). It is gathered first under either setting (from 2026-11-29). It holds no
    more than a step does: the root's parameters are gathered through every forward.
    Its price: one all-gather of the root, which the step's forward would have made.
    """
    groups = getattr(_fsdp_state(model), "_fsdp_param_groups", None)
    if groups is None:
        yield
        return
    # Put back as they were (an HSDP root may reshard onto a smaller mesh: not a bool).
    was = [g.post_forward_mesh_info for g in groups]
    if _reshards_after_forward(model):
        model.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]
    try:
        # Gathered afresh, inside the caller's meter: a root still gathered from an
        # earlier pass (a forward without its backward) holds storages from before the
        # meter's region, whose free at the post-backward no view subtracts (the prefix's
        # backward of a Llama of vocabulary 8192 on 2 ranks measured 38.67 MB then,
        # 21.89 MB gathered afresh). Resharding is local; every rank gathers.
        _reshard_if_gathered(model)
        model.unshard()  # type: ignore[operator]
        yield
    except BaseException:
        model.reshard()  # type: ignore[operator]  # the backward that would have did not run
        raise
    finally:
        for group, info in zip(groups, was, strict=True):
            group.post_forward_mesh_info = info


def starts_with_gather(module: nn.Module) -> bool:
    """Whether calling ``module`` starts with FSDP2's pre-forward (a ``fully_shard``-ed
    module: its hook, prepended to any other, all-gathers its parameters and keeps the
    all-gather output alive into its forward).

    For the profiler's outside step (:mod:`remat.profiler.instrument`), which marks where
    such a unit starts before that hook runs: a mark after it put the unit's all-gather
    output and its gathered parameters in the window of the code before it, where
    :func:`remat.profiler.sharded.sharded_profile` counts them too, in the unit's forward
    and the buffers in flight (the first unit's, 2.99 MiB each, in the prefix's forward of
    a Llama-style model on 4 ranks, 2026-11-29)."""
    return _fsdp_state(module) is not None


def check_world_size(model: nn.Module, plan: Plan) -> None:
    """Refuse a plan solved for another world size than ``model`` is sharded over: its
    per-rank figures (the shards, what FSDP gathers) are another rank's step.

    Raises:
        PlanMismatchError: the plan records a world size other than the model's.
    """
    planned = plan.target.world_size
    if planned is None:
        return
    actual = world_size(model)
    if planned != actual:
        raise PlanMismatchError(
            f"the plan was solved for a model sharded over {planned} rank(s), and this "
            f"{type(model).__name__} is sharded over {actual}: each rank's shards, and so its "
            f"peak, differ (about 1/{planned} against 1/{actual} of the parameters); solve "
            "again on every rank of this world (remat.solve(model, batch, memory_budget=...))")

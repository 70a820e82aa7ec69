"""What remat needs to know of a model sharded with FSDP2 (``fully_shard``), below both the
profiler (which turns a sharded profile into one rank's) and the runtime (which refuses a
plan solved for another world size).

Only FSDP2's public surface is read where it has one (``FSDPModule``, DTensor parameters and
their device mesh); whether a module reshards after its forward is FSDP2 state without a
public accessor, read defensively (``True``, FSDP2's default, when it cannot be read).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from remat.core.errors import PlanMismatchError
from remat.core.plan import Plan

__all__ = ["ShardedUnit", "check_world_size", "is_sharded", "sharded_inside", "sharded_unit",
           "world_size"]


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
            between its unshard and reshard (0 where the module is no ``fully_shard``-ed
            module of its own: its parameters belong to an enclosing one).
        shard_bytes: this rank's local shards of its parameters (what its sharded
            gradients take, too).
        reshard_after_forward: whether FSDP2 frees the gathered parameters after the
            forward (and all-gathers them again for the backward).
    """

    gathered_bytes: int
    shard_bytes: int
    reshard_after_forward: bool = True


def sharded_unit(module: nn.Module) -> ShardedUnit:
    """``module``'s :class:`ShardedUnit` (its own parameters, all of its submodules')."""
    cls = _fsdp_module_class()
    own = cls is not None and isinstance(module, cls)
    params = [p for p in module.parameters() if p.requires_grad]
    gathered = sum(p.numel() * p.element_size() for p in params) if own else 0
    shard = sum(_local_bytes(p) for p in params)
    return ShardedUnit(gathered, shard, _reshards_after_forward(module) if own else True)


def _reshards_after_forward(module: nn.Module) -> bool:
    """FSDP2's ``reshard_after_forward`` for ``module`` (``post_forward_mesh_info`` is
    ``None`` when it keeps the parameters gathered to the backward)."""
    try:
        group = module._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
    except AttributeError:
        return True
    if group is None:
        return True
    return getattr(group, "post_forward_mesh_info", True) is not None


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

"""Plans for models sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``), per rank.

**Order: ``apply_plan`` first, then ``fully_shard``.** ``apply_plan`` checks each
unit's class against the plan, and ``fully_shard`` changes a module's class to
``FSDP<Name>``, so a plan solved on the unsharded model no longer fits the sharded
one. The other way round composes: the planned ``forward`` is an instance attribute,
which ``fully_shard``'s class swap keeps; FSDP's forward hooks (all-gather before,
reshard after) run around it; and a checkpointed unit recomputes inside its backward,
after FSDP's pre-backward hook has all-gathered the unit's parameters again. Every
rank must apply the same plan (:func:`broadcast_plan`), so that ranks run the same
program.

**Per-unit options only.** FSDP2's hooks hand each unit's output on as a new tensor,
so at run time the units are no chain and the runtime refuses multi-unit segments
over them (a :class:`~remat.core.errors.RematError` names the two units); a segment's
recomputation would also run units whose parameters FSDP has resharded.
:func:`per_rank_profile` therefore describes the units as no chain, and the solver
then plans per-unit options only. (Off a chain, a boundary tensor that both of its
neighbours save is counted once for each: the figures err high there, never low.)

**The budget is per rank.** The profile of the *unsharded* model (on one rank, with
that rank's micro-batch) measures activations, which sharding does not change.
:func:`per_rank_profile` turns it into the step of one rank of ``world_size``:

* parameters, gradients and optimizer state are sharded: ``1/world_size`` of each
  (rounded up) stays on the rank between uses (the optimizer's step peak too);
* each unit (a ``fully_shard``-ed module) all-gathers its parameters for its forward
  and again for its backward (``reshard_after_forward=True``, FSDP2's default), and in
  its backward also holds its unsharded gradients' reduce-scatter copy, the next
  unit's prefetched parameters and, conservatively, the previous unit's (whose
  reshard may still be in flight); these are added to the unit's forward and backward
  peaks under every option;
* collectives in flight: FSDP2 runs reduce-scatters (and, on gloo, all-gathers)
  asynchronously, so the unsharded buffers of units other than those above can still
  be alive at any moment. On two CPU ranks the measured peak of one and the same step
  varied by up to 2.5 units' parameters from run to run (0.1 to 0.6 MB above the model
  on a 4-block GPT), so :data:`IN_FLIGHT` units' gathered parameters (the largest
  unit's) are counted alive from the forward's start to the backward's end;
* the root module's own parameters (those outside every unit: embeddings, the head)
  are all-gathered from the root's forward to the end of the backward (FSDP2 keeps the
  root unsharded after its forward), so they are held from the prefix's forward to
  its backward.

Profiling the sharded model itself is not supported: the profiler's replays of one unit
would issue collectives that must match across ranks, and its snapshot of the model
would gather the sharded parameters.

The per-rank figures are a model of FSDP2's memory, not a measurement: the test
suite checks them against the allocator's view of real sharded steps on two CPU
processes (gloo); :func:`measure_rank_step` measures a rank's step the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

from remat.core.errors import RematError
from remat.core.loop import Loop
from remat.core.plan import Plan
from remat.core.profile import Profile

__all__ = ["broadcast_plan", "measure_rank_step", "per_rank_profile"]

log = logging.getLogger("remat")


IN_FLIGHT = 3  # units' unsharded buffers counted in flight (see the module docstring)


def _shard(nbytes: int, world_size: int) -> int:
    return math.ceil(nbytes / world_size)


def per_rank_profile(
    profile: Profile, world_size: int, *, sharded_units: Iterable[str] | None = None
) -> Profile:
    """The step of one rank of ``world_size`` when every unit is a ``fully_shard``-ed module.

    Args:
        profile: the profile of the unsharded model on one rank's micro-batch (with the
            optimizer, when its state counts).
        world_size: the ranks the parameters are sharded over.
        sharded_units: the units that are ``fully_shard``-ed modules of their own;
            default: every unit. The parameters of other units stay with the root
            module (all-gathered for the whole forward and backward).

    Returns:
        A profile of per-rank bytes, with ``is_chain=False`` (per-unit options only);
        solve it for a per-rank budget (``remat.solve(per_rank, memory_budget=...)``).

    A unit's gathered parameters are read off its gradients (the profile measures those),
    so frozen parameters, which FSDP2 all-gathers too (a LoRA model's base weights), a
    ``MixedPrecisionPolicy``'s dtypes and the root's buffer in flight are not counted:
    ``remat.solve`` on the ``fully_shard``-ed model reads them off it
    (:mod:`remat.profiler.sharded`).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise RematError(f"world_size={world_size!r}: need an int >= 1 (the number of ranks)")
    if not isinstance(profile, Profile):
        raise RematError(f"per_rank_profile() needs a remat Profile, got {type(profile).__name__}")
    names = [u.name for u in profile.units]
    own = set(names) if sharded_units is None else set(sharded_units)
    unknown = sorted(own - set(names))
    if unknown:
        raise RematError(f"sharded_units {unknown} are not units of the profile; its units "
                         f"are {names[:6]}{'...' if len(names) > 6 else ''}")
    # A unit's parameter bytes are its gradient bytes (the profile measures those).
    gathered = [u.param_grad_bytes if u.name in own else 0 for u in profile.units]
    root_params = profile.param_bytes - sum(gathered)
    in_flight = IN_FLIGHT * max(gathered, default=0)
    units = []
    for i, unit in enumerate(profile.units):
        # Backward runs from the last unit down: the unit before this one is prefetched,
        # and the one after may not have been resharded yet (its reduce-scatter in flight).
        prefetched = gathered[i - 1] if i > 0 else 0
        lingering = gathered[i + 1] if i + 1 < len(gathered) else 0
        fwd_extra = gathered[i]
        bwd_extra = 2 * gathered[i] + prefetched + lingering
        options = {
            name: dataclasses.replace(cost, fwd_peak_bytes=cost.fwd_peak_bytes + fwd_extra,
                                      bwd_peak_bytes=cost.bwd_peak_bytes + bwd_extra)
            for name, cost in unit.options.items()
        }
        units.append(dataclasses.replace(
            unit, options=options, param_grad_bytes=_shard(unit.param_grad_bytes, world_size)
            if unit.name in own else unit.param_grad_bytes))
    prefix, suffix = profile.prefix, profile.suffix
    root_grads = prefix.param_grad_bytes + suffix.param_grad_bytes
    prefix = dataclasses.replace(
        prefix,
        held_bytes=prefix.held_bytes + root_params + in_flight,
        fwd_peak_bytes=prefix.fwd_peak_bytes + root_params + in_flight,
        bwd_peak_bytes=prefix.bwd_peak_bytes + root_grads,
        param_grad_bytes=_shard(prefix.param_grad_bytes, world_size),
    )
    suffix = dataclasses.replace(suffix, param_grad_bytes=_shard(suffix.param_grad_bytes,
                                                                  world_size))
    meta = {**profile.meta, "fsdp_world_size": world_size, "fsdp_per_rank": True}
    return dataclasses.replace(
        profile,
        units=tuple(units),
        is_chain=False,
        prefix=prefix,
        suffix=suffix,
        param_bytes=_shard(profile.param_bytes, world_size),
        optimizer_state_bytes=_shard(profile.optimizer_state_bytes, world_size),
        optimizer_step_peak_bytes=_shard(profile.optimizer_step_peak_bytes, world_size),
        meta=meta,
    )


def measure_rank_step(
    model: Any,
    batch: Any,
    *,
    optimizer: Any = None,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    loop: Loop | None = None,
    warmup: int = 1,
) -> int:
    """The peak bytes of one optimizer step of ``loop`` on this rank, as the allocator saw it.

    :func:`remat.measurement.step.measure_step` with nothing restored (a sharded model
    cannot be snapshotted): ``warmup`` steps first (they create the optimizer's state),
    then two measured steps; the peak is their rise plus what the step holds throughout
    on this rank (local shards of parameters, buffers, gradients and optimizer state, and
    the batch). Every rank must call it at the same time: the steps' collectives must
    match. The steps train the model.

    The dispatch-level meter runs beside the allocator's view (its figure is not
    returned): on gloo it notes when each storage died, on whichever thread
    (:mod:`remat.measurement.deaths`), so a block freed unrecorded on a gloo worker
    closes then, not at the reuse of its address. Measured without it (before
    2026-11-28), the tests' GPT of 4 blocks on 2 ranks varied by one unit's gathered
    parameters (195 KiB of 11.6 MiB) in some runs of one plan and not others; with it,
    what still varies is real: an all-gather's output that gloo's worker, holding the
    work, let go after the step's peak.
    """
    from remat.measurement.step import measure_step

    step = measure_step(model, batch, loss_fn=loss_fn, optimizer=optimizer, loop=loop,
                        warmup=warmup, repeats=0, restore=False, held=False)
    assert step.allocator_peak_bytes is not None  # measured with the allocator
    return step.allocator_peak_bytes


def broadcast_plan(plan: Plan | None, *, src: int = 0, group: Any = None) -> Plan:
    """``plan`` from rank ``src`` on every rank (``torch.distributed.broadcast_object_list``).

    Solve on one rank and apply the same plan everywhere: plans solved on each rank
    can differ where two plans time within noise, and ranks should run one program.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RematError("broadcast_plan() needs an initialised process group "
                         "(torch.distributed.init_process_group)")
    box = [plan.to_json() if dist.get_rank(group) == src and plan is not None else None]
    if dist.get_rank(group) == src and plan is None:
        raise RematError(f"broadcast_plan(): rank {src} (src) has no plan to send")
    dist.broadcast_object_list(box, src=src, group=group)
    return Plan.from_json(box[0])

"""``remat.solve`` on a model sharded with FSDP2, run collectively on every rank.

Every rank of the process group calls ``remat.solve(model, batch, memory_budget=...)``
on its ``fully_shard``-ed model (``remat.profile``, ``estimate`` and ``pareto`` run
steps 1 to 3 alike). The entry points hand over the eager route's values: one
:class:`~remat.core.settings.ProfilingSettings` and one
:class:`~remat.core.settings.Verify` (or ``None``). The ranks then:

1. **agree** (:func:`remat.tune.ranks.agree`): a barrier with a timeout (gloo:
   ``monitored_barrier``, which names the rank that did not come), then each rank's
   description of the call (the model's parameters' names, shapes and dtypes, the
   batch's shapes, the budget, every field of the settings, the method, the
   verification and the solver's parameters, the world size) gathered on every rank;
   a rank whose call differs from rank 0's is a :class:`~remat.core.errors.RematError` on
   every rank that names it and what differs. Without this a rank with another batch
   shape would issue other collectives than the rest, and the job would hang;
2. **profile** their own micro-batch, all running the same passes in the same order
   (so FSDP2's collectives match; :mod:`remat.profiler.sharded` says why no pass gathers
   more than FSDP2 itself), and turn it into their rank's step
   (:func:`~remat.profiler.sharded.sharded_profile`);
3. **take the worst rank**: the profiles are gathered and merged figure by figure
   (the largest of each: :func:`remat.tune.ranks.worst_profile`), so one plan covers every rank, and
   every rank solves that one profile;
4. **verify** (with a budget): each rank measures the plan's real sharded step; the
   highest measured peak over the ranks decides, on every rank alike, whether to solve
   again for less (:func:`remat.tune.verify.verified`);
5. **broadcast** rank 0's plan (its JSON), so every rank applies the same plan even
   where two plans time within noise. The plan records the world size
   (``Plan.target.world_size``): ``apply_plan`` refuses it under another.

The budget is per rank: the peak of one rank's training step, everything on it included.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from torch import nn

from remat.core.errors import ArgumentError, RematError
from remat.core.plan import Plan
from remat.core.profile import Profile
from remat.core.settings import ProfilingSettings, Verify
from remat.execute.sharding import (
    freed_optimizer_params,
    is_sharded,
    refusal_on_every_rank,
    resharded_at_rest,
    world_size,
)
from remat.tune.ranks import (
    AGREE_TIMEOUT_S,
    agree,
    broadcast_plan,
    call_description,
    verified_on_ranks,
    worst_rank_profile,
)

__all__ = ["is_sharded", "profile_sharded", "solve_sharded"]

log = logging.getLogger("remat")

_VERIFY = Verify()  # verify=True


def profile_sharded(
    model: nn.Module,
    sample_batch: Any,
    settings: ProfilingSettings,
    *,
    memory_budget: Any = None,
    call: Mapping[str, Any] | None = None,
    timeout_s: float = AGREE_TIMEOUT_S,
    group: Any = None,
) -> Profile:
    """The worst rank's step of the sharded ``model``, the same profile on every rank
    (steps 1 to 3 of the module docstring): what ``remat.profile`` returns on a sharded
    model, and what ``solve`` plans. Every rank must call it (a collective).

    ``settings`` are the eager route's (its loop already the ambient one's); ``call``: the
    entry point's own arguments, compared across ranks beside them (and ``memory_budget``).
    Two are overridden, as every rank must run every collective alike: ``tolerance`` is 0
    (stopping a time figure early on one rank's timings would skip collectives the others
    run) and ``progress`` is off.

    A module a forward left gathered without its backward (an evaluation under
    ``no_grad``) is resharded first, as the backward would have
    (:func:`~remat.execute.sharding.resharded_at_rest`).

    Raises:
        RematError: no process group, ranks that disagree or do not all call, or
            ``granularity`` other than ``"blocks"`` (each ``fully_shard``-ed block a unit).
        ArgumentError: on every rank, where a rank's optimizer holds tensors FSDP2 has
            freed (built while a module was gathered:
            :func:`~remat.execute.sharding.freed_optimizer_params`).
    """
    from remat.profiler import profile_levels
    from remat.profiler.sharded import sharded_profile

    if settings.granularity != "blocks":
        raise RematError(f"granularity={settings.granularity!r} on a sharded model: only "
                         "'blocks' (each fully_shard-ed block a unit) is supported there")
    agree(call_description(model, sample_batch, memory_budget, settings, call, group=group),
          timeout_s=timeout_s, group=group)
    resharded = resharded_at_rest(model)
    if resharded:
        log.info("remat: resharded %s, left gathered by a forward without its backward "
                 "(FSDP2 gathers them again at the next forward)",
                 ", ".join(repr(n or type(model).__name__) for n in resharded))
    freed = freed_optimizer_params(settings.optimizer)
    refusal = refusal_on_every_rank(model, None if not freed else (
        f"{freed} of the optimizer's parameters have no storage: they are the unsharded "
        "tensors of a module FSDP2 held gathered when the optimizer was built (after a "
        "forward without its backward), freed since, and the sharded parameters they "
        "stood for are in no optimizer; build the optimizer over model.parameters() "
        "after fully_shard and outside a step (before any forward, or after a backward)"))
    if refusal is not None:
        raise ArgumentError(refusal)
    local, _ = profile_levels(model, sample_batch,
                              **settings.replace(tolerance=0.0, progress=False).as_kwargs())
    return worst_rank_profile(sharded_profile(local, model), model, group)


def solve_sharded(
    model: nn.Module,
    sample_batch: Any,
    memory_budget: Any,
    settings: ProfilingSettings,
    *,
    method: str = "optimal",
    verify: Verify | None = _VERIFY,
    solver_params: Mapping[str, Any] | None = None,
    timeout_s: float = AGREE_TIMEOUT_S,
    group: Any = None,
) -> Plan:
    """The plan for one rank's step of the sharded ``model``, the same on every rank (see
    the module docstring); ``remat.solve``'s values (its settings, its verification:
    ``None`` for none), already checked by it.

    Raises:
        RematError: no process group, ranks that disagree or do not all call, or a setting
            this route does not support (``granularity`` other than ``"blocks"``).
        InfeasibleBudgetError: no plan fits the budget on the worst rank.
    """
    from remat.tune.ambient import planning

    solver_params = dict(solver_params or {})
    call = {"method": method, "verify": verify, **solver_params}
    with planning(model, settings.loop, "solve()") as loop:
        settings = settings.replace(loop=loop)
        prof = profile_sharded(model, sample_batch, settings, memory_budget=memory_budget,
                               call=call, timeout_s=timeout_s, group=group)

        def solve_at(budget: Any) -> Plan:
            return _solve_for_ranks(prof, budget, method=method, head=settings.head,
                                    solver_params=solver_params, world=world_size(model))

        plan = solve_at(memory_budget)
        if verify is not None and plan.budget_bytes is not None:
            plan = verified_on_ranks(model, sample_batch, prof, plan, settings, verify,
                                     solve_at, group=group)
    return broadcast_plan(plan, group)


def _solve_for_ranks(prof: Profile, budget: Any, *, method: str, head: str,
                     solver_params: Mapping[str, Any], world: int) -> Plan:
    """The plan for ``prof`` within ``budget``, recording the world size it is for (so
    ``apply_plan`` refuses it under another)."""
    from remat.solver.solve import solve_profile

    plan = solve_profile(prof, budget, method=method, head=head, **solver_params)
    return plan.with_(target=dataclasses.replace(plan.target, world_size=world))

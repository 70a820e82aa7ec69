"""``remat.solve`` on a model sharded with FSDP2, run collectively on every rank.

Every rank of the process group calls ``remat.solve(model, batch, memory_budget=...)``
on its ``fully_shard``-ed model (``remat.profile``, ``estimate`` and ``pareto`` run
steps 1 to 3 alike). The entry points hand over the eager route's values: one
:class:`~remat.core.settings.ProfilingSettings` and one
:class:`~remat.core.settings.Verify` (or ``None``). The ranks then:

1. **agree** (:func:`agree`): a barrier with a timeout (gloo: ``monitored_barrier``,
   which names the rank that did not come), then each rank's description of the call
   (the model's parameters' names, shapes and dtypes, the batch's shapes, the budget,
   every field of the settings, the method, the verification and the solver's
   parameters, the world size) gathered on every rank; a rank
   whose call differs from rank 0's is a :class:`~remat.core.errors.RematError` on
   every rank that names it and what differs. Without this a rank with another batch
   shape would issue other collectives than the rest, and the job would hang;
2. **profile** their own micro-batch, all running the same passes in the same order
   (so FSDP2's collectives match; :mod:`remat.profiler.sharded` says why no pass gathers
   more than FSDP2 itself), and turn it into their rank's step
   (:func:`~remat.profiler.sharded.sharded_profile`);
3. **take the worst rank**: the profiles are gathered and merged figure by figure
   (the largest of each: :func:`worst_profile`), so one plan covers every rank, and
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
import datetime
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from remat.core.errors import RematError
from remat.core.loop import Loop
from remat.core.plan import Plan
from remat.core.profile import UNIT_TYPE_COUNTS, Profile
from remat.core.settings import ProfilingSettings, Verify
from remat.execute.sharding import is_sharded, world_size
from remat.measurement.step import StepMeasurement

__all__ = ["AGREE_TIMEOUT_S", "agree", "call_description", "describe_settings", "is_sharded",
           "profile_sharded", "solve_sharded", "worst_profile"]

log = logging.getLogger("remat")

AGREE_TIMEOUT_S = 120.0  # how long a rank waits for the others to call solve() too
_VERIFY = Verify()  # verify=True


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RematError(
            "remat.solve() got a model sharded with fully_shard but no initialised process "
            "group: call it on every rank after torch.distributed.init_process_group()")
    return dist


def _shapes(batch: Any) -> list[tuple[str, tuple[int, ...], str]]:
    from torch.utils._pytree import keystr, tree_flatten_with_path

    leaves, _ = tree_flatten_with_path(batch)
    return [(keystr(path), tuple(t.shape), str(t.dtype)) for path, t in leaves
            if isinstance(t, torch.Tensor)]


def _model_signature(model: nn.Module) -> str:
    """A hash of the model's class, its parameters' names, global shapes and dtypes."""
    h = hashlib.sha256(type(model).__name__.encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
    return h.hexdigest()[:16]


def _plain(value: Any) -> Any:
    """``value`` as text that is equal on every rank for the same setting: a function, a
    class or an object without a ``repr`` of its own by its qualified name (their ``repr``
    holds an address, which differs by rank), an optimizer by its class and
    hyperparameters, a loop as its fields, a sequence item by item."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Loop):
        return value.to_dict()
    if isinstance(value, torch.optim.Optimizer):
        hyper = sorted((k, repr(v)) for k, v in value.defaults.items())
        return f"{type(value).__qualname__}{hyper}"
    if isinstance(value, type) or callable(value):
        name = getattr(value, "__qualname__", type(value).__qualname__)
        return f"{getattr(value, '__module__', '?')}.{name}"
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    if type(value).__repr__ is object.__repr__:  # "<... object at 0x...>": by its class
        return f"{type(value).__module__}.{type(value).__qualname__} object"
    return repr(value)


# Not compared across ranks: a progress line is drawn on a terminal only (rank 0's, often),
# changes no figure, and this route draws none (profile_sharded).
_UNCOMPARED = frozenset({"progress"})


def describe_settings(settings: ProfilingSettings) -> dict[str, Any]:
    """Every field of ``settings`` (but :data:`_UNCOMPARED`), as plain values: read from the
    fields, so a setting added to :class:`ProfilingSettings` is compared across ranks
    without a change here (ranks that time with other ``warmup``, ``repeats`` or
    ``tolerance`` would run other numbers of steps, so other collectives)."""
    return {f.name: _plain(getattr(settings, f.name)) for f in dataclasses.fields(settings)
            if f.name not in _UNCOMPARED}


def call_description(model: nn.Module, batch: Any, budget: Any, settings: ProfilingSettings,
                     call: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What every rank's call must agree on, as plain values (compared across ranks): the
    model, the batch's shapes, the budget, every profiling setting, and ``call``, the
    entry point's own arguments (the method, the verification, the solver's parameters)."""
    return {
        "world size": world_size(model),
        "model": _model_signature(model),
        "batch shapes": _shapes(batch),
        "memory_budget": _plain(budget),
        **describe_settings(settings),
        **{k: _plain(v) for k, v in sorted((call or {}).items())},
    }


def agree(description: Mapping[str, Any], *, timeout_s: float = AGREE_TIMEOUT_S,
          group: Any = None) -> None:
    """Check that every rank of ``group`` calls with the same ``description``.

    Raises:
        RematError: a rank did not arrive within ``timeout_s`` (the barrier's error
            names it where the backend can: gloo), or its description differs from rank
            0's (the message names the rank and the fields, with both values); raised on
            every rank alike, so none goes on into collectives the others skip.
    """
    dist = _dist()
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if dist.get_backend(group) == "gloo":
            dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
        else:
            dist.barrier(group=group)
    except RuntimeError as err:
        raise RematError(
            f"remat.solve() on a sharded model runs on every rank at once, and not every rank "
            f"called it within {timeout_s:.0f} s: {' '.join(str(err).split())[:400]}") from None
    found: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, dict(description), group=group)
    reference = found[0]
    for rank, other in enumerate(found[1:], start=1):
        differs = [k for k in reference if reference.get(k) != other.get(k)]
        if differs:
            what = "; ".join(f"{k}: rank 0 has {reference.get(k)!r}, rank {rank} has "
                             f"{other.get(k)!r}" for k in differs[:4])
            raise RematError(
                f"remat.solve() on a sharded model needs the same call on every rank, and rank "
                f"{rank} differs from rank 0 in {', '.join(differs)} ({what}); the ranks "
                f"would run different collectives (and hang): pass every rank the same model, "
                f"batch shapes, budget, loop and settings")


def _worst(values: Sequence[Any]) -> Any:
    """The largest of each figure across ranks' values of one field (see worst_profile)."""
    first = values[0]
    if isinstance(first, bool):
        return any(bool(v) for v in values)  # holds more: the conservative side
    if isinstance(first, (int, float)):
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return max(values)
        return first
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        if not all(type(v) is type(first) for v in values):
            return first
        merged = {f.name: _worst([getattr(v, f.name) for v in values])
                  for f in dataclasses.fields(first) if f.init and f.name != "meta"}
        return dataclasses.replace(first, **merged)
    if isinstance(first, Mapping):
        if not all(isinstance(v, Mapping) and v.keys() == first.keys() for v in values):
            return first
        return {k: _worst([v[k] for v in values]) for k in first}
    if isinstance(first, (tuple, list)):
        if not all(isinstance(v, (tuple, list)) and len(v) == len(first) for v in values):
            return first
        return type(first)(_worst(column) for column in zip(*values))
    return first


def worst_profile(profiles: Sequence[Profile]) -> Profile:
    """One profile whose every byte and time figure is the largest of ``profiles``' (each
    rank's step): a plan within a budget for it is within it on every rank. Names, the
    loop and ``meta`` are the first profile's."""
    if len(profiles) == 1:
        return profiles[0]
    merged = _worst(list(profiles))
    return dataclasses.replace(merged, meta=dict(profiles[0].meta), loop=profiles[0].loop)


def _gather_profiles(prof: Profile, group: Any) -> list[Profile]:
    dist = _dist()
    found: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, prof.to_json(), group=group)
    return [Profile.from_json(text) for text in found]


def _broadcast(plan: Plan, group: Any) -> Plan:
    dist = _dist()
    box = [plan.to_json() if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return Plan.from_json(box[0])


def _max_over_ranks(value: int, group: Any) -> int:
    dist = _dist()
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


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

    Raises:
        RematError: no process group, ranks that disagree or do not all call, or
            ``granularity`` other than ``"blocks"`` (each ``fully_shard``-ed block a unit).
    """
    from remat.execute.structure import unit_type_counts
    from remat.profiler import profile_levels
    from remat.profiler.sharded import sharded_profile

    if settings.granularity != "blocks":
        raise RematError(f"granularity={settings.granularity!r} on a sharded model: only "
                         "'blocks' (each fully_shard-ed block a unit) is supported there")
    agree(call_description(model, sample_batch, memory_budget, settings, call),
          timeout_s=timeout_s, group=group)
    local, _ = profile_levels(model, sample_batch,
                              **settings.replace(tolerance=0.0, progress=False).as_kwargs())
    counts = unit_type_counts(model, (u.type_name for u in local.units),
                              [u.name for u in local.units])
    sharded = sharded_profile(local, model)
    local = dataclasses.replace(sharded, meta={**sharded.meta, UNIT_TYPE_COUNTS: counts})
    return worst_profile(_gather_profiles(local, group))


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
            plan = _verified_on_ranks(model, sample_batch, prof, plan, settings, verify,
                                      solve_at, group=group)
    return _broadcast(plan, group)


def _solve_for_ranks(prof: Profile, budget: Any, *, method: str, head: str,
                     solver_params: Mapping[str, Any], world: int) -> Plan:
    """The plan for ``prof`` within ``budget``, recording the world size it is for (so
    ``apply_plan`` refuses it under another)."""
    from remat.solver.solve import solve_profile

    plan = solve_profile(prof, budget, method=method, head=head, **solver_params)
    return plan.with_(target=dataclasses.replace(plan.target, world_size=world))


def _verified_on_ranks(model: nn.Module, sample_batch: Any, prof: Profile, plan: Plan,
                       settings: ProfilingSettings, verify: Verify,
                       solve_at: Callable[[Any], Plan], *, group: Any) -> Plan:
    """``plan`` verified as ``verify`` says, against the highest peak measured over the
    ranks (every rank measures its own step, and decides alike on that one figure)."""
    from remat.tune.verify import measure_plan, verified

    def measure(candidate: Plan) -> StepMeasurement:
        # Timed (one more, un-metered step) whatever verify.timed says: without it the
        # metered steps' restore leaves FSDP2's root parameters unsharded in a state its
        # next forward refuses ("mixed torch.Tensor and DTensor"); the cause is open
        # (issue 32).
        measured = measure_plan(model, sample_batch, candidate, loss_fn=settings.loss_fn,
                                optimizer=settings.optimizer, loop=prof.loop,
                                steps=verify.steps, timed=True)
        worst = _max_over_ranks(measured.worst_peak_bytes, group)
        log.info("remat: rank's measured peak %d B, worst rank's %d B",
                 measured.worst_peak_bytes, worst)
        return dataclasses.replace(measured, peak_bytes=worst, allocator_peak_bytes=worst)

    budget_bytes = plan.budget_bytes
    return verified(plan, budget_bytes,
                    lambda target: solve_at(target).with_(budget_bytes=budget_bytes),
                    measure, rounds=verify.rounds)

"""What every rank of a distributed planning call runs alike: agree on the call, take the
worst rank's figures, verify against the worst rank's measured peak, hand out one plan.

``remat.solve`` on a model sharded with FSDP2 (:mod:`remat.tune.sharded`) and on one
replicated by DDP (:mod:`remat.tune.replicated`) is called on every rank; the two
routes differ in what a rank's step holds and share everything here. Every function
is a collective over ``group`` (``None``: the default process group): each rank must
call it, in the same order, or the job hangs; :func:`agree` comes first so that a
rank whose call differs fails, named, before any other collective runs.
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
from remat.measurement.step import StepMeasurement

__all__ = ["AGREE_TIMEOUT_S", "agree", "broadcast_plan", "call_description",
           "describe_settings", "gather_profiles", "max_over_ranks", "process_group_module",
           "verified_on_ranks", "worst_profile", "worst_rank_profile"]

log = logging.getLogger("remat")

AGREE_TIMEOUT_S = 120.0  # how long a rank waits for the others to call solve() too


def process_group_module(what: str) -> Any:
    """``torch.distributed``, with a process group initialised (``what``: the model's kind,
    for the message)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RematError(
            f"remat.solve() got {what} but no initialised process group: call it on every "
            "rank after torch.distributed.init_process_group()")
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
                     call: Mapping[str, Any] | None = None, *,
                     group: Any = None) -> dict[str, Any]:
    """What every rank's call must agree on, as plain values (compared across ranks): the
    model, the batch's shapes, the budget, every profiling setting, and ``call``, the
    entry point's own arguments (the method, the verification, the solver's parameters,
    a wrapper's settings)."""
    return {
        "world size": process_group_module("a distributed model").get_world_size(group),
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
    dist = process_group_module("a distributed model")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if dist.get_backend(group) == "gloo":
            dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
        else:
            dist.barrier(group=group)
    except RuntimeError as err:
        raise RematError(
            f"remat.solve() on a distributed model runs on every rank at once, and not every rank "
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
                f"remat.solve() on a distributed model needs the same call on every rank, and rank "
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
    loop and ``meta`` are the first profile's; the head is chunked only where every rank's
    profile has it (else ``meta["head_not_chunked"]`` names the first rank without)."""
    if len(profiles) == 1:
        return profiles[0]
    merged = _worst(list(profiles))
    meta = dict(profiles[0].meta)
    refused = next((rank for rank, p in enumerate(profiles) if p.head is None), None)
    if merged.head is not None and refused is not None:
        # A head not chunked on one rank (its check refused the rewrite on that rank's
        # micro-batch) is chunked on none: a plan must not rewrite a loss unchecked there.
        why = profiles[refused].meta.get("head_not_chunked", "its head was not measured")
        merged = dataclasses.replace(merged, head=None)
        meta["head_not_chunked"] = f"rank {refused}: {why}"
    return dataclasses.replace(merged, meta=meta, loop=profiles[0].loop)


def gather_profiles(prof: Profile, group: Any = None) -> list[Profile]:
    """Every rank's profile, on every rank (as JSON: the profiles are plain data)."""
    dist = process_group_module("a distributed model")
    found: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, prof.to_json(), group=group)
    return [Profile.from_json(text) for text in found]


def broadcast_plan(plan: Plan, group: Any = None) -> Plan:
    """Rank 0's ``plan``, on every rank: where two plans time within noise, ranks solving
    alone could pick different ones, and ranks must run one program."""
    dist = process_group_module("a distributed model")
    box = [plan.to_json() if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group or dist.group.WORLD, 0),
                               group=group)
    return Plan.from_json(box[0])


def max_over_ranks(value: int, group: Any = None) -> int:
    """The largest of every rank's ``value``, on every rank."""
    dist = process_group_module("a distributed model")
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def verified_on_ranks(model: nn.Module, sample_batch: Any, prof: Profile, plan: Plan,
                      settings: ProfilingSettings, verify: Verify,
                      solve_at: Callable[[Any], Plan], *, group: Any = None,
                      timed: bool | None = None) -> Plan:
    """``plan`` verified as ``verify`` says, against the highest peak measured over the
    ranks: every rank measures its own step of ``model`` (the wrapper, so its collectives
    run on every rank alike) and decides alike on that one figure (``timed``: overrides
    ``verify.timed``)."""
    from remat.tune.verify import measure_plan, verified

    def measure(candidate: Plan) -> StepMeasurement:
        measured = measure_plan(model, sample_batch, candidate, loss_fn=settings.loss_fn,
                                optimizer=settings.optimizer, loop=prof.loop,
                                steps=verify.steps,
                                timed=verify.timed if timed is None else timed)
        worst = max_over_ranks(measured.worst_peak_bytes, group)
        log.info("remat: rank's measured peak %d B, worst rank's %d B",
                 measured.worst_peak_bytes, worst)
        return dataclasses.replace(measured, peak_bytes=worst, allocator_peak_bytes=worst)

    budget_bytes = plan.budget_bytes
    return verified(plan, budget_bytes,
                    lambda target: solve_at(target).with_(budget_bytes=budget_bytes),
                    measure, rounds=verify.rounds)


def worst_rank_profile(local: Profile, model: nn.Module, group: Any = None) -> Profile:
    """The worst rank's profile, on every rank, from this rank's ``local`` one of ``model``
    (the module its units are in), which records how many modules of each unit class the
    model has (a plan solved from it refuses a deeper model)."""
    from remat.execute.structure import unit_type_counts

    counts = unit_type_counts(model, (u.type_name for u in local.units),
                              [u.name for u in local.units])
    local = dataclasses.replace(local, meta={**local.meta, UNIT_TYPE_COUNTS: counts})
    return worst_profile(gather_profiles(local, group))

"""``remat.solve`` on a model wrapped in ``DistributedDataParallel``, run on every rank.

DDP replicates the model: every rank holds all of it and trains it on its own
micro-batch, and the Reducer all-reduces the gradients in backward, bucket by bucket.
The plan is per rank (a rank's peak is its own step's), and the ranks must run one
program, so every rank calls ``remat.solve(ddp_model, batch, memory_budget=...)`` and:

1. **agree** on the call (:func:`remat.tune.ranks.agree`: a barrier with a timeout,
   then each rank's model, batch shapes, budget, loop and settings compared; a rank that
   differs is a ``RematError`` naming it, on every rank, not a hang);
2. **profile** their own micro-batch on the module inside the wrapper, or on a
   trainer's step around it (:class:`ReplicatedStep`: the Lightning and Hugging Face
   callbacks under DDP); the Reducer's hooks stay idle outside a DDP forward, so the
   profiler's replays run no collective. Then count what DDP adds to the rank's step
   (:func:`replicated_profile`): the Reducer's gradient buckets, read off the live
   Reducer (:func:`remat.measurement.storage.bucket_bytes`), held for the whole step. With
   ``gradient_as_bucket_view=False`` they are a second copy of the gradients; with
   ``True`` the gradients are views of them, so the buckets replace the gradients the
   backward would allocate;
3. **settle** the wrapper (:func:`settle`): one forward and backward through DDP (two
   with ``static_graph``, as written and before the profile: a known limit, see
   :func:`profile_replicated`) under the most frugal plan the rank's profile allows, its
   all-reduces run by every rank alike, and the Reducer's bucket rebuild (DDP regroups
   the buckets in gradient order at its second step, its third with ``static_graph``)
   done now, so that no measured step sees the wrapper's one-off first steps; the model
   is put back as it was;
4. **take the worst rank** (:func:`remat.tune.ranks.worst_profile`, the largest of
   every figure), so every rank solves one profile;
5. **verify** (with a budget) with a real step through the wrapper on every rank (its
   all-reduces included), the highest measured peak over the ranks deciding on every
   rank alike whether to solve again for less;
6. **broadcast** rank 0's plan, so every rank applies the same one; ``apply_plan``
   puts it on the module inside the wrapper.

The all-reduces' time is not in the profile's step time (it is the same for every plan
but for how much of it backward hides); the verified plan's measured step includes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from remat.core.loop import Loop
from remat.core.plan import Plan
from remat.core.profile import OutsideCost, Profile
from remat.core.settings import ProfilingSettings, Verify
from remat.execute.planned import unwrap
from remat.measurement.storage import bucket_bytes
from remat.tune.ranks import (
    AGREE_TIMEOUT_S,
    agree,
    broadcast_plan,
    call_description,
    process_group_module,
    verified_on_ranks,
    worst_rank_profile,
)

__all__ = ["ReplicatedStep", "is_replicated", "profile_replicated", "replicated_profile",
           "settle", "solve_replicated"]

log = logging.getLogger("remat")

DDP_BUCKET_BYTES = "ddp_bucket_bytes"  # Profile.meta: the buckets, counted with the buffers


class ReplicatedStep(nn.Module):
    """A trainer's training step, as a module remat can plan, over a module that a
    ``DistributedDataParallel`` wrapper replicates: for trainers whose step is not the
    wrapper's forward itself (Lightning redirects ``training_step`` through it, a Hugging
    Face ``Trainer`` subclass's ``compute_loss`` calls it).

    The route needs the step two ways: the profile replays units on the module directly
    (no collective: ranks may time different numbers of runs), while settling the
    wrapper and a measured step run it through the wrapper, as the trainer does (the
    Reducer's hooks and all-reduces, on every rank alike). One module serves both, so
    the units have one set of names: its forward runs :meth:`step`, and inside
    :meth:`through_ddp` it runs :meth:`step_through` instead.

    ``replicated_by`` is the wrapper (``None``: the trainer does not replicate the
    module, and ``remat.solve`` takes its ordinary route); a plain attribute, not a
    submodule, so the units stay named under the module alone. Subclasses: the callbacks
    of :mod:`remat.integrations`.
    """

    def __init__(self, replicated_by: nn.parallel.DistributedDataParallel | None) -> None:
        super().__init__()
        self.__dict__["replicated_by"] = replicated_by  # not registered (see above)
        self._through = False

    def step(self, batch: Any) -> Any:
        """The training step on the module itself (the profile's runs)."""
        raise NotImplementedError

    def step_through(self, ddp: nn.parallel.DistributedDataParallel, batch: Any) -> Any:
        """The same step through ``ddp``'s forward, as the trainer runs it."""
        raise NotImplementedError

    def forward(self, batch: Any) -> Any:
        ddp = self.replicated_by
        if self._through and ddp is not None:
            return self.step_through(ddp, batch)
        return self.step(batch)

    @contextlib.contextmanager
    def through_ddp(self) -> Iterator[None]:
        """Inside, the forward runs the step through the wrapper."""
        before, self._through = self._through, True
        try:
            yield
        finally:
            self._through = before


def _ddp(model: Any) -> nn.parallel.DistributedDataParallel | None:
    """The ``DistributedDataParallel`` among ``model``'s wrappers, or the one a
    :class:`ReplicatedStep` runs through (``None``: there is none)."""
    if isinstance(model, ReplicatedStep):
        return model.replicated_by
    while isinstance(model, nn.Module):
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return model
        inner = getattr(model, "_orig_mod", None)  # torch.compile's wrapper
        if not isinstance(inner, nn.Module):
            return None
        model = inner
    return None


def _profiled(model: nn.Module) -> nn.Module:
    """The module the profile runs on (no collective): the one inside the wrapper, or the
    step itself (:class:`ReplicatedStep`: its units are named as the plan names them)."""
    return model if isinstance(model, ReplicatedStep) else unwrap(model)


@contextlib.contextmanager
def _through_wrapper(model: nn.Module) -> Iterator[nn.Module]:
    """The module whose steps run through the wrapper, as training's do: the DDP model
    itself, or the step in its :meth:`ReplicatedStep.through_ddp` mode."""
    if isinstance(model, ReplicatedStep):
        with model.through_ddp():
            yield model
    else:
        yield model


def is_replicated(model: Any) -> bool:
    """Whether ``model`` is wrapped in ``DistributedDataParallel`` (perhaps compiled), or
    is a :class:`ReplicatedStep` that runs through such a wrapper."""
    return _ddp(model) is not None


def _group(ddp: nn.parallel.DistributedDataParallel) -> Any:
    process_group_module("a DistributedDataParallel model")
    return ddp.process_group


def _description(ddp: nn.parallel.DistributedDataParallel, batch: Any, budget: Any,
                 settings: ProfilingSettings, call: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`~remat.tune.ranks.call_description` with DDP's own settings."""
    ddp_call = {"gradient_as_bucket_view": ddp.gradient_as_bucket_view, **call}
    return call_description(ddp, batch, budget, settings, ddp_call, group=ddp.process_group)


def settle(model: nn.Module, batch: Any,
           loss_fn: Callable[[Any, Any], Any] | None, loop: Loop | None,
           frugal: Plan | None = None) -> None:
    """Run DDP's first step and its bucket rebuild now, with ``frugal`` applied, and put
    the model back.

    ``model``: the DDP model, or a :class:`ReplicatedStep` (run through its wrapper).
    ``frugal``: the plan of the smallest peak the rank's profile allows
    (:func:`_most_frugal`); ``None`` runs the step as written.

    Why: DDP's first backward records the order gradients arrive in, and the next
    forward reallocates the buckets in that order. A measured region holding that forward
    would count the new buckets and never see the old ones go (made before it): the
    buckets twice. One forward and backward through the wrapper (all-reduces on every
    rank alike), then the rebuild (a collective too), settles it for every step after.

    Why under the most frugal plan: the step as written is the step the user could not
    fit. On a device of the budget it ran out of memory before any plan was made: a raw
    ``torch.OutOfMemoryError`` out of ``solve`` (``benchmarks/fsdp_in_device.py``'s DDP
    Mixtral at its smallest feasible budget, 2026-11-29). Checkpointing recomputes within
    a unit's backward, so the gradients arrive unit by unit in the same order and the
    buckets are rebuilt as the plan's own steps would have them.
    """
    from remat.core.loop import loop_or_default
    from remat.measurement.runner import StepRunner, model_device
    from remat.measurement.state import clear_grads, training_session

    ddp = _ddp(model)
    assert ddp is not None, "settle() needs a model DistributedDataParallel replicates"
    # With ``static_graph`` the Reducer records the gradients' order at the second step,
    # not the first (it delays the first step's all-reduces to its end): two steps. With
    # ``find_unused_parameters`` (and no static graph) it never rebuilds: one step settles.
    steps = 2 if getattr(ddp, "static_graph", False) else 1
    rebuilt = False
    with _out_of_memory_named(frugal), _through_wrapper(model) as stepped, \
            training_session(stepped) as state, _applied(model, frugal):
        runner = StepRunner(stepped, batch, loss_fn, None, loop_or_default(loop),
                            model_device(stepped).type)
        for _ in range(steps):
            output, loss = runner.forward()
            del output
            runner.backward(loss)
            del loss
            clear_grads(state.params)  # with bucket views, else copied into the new buckets
            rebuilt = ddp.reducer._rebuild_buckets()
            if rebuilt:
                ddp._has_rebuilt_buckets = True  # as DDP's own forward records it
                break
    log.info("remat: DDP settled in %d step(s) (buckets rebuilt now: %s)", steps, rebuilt)


@contextlib.contextmanager
def _out_of_memory_named(frugal: Plan | None) -> Iterator[None]:
    """The device running out of memory while settling is a :class:`DeviceMemoryError`:
    the step ran under the most frugal plan, so no plan fits (a budget at the smallest
    feasible peak, which a real step can pass by a few bytes: verification refuses such a
    budget by that much where the device lets it measure)."""
    from remat.core.bytesize import format_bytes
    from remat.core.errors import DeviceMemoryError

    try:
        yield
    except torch.OutOfMemoryError as err:
        why = " ".join(str(err).split())[:200]
        if frugal is None:
            raise DeviceMemoryError(
                f"DDP's first steps, run as written to settle its buckets (static_graph: "
                f"remat.tune.replicated's known limit), ran out of device memory ({why}); "
                "plan without static_graph, or on a device that fits the unplanned step"
            ) from None
        peak = frugal.record.predicted_peak_bytes
        raise DeviceMemoryError(
            "DDP's first step, run to settle its buckets under the most frugal plan "
            f"({frugal.summary()}; predicted {format_bytes(peak) if peak else 'unknown'}), "
            f"ran out of device memory ({why}): no plan fits this device; raise the budget "
            "above that prediction, or use a smaller batch"
        ) from None


@contextlib.contextmanager
def _applied(model: nn.Module, plan: Plan | None) -> Iterator[None]:
    """``plan`` applied to ``model`` inside (nothing where ``None``), removed after."""
    from remat.runtime import apply_plan, remove_plan

    if plan is None:
        yield
        return
    apply_plan(model, plan)
    try:
        yield
    finally:
        remove_plan(model)


def _most_frugal(profile: Profile) -> Plan:
    """The plan of the smallest peak ``profile`` allows (solved at the budget a byte's
    budget says is the smallest feasible)."""
    from remat.core.errors import InfeasibleBudgetError
    from remat.solver.solve import solve_profile

    try:
        return solve_profile(profile, 1)
    except InfeasibleBudgetError as err:
        return solve_profile(profile, err.min_feasible_bytes)


def _grads_held(part: OutsideCost, in_flight: int) -> OutsideCost:
    """``part`` whose parameters' gradients land in the buckets: only a partial sum
    autograd still holds (``in_flight``: a weight tied to one used later in backward)
    is held past it. Counted to the end of the step, as a gradient: over, never under."""
    return dataclasses.replace(part, param_grad_bytes=min(part.param_grad_bytes, in_flight))


def replicated_profile(profile: Profile, ddp: nn.parallel.DistributedDataParallel) -> Profile:
    """``profile`` (measured on the module inside ``ddp``) as this rank's DDP step: the
    Reducer's gradient buckets held throughout (counted with the buffers; the bytes in
    ``meta["ddp_bucket_bytes"]``). With ``gradient_as_bucket_view`` the gradients are
    views of the buckets, so the backward's parameter gradients are the buckets' bytes
    already (each fresh gradient is copied into its bucket and dropped at once: within
    the unit's backward peak, as measured), but for the partial sum of a tied weight's
    gradient, which autograd holds from the suffix's backward to the prefix's."""
    buckets = bucket_bytes(ddp, grads=False)
    as_view = bool(ddp.gradient_as_bucket_view)
    changed: dict[str, Any] = {"buffer_bytes": profile.buffer_bytes + buckets}
    if as_view:
        changed.update(
            units=tuple(dataclasses.replace(u, param_grad_bytes=0, before_param_grad_bytes=0)
                        for u in profile.units),
            prefix=_grads_held(profile.prefix, 0),
            suffix=_grads_held(profile.suffix, profile.grad_in_flight_bytes))
    meta = {**profile.meta, DDP_BUCKET_BYTES: buckets, "ddp_gradient_as_bucket_view": as_view}
    return dataclasses.replace(profile, meta=meta, **changed)


def profile_replicated(
    model: nn.Module,
    sample_batch: Any,
    settings: ProfilingSettings,
    *,
    memory_budget: Any = None,
    call: Mapping[str, Any] | None = None,
    timeout_s: float = AGREE_TIMEOUT_S,
) -> Profile:
    """The worst rank's DDP step (steps 1 to 4 of the module docstring), the same profile
    on every rank: what ``remat.profile`` returns on a DDP model. Every rank must call it.

    ``settings`` are the eager route's (its loop already the ambient one's); ``call``: the
    entry point's own arguments, compared across ranks beside them. The profile runs no
    collective (the module inside the wrapper), so it may stop a time figure early.

    Raises:
        RematError: no process group, or ranks that disagree or do not all call.
    """
    from remat.profiler import profile_levels

    ddp = _ddp(model)
    assert ddp is not None, "profile_replicated() needs a DistributedDataParallel model"
    group = _group(ddp)
    agree(_description(ddp, sample_batch, memory_budget, settings, call or {}),
          timeout_s=timeout_s, group=group)
    inner = _profiled(model)
    # Profiled before DDP is settled (the profile runs on the module inside the wrapper,
    # the Reducer idle), so that settling runs under the most frugal plan it allows, DDP's
    # step (its buckets counted) deciding which that is. Known limit: with static_graph,
    # DDP records its graph from its first steps, and a profile's backwards before them
    # (or a recomputing plan in them) made its bucket rebuild fail ("parameters that were
    # not used in producing the loss": tests/test_trainers_ddp.py, Lightning's
    # static_graph); it settles first, as written, which a device smaller than that step
    # refuses (a DeviceMemoryError naming it).
    static = bool(getattr(ddp, "static_graph", False))
    if static:
        settle(model, sample_batch, settings.loss_fn, settings.loop)
    local, _ = profile_levels(inner, sample_batch,
                              **settings.replace(progress=False).as_kwargs())
    if not static:
        settle(model, sample_batch, settings.loss_fn, settings.loop,
               _most_frugal(replicated_profile(local, ddp)))
    return worst_rank_profile(replicated_profile(local, ddp), inner, group)


def solve_replicated(
    model: nn.Module,
    sample_batch: Any,
    memory_budget: Any,
    settings: ProfilingSettings,
    *,
    method: str = "optimal",
    verify: Verify | None = None,
    solver_params: Mapping[str, Any] | None = None,
    timeout_s: float = AGREE_TIMEOUT_S,
) -> Plan:
    """The plan for one rank's step of the DDP ``model``, the same on every rank (see the
    module docstring); ``remat.solve``'s values (its settings, its verification: ``None``
    for none), already checked by it.

    Raises:
        RematError: no process group, or ranks that disagree or do not all call.
        InfeasibleBudgetError: no plan fits the budget on the worst rank.
    """
    from remat.solver.solve import solve_profile
    from remat.tune.ambient import planning

    solver_params = dict(solver_params or {})
    ddp = _ddp(model)
    assert ddp is not None, "solve_replicated() needs a DistributedDataParallel model"
    group = _group(ddp)
    with planning(model, settings.loop, "solve()") as loop:
        settings = settings.replace(loop=loop)
        prof = profile_replicated(model, sample_batch, settings, memory_budget=memory_budget,
                                  call={"method": method, "verify": verify, **solver_params},
                                  timeout_s=timeout_s)

        def solve_at(budget: Any) -> Plan:
            return solve_profile(prof, budget, method=method, head=settings.head,
                                 **solver_params)

        plan = solve_at(memory_budget)
        if verify is not None and plan.budget_bytes is not None:
            # Through the wrapper: the buckets held, the all-reduces run on every rank.
            with _through_wrapper(model) as stepped:
                plan = verified_on_ranks(stepped, sample_batch, prof, plan, settings,
                                         verify, solve_at, group=group)
    return broadcast_plan(plan, group)

"""Stamping a solved plan with ``simulate()``'s figures, and checking that it fits.

Every algorithm (DP, CP-SAT, the baselines) ends here, so a plan's record
(``predicted_peak_bytes``, ``predicted_time_ms``) is always the specification's,
never a search's own arithmetic, and its target (what it was made for) the profile's.
"""

from __future__ import annotations

import time
from dataclasses import replace

from remat.core.plan import ChunkedHead, Plan, PlanRecord, PlanTarget, Status
from remat.core.profile import UNIT_TYPE_COUNTS, OutsideCost, Profile
from remat.solver.resolve import no_checkpoint_peak_bytes
from remat.solver.simulate import simulate

__all__ = ["activations_only", "keep_all_when_it_fits", "stamp_plan"]


def stamp_plan(
    profile: Profile,
    plan: Plan,
    *,
    algorithm: str,
    status: str,
    budget: int | None,
    start: float,
) -> Plan:
    """``plan`` with ``simulate()``'s peak and time and what produced it.

    ``start`` is the ``time.perf_counter()`` at which the algorithm started. Every
    algorithm chooses plans by the event model, which must agree with ``simulate()``:
    a plan that peaks above ``budget`` is a bug, not a user error, and raises
    ``AssertionError``.
    """
    plan = _with_required_head(profile, plan)
    sim = simulate(profile, plan)
    if budget is not None and sim.peak_bytes > budget:
        raise AssertionError(
            f"{algorithm} plan peaks at {sim.peak_bytes} B under simulate(), above the "
            f"budget {budget} B: the event model and simulate() disagree"
        )
    record = PlanRecord(
        algorithm=algorithm,
        status=status,
        solve_ms=(time.perf_counter() - start) * 1e3,
        predicted_peak_bytes=sim.peak_bytes,
        predicted_time_ms=sim.time_ms,
        persistent_bytes=profile.persistent_bytes,
        activation_peak_bytes=simulate(activations_only(profile), plan).peak_bytes,
    )
    target = PlanTarget(
        unit_types=tuple(u.type_name for u in profile.units),
        unit_signatures=_signatures(profile),
        device=profile.device.split(":")[0],
        loop=profile.loop,
        input_shapes=tuple(profile.input_shapes.items()),
        unit_type_counts=_type_counts(profile),
    )
    return plan.with_(budget_bytes=budget, target=target, record=record)


def _with_required_head(profile: Profile, plan: Plan) -> Plan:
    """``plan``, computing the head over the chunks every plan of ``profile`` needs when
    the head as it is did not fit the device while profiling (the profile's own figures
    are then that variant's: :attr:`HeadProfile.as_is`)."""
    head = profile.head
    if plan.head is not None or head is None or head.required_chunks is None:
        return plan
    return plan.with_(head=ChunkedHead(head.name, head.kind, head.signature,
                                       head.required_chunks,
                                       "the head as written did not fit the device"))


def activations_only(profile: Profile) -> Profile:
    """``profile`` without the bytes that do not grow with the batch: parameters,
    buffers, optimizer state and its steps (after or in backward), parameter gradients.

    Its peak under a plan is the plan's activation peak, whatever the moment: the
    runtime scales it to inputs larger than the profiled ones (``persistent +
    growth * activation peak`` bounds every moment's bytes when activations grow
    linearly), where scaling the plan's own peak would not, since that peak may sit
    where the gradients are the bulk and activations few.
    """
    cached = profile.__dict__.get(_ACTIVATIONS_ONLY)
    if cached is not None:
        return cached

    def no_grads(outside: OutsideCost) -> OutsideCost:
        return replace(outside, param_grad_bytes=0, stepped_bwd_peak_bytes=None)

    reduced = replace(
        profile,
        units=tuple(replace(u, param_grad_bytes=0, before_param_grad_bytes=0, options={
            name: replace(cost, stepped_bwd_peak_bytes=None) for name, cost in u.options.items()})
            for u in profile.units),
        prefix=no_grads(profile.prefix),
        suffix=no_grads(profile.suffix),
        param_bytes=0,
        buffer_bytes=0,
        optimizer_state_bytes=0,
        optimizer_step_peak_bytes=0,
        grad_in_flight_bytes=0,
        head=None if profile.head is None else replace(profile.head, variants=tuple(
            replace(v, prefix=no_grads(v.prefix), suffix=no_grads(v.suffix),
                    grad_in_flight_bytes=0)
            for v in profile.head.variants)),
    )
    # Kept on the (frozen) profile like its event model: every plan stamped from one
    # profile (a frontier, verification's rounds) reuses it and its event model.
    profile.__dict__[_ACTIVATIONS_ONLY] = reduced
    return reduced


_ACTIVATIONS_ONLY = "_remat_activations_only"


def _signatures(profile: Profile) -> tuple[str, ...] | None:
    """The units' structure signatures, when the profile recorded every one."""
    signatures = tuple(u.param_signature for u in profile.units)
    return None if any(s is None for s in signatures) else signatures  # type: ignore[return-value]


def _type_counts(profile: Profile) -> tuple[tuple[str, int], ...] | None:
    """How many modules of each unit class the profiled model had, when recorded."""
    counts = profile.meta.get(UNIT_TYPE_COUNTS)
    if not isinstance(counts, dict):
        return None
    return tuple((str(name), int(n)) for name, n in sorted(counts.items()))


def keep_all_when_it_fits(
    profile: Profile, budget: int | None, *, algorithm: str, start: float
) -> Plan | None:
    """The no-checkpoint plan, stamped optimal, when ``budget`` allows it; else ``None``.

    Keeping everything is a fastest plan (every option's ``extra_ms`` is measured
    against keep's 0), so at a budget of at least its peak, or with no budget, it
    is the optimum. Exact solvers return it without searching, so no arithmetic of
    theirs ever sees a huge budget. The plan keeps the budget as given.
    """
    if budget is not None and budget < no_checkpoint_peak_bytes(profile):
        return None
    plan = Plan.keep_all([u.name for u in profile.units])
    return stamp_plan(profile, plan, algorithm=algorithm, status=Status.OPTIMAL, budget=budget,
                      start=start)

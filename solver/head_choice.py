"""The output head as a plan decision: exact first, a chunked head where the budget needs it.

A profile that measured a chunked head (:attr:`Profile.head`) offers one more decision
per plan: the head as the model computes it, or over one of the chunk counts measured.
Each variant is a profile of its own (:meth:`Profile.with_head`). The chunked loss is
not bitwise the one as written (it sums in another order), so by default
(``head="auto"``) the head as written is kept wherever a plan with it fits, however much
faster a chunked one would be; a chunk count is chosen only below the smallest peak the
head as written reaches (then the fastest fitting count), or where the head as written
did not fit the device while profiling. ``head="chunked"`` lets speed decide: the
fastest plan over every choice, the head as written on a tie. ``head="none"`` keeps the
head as written (an error where it was not measured). The plan's head decision says why
it was taken (:attr:`ChunkedHead.why`).

Users: :func:`remat.solver.solve.solve_profile` and the frontier
(:mod:`remat.solver.pareto`) solve through :func:`solve_over_heads`; the estimate and
the infeasible-budget error quote :func:`lowest_floor`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from remat.core.bytesize import format_bytes
from remat.core.errors import ArgumentError, InfeasibleBudgetError, ProfileError
from remat.core.plan import ChunkedHead, Plan
from remat.core.profile import Profile
from remat.solver.min_peak import min_peak_bytes
from remat.solver.stamp import stamp_plan

__all__ = ["HEAD_SETTINGS", "head_choices", "head_decision", "lowest_floor",
           "min_peak_bytes_over_heads", "solve_over_heads"]

# How a plan may decide the head (see the module docstring).
HEAD_SETTINGS = ("auto", "chunked", "none")

Algorithm = Callable[..., Plan]

# Plan times are sums of floats: a variant must be faster by more than this to win.
_TIME_TOLERANCE_MS = 1e-9


def head_choices(profile: Profile) -> tuple[int | None, ...]:
    """The head's choices on ``profile``: ``None`` (as it is, where it was measured), then
    each chunk count."""
    head = profile.head
    if head is None:
        return (None,)
    return (*((None,) if head.as_is else ()), *head.chunk_counts)


def head_decision(profile: Profile, chunks: int | None, why: str = "") -> ChunkedHead | None:
    """The plan decision for the head of ``profile`` over ``chunks`` chunks (``None``: the
    head as written). Not :func:`remat.execute.head.chunked_head`, which runs one."""
    if chunks is None:
        return None
    head = profile.head
    assert head is not None, "no chunked head was measured"
    head.variant(chunks)  # measured, or a ProfileError naming the counts that were
    return ChunkedHead(head.name, head.kind, head.signature, chunks, why)


def lowest_floor(profile: Profile) -> tuple[int | None, int]:
    """``(chunks, bytes)``: the smallest peak any plan reaches, over the head's choices,
    and the head's choice reaching it (``None``, the head as it is, on a tie)."""
    floors = [(min_peak_bytes(profile.with_head(c)), k, c)
              for k, c in enumerate(head_choices(profile))]
    nbytes, _, chunks = min(floors)
    return chunks, nbytes


def min_peak_bytes_over_heads(profile: Profile) -> int:
    """The smallest simulated peak of any plan over every choice of the head measured (as
    written, and each chunk count), in bytes: :func:`lowest_floor`'s bytes.
    :func:`~remat.solver.min_peak.min_peak_bytes` is the smallest with the profile's head
    as it stands."""
    return lowest_floor(profile)[1]


def solve_over_heads(fn: Algorithm, profile: Profile, budget: int | None, *,
                     head: str = "auto", **params: Any) -> Plan:
    """``fn``'s plan for ``budget`` over the head's choices, as ``head`` says (see the
    module docstring).

    Raises:
        InfeasibleBudgetError: no choice has a plan that fits; the error quotes the
            choice with the smallest peak (and says when that is a chunked head).
        ArgumentError: ``head`` is not one of :data:`HEAD_SETTINGS`.
        ProfileError: ``head="none"`` on a profile whose head as written was not measured.
    """
    if head not in HEAD_SETTINGS:
        raise ArgumentError(f"head={head!r}: valid values are {list(HEAD_SETTINGS)}")
    if profile.head is not None and head == "none":
        if not profile.head.as_is:
            raise ProfileError(
                f"head='none': the head {profile.head.name!r} as written was not measured (it "
                "did not fit the device while profiling), so every plan of this profile "
                "computes it over chunks; profile on a device it fits, or leave head='auto'")
        profile = replace(profile, head=None)
    if profile.head is None or budget is None:
        return fn(profile, budget, **params)  # stamp_plan adds a head every plan needs
    start = time.perf_counter()
    choices = head_choices(profile)
    failures: list[tuple[int | None, InfeasibleBudgetError]] = []
    why = "head='chunked': the fastest plan"
    if head == "auto" and choices[0] is None:  # exact first
        try:
            return fn(profile.with_head(None), budget, **params)
        except InfeasibleBudgetError as err:
            failures.append((None, err))
            choices = choices[1:]
            why = (f"the budget is below {format_bytes(err.min_feasible_bytes)}, the smallest "
                   "peak with the head as written")
    best: Plan | None = None
    for chunks in choices:
        variant = profile.with_head(chunks)
        if best is not None and best.record.predicted_time_ms <= variant.step_ms:
            continue  # nothing on this variant is faster than a plan already found
        try:
            plan = fn(variant, budget, **params)
        except InfeasibleBudgetError as err:
            failures.append((chunks, err))
            continue
        if chunks is not None:
            plan = stamp_plan(profile, plan.with_(head=head_decision(profile, chunks, why)),
                              algorithm=plan.record.algorithm, status=plan.record.status,
                              budget=budget, start=start)
        if best is None or (plan.record.predicted_time_ms
                            < best.record.predicted_time_ms - _TIME_TOLERANCE_MS):
            best = plan
    if best is None:
        raise _lowest(profile, failures)
    return best


def _lowest(profile: Profile,
            failures: list[tuple[int | None, InfeasibleBudgetError]]) -> InfeasibleBudgetError:
    """The failure with the smallest peak, saying which head reaches it."""
    chunks, err = min(failures, key=lambda f: f[1].min_feasible_bytes)
    if chunks is None:
        return err
    assert profile.head is not None
    head = (f"That peak computes the head {profile.head.name!r} and its loss over {chunks} "
            f"chunks of the tokens (remat chooses it when the budget needs it).")
    return InfeasibleBudgetError(err.budget_bytes, err.min_feasible_bytes,
                                 f"{head} {err.detail}".strip(), peak_event=err.peak_event,
                                 peak_parts=err.peak_parts)

"""The output head as a plan decision: the fastest plan over the head's measured variants.

A profile that measured a chunked head (:attr:`Profile.head`) offers one more decision
per plan: the head as the model computes it, or over one of the chunk counts measured.
Each variant is a profile of its own (:meth:`Profile.with_head`); the algorithm solves
each, and the fastest plan that fits wins, the head as it is on a tie. A variant's step
is never faster than the head as it is (:class:`~remat.core.profile.HeadVariant`), so a
chunk count is chosen only where the budget needs it: where the head as it is has no
plan that fits, or only slower ones (more recomputation in the blocks than the head's
own costs).

Users: :func:`remat.solver.solve.solve_profile` and the frontier
(:mod:`remat.solver.pareto`) solve through :func:`solve_over_heads`; the estimate and
the infeasible-budget error quote :func:`lowest_floor`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from remat.core.errors import InfeasibleBudgetError
from remat.core.plan import ChunkedHead, Plan
from remat.core.profile import Profile
from remat.solver.min_peak import min_peak_bytes
from remat.solver.stamp import stamp_plan

__all__ = ["chunked_head", "head_choices", "lowest_floor", "solve_over_heads"]

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


def chunked_head(profile: Profile, chunks: int | None) -> ChunkedHead | None:
    """The plan decision for the head of ``profile`` over ``chunks`` chunks."""
    if chunks is None:
        return None
    head = profile.head
    assert head is not None, "no chunked head was measured"
    head.variant(chunks)  # measured, or a ProfileError naming the counts that were
    return ChunkedHead(head.name, head.kind, head.signature, chunks)


def lowest_floor(profile: Profile) -> tuple[int | None, int]:
    """``(chunks, bytes)``: the smallest peak any plan reaches, over the head's choices,
    and the head's choice reaching it (``None``, the head as it is, on a tie)."""
    floors = [(min_peak_bytes(profile.with_head(c)), k, c)
              for k, c in enumerate(head_choices(profile))]
    nbytes, _, chunks = min(floors)
    return chunks, nbytes


def solve_over_heads(fn: Algorithm, profile: Profile, budget: int | None,
                     **params: Any) -> Plan:
    """The fastest of ``fn``'s plans for ``budget`` over the head's choices.

    Raises:
        InfeasibleBudgetError: no choice has a plan that fits; the error quotes the
            choice with the smallest peak (and says when that is a chunked head).
    """
    if profile.head is None or budget is None:
        return fn(profile, budget, **params)  # stamp_plan adds a head every plan needs
    start = time.perf_counter()
    best: Plan | None = None
    failures: list[tuple[int | None, InfeasibleBudgetError]] = []
    for chunks in head_choices(profile):
        variant = profile.with_head(chunks)
        if best is not None and best.record.predicted_time_ms <= variant.step_ms:
            continue  # nothing on this variant is faster than a plan already found
        try:
            plan = fn(variant, budget, **params)
        except InfeasibleBudgetError as err:
            failures.append((chunks, err))
            continue
        if chunks is not None:
            plan = stamp_plan(profile, plan.with_(head=chunked_head(profile, chunks)),
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

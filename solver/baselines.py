"""The plans people use without an optimiser, as algorithms: none, all, uniform, chen, chen-greedy.

Each has the solver signature ``fn(profile, budget_bytes, **params) -> Plan``.
With a budget, a heuristic's plan must fit it under ``simulate()``; when it does
not, :class:`InfeasibleBudgetError` says so and points to ``method="optimal"``.

Segment-based heuristics produce groups of consecutive units to checkpoint.
On a chain a group becomes one multi-unit segment; off a chain (where segments
do not exist) and for a single unit it becomes the per-unit option
``checkpoint``. Units without a ``checkpoint`` cost are kept and split a group.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from remat.core.checks import check_budget_bytes, check_count
from remat.core.errors import InfeasibleBudgetError
from remat.core.option import Option
from remat.core.plan import Plan, Status
from remat.core.profile import Profile
from remat.solver.events import StepModel, plan_peak_bytes, step_model
from remat.solver.infeasible import infeasible_budget_error
from remat.solver.min_peak import min_peak_bytes
from remat.solver.stamp import stamp_plan

__all__ = [
    "chen_greedy_plan",
    "chen_groups",
    "chen_plan",
    "checkpoint_all_plan",
    "greedy_groups",
    "groups_to_options",
    "keep_all_plan",
    "uniform_groups",
    "uniform_plan",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Candidate:
    """A heuristic's plan before it is stamped: options, segments, and its figures.

    Attributes:
        options: per unit option.
        segments: multi-unit checkpoint segments.
        peak_bytes: its peak by the event model (``simulate()``'s figure).
        time_ms: its step time, in milliseconds.
        label: what produced it (``"uniform(k=4)"``).
    """

    options: tuple[str, ...]
    segments: tuple[tuple[int, int], ...]
    peak_bytes: int
    time_ms: float
    label: str


# ---------------------------------------------------------------------------------
# Groups of units to checkpoint -> options and segments
# ---------------------------------------------------------------------------------
def _runs_with_checkpoint(profile: Profile, group: range) -> list[range]:
    """Maximal runs of ``group`` whose units all offer ``checkpoint``; a run also ends
    where no segment may span a link (:meth:`Profile.segment_link`), so that each run
    can be one segment."""
    runs, start = [], None
    for i in group:
        has = Option.CHECKPOINT in profile.units[i].options
        if has and start is None:
            start = i
        if not has and start is not None:
            runs.append(range(start, i))
            start = None
        elif (has and i + 1 < group.stop and profile.is_chain
              and Option.CHECKPOINT in profile.units[i + 1].options
              and not profile.segment_link(i)):
            runs.append(range(start, i + 1))
            start = None
    if start is not None:
        runs.append(range(start, group.stop))
    return runs


def groups_to_options(
    profile: Profile, groups: Iterable[range]
) -> tuple[tuple[str, ...], tuple[tuple[int, int], ...]]:
    """Options and segments that checkpoint ``groups`` and keep every other unit."""
    options = [Option.KEEP.value] * profile.n
    segments = []
    for group in groups:
        for run in _runs_with_checkpoint(profile, group):
            for i in run:
                options[i] = Option.CHECKPOINT.value
            if profile.is_chain and len(run) >= 2:
                segments.append((run.start, run.stop - 1))
    return tuple(options), tuple(sorted(segments))


def _candidate(
    profile: Profile, model: StepModel, groups: Iterable[range], label: str
) -> _Candidate:
    options, segments = groups_to_options(profile, groups)
    time_ms = profile.step_time_ms(sum(
        profile.units[i].options[o].extra_ms for i, o in enumerate(options)
    ))
    return _Candidate(options, segments, plan_peak_bytes(model, options, segments), time_ms,
                      label)


# ---------------------------------------------------------------------------------
# Choosing among candidates, stamping, and failing well
# ---------------------------------------------------------------------------------
def _fastest_fitting(candidates: Sequence[_Candidate], budget: int | None) -> _Candidate | None:
    """With a budget, the fastest candidate that fits (then the lowest peak);
    without one, the lowest peak (then the fastest)."""
    if budget is None:
        return min(candidates, key=lambda c: (c.peak_bytes, c.time_ms))
    fitting = [c for c in candidates if c.peak_bytes <= budget]
    if not fitting:
        return None
    return min(fitting, key=lambda c: (c.time_ms, c.peak_bytes))


def _too_tight(
    profile: Profile, budget: int, algorithm: str, best: _Candidate
) -> InfeasibleBudgetError:
    """The error for a heuristic that cannot meet ``budget``; ``best`` is its lowest peak.

    Below the true smallest peak nothing fits, and the error carries that peak and
    where it sits; otherwise the optimum would fit, and the error carries this
    heuristic's smallest peak and where it sits, and says to use ``method="optimal"``.
    """
    floor = min_peak_bytes(profile)
    if budget < floor:
        return infeasible_budget_error(profile, budget, detail="No plan of any method fits it.")
    return infeasible_budget_error(
        profile,
        budget,
        best=_as_plan(profile, best),
        detail=f"Here 'any plan' means any plan method {algorithm!r} makes; method='optimal' "
        f"fits this budget (its plans go down to {floor} bytes): try method='optimal'.",
    )


def _as_plan(profile: Profile, candidate: _Candidate) -> Plan:
    return Plan(tuple(u.name for u in profile.units), candidate.options, candidate.segments)


def _pick(
    profile: Profile,
    candidates: Sequence[_Candidate],
    budget: int | None,
    algorithm: str,
    start: float,
) -> Plan:
    """The chosen candidate, stamped; or the error for a budget none of them fits."""
    chosen = _fastest_fitting(candidates, budget)
    if chosen is None:
        assert budget is not None
        lowest = min(candidates, key=lambda c: (c.peak_bytes, c.time_ms))
        raise _too_tight(profile, budget, algorithm, lowest)
    plan = stamp_plan(profile, _as_plan(profile, chosen), algorithm=algorithm,
                      status=Status.FEASIBLE, budget=budget, start=start)
    log.debug("%s: chose %s (peak %d B, %.3f ms)", algorithm, chosen.label,
              plan.record.predicted_peak_bytes, plan.record.predicted_time_ms)
    return plan


# ---------------------------------------------------------------------------------
# The algorithms
# ---------------------------------------------------------------------------------
def keep_all_plan(profile: Profile, budget_bytes: int | None = None) -> Plan:
    """``none``: no checkpointing at all."""
    start = time.perf_counter()
    budget_bytes = check_budget_bytes(budget_bytes)
    model = step_model(profile)
    return _pick(profile, [_candidate(profile, model, [], "none")], budget_bytes, "none", start)


def checkpoint_all_plan(profile: Profile, budget_bytes: int | None = None) -> Plan:
    """``all``: every unit checkpointed on its own (Hugging Face's gradient checkpointing).

    Units without a ``checkpoint`` cost are kept.
    """
    start = time.perf_counter()
    budget_bytes = check_budget_bytes(budget_bytes)
    model = step_model(profile)
    options = tuple(
        (Option.CHECKPOINT if Option.CHECKPOINT in u.options else Option.KEEP).value
        for u in profile.units
    )
    peak = plan_peak_bytes(model, options)
    ms = profile.step_time_ms(sum(u.options[o].extra_ms
                                  for u, o in zip(profile.units, options)))
    candidate = _Candidate(options, (), peak, ms, "all")
    return _pick(profile, [candidate], budget_bytes, "all", start)


def uniform_groups(n: int, k: int) -> list[range]:
    """The units ``torch.utils.checkpoint.checkpoint_sequential(functions, k)`` checkpoints.

    It cuts ``n`` functions into segments of ``n // k`` and checkpoints the first
    ``k - 1`` of them; the rest (the last segment and the remainder) run normally.
    """
    k = check_count("k", k, lo=1, hi=n, meaning="the number of units", owner="uniform")
    size = n // k
    return [range(start, start + size) for start in range(0, size * (k - 1), size)]


def uniform_plan(profile: Profile, budget_bytes: int | None = None, *, k: int | None = None
                 ) -> Plan:
    """``uniform``: what ``checkpoint_sequential(functions, k)`` does.

    Args:
        profile: the measured profile.
        budget_bytes: the budget, or ``None``.
        k: the number of segments. Without it: with a budget, the fastest ``k`` whose
            plan fits; without a budget, ``k = round(sqrt(n))``.
    """
    start = time.perf_counter()
    budget_bytes = check_budget_bytes(budget_bytes)
    n = profile.n
    model = step_model(profile)
    if k is not None:
        ks: Iterable[int] = [
            check_count("k", k, lo=1, hi=n, meaning="the number of units", owner="uniform")
        ]
    elif budget_bytes is None:
        ks = [max(1, min(n, round(math.sqrt(n))))]
    else:
        ks = range(1, n + 1)
    candidates = [
        _candidate(profile, model, uniform_groups(n, kk), f"uniform(k={kk})") for kk in ks
    ]
    return _pick(profile, candidates, budget_bytes, "uniform", start)


def chen_groups(n: int) -> list[range]:
    """Chen et al. (2016)'s sqrt(n) scheme: ``round(sqrt(n))`` near-equal segments, all
    checkpointed (only each segment's input is kept through the forward pass)."""
    k = max(1, round(math.sqrt(n)))
    bounds = np.linspace(0, n, k + 1).round().astype(int)
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def chen_plan(profile: Profile, budget_bytes: int | None = None) -> Plan:
    """``chen``: ~sqrt(n) checkpoint segments of ~sqrt(n) units (Chen et al., 2016)."""
    start = time.perf_counter()
    budget_bytes = check_budget_bytes(budget_bytes)
    model = step_model(profile)
    candidate = _candidate(profile, model, chen_groups(profile.n), "chen")
    return _pick(profile, [candidate], budget_bytes, "chen", start)


def greedy_groups(unit_bytes: Sequence[int], threshold: float) -> list[range]:
    """Chen et al. (2016)'s greedy: walk the units adding up their activation bytes and
    close a segment at the unit where the running sum passes ``threshold``."""
    groups, start, total = [], 0, 0
    for i, nbytes in enumerate(unit_bytes):
        total += nbytes
        if total > threshold:
            groups.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(unit_bytes):
        groups.append(range(start, len(unit_bytes)))
    return groups


def chen_greedy_plan(
    profile: Profile, budget_bytes: int | None = None, *, thresholds: int = 48
) -> Plan:
    """``chen-greedy``: Chen et al. (2016)'s budgeted greedy, with its threshold searched.

    Each unit's activation bytes are its ``keep`` held bytes plus its output. For
    ``thresholds`` values spread geometrically between the largest single unit and
    the whole model, the greedy cuts segments; every segment is checkpointed, or all
    but the trailing one (which gains least from recomputation). Among those plans:
    with a budget, the fastest that fits under ``simulate()``; without, the one with
    the lowest peak.
    """
    start = time.perf_counter()
    budget_bytes = check_budget_bytes(budget_bytes)
    thresholds = check_count("thresholds", thresholds, lo=1, meaning="how many thresholds to try",
                             owner="chen-greedy")
    model = step_model(profile)
    sizes = [u.keep.held_bytes + u.output_bytes for u in profile.units]
    lo, hi = max(max(sizes), 1), max(sum(sizes), 1)
    candidates = []
    for threshold in sorted(set(np.geomspace(lo, hi, max(thresholds, 2)).tolist())):
        groups = greedy_groups(sizes, threshold)
        label = f"chen-greedy(threshold={threshold:.0f})"
        candidates.append(_candidate(profile, model, groups, label))
        if len(groups) > 1:
            candidates.append(_candidate(profile, model, groups[:-1], label + ", last kept"))
    return _pick(profile, candidates, budget_bytes, "chen-greedy", start)

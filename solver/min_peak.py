"""The smallest peak any plan reaches, and a plan that reaches it.

Both come from the event model's need-to-go table (:mod:`remat.solver.events`):
``need[0, start_flag]`` is the smallest peak above the floor, and following, unit
by unit, a move that attains each state's need rebuilds a plan with that peak.
"""

from __future__ import annotations

from remat.core.option import Option
from remat.core.plan import Plan
from remat.core.profile import Profile
from remat.solver.events import StepModel, step_model

__all__ = ["min_peak_bytes", "min_peak_plan"]


def min_peak_bytes(profile: Profile) -> int:
    """The smallest simulated peak over the whole plan space, in bytes, with the profile's
    head as it stands (over every choice of a measured chunked head:
    :func:`remat.solver.head_choice.min_peak_bytes_over_heads`)."""
    model = step_model(profile)
    return max(model.floor_bytes, int(model.need[0, model.start_flag]))


def min_peak_plan(profile: Profile) -> Plan:
    """A plan whose simulated peak is :func:`min_peak_bytes` (unstamped).

    Among the moves that attain a state's need it takes the first in option order
    (``keep`` first), then the shortest segment.
    """
    model = step_model(profile)
    options: list[Option] = []
    segments: list[tuple[int, int]] = []
    i, flag = 0, model.start_flag
    while i < model.n:
        target = int(model.need[i, flag])
        step = _attaining_move(model, i, flag, target)
        if step is None:
            last = _attaining_segment(model, i, target)
            options += [Option.CHECKPOINT] * (last - i + 1)
            segments.append((i, last))
            i, flag = last + 1, 0
        else:
            options.append(step[0])
            i, flag = i + 1, step[1]
    return Plan(tuple(u.name for u in profile.units), tuple(options), tuple(segments))


def _attaining_move(
    model: StepModel, i: int, flag: int, target: int
) -> tuple[Option, int] | None:
    """(option, next flag) of a single-unit move from (i, flag) whose need is ``target``."""
    for mv in model.moves[i]:
        if mv.in_flag != flag:
            continue
        via = max(mv.need_bytes, mv.inc_bytes + int(model.need[i + 1, mv.out_flag]))
        if via == target:
            return mv.option, mv.out_flag
    return None


def _attaining_segment(model: StepModel, a: int, target: int) -> int:
    """The last unit of a segment from unit ``a`` whose need is ``target``."""
    for b in range(a + 1, int(model.seg_last[a]) + 1):
        via = max(int(model.seg_need[a, b]), int(model.seg_inc[a]) + int(model.need[b + 1, 0]))
        if via == target:
            return b
    # need_to_go took its minimum over exactly these moves and segments.
    raise AssertionError(f"no move attains the need-to-go of unit {a}")

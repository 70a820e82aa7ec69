"""The budgeted optimum as a CP-SAT model: an independent check of the DP, and a fallback.

The model has the same plan space and the same event rules as ``simulate()`` (see
:mod:`remat.solver.events` for the derivation). Variables are named after what they
mean, so an exported model reads like the plan:

* ``opt[u3,selective]`` -- unit 3 runs alone with option ``selective``;
* ``seg[4..7]`` -- units 4 to 7 are one checkpoint segment;
* ``inseg[u5]`` -- unit 5 is in some segment; ``H[b3]`` -- boundary storage 3
  (unit 2's output = unit 3's input on a chain) is held after the forward pass;
* ``A[u3]`` -- bytes held after the forward pass by units before unit 3
  (their ``held_bytes`` and held boundaries), above the fixed bytes.

Each constraint family is one small function below. Every event is "``A`` of its
unit + a constant of the chosen option <= budget". Exactly one of a unit's
``opt``/``inseg`` literals is 1 and at most one segment starts at a unit, so the
option-dependent constant is a plain weighted sum of those literals: every
family is a set of linear constraints without enforcement literals or big-M
terms, which keeps CP-SAT's LP relaxation as tight as the DP's own model.

Scaling. Bytes are integers already and enter as they are. Time enters the
objective in integer units of :data:`TIME_UNITS_PER_MS` per millisecond
(nanoseconds): every ``extra_ms`` is rounded to the nearest nanosecond. So the
plan CP-SAT calls optimal is within ``n_units * 1e-6`` ms of the true optimum, and
plans whose times differ by less than that may be ranked as ties (either may come
back). The returned plan's ``predicted_time_ms`` is always ``simulate()``'s, not the
rounded objective.

Segments that no feasible plan can use (their own peak, on top of the least bytes
any feasible plan holds before them, already exceeds the budget) are left out of
the model; that removes no feasible plan. With a ``hint`` (a plan that fits),
segments whose checkpoint time alone exceeds the hint's are left out too: they
cannot be part of any plan at least as fast as the hint.

Speed: on 2 cores CP-SAT proves the optimum of realistic 100-unit profiles in a
few seconds and 300-unit ones in about 10 s; at 1000 units it needs a hint (see
``benchmarks/results/solver_speed.md``). The DP is the solver to use; this model
is its independent check.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from ortools.sat.python import cp_model

from remat.core.checks import check_budget_bytes, check_count, check_seconds
from remat.core.errors import ParameterError, RematError
from remat.core.option import Option
from remat.core.plan import Plan, Status
from remat.core.profile import Profile
from remat.solver.events import StepModel, step_model
from remat.solver.infeasible import infeasible_budget_error
from remat.solver.min_peak import min_peak_bytes
from remat.solver.simulate import simulate
from remat.solver.stamp import keep_all_when_it_fits, stamp_plan

__all__ = ["TIME_UNITS_PER_MS", "build_cp_model", "solve_ilp"]

log = logging.getLogger(__name__)

TIME_UNITS_PER_MS = 1_000_000  # objective resolution: 1 ns

LinearExpr = cp_model.LinearExprT


@dataclass
class _Vars:
    """The model's variables, by what they mean."""

    opt: dict[tuple[int, str], cp_model.IntVar] = field(default_factory=dict)
    seg: dict[tuple[int, int], cp_model.IntVar] = field(default_factory=dict)
    inseg: dict[int, cp_model.IntVar] = field(default_factory=dict)
    starting: dict[int, list[tuple[int, cp_model.IntVar]]] = field(default_factory=dict)
    ending: dict[int, list[cp_model.IntVar]] = field(default_factory=dict)
    coverable: set[int] = field(default_factory=set)  # units some modelled segment covers
    open_count: dict[int, cp_model.IntVar] = field(default_factory=dict)
    held_boundary: dict[int, LinearExpr] = field(default_factory=dict)
    held_before: list[cp_model.IntVar] = field(default_factory=list)


# ---------------------------------------------------------------------------------
# Variables
# ---------------------------------------------------------------------------------
def _option_vars(m: cp_model.CpModel, profile: Profile, v: _Vars) -> None:
    for i, unit in enumerate(profile.units):
        for name in unit.options:
            v.opt[i, name] = m.new_bool_var(f"opt[u{i},{name}]")


def _segment_vars(
    m: cp_model.CpModel, segments: Sequence[tuple[int, int]], n: int, v: _Vars
) -> None:
    for i in range(n):
        v.inseg[i] = m.new_bool_var(f"inseg[u{i}]")
        v.starting[i] = []
        v.ending[i] = []
    for a, b in segments:
        x = m.new_bool_var(f"seg[{a}..{b}]")
        v.seg[a, b] = x
        v.starting[a].append((b, x))
        v.ending[b].append(x)
    # Units covered by some segment, by a difference array over the segments' ranges.
    depth = np.zeros(n + 1, dtype=np.int64)
    for a, b in segments:
        depth[a] += 1
        depth[b + 1] -= 1
    v.coverable = set(np.flatnonzero(np.cumsum(depth)[:n] > 0).tolist())


def _held_before_vars(m: cp_model.CpModel, n: int, budget: int, v: _Vars) -> None:
    v.held_before = [m.new_int_var(0, budget, f"A[u{i}]") for i in range(n + 1)]


# ---------------------------------------------------------------------------------
# Linear pieces shared by several families
# ---------------------------------------------------------------------------------
def _holds_input(profile: Profile, v: _Vars, i: int) -> LinearExpr:
    """1 when unit i's input is held by unit i (its option, or a segment starting there)."""
    unit = profile.units[i]
    terms = [v.opt[i, o] for o, c in unit.options.items() if c.holds_input]
    return sum(terms) + sum(x for _, x in v.starting[i])


def _holds_output(profile: Profile, v: _Vars, i: int) -> LinearExpr:
    """1 when unit i's own option holds its output (segment members never do)."""
    unit = profile.units[i]
    return sum(v.opt[i, o] for o, c in unit.options.items() if c.holds_output)


def _held_bytes(profile: Profile, v: _Vars, i: int) -> LinearExpr:
    """Unit i's ``held_bytes`` (a segment's first unit holds its checkpoint bytes)."""
    unit = profile.units[i]
    own = sum(c.held_bytes * v.opt[i, o] for o, c in unit.options.items())
    if Option.CHECKPOINT in unit.options:
        own += unit.options[Option.CHECKPOINT].held_bytes * sum(x for _, x in v.starting[i])
    return own


# ---------------------------------------------------------------------------------
# Constraint families
# ---------------------------------------------------------------------------------
def _one_option_per_unit(m: cp_model.CpModel, profile: Profile, v: _Vars) -> None:
    """Each unit runs alone with exactly one option, or belongs to exactly one segment."""
    for i, unit in enumerate(profile.units):
        m.add_exactly_one([*(v.opt[i, o] for o in unit.options), v.inseg[i]])


def _segment_consistency(m: cp_model.CpModel, profile: Profile, v: _Vars) -> None:
    """Chosen segments are disjoint and ``inseg[u_i]`` says whether one covers unit i.

    ``open[u_i] = open[u_{i-1}] - (segments ending at i-1) + (segments starting at i)``
    telescopes to the number of chosen segments covering unit i; bounding it to
    0..1 makes them disjoint. This needs each ``seg`` variable in two sums only,
    where summing the covering segments per unit would need O(n^3) terms.
    """
    previous: LinearExpr = 0
    for i in range(profile.n):
        if not v.starting[i] and not v.ending.get(i - 1):
            m.add(v.inseg[i] == previous)
        else:
            opened = m.new_bool_var(f"open[u{i}]")
            v.open_count[i] = opened
            closed = sum(v.ending.get(i - 1, []))
            m.add(opened == previous - closed + sum(x for _, x in v.starting[i]))
            m.add(v.inseg[i] == opened)
        previous = v.inseg[i]


def _boundary_held(m: cp_model.CpModel, profile: Profile, v: _Vars) -> None:
    """``H[b_i]`` = (left side holds it) OR (right side holds it), as linear inequalities.

    On a chain boundary i is unit i-1's output and unit i's input; boundary 0's
    left side is the prefix and boundary n's right side is the suffix. Off a
    chain every unit's input and output are separate boundaries ``in``/``out``,
    held by the unit's option or by the code outside.
    """
    units = profile.units
    n = len(units)
    if not profile.is_chain:
        return  # off a chain each hold is one unit's option: no OR to model
    for i in range(n + 1):
        left: LinearExpr = (
            int(units[0].input_held_outside) if i == 0 else _holds_output(profile, v, i - 1)
        )
        right: LinearExpr = (
            int(units[-1].output_held_outside) if i == n else _holds_input(profile, v, i)
        )
        h = m.new_bool_var(f"H[b{i}]")
        m.add(h >= left)
        m.add(h >= right)
        m.add(h <= left + right)
        v.held_boundary[i] = h


def _free_boundary_bytes(profile: Profile, v: _Vars, i: int) -> LinearExpr:
    """Off a chain: the bytes of unit i's own input and output boundaries held."""
    unit = profile.units[i]
    held_in: LinearExpr = 1 if unit.input_held_outside else _holds_input(profile, v, i)
    held_out: LinearExpr = 1 if unit.output_held_outside else _holds_output(profile, v, i)
    if _kept_by_loop(profile, i):
        held_out = 0  # in the constants, alive to the end
    return unit.input_bytes * held_in + unit.output_bytes * held_out


def _kept_by_loop(profile: Profile, i: int) -> bool:
    """Unit i's output is the model's, which the loop keeps to the end of the step."""
    return i == profile.n - 1 and profile.last_output_kept


def _held_recurrence(m: cp_model.CpModel, profile: Profile, v: _Vars) -> None:
    """``A[u_{i+1}] = A[u_i]`` + unit i's held bytes + the boundaries it adds."""
    a = v.held_before
    m.add(a[0] == 0)
    for i, unit in enumerate(profile.units):
        if profile.is_chain:
            boundary = unit.input_bytes * v.held_boundary[i]
        else:
            boundary = _free_boundary_bytes(profile, v, i)
        m.add(a[i + 1] == a[i] + _held_bytes(profile, v, i) + boundary)


def _forward_events(
    m: cp_model.CpModel, profile: Profile, model: StepModel, v: _Vars, budget: int
) -> None:
    """Unit i's forward: ``A_i + C_i + in_i + fwd_peak`` of its option (segment: checkpoint).

    Exactly one of ``opt[u_i,*]`` and ``inseg[u_i]`` is 1, so the option-dependent
    term is a plain sum: one linear constraint per unit, no enforcement literal,
    which keeps CP-SAT's LP relaxation tight.
    """
    for i, unit in enumerate(profile.units):
        c = model.fwd_const[i]
        peak = sum(cost.fwd_peak_bytes * v.opt[i, o] for o, cost in unit.options.items())
        if i in v.coverable:
            peak += unit.options[Option.CHECKPOINT].fwd_peak_bytes * v.inseg[i]
        m.add(v.held_before[i] + c + unit.input_bytes + peak <= budget)


def _backward_events(
    m: cp_model.CpModel, profile: Profile, model: StepModel, v: _Vars, budget: int
) -> None:
    """Unit i's own backward (when it is not in a segment)::

        A_i + H_i*in_i + held + holds_output*out_i + bwd_peak + D_i <= budget

    ``D_i``: fixed and prefix bytes plus the gradients alive at that point. As one
    linear constraint per unit: a segment member contributes ``D_i`` only, which
    its segment's backward event at unit i already exceeds (it holds the
    segment's input and ``A`` never shrinks), so nothing feasible is cut off.
    """
    for i, unit in enumerate(profile.units):
        d = model.bwd_const[i]
        terms = []
        for o, cost in unit.options.items():
            out = unit.output_bytes if cost.holds_output and not _kept_by_loop(profile, i) else 0
            rest = cost.held_bytes + out + profile.bwd_peak(cost) + d
            if not profile.is_chain and (cost.holds_input or unit.input_held_outside):
                rest += unit.input_bytes
            terms.append(rest * v.opt[i, o])
        if i in v.coverable:
            terms.append(d * v.inseg[i])
        held_in = unit.input_bytes * v.held_boundary[i] if profile.is_chain else 0
        m.add(v.held_before[i] + held_in + sum(terms) <= budget)


def _between_events(
    m: cp_model.CpModel, profile: Profile, model: StepModel, v: _Vars, budget: int
) -> None:
    """Off a chain, the code between two units: its forward after unit i's,
    ``A_i + held_i + (constant)``, and its backward once unit i's is done, ``A_i +
    (constant)`` (:func:`remat.solver.events._between_constants`)."""
    for i, unit in enumerate(profile.units):
        after = model.after_fwd_const[i]
        if after:
            held = sum(cost.held_bytes * v.opt[i, o] for o, cost in unit.options.items())
            m.add(v.held_before[i] + held + after <= budget)
        if model.before_bwd_const[i]:
            m.add(v.held_before[i] + model.before_bwd_const[i] <= budget)


def _segment_event_family(
    m: cp_model.CpModel, v: _Vars, need: np.ndarray, budget: int
) -> None:
    """``A_a + need[a, b] <= budget`` for the chosen segment starting at each unit a.

    At most one segment starts at a, so ``A_a + sum_b need[a, b] * seg[a..b] <=
    budget`` says exactly that without a big-M (``A_a <= budget`` anyway).
    """
    for a, starts in v.starting.items():
        if not starts:
            continue
        m.add(v.held_before[a] + sum(int(need[a, b]) * x for b, x in starts) <= budget)


def _recompute_events(
    m: cp_model.CpModel, model: StepModel, v: _Vars, budget: int
) -> None:
    """Segment a..b recomputes its units: ``A_a`` + its highest recompute event."""
    _segment_event_family(m, v, model.seg_rec_need, budget)


def _segment_backward_events(
    m: cp_model.CpModel, model: StepModel, v: _Vars, budget: int
) -> None:
    """Segment a..b's units run their keep backwards: ``A_a`` + the highest of those."""
    _segment_event_family(m, v, model.seg_bwd_need, budget)


def _suffix_events(
    m: cp_model.CpModel, profile: Profile, model: StepModel, v: _Vars, budget: int
) -> None:
    """The suffix's forward and backward, on top of everything the units hold."""
    s = profile.suffix
    s_bwd = profile.bwd_peak(s)
    a_n = v.held_before[profile.n]
    c_fwd, c_bwd = model.fwd_const[profile.n], model.suffix_bwd_const
    if not profile.is_chain:
        kept = profile.kept_last_output_bytes  # in c_bwd already
        m.add(a_n + c_fwd + kept + s.fwd_peak_bytes <= budget)
        m.add(a_n + c_bwd + s.held_bytes + s_bwd <= budget)
        return
    out = profile.units[-1].output_bytes
    m.add(a_n + c_fwd + out + s.fwd_peak_bytes <= budget)
    held_out = out if profile.last_output_kept else out * v.held_boundary[profile.n]
    m.add(a_n + c_bwd + held_out + s.held_bytes + s_bwd <= budget)


def _objective(m: cp_model.CpModel, profile: Profile, v: _Vars) -> None:
    """Minimise the added step time, in integer nanoseconds (see the module docstring)."""
    terms = []
    for i, unit in enumerate(profile.units):
        for o, cost in unit.options.items():
            terms.append(_scaled_ms(cost.extra_ms) * v.opt[i, o])
        if Option.CHECKPOINT in unit.options:
            terms.append(_scaled_ms(unit.options[Option.CHECKPOINT].extra_ms) * v.inseg[i])
    m.minimize(sum(terms))


def _scaled_ms(ms: float) -> int:
    return int(round(ms * TIME_UNITS_PER_MS))


# ---------------------------------------------------------------------------------
# Which segments to model
# ---------------------------------------------------------------------------------
def _min_held_before(model: StepModel, budget: int, ng: np.ndarray) -> np.ndarray:
    """Per unit, the least ``A`` any feasible, completable prefix reaches (inf if none)."""
    n = model.n
    inf = np.iinfo(np.int64).max // 4
    low = np.full((n + 1, 2), inf, dtype=np.int64)
    low[0, model.start_flag] = 0
    for i in range(n):
        for mv in model.moves[i]:
            a = int(low[i, mv.in_flag])
            landing = a + mv.inc_bytes
            ok = a + mv.need_bytes <= budget and landing + ng[i + 1, mv.out_flag] <= budget
            if a < inf and ok:
                low[i + 1, mv.out_flag] = min(low[i + 1, mv.out_flag], landing)
        for a_ in range(i):  # segments a_..i landing at i+1
            if model.seg_last[a_] < i:
                continue
            a = int(low[a_].min())
            landing = a + int(model.seg_inc[a_])
            fits = a + int(model.seg_need[a_, i]) <= budget
            if a < inf and fits and landing + ng[i + 1, 0] <= budget:
                low[i + 1, 0] = min(low[i + 1, 0], landing)
    return low.min(axis=1)


def _usable_segments(
    model: StepModel, budget: int, max_extra_ms: float = np.inf
) -> list[tuple[int, int]]:
    """Segments some feasible plan at most ``max_extra_ms`` slower than ``step_ms`` might use.

    See the module docstring: the memory test removes no feasible plan; the time
    test removes only plans slower than a known one (the hint).
    """
    if not model.chain:
        return []
    ng = model.need
    low = _min_held_before(model, budget, ng)
    cum = model.ckpt_cum_ms
    out = []
    for a in range(model.n - 1):
        last = int(model.seg_last[a])
        bs = np.arange(a + 1, last + 1)
        need = np.maximum(model.seg_need[a, bs], model.seg_inc[a] + ng[bs + 1, 0])
        ok = (low[a] + need <= budget) & (cum[bs + 1] - cum[a] <= max_extra_ms)
        out.extend((a, int(b)) for b in bs[ok])
    return out


# ---------------------------------------------------------------------------------
# Building, solving, reading back
# ---------------------------------------------------------------------------------
def build_cp_model(
    profile: Profile,
    budget: int,
    model: StepModel | None = None,
    *,
    max_extra_ms: float = np.inf,
) -> tuple[cp_model.CpModel, _Vars]:
    """The CP-SAT model of "fastest plan with simulated peak <= budget".

    ``max_extra_ms`` (the added time of a known feasible plan) lets it leave out
    segments whose checkpoint time alone is more than that.
    """
    model = model or step_model(profile)
    m = cp_model.CpModel()
    v = _Vars()
    _option_vars(m, profile, v)
    _segment_vars(m, _usable_segments(model, budget, max_extra_ms), profile.n, v)
    _held_before_vars(m, profile.n, budget, v)
    _one_option_per_unit(m, profile, v)
    _segment_consistency(m, profile, v)
    _boundary_held(m, profile, v)
    _held_recurrence(m, profile, v)
    _forward_events(m, profile, model, v, budget)
    _backward_events(m, profile, model, v, budget)
    _between_events(m, profile, model, v, budget)
    _recompute_events(m, model, v, budget)
    _segment_backward_events(m, model, v, budget)
    _suffix_events(m, profile, model, v, budget)
    _objective(m, profile, v)
    return m, v


def _add_hint(m: cp_model.CpModel, profile: Profile, v: _Vars, plan: Plan) -> None:
    """Warm-start CP-SAT with ``plan``: a first incumbent, never a constraint.

    Every variable gets a value (CP-SAT uses a complete, feasible hint at once).
    """
    in_segment = [plan.segment_of(i) is not None for i in range(plan.n)]
    for (i, o), x in v.opt.items():
        m.add_hint(x, not in_segment[i] and plan.options[i] == o)
    chosen = set(plan.segments)
    for seg, x in v.seg.items():
        m.add_hint(x, seg in chosen)
    for i, x in v.inseg.items():
        m.add_hint(x, in_segment[i])
    for i, x in v.open_count.items():
        m.add_hint(x, in_segment[i])
    held, boundary = _plan_holds(profile, plan)
    for i, h in v.held_boundary.items():
        m.add_hint(h, boundary[i])
    for i, a in enumerate(v.held_before):
        m.add_hint(a, held[i])


def _plan_holds(profile: Profile, plan: Plan) -> tuple[list[int], list[bool]]:
    """``A`` before each unit and, on a chain, which boundaries are held, under ``plan``."""
    units = profile.units
    n = len(units)
    hin, hout, own = [], [], []
    for i, unit in enumerate(units):
        seg = plan.segment_of(i)
        cost = unit.options[plan.options[i]]
        if seg is None:
            hin.append(cost.holds_input)
            hout.append(cost.holds_output)
            own.append(cost.held_bytes)
        else:
            first = seg[0] == i
            hin.append(first)
            hout.append(False)
            own.append(cost.held_bytes if first else 0)
    boundary = [False] * (n + 1)
    if profile.is_chain:
        boundary[0] = units[0].input_held_outside or hin[0]
        boundary[n] = units[-1].output_held_outside or hout[-1]
        for i in range(1, n):
            boundary[i] = hout[i - 1] or hin[i]
    held = [0]
    for i, unit in enumerate(units):
        if profile.is_chain:
            extra = unit.input_bytes if boundary[i] else 0
        else:
            extra = (unit.input_bytes if hin[i] or unit.input_held_outside else 0) + (
                unit.output_bytes if hout[i] or unit.output_held_outside else 0
            )
        held.append(held[-1] + own[i] + extra)
    return held, boundary


def _read_plan(profile: Profile, solver: cp_model.CpSolver, v: _Vars) -> Plan:
    names = tuple(u.name for u in profile.units)
    options = []
    for i, unit in enumerate(profile.units):
        chosen = [o for o in unit.options if solver.boolean_value(v.opt[i, o])]
        options.append(chosen[0] if chosen else Option.CHECKPOINT)  # none chosen: in a segment
    segments = tuple(sorted(s for s, x in v.seg.items() if solver.boolean_value(x)))
    return Plan(names, tuple(options), segments)


def solve_ilp(
    profile: Profile,
    budget_bytes: int | None,
    *,
    time_limit_s: float = 60.0,
    workers: int | None = None,
    seed: int = 0,
    hint: Plan | None = None,
) -> Plan:
    """The minimum-time plan under ``budget_bytes``, found by CP-SAT.

    Args:
        profile: the measured profile.
        budget_bytes: the budget; ``None`` means none. With none, or a budget of at
            least the no-checkpoint peak, the plan keeps everything (no search).
        time_limit_s: CP-SAT's wall-time limit, in seconds. When it stops the search
            with a plan it has not proven optimal, the plan's status is ``"feasible"``.
        workers: CP-SAT search workers (default: the machine's CPU count).
        seed: CP-SAT's random seed, for repeatable runs.
        hint: a plan that fits the budget, to warm-start the search. It is only a
            first incumbent: CP-SAT still proves (or fails to prove) optimality on
            its own, and segments slower than the hint alone are left out.

    Raises:
        InfeasibleBudgetError: no plan fits; it carries the smallest peak any plan
            reaches and where that peak sits.
        ParameterError: a parameter of the wrong type or out of range.
        RematError: CP-SAT found no plan within the time limit.
    """
    start = time.perf_counter()
    budget_bytes = check_budget_bytes(budget_bytes)
    _check_params(time_limit_s, workers, seed, hint)
    kept = keep_all_when_it_fits(profile, budget_bytes, algorithm="ilp", start=start)
    if kept is not None:
        return kept
    assert budget_bytes is not None  # keep_all_when_it_fits returns a plan for None
    if min_peak_bytes(profile) > budget_bytes:
        raise infeasible_budget_error(profile, budget_bytes)
    model = step_model(profile)
    max_extra_ms = _hint_extra_ms(profile, hint, budget_bytes)
    m, v = build_cp_model(profile, budget_bytes, model, max_extra_ms=max_extra_ms)
    if hint is not None:
        _add_hint(m, profile, v, hint)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = int(workers or os.cpu_count() or 1)
    solver.parameters.random_seed = int(seed)
    code = solver.solve(m)
    log.debug("ilp: %s after %.2f s (%d segments modelled)", solver.status_name(code),
              solver.wall_time, len(v.seg))
    if code == cp_model.INFEASIBLE:
        # The smallest peak fits the budget (checked above), so the model admits a plan.
        raise AssertionError(
            f"CP-SAT calls budget {budget_bytes} B infeasible, but a plan peaking at "
            f"{min_peak_bytes(profile)} B fits it: the CP-SAT model and the event model disagree"
        )
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise RematError(
            f"CP-SAT found no plan within time_limit_s={time_limit_s} "
            f"({solver.status_name(code)}); raise the limit or use method='dp'"
        )
    status = Status.OPTIMAL if code == cp_model.OPTIMAL else Status.FEASIBLE
    plan = _read_plan(profile, solver, v)
    return stamp_plan(profile, plan, algorithm="ilp", status=status, budget=budget_bytes,
                      start=start)


def _check_params(time_limit_s: object, workers: object, seed: object, hint: object) -> None:
    """Refuse parameters CP-SAT would misread or fail on, naming them."""
    check_seconds("time_limit_s", time_limit_s, owner="ilp")
    if workers is not None:
        check_count("workers", workers, lo=1, meaning="CP-SAT search workers", owner="ilp")
    check_count("seed", seed, lo=0, hi=2**31 - 1, meaning="CP-SAT's random seed", owner="ilp")
    if hint is not None and not isinstance(hint, Plan):
        raise ParameterError(f"ilp needs hint, a Plan or None, got {type(hint).__name__}")


def _hint_extra_ms(profile: Profile, hint: Plan | None, budget: int) -> float:
    """The hint's added time, when it is a plan that fits; else no limit."""
    if hint is None:
        return np.inf
    peak, ms = simulate(profile, hint)
    if peak > budget:
        log.warning("ilp: the hint peaks at %d B, above the budget %d B; ignoring it",
                    peak, budget)
        return np.inf
    # Slack for float noise: the limit must never cut off the hint itself.
    return profile.extra_ms_of(ms) + 1e-6 * (1 + abs(ms))

"""The exact budgeted optimum by dynamic programming over the event model.

The event model (:mod:`remat.solver.events`) turns a plan's peak into
``max(floor, max over events of A_i + need)``, one unit at a time; this module
searches it.

Left to right over units, the state is ``(i, p)``; each state carries the Pareto
front of ``(A_i, time so far)`` as sorted numpy arrays: a state with less held
memory and less time dominates, because the future only sees ``A_i`` (through
``A_i + need <= budget``) and adds to time. Every move keeps the prefix of a front
whose events fit, shifted by the move's ``(bytes, ms)``. The model's *need-to-go*
table (the least headroom any completion needs above ``A_i``) prunes states that
cannot finish, exactly.

Fronts on realistic profiles (many near-identical blocks) grow into the
thousands, so the search is a branch and bound over that DP:

1. a *beam* pass runs the same DP keeping only the :data:`BEAM_WIDTH` most
   promising points per front and per segment pool, plus each front's
   least-held point: that point can finish whenever any point of its front can
   (need-to-go depends on ``A`` alone), so the beam always ends with a feasible
   plan, whose time is an upper bound ``U``;
2. the *exact* pass drops every point whose time plus a lower bound on the time
   still to pay exceeds ``U``. The bound (:class:`_TimeBound`) is the LP
   relaxation of the remaining units as a multiple-choice knapsack against the
   last event. Only points that cannot lead to a plan faster than ``U`` go, so
   the optimum survives and the result is exact.

Segment transitions (a..b for every a < b) would make each layer O(n): their
sources sit in a pool (:class:`_SegmentPool`) from which a source leaves for good
once a bound that only grows with ``b`` fails. There is no cap on segment length.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from remat.core.checks import check_budget_bytes
from remat.core.option import OPTION_ORDER, Option
from remat.core.plan import Plan, Status
from remat.core.profile import Profile
from remat.solver.events import StepModel, step_model
from remat.solver.infeasible import infeasible_budget_error
from remat.solver.stamp import keep_all_when_it_fits, stamp_plan

__all__ = ["BEAM_WIDTH", "solve_dp"]

log = logging.getLogger(__name__)

SEGMENT_MOVE = -1  # move code of a multi-unit segment in the DP's back-pointers

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


# ---------------------------------------------------------------------------------
# A lower bound on the time still to pay (for exact branch-and-bound pruning)
# ---------------------------------------------------------------------------------
class _TimeBound:
    """``lower(i, A)``: a lower bound on the ``extra_ms`` units ``>= i`` add, from held ``A``.

    Every completion ends with the suffix's events, so the bytes units ``>= i``
    add to ``A`` are at most ``budget - min(end_need) - A``. Relaxing every other
    event, letting each unit take any option at its smallest increment (left flag
    0; a possible segment member adds nothing and pays its checkpoint time) and
    allowing fractions gives a multiple-choice knapsack LP, solved by the greedy
    over each unit's lower convex hull of (bytes, ms) edges in order of ms per byte.

    Because a segment member's relaxed option is ``(0 B, checkpoint ms)``,
    ``cum_ckpt_ms[b+1] + lower(b+1, A)`` never decreases in ``b``: that makes a
    segment source whose bound fails at ``b`` useless for every longer segment.
    """

    def __init__(self, model: StepModel, budget: int) -> None:
        self.room = budget - min(model.end_need)  # bytes units may add in all
        base_w, base_t, edges = _relaxed_edges(model)
        order = np.argsort(edges[:, 2], kind="stable")  # by ms per byte
        self.edge_unit = edges[order, 3].astype(np.int64)
        self.edge_w = edges[order, 0]
        self.edge_t = edges[order, 1]
        self.base_w = np.concatenate((np.cumsum(base_w[::-1])[::-1], [0.0]))
        self.base_t = np.concatenate((np.cumsum(base_t[::-1])[::-1], [0.0]))
        self._layer = -1
        self._cw = np.zeros(1)
        self._ct = np.zeros(1)

    def lower(self, layer: int, held: IntArray) -> FloatArray:
        """The bound for points holding ``held`` bytes after units ``< layer``."""
        if layer != self._layer:
            mine = self.edge_unit >= layer
            self._cw = np.concatenate(([0.0], np.cumsum(self.edge_w[mine])))
            self._ct = np.concatenate(([0.0], np.cumsum(self.edge_t[mine])))
            self._layer = layer
        excess = held.astype(np.float64) + (self.base_w[layer] - self.room)
        bound = self.base_t[layer] + np.interp(excess, self._cw, self._ct)
        # Beyond every edge the suffix cannot fit at all (the relaxation says so).
        return np.where(excess > self._cw[-1], np.inf, bound)


def _relaxed_edges(model: StepModel) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Per unit its cheapest relaxed point, and all hull edges (dw, dt, ms/B, unit)."""
    base_w = np.zeros(model.n)
    base_t = np.zeros(model.n)
    edges: list[tuple[float, float, float, int]] = []
    for j in range(model.n):
        points = {(mv.inc_bytes, mv.extra_ms) for mv in model.moves[j] if mv.in_flag == 0}
        if _may_join_segment(model, j):
            points.add((0, float(model.ckpt_cum_ms[j + 1] - model.ckpt_cum_ms[j])))
        w, t = min(points, key=lambda wt: (wt[1], wt[0]))
        base_w[j], base_t[j] = w, t
        for dw, dt in _hull_steps(sorted(points), w, t):
            edges.append((dw, dt, dt / dw, j))
    table = np.array(edges, dtype=np.float64).reshape(-1, 4)
    return base_w, base_t, table


def _may_join_segment(model: StepModel, j: int) -> bool:
    if model.seg_last[j] > j:
        return True
    return j > 0 and any(model.seg_last[a] >= j for a in range(max(0, j - 1), j))


def _hull_steps(
    points: list[tuple[int, float]], w: float, t: float
) -> list[tuple[float, float]]:
    """Edges of the lower convex hull from (w, t) towards fewer bytes, cheapest first."""
    steps = []
    while True:
        cheaper = [(pw, pt) for pw, pt in points if pw < w]
        if not cheaper:
            return steps
        # Least ms per byte saved; on a tie the one saving the most bytes.
        pw, pt = min(cheaper, key=lambda p: ((p[1] - t) / (w - p[0]), p[0]))
        steps.append((float(w - pw), float(max(pt - t, 0.0))))
        w, t = pw, pt


# ---------------------------------------------------------------------------------
# Pareto fronts
# ---------------------------------------------------------------------------------
# A point's back-pointer is one int64: ((layer * 2 + flag) * 2**32 + index) * 8 + move + 1,
# where (layer, flag, index) is the point it was reached from and move is an index
# into OPTION_ORDER or SEGMENT_MOVE. One array instead of four keeps merging cheap.
_IDX_SPAN = 2**32


def _code_base(layer: int, flag: int, move: int) -> int:
    return ((layer * 2 + flag) * _IDX_SPAN) * 8 + move + 1


def _decode(code: int) -> tuple[int, int, int, int]:
    """(layer, flag, index, move) of a back-pointer."""
    rest, move = divmod(code, 8)
    state, idx = divmod(rest, _IDX_SPAN)
    layer, flag = divmod(state, 2)
    return layer, flag, idx, move - 1


@dataclass
class _Front:
    """Points sorted by ``held`` ascending, ``ms`` strictly descending.

    Attributes:
        held: ``A_i`` per point, bytes.
        ms: time so far per point (sum of ``extra_ms``), milliseconds.
        code: back-pointer per point (see :func:`_decode`).
    """

    held: IntArray
    ms: FloatArray
    code: IntArray

    def __len__(self) -> int:
        return len(self.held)

    def take(self, idx: npt.NDArray[np.intp] | npt.NDArray[np.bool_]) -> _Front:
        return _Front(self.held[idx], self.ms[idx], self.code[idx])


def _pareto(parts: list[_Front]) -> _Front | None:
    """Merge candidate points and keep the non-dominated ones."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return None
    if len(parts) == 1:
        f = parts[0]  # sorted by held bytes already, like every part
    else:
        f = _Front(
            np.concatenate([p.held for p in parts]),
            np.concatenate([p.ms for p in parts]),
            np.concatenate([p.code for p in parts]),
        )
        # The parts are sorted runs: a stable sort merges them in near-linear time.
        f = f.take(np.argsort(f.held, kind="stable"))
    keep = np.empty(len(f), dtype=bool)
    keep[0] = True
    # A point survives when it is strictly faster than every point before it...
    keep[1:] = f.ms[1:] < np.minimum.accumulate(f.ms)[:-1]
    f = f.take(keep)
    # ...and, among survivors holding the same bytes, only the last (fastest) stays.
    last = np.empty(len(f), dtype=bool)
    last[-1] = True
    last[:-1] = f.held[1:] != f.held[:-1]
    return f.take(last) if not last.all() else f


def _best_first(front: _Front, promise: FloatArray, width: int) -> _Front:
    """The ``width`` points with the least time-plus-bound, in front order (beam).

    The least-held point is always kept: it is the one most likely to finish.
    """
    idx = np.argpartition(promise, width - 1)[:width]
    return front.take(np.unique(np.append(idx, 0)))


# ---------------------------------------------------------------------------------
# Segment sources
# ---------------------------------------------------------------------------------
class _SegmentPool:
    """Points where a multi-unit segment may start, kept while they may still end well.

    A point of layer ``a``'s front (either flag: a segment holds its own input)
    can start segment ``a..b`` for every ``b`` up to ``seg_last[a]``, landing at
    ``landing = A_a + seg_inc[a]`` with ``ms - ckpt_cum_ms[a] + ckpt_cum_ms[b+1]``.
    A point leaves for good when

    * a bound that never improves with ``b`` fails: its time bound (see
      :class:`_TimeBound`) or the monotone part of the segment's peak; or
    * a point of a later layer ``a' > a`` (same checkpoint run) lands with no more
      bytes and no more time (both relative as above). Every event of segment
      ``a'..b`` is its landing bytes plus a term that sums fewer keep activations
      than segment ``a..b``'s, so the later point fits wherever the earlier one
      does, for every ``b > a'``, and is at least as good there.
    """

    def __init__(self) -> None:
        self.layer = np.empty(0, np.int64)
        self.held = np.empty(0, np.int64)  # A_a
        self.landing = np.empty(0, np.int64)  # A_a + seg_inc[a]
        self.ms = np.empty(0, np.float64)  # time so far minus checkpoint ms of units < a
        self.code = np.empty(0, np.int64)

    def __len__(self) -> int:
        return len(self.layer)

    def add(self, layer: int, fronts: list[_Front | None], inc: int, ckpt_ms_before: float
            ) -> None:
        """Add layer ``layer``'s points; call it once segments ending at ``layer`` are done."""
        parts = [(flag, f) for flag, f in enumerate(fronts) if f is not None and len(f)]
        if not parts:
            return
        held = np.concatenate([f.held for _, f in parts])
        ms = np.concatenate([f.ms for _, f in parts]) - ckpt_ms_before
        code = np.concatenate(
            [_code_base(layer, flag, SEGMENT_MOVE) + np.arange(len(f), dtype=np.int64) * 8
             for flag, f in parts]
        )
        self._drop_dominated_by(held + inc, ms)
        self.layer = np.concatenate((self.layer, np.full(len(held), layer, np.int64)))
        self.held = np.concatenate((self.held, held))
        self.landing = np.concatenate((self.landing, held + inc))
        self.ms = np.concatenate((self.ms, ms))
        self.code = np.concatenate((self.code, code))

    def _drop_dominated_by(self, landing: IntArray, ms: FloatArray) -> None:
        """Remove older points that a newer one lands below, no slower (see the class)."""
        if not len(self):
            return
        order = np.argsort(landing, kind="stable")
        stair = np.minimum.accumulate(ms[order])  # least ms landing at most landing[order]
        pos = np.searchsorted(landing[order], self.landing, side="right") - 1
        beaten = (pos >= 0) & (stair[np.maximum(pos, 0)] <= self.ms)
        self.keep(~beaten)

    def keep(self, alive: npt.NDArray[np.bool_]) -> None:
        self.layer = self.layer[alive]
        self.held = self.held[alive]
        self.landing = self.landing[alive]
        self.ms = self.ms[alive]
        self.code = self.code[alive]


# ---------------------------------------------------------------------------------
# The forward pass of the DP
# ---------------------------------------------------------------------------------
class _Solver:
    """Left-to-right DP over the units for one budget.

    Args:
        model: the profile's event model (its need-to-go table prunes exactly).
        budget: the budget in bytes.
        bound: the time lower bound used to prune against ``upper_ms``.
        upper_ms: the extra time of a known feasible plan (``inf`` when none):
            points whose time plus bound exceed it cannot be on a better plan.
        beam: keep at most this many points per front (a heuristic pass), or ``None``
            for the exact pass.
    """

    def __init__(
        self,
        model: StepModel,
        budget: int,
        bound: _TimeBound,
        upper_ms: float = np.inf,
        beam: int | None = None,
    ) -> None:
        self.model = model
        self.budget = budget
        self.ng = model.need
        self.bound = bound
        # Float sums differ in the last bits between paths: never prune on a hair.
        finite = bool(np.isfinite(upper_ms))
        self.limit_ms = upper_ms + 1e-9 * max(1.0, abs(upper_ms)) if finite else np.inf
        self.beam = beam
        self.fronts: list[list[_Front | None]] = [[None, None] for _ in range(model.n + 1)]
        self.pool = _SegmentPool()
        self.largest_front = 0
        self._arange = np.arange(0, dtype=np.int64)

    def run(self) -> None:
        m = self.model
        self.fronts[0][m.start_flag] = _Front(
            np.zeros(1, np.int64), np.zeros(1), np.zeros(1, np.int64)
        )
        for i in range(m.n):
            # Layer i-1 may start segments ending at i or later: it joins the pool now,
            # after the segments ending at i-1 (which it must not displace) are done.
            if m.chain and i >= 1 and m.seg_last[i - 1] > i - 1:
                self.pool.add(i - 1, self.fronts[i - 1], int(m.seg_inc[i - 1]),
                              float(m.ckpt_cum_ms[i - 1]))
            slack = self._slack(i)
            for q in (0, 1):
                parts = self._unit_parts(i, q, slack)
                if q == 0 and m.chain and i >= 1:
                    parts += self._segment_parts(i)
                self.fronts[i + 1][q] = self._prune(i + 1, _pareto(parts))
            size = sum(len(f) for f in self.fronts[i + 1] if f is not None)
            self.largest_front = max(self.largest_front, size)

    def _slack(self, i: int) -> list[FloatArray | None]:
        """Per flag, per point of layer i: the most ms a move may add and still win.

        Uses the bound at layer i+1 on the point's own held bytes, which no move
        can lower, so it is a safe filter before the exact check after merging.
        """
        out: list[FloatArray | None] = [None, None]
        if not np.isfinite(self.limit_ms):
            return out
        for p, src in enumerate(self.fronts[i]):
            if src is not None:
                out[p] = self.limit_ms - src.ms - self.bound.lower(i + 1, src.held)
        return out

    def _prune(self, layer: int, front: _Front | None) -> _Front | None:
        """Drop points that cannot beat the known plan; thin to the beam."""
        if front is None:
            return None
        if not np.isfinite(self.limit_ms) and self.beam is None:
            return front
        promise = front.ms + self.bound.lower(layer, front.held)
        if np.isfinite(self.limit_ms):
            ok = promise <= self.limit_ms
            front, promise = front.take(ok), promise[ok]
        if self.beam is not None and len(front) > self.beam:
            front = _best_first(front, promise, self.beam)
        return front if len(front) else None

    def _cap(self, need: int, inc: int, layer: int, flag: int) -> int:
        """Largest ``A`` from which a move's events fit and its landing state can finish."""
        return self.budget - max(need, inc + int(self.ng[layer, flag]))

    def _aranged(self, count: int) -> IntArray:
        if len(self._arange) < count:
            self._arange = np.arange(max(count, 2 * len(self._arange)), dtype=np.int64) * 8
        return self._arange[:count]

    def _unit_parts(self, i: int, q: int, slack: list[FloatArray | None]) -> list[_Front]:
        parts = []
        for mv in self.model.moves[i]:
            src = self.fronts[i][mv.in_flag]
            if mv.out_flag != q or src is None:
                continue
            cap = self._cap(mv.need_bytes, mv.inc_bytes, i + 1, q)
            count = int(np.searchsorted(src.held, cap, side="right"))
            if not count:
                continue
            base = _code_base(i, mv.in_flag, OPTION_ORDER.index(mv.option))
            part = _Front(
                src.held[:count] + mv.inc_bytes,
                src.ms[:count] + mv.extra_ms,
                base + self._aranged(count),
            )
            room = slack[mv.in_flag]
            if room is not None and mv.extra_ms > 0:
                part = part.take(room[:count] >= mv.extra_ms)
            parts.append(part)
        return parts

    def _segment_parts(self, b: int) -> list[_Front]:
        """Segments a..b (the pool holds sources a <= b-1) landing in state (b+1, 0)."""
        m, pool = self.model, self.pool
        if not len(pool):
            return []
        a = pool.layer
        alive = m.seg_last[a] >= b
        a_ok = np.where(alive, a, 0)  # an in-range row, for safe gathers
        alive &= pool.held + m.seg_mono_need[a_ok, b] <= self.budget
        ms = pool.ms + m.ckpt_cum_ms[b + 1]
        promise = ms + self.bound.lower(b + 1, pool.landing)
        alive &= promise <= self.limit_ms
        if self.beam is not None and alive.sum() > self.beam:
            # Heuristic pass: only the most promising sources stay (for good), and the
            # least-held point of each source front: if any point of that front can
            # finish through a segment, that one can, so the beam always ends.
            best = np.argpartition(np.where(alive, promise, np.inf), self.beam - 1)
            first = alive & ((pool.code // 8) % _IDX_SPAN == 0)
            alive = first
            alive[best[: self.beam]] = True
        pool.keep(alive)
        a_ok, ms = a_ok[alive], ms[alive]
        cap = self.budget - np.maximum(m.seg_need[a_ok, b], m.seg_inc[a_ok] + self.ng[b + 1, 0])
        fits = np.flatnonzero(pool.held <= cap)
        if not len(fits):
            return []
        # Sorted by held bytes like every other part (pool order is arbitrary).
        fits = fits[np.argsort(pool.landing[fits], kind="stable")]
        return [_Front(pool.landing[fits], ms[fits], pool.code[fits])]

    # -- reading the answer back ------------------------------------------------------
    def best_end(self) -> tuple[float, int, int] | None:
        """The fastest final state: (extra ms, flag, index), or ``None`` when none fits."""
        best: tuple[float, int, int, int] | None = None
        for q in (0, 1):
            f = self.fronts[self.model.n][q]
            if f is None or not len(f):
                continue
            # Need-to-go pruning already guarantees the suffix fits; the fastest is last.
            k = len(f) - 1
            key = (float(f.ms[k]), int(f.held[k]), q, k)
            if best is None or key < best:
                best = key
        return None if best is None else (best[0], best[2], best[3])

    def backtrack(self, flag: int, idx: int) -> tuple[list[Option], list[tuple[int, int]]]:
        """Options per unit and segments of the path ending at (n, flag, idx)."""
        n = self.model.n
        options = [Option.KEEP] * n
        segments: list[tuple[int, int]] = []
        layer = n
        while layer > 0:
            f = self.fronts[layer][flag]
            assert f is not None
            prev, prev_flag, prev_idx, move = _decode(int(f.code[idx]))
            if move == SEGMENT_MOVE:
                options[prev:layer] = [Option.CHECKPOINT] * (layer - prev)
                segments.append((prev, layer - 1))
            else:
                options[layer - 1] = OPTION_ORDER[move]
            flag, idx, layer = prev_flag, prev_idx, prev
        return options, sorted(segments)


BEAM_WIDTH = 8  # points per front in the heuristic pass that finds the first upper bound


def _search(model: StepModel, budget: int) -> _Solver | None:
    """Beam pass for an upper bound, then the exact pass pruned by it.

    Returns the exact pass's solver, or ``None`` when no plan fits.
    """
    if model.floor_bytes > budget or int(model.need[0, model.start_flag]) > budget:
        return None
    bound = _TimeBound(model, budget)
    beam = _Solver(model, budget, bound, beam=BEAM_WIDTH)
    beam.run()
    first = beam.best_end()
    if first is None:
        # Cannot happen (the beam keeps each front's least-held point, which can finish);
        # should it, the exact pass without an upper bound is slower but still exact.
        log.warning("dp: the beam pass found no plan; searching without an upper bound")
    exact = _Solver(model, budget, bound, upper_ms=np.inf if first is None else first[0])
    exact.run()
    return exact


def solve_dp(profile: Profile, budget_bytes: int | None) -> Plan:
    """The minimum-time plan whose simulated peak is at most ``budget_bytes``.

    Exact over the whole plan space (every option a unit has a cost for, and every
    multi-unit checkpoint segment on a chain). ``budget_bytes=None`` means no budget,
    and a budget of at least the no-checkpoint peak is met by keeping everything:
    either way the plan keeps everything, without a search.

    Raises:
        InfeasibleBudgetError: no plan fits; it carries the smallest peak any plan
            reaches, and the event and parts that peak is made of.
        BudgetError: ``budget_bytes`` is not an int.
    """
    start = time.perf_counter()
    budget_bytes = check_budget_bytes(budget_bytes)
    kept = keep_all_when_it_fits(profile, budget_bytes, algorithm="dp", start=start)
    if kept is not None:
        return kept
    assert budget_bytes is not None  # keep_all_when_it_fits returns a plan for None
    model = step_model(profile)
    solver = _search(model, budget_bytes)
    end = solver.best_end() if solver is not None else None
    if solver is None or end is None:
        raise infeasible_budget_error(profile, budget_bytes)
    options, segments = solver.backtrack(end[1], end[2])
    log.debug("dp: %d units, largest front %d points", model.n, solver.largest_front)
    plan = Plan(tuple(u.name for u in profile.units), tuple(options), tuple(segments))
    return stamp_plan(profile, plan, algorithm="dp", status=Status.OPTIMAL, budget=budget_bytes,
                      start=start)

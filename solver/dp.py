"""The exact budgeted optimum by dynamic programming, and the event model it rests on.

The event model
---------------
``simulate()`` replays a step event by event. Every event's live bytes split into

* a plan-independent part (fixed bytes, the prefix's held bytes, gradients that
  exist at that point of the backward pass, ...),
* ``A_i``: what the units *before* unit ``i`` hold after the forward pass -- their
  ``held_bytes`` plus every boundary storage ``b_k`` (``k < i``) somebody holds,
* local terms that depend only on unit ``i``'s option and on whether its left
  neighbour holds their shared boundary (``holds_output`` of unit ``i-1``).

So the plan's peak is ``max(floor, max over events e of A_{i(e)} + need_e)`` and a
left-to-right pass over the units sees each event exactly once. On a chain unit
``i`` with option ``o`` after a left neighbour whose ``holds_output`` is ``p``::

    H        = p or o.holds_input                       # boundary b_i held?
    forward  : A_i + in_i + o.fwd_peak + C
    backward : A_i + o.held + H*in_i + o.holds_output*out_i + o.bwd_peak + D_i
    A_{i+1}  = A_i + o.held + H*in_i,   next p = o.holds_output

with ``C`` = fixed + prefix held bytes and ``D_i`` = ``C`` + the loss + the gradients alive at
unit ``i``'s backward (suffix and later units' parameter gradients, and the
gradient of unit ``i``'s output). A multi-unit segment ``a..b`` is one move from
``A_a`` to ``A_{b+1} = A_a + ckpt.held_a + in_a`` (only its first input is held,
next ``p`` = 0) whose forward, recompute and backward events are
``A_a + (constant of a and b)``; :func:`build_model` derives those constants with
prefix sums. Off a chain every unit's input and output are boundaries of their own,
``p`` is always 0 and segments do not exist.

The dynamic programme
---------------------
Left to right over units, the state is ``(i, p)``; each state carries the Pareto
front of ``(A_i, time so far)`` as sorted numpy arrays: a state with less held
memory and less time dominates, because the future only sees ``A_i`` (through
``A_i + need <= budget``) and adds to time. Every move keeps the prefix of a front
whose events fit, shifted by the move's ``(bytes, ms)``. A *need-to-go* table
computed right to left (the least headroom any completion needs above ``A_i``)
prunes states that cannot finish, exactly; the same table at unit 0 is the
smallest peak any plan reaches (:func:`min_peak_bytes`).

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
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from remat.errors import InfeasibleBudgetError
from remat.solver.plan import Plan, Status
from remat.solver.profile import Option, Profile
from remat.solver.simulate import simulate

__all__ = [
    "Move",
    "StepModel",
    "build_model",
    "min_peak_bytes",
    "need_to_go",
    "plan_peak_bytes",
    "stamp_plan",
    "solve_dp",
]

log = logging.getLogger(__name__)

_KEEP = Option.KEEP.value
_CKPT = Option.CHECKPOINT.value
OPTION_ORDER: tuple[str, ...] = tuple(o.value for o in Option)
SEGMENT_MOVE = -1  # move code of a multi-unit segment in the DP's back-pointers
# Larger than any real byte count, small enough that adding two never overflows int64.
UNREACHABLE = np.int64(2**60)

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Move:
    """One unit run with one option, entered with left flag ``in_flag``.

    Attributes:
        option: the option's name.
        in_flag: 1 when the left neighbour holds the shared boundary (chain only).
        inc_bytes: what the move adds to ``A`` (held bytes and held boundaries).
        need_bytes: its highest event minus ``A_i`` (absolute bytes, constants included).
        out_flag: 1 when the option holds its output boundary (chain only).
        extra_ms: the option's added step time, in milliseconds.
    """

    option: str
    in_flag: int
    inc_bytes: int
    need_bytes: int
    out_flag: int
    extra_ms: float


@dataclass(frozen=True)
class StepModel:
    """A profile reduced to the DP's terms (see the module docstring).

    Attributes:
        n: number of units.
        chain: whether multi-unit segments exist.
        floor_bytes: the highest plan-independent event (prefix, end of backward,
            optimizer step), absolute bytes.
        start_flag: the flag entering unit 0 (the prefix holds unit 0's input).
        moves: per unit, its single-unit moves.
        end_need: per flag after the last unit, the suffix's events minus ``A_n``.
        const_bytes: ``C`` = fixed bytes + prefix held bytes.
        bwd_const: per unit ``i``, ``D_i``.
        seg_last: per unit ``a``, the last unit a segment starting at ``a`` may reach
            (``a`` itself when no segment starts there).
        seg_inc: per unit ``a``, ``ckpt.held_a + in_a``: what a segment adds to ``A``.
        seg_fwd_need, seg_rec_need, seg_bwd_need: ``[a, b]`` the highest forward,
            recompute and backward event of segment ``a..b`` minus ``A_a``
            (:data:`UNREACHABLE` where there is no such segment).
        seg_need: ``[a, b]`` the highest event of segment ``a..b`` minus ``A_a``.
        seg_mono_need: ``[a, b]`` a lower bound of ``seg_need`` that never decreases
            in ``b`` (a longer segment recomputes with fewer gradients alive, so the
            recompute events alone may decrease).
        ckpt_cum_ms: ``[i]`` the summed checkpoint ``extra_ms`` of units ``< i``.
    """

    n: int
    chain: bool
    floor_bytes: int
    start_flag: int
    moves: tuple[tuple[Move, ...], ...]
    end_need: tuple[int, int]
    const_bytes: int
    bwd_const: tuple[int, ...]
    seg_last: IntArray
    seg_inc: IntArray
    seg_fwd_need: IntArray
    seg_rec_need: IntArray
    seg_bwd_need: IntArray
    seg_need: IntArray
    seg_mono_need: IntArray
    ckpt_cum_ms: FloatArray


# ---------------------------------------------------------------------------------
# The event model
# ---------------------------------------------------------------------------------
def _bwd_constants(profile: Profile, const_bytes: int) -> tuple[int, ...]:
    """``D_i``: ``C`` + gradient bytes alive during unit i's backward event."""
    units = profile.units
    n = len(units)
    later_pgrad = 0
    out: list[int] = [0] * n
    for i in range(n - 1, -1, -1):
        if profile.is_chain and i < n - 1:
            grad_out = units[i + 1].input_grad_bytes
        else:
            grad_out = units[i].output_bytes
        out[i] = (
            const_bytes
            + profile.loss_bytes
            + profile.suffix.param_grad_bytes
            + later_pgrad
            + grad_out
        )
        later_pgrad += units[i].param_grad_bytes
    return tuple(out)


def _floor_bytes(profile: Profile) -> int:
    """The highest event whose bytes no plan changes: prefix, end of backward, optimizer."""
    fixed = profile.fixed_bytes
    first = profile.units[0]
    unit_pgrad = sum(u.param_grad_bytes for u in profile.units)
    prefix_bwd = (
        fixed
        + profile.prefix.held_bytes
        + profile.suffix.param_grad_bytes
        + unit_pgrad
        + profile.prefix.bwd_peak_bytes
        + profile.loss_bytes
    )
    if profile.is_chain:
        # The prefix's hold on unit 0's input outlives unit 0, and so does its gradient.
        prefix_bwd += first.input_grad_bytes
        prefix_bwd += first.input_bytes if first.input_held_outside else 0
    end = fixed + profile.grad_bytes + profile.loss_bytes
    return max(
        fixed + profile.prefix.fwd_peak_bytes,
        prefix_bwd,
        end,
        end + profile.optimizer_step_peak_bytes,
    )


def _chain_moves(profile: Profile, i: int, c: int, d: int) -> tuple[Move, ...]:
    """Unit i's moves on a chain, for both left flags."""
    unit = profile.units[i]
    moves = []
    for name in OPTION_ORDER:
        o = unit.options.get(name)
        if o is None:
            continue
        fwd = c + unit.input_bytes + o.fwd_peak_bytes
        for p in (0, 1):
            held_in = unit.input_bytes if (p or o.holds_input) else 0
            bwd = (
                o.held_bytes
                + held_in
                + (unit.output_bytes if o.holds_output else 0)
                + o.bwd_peak_bytes
                + d
            )
            moves.append(
                Move(name, p, o.held_bytes + held_in, max(fwd, bwd), int(o.holds_output),
                     o.extra_ms)
            )
    return tuple(moves)


def _free_moves(profile: Profile, i: int, c: int, d: int) -> tuple[Move, ...]:
    """Unit i's moves off a chain: its input and output are its own boundaries."""
    unit = profile.units[i]
    moves = []
    for name in OPTION_ORDER:
        o = unit.options.get(name)
        if o is None:
            continue
        held_in = unit.input_bytes if (o.holds_input or unit.input_held_outside) else 0
        held_out = unit.output_bytes if (o.holds_output or unit.output_held_outside) else 0
        fwd = c + unit.input_bytes + o.fwd_peak_bytes
        # The outside's hold on the output ends before the unit's backward starts.
        bwd = (
            o.held_bytes
            + held_in
            + (unit.output_bytes if o.holds_output else 0)
            + o.bwd_peak_bytes
            + d
        )
        moves.append(Move(name, 0, o.held_bytes + held_in + held_out, max(fwd, bwd), 0,
                          o.extra_ms))
    return tuple(moves)


def _end_need(profile: Profile, c: int) -> tuple[int, int]:
    """The suffix's forward / backward events minus ``A_n``, per flag of the last unit."""
    s = profile.suffix
    if not profile.is_chain:
        need = c + max(s.fwd_peak_bytes, s.held_bytes + s.bwd_peak_bytes)
        return (need, need)
    last = profile.units[-1]
    out = last.output_bytes
    needs = []
    for q in (0, 1):
        held = out if (q or last.output_held_outside) else 0
        needs.append(c + max(out + s.fwd_peak_bytes, held + s.held_bytes + s.bwd_peak_bytes))
    return (needs[0], needs[1])


def _segment_runs(profile: Profile) -> IntArray:
    """Per unit a, the last unit b such that units a..b all offer ``checkpoint``."""
    n = profile.n
    last = np.arange(n, dtype=np.int64)
    if not profile.is_chain:
        return last
    for a in range(n - 2, -1, -1):
        both = _CKPT in profile.units[a].options and _CKPT in profile.units[a + 1].options
        if both:
            last[a] = last[a + 1]
    return last


def _segment_needs(
    profile: Profile, c: int, d: tuple[int, ...], seg_last: IntArray
) -> tuple[IntArray, IntArray, IntArray]:
    """``[a, b]`` forward / recompute / backward peaks of segment a..b minus ``A_a``.

    With ``kh`` keep held bytes, ``RH_m`` = "recomputed boundary m is held" and
    ``Kpre(a, k)`` = keep bytes held by units a..k-1 and their held recomputed
    boundaries, the events of segment a..b are (see simulate's _backward_segment)::

        forward k   : C + in_a + ckpt.fwd_a              (k = a)
                      c_a + C + in_k + ckpt.fwd_k        (k > a)
        recompute k : c_a + D_b + Kpre(a, k) + [k>a]*in_k + keep.fwd_k
        backward k  : c_a + D_k + Kpre(a, k) + kh_k + [k>a]*RH_k*in_k
                      + keep.holds_output_k*out_k + keep.bwd_k

    with ``c_a = ckpt.held_a + in_a``. Prefix sums make ``Kpre`` O(1), running
    maxima over k make each row one pass.
    """
    units = profile.units
    n = len(units)
    shape = (n, n)
    fwd_need = np.full(shape, UNREACHABLE, dtype=np.int64)
    rec_need = np.full(shape, UNREACHABLE, dtype=np.int64)
    bwd_need = np.full(shape, UNREACHABLE, dtype=np.int64)
    if not profile.is_chain or n < 2 or not np.any(seg_last > np.arange(n)):
        return fwd_need, rec_need, bwd_need

    keep = [u.options[_KEEP] for u in units]
    in_b = np.array([u.input_bytes for u in units], dtype=np.int64)
    out_b = np.array([u.output_bytes for u in units], dtype=np.int64)
    kh = np.array([k.held_bytes for k in keep], dtype=np.int64)
    kfwd = np.array([k.fwd_peak_bytes for k in keep], dtype=np.int64)
    kbwd = np.array([k.bwd_peak_bytes for k in keep], dtype=np.int64)
    khout = np.array([k.holds_output for k in keep], dtype=bool)
    khin = np.array([k.holds_input for k in keep], dtype=bool)
    dv = np.array(d, dtype=np.int64)
    rh = np.zeros(n, dtype=np.int64)  # RH_m * in_m for m >= 1
    rh[1:] = np.where(khout[:-1] | khin[1:], in_b[1:], 0)
    kh_cum = np.concatenate(([0], np.cumsum(kh)))
    rh_cum = np.concatenate(([0], np.cumsum(rh)))

    # Per-k terms, so that an event of segment a..b is (a's constant) + (k's term).
    f_k = c + in_b + _ckpt_array(profile, "fwd_peak_bytes")  # a member's forward
    r_k = kh_cum[:-1] + rh_cum[:-1] + in_b + kfwd
    s_k = dv + kh_cum[1:] + rh_cum[1:] + np.where(khout, out_b, 0) + kbwd
    ck_held = _ckpt_array(profile, "held_bytes")
    ck_fwd = _ckpt_array(profile, "fwd_peak_bytes")
    for a in range(n - 1):
        last = int(seg_last[a])
        if last <= a:
            continue
        ks = slice(a + 1, last + 1)
        c_a = int(ck_held[a] + in_b[a])
        q_a = int(kh_cum[a] + rh_cum[a + 1])
        fwd_first = c + int(in_b[a]) + int(ck_fwd[a])
        fwd_need[a, ks] = np.maximum(fwd_first, c_a + np.maximum.accumulate(f_k[ks]))
        rec_inner = np.maximum(int(kfwd[a]), np.maximum.accumulate(r_k[ks]) - q_a)
        rec_need[a, ks] = c_a + dv[ks] + rec_inner
        bwd_first = c_a + int(dv[a] + kh[a] + (out_b[a] if khout[a] else 0) + kbwd[a])
        bwd_need[a, ks] = np.maximum(bwd_first, c_a - q_a + np.maximum.accumulate(s_k[ks]))
    return fwd_need, rec_need, bwd_need


def _ckpt_array(profile: Profile, field_name: str) -> IntArray:
    """A checkpoint cost field per unit (0 where a unit has no checkpoint option)."""
    return np.array(
        [getattr(u.options[_CKPT], field_name) if _CKPT in u.options else 0
         for u in profile.units],
        dtype=np.int64,
    )


def build_model(profile: Profile) -> StepModel:
    """Reduce ``profile`` to the DP's per-unit moves and segment tables."""
    c = profile.fixed_bytes + profile.prefix.held_bytes
    d = _bwd_constants(profile, c)
    make_moves = _chain_moves if profile.is_chain else _free_moves
    moves = tuple(make_moves(profile, i, c, d[i]) for i in range(profile.n))
    seg_last = _segment_runs(profile)
    fwd_need, rec_need, bwd_need = _segment_needs(profile, c, d, seg_last)
    ck_ms = [u.options[_CKPT].extra_ms if _CKPT in u.options else 0.0 for u in profile.units]
    in_b = np.array([u.input_bytes for u in profile.units], dtype=np.int64)
    start = int(profile.is_chain and profile.units[0].input_held_outside)
    seg_need = np.maximum(np.maximum(fwd_need, rec_need), bwd_need)
    # A longer segment recomputes with other gradients alive (D_b is not monotone in b);
    # the smallest D_b' over b' >= b bounds every longer segment's recompute from below.
    d_arr = np.array(d, dtype=np.int64)
    d_min_after = np.minimum.accumulate(d_arr[::-1])[::-1]
    rec_floor = np.where(rec_need >= UNREACHABLE, UNREACHABLE, rec_need - d_arr + d_min_after)
    seg_mono = np.maximum(np.maximum(fwd_need, bwd_need), rec_floor)
    return StepModel(
        n=profile.n,
        chain=profile.is_chain,
        floor_bytes=_floor_bytes(profile),
        start_flag=start,
        moves=moves,
        end_need=_end_need(profile, c),
        const_bytes=c,
        bwd_const=d,
        seg_last=seg_last,
        seg_inc=_ckpt_array(profile, "held_bytes") + in_b,
        seg_fwd_need=fwd_need,
        seg_rec_need=rec_need,
        seg_bwd_need=bwd_need,
        seg_need=seg_need,
        seg_mono_need=seg_mono,
        ckpt_cum_ms=np.concatenate(([0.0], np.cumsum(ck_ms))),
    )


def plan_peak_bytes(
    model: StepModel, options: Sequence[str], segments: Sequence[tuple[int, int]] = ()
) -> int:
    """The peak of a plan by the event model: ``simulate()``'s figure, in O(n).

    For heuristics that score many candidate plans; a chosen plan is still
    re-scored with ``simulate()``.
    """
    starts = {a: b for a, b in segments}
    peak = model.floor_bytes
    held, flag, i = 0, model.start_flag, 0
    while i < model.n:
        if i in starts:
            b = starts[i]
            peak = max(peak, held + int(model.seg_need[i, b]))
            held += int(model.seg_inc[i])
            flag, i = 0, b + 1
            continue
        mv = next(m for m in model.moves[i] if m.option == options[i] and m.in_flag == flag)
        peak = max(peak, held + mv.need_bytes)
        held += mv.inc_bytes
        flag, i = mv.out_flag, i + 1
    return max(peak, held + model.end_need[flag])


# ---------------------------------------------------------------------------------
# Need-to-go: the least headroom above A_i that any completion needs
# ---------------------------------------------------------------------------------
def need_to_go(model: StepModel, seg_need: IntArray) -> IntArray:
    """``[i, p]``: min over completions from state (i, p) of (their highest event - A_i).

    ``[0, start_flag]`` is the smallest peak any plan reaches, the floor aside.
    """
    n = model.n
    ng = np.full((n + 1, 2), UNREACHABLE, dtype=np.int64)
    ng[n] = model.end_need
    for i in range(n - 1, -1, -1):
        for mv in model.moves[i]:
            via = max(mv.need_bytes, mv.inc_bytes + int(ng[i + 1, mv.out_flag]))
            ng[i, mv.in_flag] = min(ng[i, mv.in_flag], via)
        last = int(model.seg_last[i])
        if last > i:
            # Segment i..b lands in state (b+1, 0) whatever flag it was entered with.
            bs = slice(i + 1, last + 1)
            via = np.maximum(seg_need[i, bs], model.seg_inc[i] + ng[i + 2 : last + 2, 0])
            best = np.int64(via.min())
            ng[i] = np.minimum(ng[i], best)
    return np.minimum(ng, UNREACHABLE)


def min_peak_bytes(profile: Profile, model: StepModel | None = None) -> int:
    """The smallest simulated peak over the whole plan space, in bytes."""
    model = model or build_model(profile)
    ng = need_to_go(model, model.seg_need)
    return max(model.floor_bytes, int(ng[0, model.start_flag]))


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
        model: the profile's event model.
        budget: the budget in bytes.
        ng: the need-to-go table (:func:`need_to_go`).
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
        ng: IntArray,
        bound: _TimeBound,
        upper_ms: float = np.inf,
        beam: int | None = None,
    ) -> None:
        self.model = model
        self.budget = budget
        self.ng = ng
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

    def backtrack(self, flag: int, idx: int) -> tuple[list[str], list[tuple[int, int]]]:
        """Options per unit and segments of the path ending at (n, flag, idx)."""
        n = self.model.n
        options = [""] * n
        segments: list[tuple[int, int]] = []
        layer = n
        while layer > 0:
            f = self.fronts[layer][flag]
            assert f is not None
            prev, prev_flag, prev_idx, move = _decode(int(f.code[idx]))
            if move == SEGMENT_MOVE:
                options[prev:layer] = [_CKPT] * (layer - prev)
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
    ng = need_to_go(model, model.seg_need)
    if model.floor_bytes > budget or int(ng[0, model.start_flag]) > budget:
        return None
    bound = _TimeBound(model, budget)
    beam = _Solver(model, budget, ng, bound, beam=BEAM_WIDTH)
    beam.run()
    first = beam.best_end()
    if first is None:
        # Cannot happen (the beam keeps each front's least-held point, which can finish);
        # should it, the exact pass without an upper bound is slower but still exact.
        log.warning("dp: the beam pass found no plan; searching without an upper bound")
    exact = _Solver(model, budget, ng, bound, upper_ms=np.inf if first is None else first[0])
    exact.run()
    return exact


def solve_dp(profile: Profile, budget_bytes: int | None, **params: object) -> Plan:
    """The minimum-time plan whose simulated peak is at most ``budget_bytes``.

    Exact over the whole plan space (every option a unit has a cost for, and every
    multi-unit checkpoint segment on a chain). ``budget_bytes=None`` means no budget:
    the plan keeps everything. Raises :class:`InfeasibleBudgetError` when no plan fits.
    """
    if params:
        raise TypeError(f"dp takes no parameters, got {sorted(params)}")
    start = time.perf_counter()
    names = [u.name for u in profile.units]
    if budget_bytes is None:
        plan = Plan.keep_all(names)
        return _finish(profile, plan, budget_bytes, start)
    model = build_model(profile)
    solver = _search(model, budget_bytes)
    end = solver.best_end() if solver is not None else None
    if solver is None or end is None:
        raise InfeasibleBudgetError(budget_bytes, min_peak_bytes(profile, model))
    options, segments = solver.backtrack(end[1], end[2])
    log.debug("dp: %d units, largest front %d points", model.n, solver.largest_front)
    plan = Plan(tuple(names), tuple(options), tuple(segments))
    return _finish(profile, plan, budget_bytes, start)


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

    ``start`` is the ``time.perf_counter()`` at which the algorithm started.
    """
    sim = simulate(profile, plan)
    return plan.with_(
        algorithm=algorithm,
        status=status,
        solve_ms=(time.perf_counter() - start) * 1e3,
        budget_bytes=budget,
        predicted_peak_bytes=sim.peak_bytes,
        predicted_time_ms=sim.time_ms,
        fingerprint=profile.fingerprint(),
        unit_types=tuple(u.type_name for u in profile.units),
        device=profile.device.split(":")[0],
    )


def _finish(profile: Profile, plan: Plan, budget: int | None, start: float) -> Plan:
    """Stamp a DP plan and check that it fits."""
    plan = stamp_plan(profile, plan, algorithm="dp", status=Status.OPTIMAL, budget=budget,
                      start=start)
    if budget is not None and plan.predicted_peak_bytes > budget:
        # The event model and simulate() disagree: a bug, not a user error.
        raise AssertionError(
            f"dp plan peaks at {plan.predicted_peak_bytes} B under simulate(), above the "
            f"budget {budget} B"
        )
    return plan

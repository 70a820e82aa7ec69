"""The event model: a profile reduced to per-unit moves, so a plan's peak is a sum per unit.

``simulate()`` replays a step event by event and stays the specification; this
module derives the same peaks in a form a search can use. The DP
(:mod:`remat.solver.dp`), the CP-SAT model (:mod:`remat.solver.ilp`) and the
baselines (:mod:`remat.solver.baselines`) all rest on it, and it is tested
against ``simulate()`` plan by plan.

Every event's live bytes split into

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
    forward  : A_i + in_i + o.fwd_peak + C_i
    backward : A_i + o.held + H*in_i + o.holds_output*out_i + o.bwd_peak + D_i
    A_{i+1}  = A_i + o.held + H*in_i,   next p = o.holds_output

with ``C_i`` = fixed + prefix held bytes + what the loop carries and keeps alive
(the previous output and loss, gradients it accumulates) + earlier units'
autocast casts + the shared tensors born by then, and ``D_i`` = fixed + prefix
held bytes + the loss and the kept output + the shared tensors still alive + the
gradients alive at unit ``i``'s backward (suffix and later units' parameter
gradients, or all of them when the loop keeps them, and the gradient of unit
``i``'s output). ``o.bwd_peak`` is the option's backward peak in the profile's loop
(:meth:`Profile.bwd_peak`: in a loop that steps the optimizer in backward, its
parameters' steps included; no parameter gradient then outlives its phase). A
multi-unit segment ``a..b`` is one move from
``A_a`` to ``A_{b+1} = A_a + ckpt.held_a + in_a`` (only its first input is held,
next ``p`` = 0) whose forward, recompute and backward events are
``A_a + (constant of a and b)``; :func:`build_model` derives those constants with
prefix sums. Off a chain every unit's input and output are boundaries of their own,
``p`` is always 0 and segments do not exist. There the code between units ``i`` and
``i+1`` (a downsampling layer between stages) has a forward event after unit ``i``'s,
``A_i + C_{i+1} + in_i + o.held + out_i + (its forward peak)``, and a backward event once
unit ``i+1``'s backward is done, ``A_{i+1} + (a constant)``: unit ``i``'s and unit
``i+1``'s moves carry them, and its parameter gradients are in ``D`` from then on.

Need-to-go
----------
Computed right to left, ``need[i, p]`` is the least headroom above ``A_i`` that
any completion from state ``(i, p)`` needs: the DP prunes with it exactly, and
``need[0, start_flag]`` is the smallest peak any plan reaches, the floor aside
(:mod:`remat.solver.min_peak`).

A profile's model is built once and cached on the (frozen) profile:
:func:`step_model`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from remat.core.option import OPTION_ORDER, Option
from remat.core.profile import Profile

__all__ = [
    "UNREACHABLE",
    "Move",
    "StepModel",
    "build_model",
    "need_to_go",
    "plan_peak_bytes",
    "step_model",
]

# Larger than any real byte count (profile fields are at most MAX_BYTES = 2**50), small
# enough that adding two never overflows int64.
UNREACHABLE = np.int64(2**60)

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

# Where step_model() keeps a profile's model: an attribute no dataclass field uses.
_CACHE_ATTRIBUTE = "_remat_step_model"


@dataclass(frozen=True)
class Move:
    """One unit run with one option, entered with left flag ``in_flag``.

    Attributes:
        option: the option.
        in_flag: 1 when the left neighbour holds the shared boundary (chain only).
        inc_bytes: what the move adds to ``A`` (held bytes and held boundaries).
        need_bytes: its highest event minus ``A_i`` (absolute bytes, constants included).
        out_flag: 1 when the option holds its output boundary (chain only).
        extra_ms: the option's added step time, in milliseconds.
    """

    option: Option
    in_flag: int
    inc_bytes: int
    need_bytes: int
    out_flag: int
    extra_ms: float


@dataclass(frozen=True, eq=False)
class StepModel:
    """A profile reduced to the event model's terms (see the module docstring).

    Compared by identity (it holds numpy tables); build it with :func:`step_model`.

    Attributes:
        n: number of units.
        chain: whether multi-unit segments exist.
        floor_bytes: the highest plan-independent event (prefix, end of backward,
            optimizer step), absolute bytes.
        start_flag: the flag entering unit 0 (the prefix holds unit 0's input).
        moves: per unit, its single-unit moves.
        end_need: per flag after the last unit, the suffix's events minus ``A_n``.
        fwd_const: per unit ``i`` (and ``n``, the suffix), ``C_i``: what no plan
            changes at its forward (fixed and prefix bytes, what the loop carries and
            keeps, earlier autocast casts, shared tensors born).
        suffix_bwd_const: the same at the suffix's backward.
        bwd_const: per unit ``i``, ``D_i``.
        after_fwd_const, before_bwd_const: per unit ``i``, off a chain, the events of
            the code between units around it (0: none; :func:`_between_constants`).
        seg_last: per unit ``a``, the last unit a segment starting at ``a`` may reach
            (``a`` itself when no segment starts there).
        seg_inc: per unit ``a``, ``ckpt.held_a + in_a``: what a segment adds to ``A``.
        seg_rec_need, seg_bwd_need: ``[a, b]`` the highest recompute and backward
            event of segment ``a..b`` minus ``A_a`` (:data:`UNREACHABLE` where there
            is no such segment); the CP-SAT model constrains them one by one.
        seg_need: ``[a, b]`` the highest event of segment ``a..b`` minus ``A_a``.
        seg_mono_need: ``[a, b]`` a lower bound of ``seg_need`` that never decreases
            in ``b`` (a longer segment recomputes with fewer gradients alive, so the
            recompute events alone may decrease).
        ckpt_cum_ms: ``[i]`` the summed checkpoint ``extra_ms`` of units ``< i``.
        need: ``[i, p]`` the need-to-go table (:func:`need_to_go`).
    """

    n: int
    chain: bool
    floor_bytes: int
    start_flag: int
    moves: tuple[tuple[Move, ...], ...]
    end_need: tuple[int, int]
    fwd_const: tuple[int, ...]
    suffix_bwd_const: int
    bwd_const: tuple[int, ...]
    after_fwd_const: tuple[int, ...]
    before_bwd_const: tuple[int, ...]
    seg_last: IntArray
    seg_inc: IntArray
    seg_rec_need: IntArray
    seg_bwd_need: IntArray
    seg_need: IntArray
    seg_mono_need: IntArray
    ckpt_cum_ms: FloatArray
    need: IntArray


def step_model(profile: Profile) -> StepModel:
    """``profile``'s event model, built on first use and kept on the profile.

    Profiles are frozen, so the model stays valid for the profile's lifetime; every
    solve, frontier point and baseline on the same profile reuses it.
    """
    model = profile.__dict__.get(_CACHE_ATTRIBUTE)
    if model is None:
        model = build_model(profile)
        # A frozen dataclass refuses setattr; its __dict__ is where a cache may live.
        profile.__dict__[_CACHE_ATTRIBUTE] = model
    return model


# ---------------------------------------------------------------------------------
# Building the model
# ---------------------------------------------------------------------------------
def _param_grads_at_start(profile: Profile) -> int:
    return profile.grad_bytes if profile.grads_alive_at_start else 0


def _fwd_constants(profile: Profile) -> tuple[int, ...]:
    """``C_i`` for i in 0..n: what no plan changes at unit i's forward (``i = n``: the
    suffix's): fixed and prefix bytes, what the loop carries from the previous
    iteration, gradients it keeps, earlier units' autocast casts, shared tensors born."""
    born = [0] * (profile.n + 1)  # shared bytes first alive at unit i's forward
    for t in profile.shared:
        born[t.born_after + 1] += t.nbytes
    for i, unit in enumerate(profile.units):  # what the code before unit i holds, off a chain
        born[i] += unit.before_held_bytes
    c = (profile.fixed_bytes + profile.prefix.held_bytes + profile.carried_bytes
         + _param_grads_at_start(profile))
    out = []
    for i in range(profile.n + 1):
        c += born[i]
        out.append(c)
        if i < profile.n:
            c += profile.units[i].autocast_cache_bytes
    return tuple(out)


def _shared_alive_in_backward(profile: Profile) -> tuple[int, ...]:
    """Per unit i, the shared bytes still alive at its backward (freed after the
    backward of a unit ``<= i`` or at the end), and at index n those alive to the end."""
    n = profile.n
    alive = [0] * (n + 1)
    for t, released in zip(profile.shared, profile.shared_released_after()):
        for i in range(n + 1):
            if released is None or (i < n and released <= i):
                alive[i] += t.nbytes
    return tuple(alive)


def _shared_grads_in_backward(profile: Profile) -> tuple[int, ...]:
    """Per unit i, the gradients of shared tensors alive at its backward (made by a
    later user's, not yet consumed by their maker's); at index n, those alive at the
    prefix's backward."""
    n = profile.n
    alive = [0] * (n + 1)
    for t in profile.shared:
        if not t.grad_bytes or t.last_user <= t.born_after:
            continue
        # Off a chain, a shared output's gradient at its maker's backward is the
        # maker's output gradient, counted there (on a chain they may be two buffers).
        merged = t.maker_output and not profile.is_chain
        for i in range(max(t.born_after + merged, 0), t.last_user):
            alive[i] += t.grad_bytes
        if t.born_after < 0:
            alive[n] += t.grad_bytes
    return tuple(alive)


def _kept_input_grads_in_backward(profile: Profile) -> tuple[int, ...]:
    """Per unit i, off a chain, the input gradients of later units that the code before
    them still keeps at unit i's backward (see ``UnitProfile.input_grad_kept_until``);
    at index n, those kept through the prefix's backward."""
    n = profile.n
    alive = [0] * (n + 1)
    if profile.is_chain:
        return tuple(alive)
    for j, unit in enumerate(profile.units):
        k = unit.input_grad_kept_until
        if k is None:
            continue
        for i in range(max(k, 0), j):
            alive[i] += unit.input_grad_bytes
        if k < 0:
            alive[n] += unit.input_grad_bytes
        elif k == j - 1:  # unit k's output gradient is part of it: counted once
            alive[k] -= min(profile.units[k].output_bytes, unit.input_grad_bytes)
    return tuple(alive)


def _suffix_bwd_const(profile: Profile) -> int:
    """What no plan changes at the suffix's backward (the loss is not made yet; on a
    chain the last unit's output is the end's own term, see :func:`_end_need`)."""
    kept = 0 if profile.is_chain else profile.kept_last_output_bytes
    return (profile.fixed_bytes + profile.prefix.held_bytes + profile.output_bytes + kept
            + _param_grads_at_start(profile) + sum(t.nbytes for t in profile.shared)
            + sum(u.before_held_bytes for u in profile.units))


def _bwd_constants(profile: Profile) -> tuple[int, ...]:
    """``D_i``: the fixed and prefix bytes, the loss and the kept output, the shared
    tensors still alive and the gradient bytes alive during unit i's backward event."""
    units = profile.units
    n = len(units)
    shared = _shared_alive_in_backward(profile)
    base = profile.fixed_bytes + profile.prefix.held_bytes + profile.loss_bytes
    base += profile.output_bytes + profile.kept_last_output_bytes
    base += profile.extra_grad_in_flight_bytes
    shared_grads = _shared_grads_in_backward(profile)
    kept_grads = _kept_input_grads_in_backward(profile)
    at_start = profile.grads_alive_at_start
    # Gradients alive at unit i's backward: every one (kept from before), the suffix's and
    # later units' (made in this backward), or none (each freed after its phase).
    accumulates = not at_start and not profile.optimizer_in_backward
    later_pgrad = (profile.grad_bytes if at_start
                   else profile.suffix.param_grad_bytes if accumulates else 0)
    # What the code between units holds until its backward: the code before units <= i
    # (it runs its backward after theirs).
    between_held = np.cumsum([u.before_held_bytes for u in units]).tolist()
    out: list[int] = [0] * n
    for i in range(n - 1, -1, -1):
        if profile.is_chain and i < n - 1:
            grad_out = units[i + 1].input_grad_bytes
        else:
            grad_out = units[i].output_bytes
        out[i] = (base + later_pgrad + grad_out + shared[i] + shared_grads[i] + kept_grads[i]
                  + between_held[i])
        if accumulates:
            later_pgrad += units[i].param_grad_bytes + units[i].before_param_grad_bytes
    return tuple(out)


def _between_constants(profile: Profile, c: tuple[int, ...], d: tuple[int, ...]
                       ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Off a chain, the events of the code between two units (0 where there is none).

    Per unit i, ``after_fwd[i]``: the forward of the code between unit i and i+1 minus
    ``A_i`` and unit i's ``held_bytes`` (its input and output counted alive); and
    ``before_bwd[i]``: the backward of the code between unit i-1 and i minus ``A_i``.
    That one runs once unit i's backward is done: ``D_i`` less the output's gradient,
    plus the input's gradient, the unit's parameter gradients (where they accumulate),
    the shared tensors' gradients its backward completed, and its input while the code
    before it holds it. No option of unit i changes it: the unit has let go of all it
    held by then.
    """
    n = profile.n
    after_fwd, before_bwd = [0] * n, [0] * n
    if profile.is_chain:
        return tuple(after_fwd), tuple(before_bwd)
    accumulates = not profile.grads_alive_at_start and not profile.optimizer_in_backward
    made = [0] * n
    for t in profile.shared:
        if t.grad_bytes and t.last_user > t.born_after:
            made[t.last_user] += t.grad_bytes
    units = profile.units
    for i, unit in enumerate(units):
        if i < n - 1 and units[i + 1].before_fwd_peak_bytes:
            after_fwd[i] = (c[i + 1] + unit.input_bytes + unit.output_bytes
                            + units[i + 1].before_fwd_peak_bytes)
        if i > 0 and unit.before_bwd_peak_bytes:
            before_bwd[i] = (d[i] - unit.output_bytes + unit.input_grad_bytes
                             + (unit.param_grad_bytes if accumulates else 0) + made[i]
                             + (unit.input_bytes if unit.input_held_outside else 0)
                             + unit.before_bwd_peak_bytes)
    return tuple(after_fwd), tuple(before_bwd)


def _floor_bytes(profile: Profile) -> int:
    """The highest event whose bytes no plan changes: prefix, end of backward, optimizer."""
    fixed = profile.fixed_bytes
    first = profile.units[0]
    at_start = profile.grads_alive_at_start
    to_end = _shared_alive_in_backward(profile)[profile.n]
    kept = (profile.loss_bytes + profile.output_bytes + profile.kept_last_output_bytes
            + to_end)
    released = profile.optimizer_in_backward
    grads_then = 0 if released else (
        profile.grad_bytes - (0 if at_start else profile.prefix.param_grad_bytes))
    prefix_bwd = (
        fixed
        + profile.prefix.held_bytes
        + grads_then
        + profile.bwd_peak(profile.prefix)
        + kept
        + profile.extra_grad_in_flight_bytes
        + _shared_grads_in_backward(profile)[profile.n]
        + _kept_input_grads_in_backward(profile)[profile.n]
    )
    if profile.is_chain:
        # The prefix's hold on unit 0's input outlives unit 0, and so does its gradient.
        prefix_bwd += first.input_grad_bytes
        prefix_bwd += first.input_bytes if first.input_held_outside else 0
    end = fixed + (0 if released else profile.grad_bytes) + kept
    prefix_fwd = (fixed + profile.carried_bytes + _param_grads_at_start(profile)
                  + profile.prefix.fwd_peak_bytes)
    return max(prefix_fwd, prefix_bwd, end, end + profile.end_step_peak_bytes)


def _chain_moves(profile: Profile, i: int, c: int, d: int) -> tuple[Move, ...]:
    """Unit i's moves on a chain, for both left flags."""
    unit = profile.units[i]
    moves = []
    for option in OPTION_ORDER:
        o = unit.options.get(option)
        if o is None:
            continue
        fwd = c + unit.input_bytes + o.fwd_peak_bytes
        # A last output the loop keeps is in D already.
        holds_out = o.holds_output and not (i == profile.n - 1 and profile.last_output_kept)
        for p in (0, 1):
            held_in = unit.input_bytes if (p or o.holds_input) else 0
            bwd = (
                o.held_bytes
                + held_in
                + (unit.output_bytes if holds_out else 0)
                + profile.bwd_peak(o)
                + d
            )
            moves.append(
                Move(option, p, o.held_bytes + held_in, max(fwd, bwd), int(o.holds_output),
                     o.extra_ms)
            )
    return tuple(moves)


def _free_moves(profile: Profile, i: int, c: int, d: int, after_fwd: int = 0,
                before_bwd: int = 0) -> tuple[Move, ...]:
    """Unit i's moves off a chain: its input and output are its own boundaries. The
    events of the code around it (``after_fwd``, ``before_bwd``: see
    :func:`_between_constants`) are its moves' too."""
    unit = profile.units[i]
    moves = []
    for option in OPTION_ORDER:
        o = unit.options.get(option)
        if o is None:
            continue
        held_in = unit.input_bytes if (o.holds_input or unit.input_held_outside) else 0
        # A last output the loop keeps is in the constants (D, the suffix's) already.
        kept = i == profile.n - 1 and profile.last_output_kept
        held_out = unit.output_bytes if (o.holds_output or unit.output_held_outside) else 0
        held_out = 0 if kept else held_out
        fwd = c + unit.input_bytes + o.fwd_peak_bytes
        # The outside's hold on the output ends before the unit's backward starts.
        bwd = (
            o.held_bytes
            + held_in
            + (unit.output_bytes if o.holds_output and not kept else 0)
            + profile.bwd_peak(o)
            + d
        )
        between = max(o.held_bytes + after_fwd if after_fwd else 0, before_bwd)
        moves.append(Move(option, 0, o.held_bytes + held_in + held_out,
                          max(fwd, bwd, between), 0, o.extra_ms))
    return tuple(moves)


def _end_need(profile: Profile, c_fwd: int, c_bwd: int) -> tuple[int, int]:
    """The suffix's forward / backward events minus ``A_n``, per flag of the last unit."""
    s = profile.suffix
    s_bwd = profile.bwd_peak(s)
    if not profile.is_chain:
        kept = profile.kept_last_output_bytes  # in c_bwd already
        need = max(c_fwd + kept + s.fwd_peak_bytes, c_bwd + s.held_bytes + s_bwd)
        return (need, need)
    last = profile.units[-1]
    out = last.output_bytes
    needs = []
    for q in (0, 1):
        held = out if (q or last.output_held_outside or profile.last_output_kept) else 0
        needs.append(max(c_fwd + out + s.fwd_peak_bytes,
                         c_bwd + held + s.held_bytes + s_bwd))
    return (needs[0], needs[1])


def _segment_runs(profile: Profile) -> IntArray:
    """Per unit a, the last unit b such that units a..b may form one segment (every link
    between them a :meth:`Profile.segment_link`)."""
    n = profile.n
    last = np.arange(n, dtype=np.int64)
    for a in range(n - 2, -1, -1):
        if profile.segment_link(a):
            last[a] = last[a + 1]
    return last


def _segment_needs(
    profile: Profile, c: tuple[int, ...], d: tuple[int, ...], seg_last: IntArray
) -> tuple[IntArray, IntArray, IntArray]:
    """``[a, b]`` forward / recompute / backward peaks of segment a..b minus ``A_a``.

    With ``kh`` keep held bytes, ``RH_m`` = "recomputed boundary m is held" and
    ``Kpre(a, k)`` = keep bytes held by units a..k-1 and their held recomputed
    boundaries, the events of segment a..b are (see simulate's _backward_segment)::

        forward k   : C_a + in_a + ckpt.fwd_a            (k = a)
                      c_a + C_k + in_k + ckpt.fwd_k      (k > a)
        recompute k : c_a + D_b + S(a, b) + Kpre(a, k) + [k>a]*in_k + keep.fwd_k
        backward k  : c_a + D_k + Kpre(a, k) + kh_k + [k>a]*RH_k*in_k
                      + keep.holds_output_k*out_k + keep.bwd_k

    with ``c_a = ckpt.held_a + in_a`` and ``S(a, b)`` what the recomputation holds
    throughout (the RNG stash and the units' ``recompute_state_bytes``). Prefix sums
    make ``Kpre`` and ``S`` O(1), running maxima over k make each row one pass.
    """
    units = profile.units
    n = len(units)
    shape = (n, n)
    fwd_need = np.full(shape, UNREACHABLE, dtype=np.int64)
    rec_need = np.full(shape, UNREACHABLE, dtype=np.int64)
    bwd_need = np.full(shape, UNREACHABLE, dtype=np.int64)
    if not profile.is_chain or n < 2 or not np.any(seg_last > np.arange(n)):
        return fwd_need, rec_need, bwd_need

    keep = [u.keep for u in units]
    in_b = np.array([u.input_bytes for u in units], dtype=np.int64)
    out_b = np.array([u.output_bytes for u in units], dtype=np.int64)
    kh = np.array([k.held_bytes for k in keep], dtype=np.int64)
    kfwd = np.array([k.fwd_peak_bytes for k in keep], dtype=np.int64)
    kbwd = np.array([profile.bwd_peak(k) for k in keep], dtype=np.int64)
    khout = np.array([k.holds_output for k in keep], dtype=bool)
    khin = np.array([k.holds_input for k in keep], dtype=bool)
    dv = np.array(d, dtype=np.int64)
    rh = np.zeros(n, dtype=np.int64)  # RH_m * in_m for m >= 1
    rh[1:] = np.where(khout[:-1] | khin[1:], in_b[1:], 0)
    kh_cum = np.concatenate(([0], np.cumsum(kh)))
    rh_cum = np.concatenate(([0], np.cumsum(rh)))
    st = np.array([u.recompute_state_bytes for u in units], dtype=np.int64)
    st_cum = np.concatenate(([0], np.cumsum(st)))

    # Per-k terms, so that an event of segment a..b is (a's constant) + (k's term).
    cv = np.array(c[:n], dtype=np.int64)
    f_k = cv + in_b + _ckpt_array(profile, "fwd_peak_bytes")  # a member's forward
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
        fwd_first = int(cv[a]) + int(in_b[a]) + int(ck_fwd[a])
        fwd_need[a, ks] = np.maximum(fwd_first, c_a + np.maximum.accumulate(f_k[ks]))
        rec_inner = np.maximum(int(kfwd[a]), np.maximum.accumulate(r_k[ks]) - q_a)
        stash = profile.recompute_rng_bytes + st_cum[a + 2 : last + 2] - st_cum[a]
        rec_need[a, ks] = c_a + dv[ks] + stash + rec_inner
        bwd_first = c_a + int(dv[a] + kh[a] + (out_b[a] if khout[a] else 0) + kbwd[a])
        bwd_need[a, ks] = np.maximum(bwd_first, c_a - q_a + np.maximum.accumulate(s_k[ks]))
    return fwd_need, rec_need, bwd_need


def _ckpt_array(profile: Profile, field_name: str) -> IntArray:
    """A checkpoint cost field per unit (0 where a unit has no checkpoint option)."""
    return np.array(
        [
            getattr(u.options[Option.CHECKPOINT], field_name)
            if Option.CHECKPOINT in u.options
            else 0
            for u in profile.units
        ],
        dtype=np.int64,
    )


def build_model(profile: Profile) -> StepModel:
    """Reduce ``profile`` to per-unit moves and segment tables (uncached: see step_model)."""
    c = _fwd_constants(profile)
    d = _bwd_constants(profile)
    after_fwd, before_bwd = _between_constants(profile, c, d)
    if profile.is_chain:
        moves = tuple(_chain_moves(profile, i, c[i], d[i]) for i in range(profile.n))
    else:
        moves = tuple(_free_moves(profile, i, c[i], d[i], after_fwd[i], before_bwd[i])
                      for i in range(profile.n))
    seg_last = _segment_runs(profile)
    fwd_need, rec_need, bwd_need = _segment_needs(profile, c, d, seg_last)
    ck_ms = [
        u.options[Option.CHECKPOINT].extra_ms if Option.CHECKPOINT in u.options else 0.0
        for u in profile.units
    ]
    in_b = np.array([u.input_bytes for u in profile.units], dtype=np.int64)
    seg_inc = _ckpt_array(profile, "held_bytes") + in_b
    seg_need = np.maximum(np.maximum(fwd_need, rec_need), bwd_need)
    # A longer segment recomputes with other gradients alive (D_b is not monotone in b);
    # the smallest D_b' over b' >= b bounds every longer segment's recompute from below.
    d_arr = np.array(d, dtype=np.int64)
    d_min_after = np.minimum.accumulate(d_arr[::-1])[::-1]
    rec_floor = np.where(rec_need >= UNREACHABLE, UNREACHABLE, rec_need - d_arr + d_min_after)
    seg_mono = np.maximum(np.maximum(fwd_need, bwd_need), rec_floor)
    suffix_bwd = _suffix_bwd_const(profile)
    end_need = _end_need(profile, c[profile.n], suffix_bwd)
    return StepModel(
        n=profile.n,
        chain=profile.is_chain,
        floor_bytes=_floor_bytes(profile),
        start_flag=int(profile.is_chain and profile.units[0].input_held_outside),
        moves=moves,
        end_need=end_need,
        fwd_const=c,
        suffix_bwd_const=suffix_bwd,
        bwd_const=d,
        after_fwd_const=after_fwd,
        before_bwd_const=before_bwd,
        seg_last=seg_last,
        seg_inc=seg_inc,
        seg_rec_need=rec_need,
        seg_bwd_need=bwd_need,
        seg_need=seg_need,
        seg_mono_need=seg_mono,
        ckpt_cum_ms=np.concatenate(([0.0], np.cumsum(ck_ms))),
        need=need_to_go(moves, end_need, seg_last, seg_need, seg_inc),
    )


# ---------------------------------------------------------------------------------
# Need-to-go: the least headroom above A_i that any completion needs
# ---------------------------------------------------------------------------------
def need_to_go(
    moves: Sequence[Sequence[Move]],
    end_need: tuple[int, int],
    seg_last: IntArray,
    seg_need: IntArray,
    seg_inc: IntArray,
) -> IntArray:
    """``[i, p]``: min over completions from state (i, p) of (their highest event - A_i).

    ``[0, start_flag]`` is the smallest peak any plan reaches, the floor aside. Read
    it as ``StepModel.need``: :func:`build_model` computes it once.
    """
    n = len(moves)
    ng = np.full((n + 1, 2), UNREACHABLE, dtype=np.int64)
    ng[n] = end_need
    for i in range(n - 1, -1, -1):
        for mv in moves[i]:
            via = max(mv.need_bytes, mv.inc_bytes + int(ng[i + 1, mv.out_flag]))
            ng[i, mv.in_flag] = min(ng[i, mv.in_flag], via)
        last = int(seg_last[i])
        if last > i:
            # Segment i..b lands in state (b+1, 0) whatever flag it was entered with.
            bs = slice(i + 1, last + 1)
            via = np.maximum(seg_need[i, bs], seg_inc[i] + ng[i + 2 : last + 2, 0])
            best = np.int64(via.min())
            ng[i] = np.minimum(ng[i], best)
    return np.minimum(ng, UNREACHABLE)


# ---------------------------------------------------------------------------------
# Scoring a plan
# ---------------------------------------------------------------------------------
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

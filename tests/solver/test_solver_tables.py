"""Tiny hand-made profiles whose optima are worked out by hand in the comments.

Conventions for every profile here unless said otherwise: a chain, boundaries of
10 B, no fixed bytes, an empty prefix/suffix, no parameter gradients and input
gradients of 0 B (so the only gradient is the last unit's output gradient, 10 B,
alive from the suffix's backward on). ``step_ms`` is 100.

With ``A_i`` the bytes held by units before unit ``i`` (their held bytes plus
held boundaries), ``D_i`` the gradient bytes alive at unit i's backward
(10 for the last unit, 0 before), the events are:

    forward i   : A_i + 10 + fwd_peak
    backward i  : A_i + held + H_i*10 + bwd_peak + D_i  (H_i: input held)
    suffix fwd  : A_n + 10 (+ suffix fwd peak)
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from solver_testlib import CKPT, KEEP, SEL, brute_force, brute_min_peak, cost, unit

from remat.core.errors import InfeasibleBudgetError
from remat.core.plan import Plan
from remat.core.profile import OutsideCost, Profile
from remat.solver.baselines import chen_plan, uniform_plan
from remat.solver.dp import solve_dp
from remat.solver.ilp import solve_ilp
from remat.solver.min_peak import min_peak_bytes
from remat.solver.simulate import simulate

SOLVERS = [solve_dp, solve_ilp]


def _chain(*units, suffix: OutsideCost | None = None) -> Profile:
    return Profile(units=units, is_chain=True, suffix=suffix or OutsideCost(), step_ms=100.0)


def _u(name: str, options: dict, **kw) -> object:
    return unit(name, options, in_grad=0, **kw)


# Two units; keep holds 100 B and its input; checkpoint holds only the input and
# recomputes 100 B in its backward, for 5 ms.
#   keep, keep : A1 = 110, A2 = 220; suffix fwd 230, backward u1 110+100+10+10 = 230 -> 230
#   ckpt, keep : A1 = 10,  A2 = 120; suffix fwd 130, backward u1 10+110+10 = 130,
#                backward u0 0+0+10+100 = 110                                     -> 130, +5
#   keep, ckpt : backward u1 110+0+10+100+10 = 230 (the last unit gains nothing)  -> 230, +5
#   ckpt, ckpt : A2 = 20; backward u1 10+10+100+10 = 130                           -> 130, +10
#   segment 0-1: recomputes both: 10 (input) + 10 (grad) + 100 + 100 + 10 (r1)    -> 230, +10
TWO = _chain(
    _u("u0", {KEEP: cost(100), CKPT: cost(0, bwd=100, ms=5.0)}),
    _u("u1", {KEEP: cost(100), CKPT: cost(0, bwd=100, ms=5.0)}),
)


@pytest.mark.parametrize("solve", SOLVERS)
@pytest.mark.parametrize(
    ("budget", "options", "time_ms"),
    [
        (130, (CKPT, KEEP), 105.0),  # binding: checkpoint the first unit only
        (229, (CKPT, KEEP), 105.0),  # still binding: keep-all needs 230
        (230, (KEEP, KEEP), 100.0),  # slack: the no-checkpoint peak fits
        (10**9, (KEEP, KEEP), 100.0),
    ],
)
def test_two_units(solve, budget: int, options: tuple[str, str], time_ms: float) -> None:
    plan = solve(TWO, budget)
    assert plan.options == options
    assert plan.segments == ()
    assert plan.record.predicted_time_ms == pytest.approx(time_ms)
    assert plan.record.predicted_peak_bytes <= budget
    assert brute_force(TWO, budget)[0] == pytest.approx(time_ms)


@pytest.mark.parametrize("solve", SOLVERS)
def test_infeasible_budget_reports_the_true_minimum(solve) -> None:
    # The smallest peak of the five plans above is 130.
    assert min_peak_bytes(TWO) == 130 == brute_min_peak(TWO)
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(TWO, 129)
    assert err.value.min_feasible_bytes == 130
    assert err.value.budget_bytes == 129
    assert "130 bytes" in str(err.value)


# Three units; the suffix's forward peaks 100 B above its start, so the suffix
# forward event A_3 + 10 + 100 decides. keep: 5 B + its 10 B input held;
# checkpoint: only the input (10 B), 1 ms each.
#   keep all           : A_3 = 45 -> 155
#   checkpoint each    : A_3 = 30 -> 140
#   segment 0-2        : A_3 = 10 (one input) -> 120; its recompute peaks at
#                        10 + 10 (grad) + 15 (keep held) + 20 (two held inner inputs) = 55
#   segment 0-1 + ckpt : A_3 = 20 -> 130;  keep + segment 1-2: A_3 = 25 -> 135
# So at 120 only the full segment fits, at +3 ms.
SEGMENT = _chain(
    *(_u(f"u{i}", {KEEP: cost(5), CKPT: cost(0, bwd=5, ms=1.0)}) for i in range(3)),
    suffix=OutsideCost(fwd_peak_bytes=100),
)


@pytest.mark.parametrize("solve", SOLVERS)
def test_multi_unit_segment_beats_per_unit_checkpoint(solve) -> None:
    per_unit = Plan.checkpoint_all(["u0", "u1", "u2"])
    assert simulate(SEGMENT, per_unit).peak_bytes == 140
    assert simulate(SEGMENT, Plan.keep_all(["u0", "u1", "u2"])).peak_bytes == 155
    plan = solve(SEGMENT, 120)
    assert plan.segments == ((0, 2),)
    assert plan.options == (CKPT, CKPT, CKPT)
    assert plan.record.predicted_peak_bytes == 120
    assert plan.record.predicted_time_ms == pytest.approx(103.0)


@pytest.mark.parametrize("solve", SOLVERS)
def test_segment_ties_at_a_looser_budget(solve) -> None:
    # At 135 one unit may be kept: segment 0-1 + keep u2, or keep u0 + segment 1-2: +2 ms.
    plan = solve(SEGMENT, 135)
    assert plan.record.predicted_time_ms == pytest.approx(102.0)
    assert len(plan.segments) == 1
    assert plan.options.count(KEEP) == 1


# Two units; u0 may be kept (100 B), checkpointed (0 B, recomputes 100 B, 5 ms)
# or selectively recomputed (40 B held, 60 B recomputed, 1 ms); u1 is kept (100 B).
#   keep      : A_1 = 110, A_2 = 220; backward u1 110+100+10+10 = 230      -> 230
#   checkpoint: A_1 = 10;  backward u1 10+110+10 = 130, backward u0 110     -> 130, +5
#   selective : A_1 = 50;  backward u1 50+120 = 170, backward u0 0+50+60 = 110 -> 170, +1
SELECTIVE = _chain(
    _u("u0", {KEEP: cost(100), CKPT: cost(0, bwd=100, ms=5.0), SEL: cost(40, bwd=60, ms=1.0)}),
    _u("u1", {KEEP: cost(100)}),
)


@pytest.mark.parametrize("solve", SOLVERS)
@pytest.mark.parametrize(
    ("budget", "option", "time_ms"),
    [(170, SEL, 101.0), (169, CKPT, 105.0), (130, CKPT, 105.0), (230, KEEP, 100.0)],
)
def test_selective_beats_checkpoint(solve, budget: int, option: str, time_ms: float) -> None:
    plan = solve(SELECTIVE, budget)
    assert plan.options == (option, KEEP)
    assert plan.record.predicted_time_ms == pytest.approx(time_ms)
    assert plan.record.predicted_peak_bytes <= budget


# Off a chain each unit's input and output are boundaries of their own (10 B each;
# nobody holds the outputs). keep: 50 B + input held -> adds 60 to A; checkpoint:
# input only -> adds 10, recomputes 50 B; u0's checkpoint costs 2 ms, u1's 1 ms.
# The backward event of either option is A_i + 70 (the output gradient is 10 B).
#   keep all : A_2 = 120 -> backward u2 = 190
#   budget 140 needs A_2 <= 70: one of u0, u1 checkpointed; u1 is cheaper -> +1 ms
FREE = Profile(
    units=(
        _u("u0", {KEEP: cost(50), CKPT: cost(0, bwd=50, ms=2.0)}),
        _u("u1", {KEEP: cost(50), CKPT: cost(0, bwd=50, ms=1.0)}),
        _u("u2", {KEEP: cost(50), CKPT: cost(0, bwd=50, ms=1.0)}),
    ),
    is_chain=False,
    step_ms=100.0,
)


@pytest.mark.parametrize("solve", SOLVERS)
def test_non_chain_uses_no_segments(solve) -> None:
    assert simulate(FREE, Plan.keep_all(["u0", "u1", "u2"])).peak_bytes == 190
    plan = solve(FREE, 140)
    assert plan.segments == ()
    assert plan.options == (KEEP, CKPT, KEEP)
    assert plan.record.predicted_time_ms == pytest.approx(101.0)
    assert plan.record.predicted_peak_bytes == 140


def test_segment_heuristics_fall_back_to_per_unit_checkpoint_off_a_chain() -> None:
    for plan in (chen_plan(FREE), uniform_plan(FREE, k=2), uniform_plan(FREE, k=1)):
        assert plan.segments == ()
    # uniform k=3 on 3 units checkpoints the first two, one at a time.
    assert uniform_plan(FREE, k=3).options == (CKPT, CKPT, KEEP)


# Off a chain with code between the two units (a downsampling layer between two stages):
# both units keep 100 B and their input (10 B) or checkpoint (hold the input, recompute
# 100 B, 5 ms); outputs of 10 B are held by nobody. The code's backward peaks 200 B above
# what is alive once u1's backward is done (A_1 alone: u1 let go of all it held), its
# parameter gradients (150 B) stay to the end, and its forward peaks 250 B above u0's end
# (u0's input, held bytes and output alive):
#   backward before u1 : A_1 + 200     keep, keep: 310      ckpt, keep: 10 + 200 = 210
#   backward u0        : A_0 + held + in + 150 + 10 (output gradient) + bwd peak:
#                        keep: 270, ckpt: 10 + 150 + 10 + 100 = 270
#   forward before u1  : A_0 + in + held + out + 250   keep: 370   ckpt: 270
#   the others         : at most 230 (u1's backward under keep, after keep)
def _off_chain(bwd: int = 0, grads: int = 0, fwd: int = 0) -> Profile:
    u0 = _u("u0", {KEEP: cost(100), CKPT: cost(0, bwd=100, ms=5.0)})
    u1 = _u("u1", {KEEP: cost(100), CKPT: cost(0, bwd=100, ms=5.0)})
    u1 = replace(u1, before_bwd_peak_bytes=bwd, before_param_grad_bytes=grads,
                 before_fwd_peak_bytes=fwd)
    return Profile(units=(u0, u1), is_chain=False, step_ms=100.0)


@pytest.mark.parametrize("solve", SOLVERS)
@pytest.mark.parametrize(
    ("profile", "keep_peak", "keep_event", "min_peak"),
    [
        (_off_chain(bwd=200), 310, "backward before u1", 210),
        (_off_chain(bwd=200, grads=150), 310, "backward before u1", 270),
        (_off_chain(fwd=250), 370, "forward before u1", 270),
    ],
)
def test_code_between_units_off_a_chain(solve, profile: Profile, keep_peak: int,
                                        keep_event: str, min_peak: int) -> None:
    kept = simulate(profile, Plan.from_options([u.name for u in profile.units], {}))
    assert (kept.peak_bytes, kept.peak_event) == (keep_peak, keep_event)
    assert min_peak_bytes(profile) == min_peak == brute_min_peak(profile)
    # Below the no-checkpoint peak only checkpointing u0 lowers the code's events.
    plan = solve(profile, keep_peak - 1)
    assert plan.options == (CKPT, KEEP)
    assert plan.record.predicted_peak_bytes == min_peak
    assert brute_force(profile, keep_peak - 1)[0] == pytest.approx(105.0)
    assert solve(profile, keep_peak).options == (KEEP, KEEP)

"""Regressions of simulate()'s segments.

* A segment's first unit frees its checkpoint ``held_bytes`` in its backward.
  simulate() allocated it in the forward pass and never freed it, so every event
  after the segment's backward (earlier units' backwards, the prefix, the end of the
  step, the optimizer step) was too high by that much, unlike the per-unit
  ``checkpoint`` option, which frees it.
* A segment's recomputation holds torch's RNG stash and its units' BatchNorm
  statistics' copies. simulate() recomputed with ``keep``'s figures alone, which have
  neither, so the reference CNN's measured peak (at the end of a recomputation) was
  3040 B above the prediction.
"""

from __future__ import annotations

from dataclasses import replace

from solver_testlib import CKPT, KEEP, cost, unit

from remat.core.plan import Plan
from remat.core.profile import Profile
from remat.solver.events import plan_peak_bytes, step_model
from remat.solver.simulate import simulate


def _profile() -> Profile:
    # Checkpoint holds 7 B besides its input; no gradients anywhere, 0 fixed bytes.
    options = {KEEP: cost(100), CKPT: cost(7, bwd=100, ms=1.0)}
    units = tuple(unit(f"u{i}", options, in_grad=0) for i in range(3))
    return Profile(units=units, is_chain=True, optimizer_step_peak_bytes=0)


def _event(sim, label: str) -> int:
    return dict(sim.events)[label]


def test_segment_frees_its_checkpoint_held_bytes() -> None:
    profile = _profile()
    names = [u.name for u in profile.units]
    segment = simulate(profile, Plan(tuple(names), (CKPT,) * 3, ((1, 2),)))
    per_unit = simulate(profile, Plan.checkpoint_all(names))
    # After the whole backward only gradients are alive: none here.
    assert _event(segment, "backward end") == 0 == _event(per_unit, "backward end")
    assert _event(segment, "optimizer step") == 0
    # Unit 0 runs its backward after the segment: its 7 B, its input (10 B) and 100 B of
    # recompute, with nothing left over from the segment.
    assert _event(segment, "backward u0") == _event(per_unit, "backward u0") == 117


def test_segment_recompute_holds_its_stash() -> None:
    """Recomputing a segment holds torch's RNG stash and each unit's BatchNorm copies
    (a one-unit checkpoint's measured backward has them; keep's figures do not), from
    the first recompute event to the last, and frees them before the backwards."""
    base = _profile()
    units = tuple(replace(u, recompute_state_bytes=3 + k) for k, u in enumerate(base.units))
    stashed = replace(base, units=units, recompute_rng_bytes=50)
    plan = Plan(tuple(u.name for u in units), (CKPT,) * 3, ((1, 2),))
    before, after = simulate(base, plan), simulate(stashed, plan)
    stash = 50 + 4 + 5  # the RNG state, units 1 and 2's statistics
    for label, nbytes in after.events:
        expected = _event(before, label) + (stash if label.startswith("recompute") else 0)
        assert nbytes == expected, label
    assert plan_peak_bytes(step_model(stashed), plan.options, plan.segments) == after.peak_bytes

"""A budget in bytes for a profile, and the no-checkpoint peak its percentages refer to.

A budget is read once, where the user hands it over (:func:`remat.core.budget.check_budget`:
bytes, or a percentage kept relative). Bytes need no profile; a percentage is taken of
the profile's **no-checkpoint peak**, which this module computes, in one place for the
whole of remat (budgets, the frontier's upper end, the exact solvers' shortcut, the
estimate), by the specification: ``simulate()`` of the plan that keeps everything.
"""

from __future__ import annotations

from remat.core.budget import check_budget
from remat.core.plan import Plan
from remat.core.profile import Profile
from remat.solver.simulate import Simulation, simulate

__all__ = ["no_checkpoint", "no_checkpoint_peak_bytes", "resolve_budget"]

_CACHE = "_remat_no_checkpoint"


def no_checkpoint(profile: Profile) -> Simulation:
    """``simulate()`` of keeping everything on ``profile`` (cached on the frozen profile,
    as its event model is: every solve, frontier and estimate of one profile reuses it)."""
    cached = profile.__dict__.get(_CACHE)
    if cached is None:
        cached = simulate(profile, Plan.keep_all([u.name for u in profile.units]))
        profile.__dict__[_CACHE] = cached
    return cached


def no_checkpoint_peak_bytes(profile: Profile) -> int:
    """The peak of keeping everything: what percentage budgets refer to."""
    return no_checkpoint(profile).peak_bytes


def resolve_budget(budget: object, profile: Profile) -> int:
    """``budget`` in bytes for ``profile``: a budget of bytes as it is; a percentage of
    the no-checkpoint peak (of the activation memory unless written ``"... of peak"``).

    ``budget`` is what :func:`~remat.core.budget.check_budget` returned, or anything it
    accepts (then it is read here).
    """
    checked = check_budget(budget)
    if isinstance(checked, int):
        return checked
    return checked.bytes_for(no_checkpoint_peak_bytes(profile), profile.persistent_bytes)

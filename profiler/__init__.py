"""Measure a model's training step, unit by unit, for the solver (needs torch).

``profile(model, batch)`` returns a :class:`~remat.core.profile.Profile` (its units
found by ``find_units``: the repeated blocks of the whole model, and its
``coverage``); ``profile_levels`` the profiles of the blocks and of their children,
for :mod:`remat.tune.granularity` to compare. The profiler imports neither the runtime nor
the solver: what an option does to a call is :mod:`remat.execute`'s, and measuring a
real step :mod:`remat.measurement`'s.
"""

from remat.profiler.choice import UnitChoice, find_units
from remat.profiler.profile import check_chain, default_options, profile, profile_levels
from remat.profiler.records import ChainCheck
from remat.profiler.units import discover_units, longest_list

__all__ = [
    "ChainCheck",
    "UnitChoice",
    "check_chain",
    "default_options",
    "discover_units",
    "find_units",
    "longest_list",
    "profile",
    "profile_levels",
]

"""Measure a model's training step, unit by unit, for the solver (needs torch).

``profile(model, batch)`` returns a :class:`~remat.solver.Profile` (its units found
by ``find_units``: the repeated blocks of the whole model, and its ``coverage``);
``measure_step(model, batch)`` (exported as ``remat.measure``) measures a real
step of the model as it is, planned or not.
"""

from remat.profiler.capture import ChainCheck, check_chain
from remat.profiler.choice import UnitChoice, find_units
from remat.profiler.profile import default_options, profile
from remat.profiler.step import StepMeasurement, measure_step
from remat.profiler.units import discover_units

measure = measure_step  # ``remat.measure``

__all__ = [
    "ChainCheck",
    "StepMeasurement",
    "UnitChoice",
    "check_chain",
    "default_options",
    "discover_units",
    "find_units",
    "measure",
    "measure_step",
    "profile",
]

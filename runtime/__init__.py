"""Apply a plan to a model: each unit's forward runs under its option, segments recompute together.

``apply_plan(model, plan)`` changes the model in place; ``remove_plan(model)``
undoes it; ``planned(model)`` is the plan in force.
"""

from remat.execute.options import forward_with_option
from remat.runtime.apply import apply_plan, planned, remove_plan

__all__ = ["apply_plan", "forward_with_option", "planned", "remove_plan"]

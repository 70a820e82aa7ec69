"""remat: activation checkpointing for PyTorch, planned optimally for a memory budget."""

from importlib import import_module

from remat.errors import (
    BudgetError,
    InfeasibleBudgetError,
    PlanMismatchError,
    RematError,
    RematWarning,
)
from remat.solver.budget import of_activations, of_peak
from remat.solver.loop import Loop
from remat.solver.plan import Plan
from remat.solver.profile import Option, Profile
from remat.solver.simulate import simulate
from remat.validate import ArgumentError

# Loaded on first use: `import remat` imports neither torch nor ortools, pandas, matplotlib.
_LAZY = {
    "profile": "remat.profiler", "measure": "remat.profiler",
    "apply_plan": "remat.api", "remove_plan": "remat.runtime",
    "solve": "remat.api", "pareto": "remat.api", "plot_pareto": "remat.plot",
    "compile_planned": "remat.compiled", "estimate": "remat.preflight",
}
__all__ = ["ArgumentError", "BudgetError", "InfeasibleBudgetError", "Loop", "Option", "Plan",
           "PlanMismatchError", "Profile", "RematError", "RematWarning", "of_activations",
           "of_peak", "simulate",
           *_LAZY]


def __getattr__(name: str):  # noqa: ANN202 - PEP 562 lazy attributes
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'remat' has no attribute {name!r}")

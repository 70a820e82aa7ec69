"""remat: activation checkpointing for PyTorch, planned optimally for a memory budget."""

from importlib import import_module

from remat.core.budget import of_activations, of_peak
from remat.core.errors import (
    ArgumentError,
    BudgetError,
    DeviceMemoryError,
    InfeasibleBudgetError,
    PlanMismatchError,
    RematError,
    RematWarning,
)
from remat.core.loop import Loop
from remat.core.option import Option
from remat.core.plan import Plan
from remat.core.profile import Profile
from remat.solver.simulate import simulate

# Loaded on first use: `import remat` imports neither torch nor ortools, pandas, matplotlib.
# name -> (module, attribute)
_LAZY = {
    "profile": ("remat.api", "profile"),
    "measure": ("remat.measurement.step", "measure_step"),
    "apply_plan": ("remat.api", "apply_plan"),
    "remove_plan": ("remat.api", "remove_plan"),
    "solve": ("remat.api", "solve"),
    "pareto": ("remat.api", "pareto"),
    "plot_pareto": ("remat.plot", "plot_pareto"),
    "compile_planned": ("remat.compiled", "compile_planned"),
    "estimate": ("remat.preflight", "estimate"),
    "optimizer_in_backward": ("remat.in_backward", "optimizer_in_backward"),
    "head_loss": ("remat.execute.head", "head_loss"),
}
__all__ = ["ArgumentError", "BudgetError", "DeviceMemoryError", "InfeasibleBudgetError",
           "Loop", "Option", "Plan", "PlanMismatchError", "Profile", "RematError",
           "RematWarning", "of_activations", "of_peak", "simulate",
           *_LAZY]


def __getattr__(name: str):  # noqa: ANN202 - PEP 562 lazy attributes
    if name in _LAZY:
        module, attribute = _LAZY[name]
        return getattr(import_module(module), attribute)
    raise AttributeError(f"module 'remat' has no attribute {name!r}")

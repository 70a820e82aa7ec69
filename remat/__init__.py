"""remat: activation checkpointing for PyTorch, planned optimally for a memory budget."""

import sys
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
from remat.core.settings import Verify
from remat.solver import RENAMED as _SOLVER_RENAMED
from remat.solver.simulate import simulate

# Loaded on first use: `import remat` imports neither torch nor ortools, pandas, matplotlib.
# name -> (module, attribute)
_LAZY = {
    "profile": ("remat.api", "profile"),
    "activation_budget": ("remat.api", "activation_budget"),
    "measure": ("remat.measurement.step", "measure_step"),
    "apply_plan": ("remat.api", "apply_plan"),
    "remove_plan": ("remat.api", "remove_plan"),
    "solve": ("remat.api", "solve"),
    "solve_compiled": ("remat.api", "solve_compiled"),
    "pareto": ("remat.api", "pareto"),
    "plot_pareto": ("remat.plot", "plot_pareto"),
    "compile_planned": ("remat.tune.compiled", "compile_planned"),
    "estimate": ("remat.preflight", "estimate"),
    "optimizer_in_backward": ("remat.tune.optimizer_in_backward", "optimizer_in_backward"),
    "head_loss": ("remat.execute.head", "head_loss"),
}
__all__ = ["ArgumentError", "BudgetError", "DeviceMemoryError", "InfeasibleBudgetError",
           "Loop", "Option", "Plan", "PlanMismatchError", "Profile", "RematError",
           "RematWarning", "Verify", "of_activations", "of_peak", "simulate",
           *_LAZY]


# Modules and names that moved (docs/compatibility.md): remat is pre-1.0 and keeps no
# aliases; importing an old path is an error that names the new one. old -> new path
_MOVED = {
    "remat.verify": "remat.tune.verify",
    "remat.compiled": "remat.tune.compiled",
    "remat.granularity": "remat.tune.granularity",
    "remat.profile_cache": "remat.tune.profile_cache",
    "remat.ambient": "remat.tune.ambient",
    "remat.remedies": "remat.tune.remedies",
    "remat.in_backward": "remat.tune.optimizer_in_backward",
    "remat.plot_labels": "remat.plot.labels",
    "remat.report": "remat.cli.report",
    "remat.output": "remat.cli.output",
    "remat.losses": "remat.cli.losses",
    "remat.models.demo": "remat.cli.demo",
    "remat.models.hf": "remat.models.transformers_models",
    "remat.solver.heads": "remat.solver.head_choice",
    "remat.runtime.head": "remat.runtime.plan_head",
    # `from remat.solver import <old name>` asks the finders for a submodule of that name.
    **{f"remat.solver.{old}": f"remat.solver.{new}" for old, new in _SOLVER_RENAMED.items()},
}


class _MovedModules:
    """The last finder on ``sys.meta_path``: asked only for a module no other finder has,
    it refuses an old path in :data:`_MOVED` with the new one."""

    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> None:
        if name in _MOVED:
            # No ``name=``: `from remat import verify` would otherwise drop this message.
            raise ModuleNotFoundError(f"{name} moved to {_MOVED[name]} (remat is "
                                      "pre-1.0; CHANGELOG.md lists every rename)")


if not any(type(finder).__name__ == "_MovedModules" for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def __getattr__(name: str):  # noqa: ANN202 - PEP 562 lazy attributes
    if name in _LAZY:
        module, attribute = _LAZY[name]
        return getattr(import_module(module), attribute)
    if f"remat.{name}" in _MOVED:
        raise AttributeError(f"remat.{name} moved to {_MOVED[f'remat.{name}']}")
    raise AttributeError(f"module 'remat' has no attribute {name!r}")

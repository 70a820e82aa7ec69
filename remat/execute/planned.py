"""Whether a model has a plan applied, and which module a plan goes on: one definition.

:func:`remat.runtime.apply_plan` records what it changed in one attribute of the model
(:data:`STATE_ATTR`) on the module inside any wrapper (:func:`unwrap`); the profiler
refuses to profile a model that has one (a plan changes what its units save), and the
runtime finds and removes it. Both read these two definitions.
"""

from __future__ import annotations

from torch import nn

from remat.core.errors import ArgumentError, RematError

__all__ = ["STATE_ATTR", "has_plan", "unwrap"]

STATE_ATTR = "_remat_state"


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside ``DistributedDataParallel`` / ``torch.compile`` wrappers.

    Raises:
        ArgumentError: ``model`` is not a module.
        RematError: ``nn.DataParallel``, whose replicas would share the planned forwards.
    """
    if not isinstance(model, nn.Module):
        raise ArgumentError(f"expected the model, a torch.nn.Module, got a "
                            f"{type(model).__name__}; pass the model the plan is (or goes) on")
    while True:
        if isinstance(model, nn.DataParallel):
            raise RematError(
                "nn.DataParallel is not supported (its replicas would share the planned "
                "forwards); use DistributedDataParallel, or apply the plan without it"
            )
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(
            getattr(model, "_orig_mod", None), nn.Module
        ):
            model = model._orig_mod
        else:
            return model


def has_plan(model: nn.Module) -> bool:
    """Whether :func:`remat.runtime.apply_plan` has applied a plan to ``model``."""
    return STATE_ATTR in unwrap(model).__dict__

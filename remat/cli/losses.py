"""Losses by name, for the command line's ``--loss``: ``cross_entropy``, ``mse`` or
``module:function``.

The named losses compare the model's output with a *target*, which a
``--model module:function`` factory returns as the third element of
``(model, sample_batch, target)``. The output may be a tensor, have ``.logits``
(Hugging Face), or be a tuple/list or dict whose first tensor is the prediction.
``module:function`` names a ``loss_fn(output, batch) -> scalar Tensor``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from remat.core.checks import why_not_callable_with
from remat.core.errors import RematError

__all__ = ["LOSSES", "LossSpecError", "loss_from_spec", "prediction"]

LOSSES = ("cross_entropy", "mse")


class LossSpecError(RematError):
    """A ``--loss`` that names no loss, or a named loss without the target it needs."""


def prediction(output: Any) -> Any:
    """The tensor a loss compares: the output itself, its ``.logits``, or the first
    element of a tuple/list/dict output."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    values = list(output.values()) if isinstance(output, Mapping) else (
        list(output) if isinstance(output, (tuple, list)) else [])
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
    raise LossSpecError(f"--loss: cannot find a prediction tensor in the model's output "
                        f"({type(output).__name__}); pass --loss module:function")


def loss_from_spec(spec: str, target: Any = None) -> Callable[[Any, Any], Any]:
    """``loss_fn(output, batch)`` for ``spec``: a name in :data:`LOSSES` (comparing with
    ``target``) or ``module:function``."""
    if ":" in spec:
        module_name, _, fn_name = spec.partition(":")
        if not module_name.strip() or not fn_name.strip():
            raise LossSpecError(f"--loss {spec!r}: name both the module and the function, "
                                "module:function (e.g. mypackage.losses:my_loss), where "
                                "function(output, batch) returns the scalar loss; or "
                                f"{' or '.join(LOSSES)}")
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
        except (ImportError, AttributeError, ValueError) as err:
            raise LossSpecError(f"--loss {spec!r}: cannot load {fn_name!r} from module "
                                f"{module_name!r} ({err}); give module:function, where "
                                "function(output, batch) returns the scalar loss") from err
        if not callable(fn):
            raise LossSpecError(f"--loss {spec!r} is a {type(fn).__name__}, not a function")
        # Checked here too (profile() checks any loss_fn) to name the flag, not loss_fn=.
        why = why_not_callable_with(fn, 2)
        if why is not None:
            raise LossSpecError(f"--loss {spec!r}: the loss is called as function(output, "
                                f"batch), and {why}; give module:function naming a function "
                                "of (output, batch) that returns the scalar loss")
        return fn
    if spec not in LOSSES:
        raise LossSpecError(f"--loss {spec!r}: valid are {', '.join(LOSSES)} or module:function")
    if target is None:
        raise LossSpecError(
            f"--loss {spec} compares the output with a target, and the model gave none: make "
            "the --model function return (model, sample_batch, target), or use --loss "
            "module:function")
    import torch.nn.functional as F

    if spec == "cross_entropy":
        def cross_entropy(output: Any, batch: Any) -> Any:
            logits = prediction(output)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

        return cross_entropy

    def mse(output: Any, batch: Any) -> Any:
        return F.mse_loss(prediction(output), target)

    return mse

"""A model from what a user types: a built-in name or ``module:function``.

Shared by the command line (``--model``) and the demo.
"""

from __future__ import annotations

import importlib
from typing import Any

from remat.core.checks import why_not_callable_with
from remat.core.errors import RematError
from remat.models.registry import build

__all__ = ["load_model"]


def load_model(spec: str, *, size: str = "small", seed: int = 0) -> tuple[Any, Any, Any, str]:
    """``(model, batch, loss_fn, label)`` from a built-in name or ``module:function``.

    The function takes no arguments and returns ``(model, sample_batch)``,
    ``(model, sample_batch, loss_fn)`` or a :class:`~remat.models.ReferenceModel`;
    ``size`` and ``seed`` apply to built-in models only.

    Raises:
        RematError: the function cannot be loaded or returns something else.
        UnknownModelError: an unknown built-in name.
    """
    if ":" not in spec:
        ref = build(spec, size=size, seed=seed)
        return ref.model, ref.batch, ref.loss_fn, f"{spec} ({size})"
    module_name, _, fn_name = spec.partition(":")
    if not module_name.strip() or not fn_name.strip():
        raise RematError(
            f"--model {spec!r}: name both the module and the function, module:function "
            "(e.g. mypackage.models:make_model), where the function returns (model, "
            "sample_batch)"
        )
    try:
        factory = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise RematError(
            f"--model {spec!r}: cannot load {fn_name!r} from module {module_name!r} ({exc}); "
            "give module:function where the function returns (model, sample_batch)"
        ) from exc
    if not callable(factory):
        raise RematError(f"--model {spec!r}: {fn_name!r} is a {type(factory).__name__}, not a "
                         "function; give module:function where the function returns (model, "
                         "sample_batch)")
    # Called with no arguments: one that needs some would fail with a raw TypeError.
    why = why_not_callable_with(factory, 0)
    if why is not None:
        raise RematError(f"--model {spec!r}: the function is called with no arguments, and "
                         f"{why}; give module:function where the function takes none and "
                         "returns (model, sample_batch)")
    made = factory()
    if hasattr(made, "model") and hasattr(made, "batch"):
        return made.model, made.batch, made.loss_fn, spec
    if isinstance(made, tuple) and len(made) in (2, 3):
        model, batch, *rest = made
        return model, batch, (rest[0] if rest else None), spec
    raise RematError(
        f"--model {spec!r} returned {type(made).__name__}; expected (model, sample_batch), "
        "(model, sample_batch, loss_fn) or a ReferenceModel"
    )

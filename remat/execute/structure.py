"""A unit's structure in one short string, so a plan can tell the model it was made for.

Unit names and class names do not tell a model from a wider copy of it: a Llama at
twice the width has the same ``model.layers.3`` of the same ``LlamaDecoderLayer``,
and a plan measured on the narrow one would peak far above its budget on the wide
one. The profile records each unit's :func:`unit_signature`, solved plans carry
them, and :func:`~remat.runtime.apply_plan` compares them with the live model's.

A signature is ``"<numel>:<hash>"``: how many parameters the unit has, and a hash
of its parameters' names, shapes and dtypes (buffers are left out: they hold
statistics and tables, not what the activations' sizes follow).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["describe_mismatch", "holds_a_unit", "signature_dtype", "signature_numel",
           "unit_signature", "unit_type_counts"]

# The dtypes a unit's parameters are usually converted between (``model.float()``,
# ``.half()``, ``.bfloat16()``, ``.double()``): a signature that matches the unit in one
# of them tells that the unit was converted, and to what.
_CONVERTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def unit_signature(module: nn.Module, dtype: torch.dtype | None = None) -> str:
    """``"<numel>:<hash>"`` of ``module``'s parameters (names, shapes, dtypes); with
    ``dtype``, as if every parameter were in that dtype."""
    params = list(module.named_parameters())
    numel = sum(p.numel() for _, p in params)
    text = ";".join(f"{name}:{tuple(p.shape)}:{dtype or p.dtype}" for name, p in params)
    return f"{numel}:{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def signature_dtype(module: nn.Module, expected: str) -> torch.dtype | None:
    """The dtype ``module``'s parameters had when ``expected`` was taken, when they differ
    from it in their dtype only (the model was converted since); else ``None``."""
    for dtype in _CONVERTED_DTYPES:
        if unit_signature(module, dtype) == expected:
            return dtype
    return None


def holds_a_unit(name: str, unit_names: Iterable[str]) -> bool:
    """Whether module ``name`` contains one of the units (the model, ``""``, holds them all)."""
    return name == "" or any(u.startswith(name + ".") for u in unit_names)


def unit_type_counts(model: nn.Module, type_names: Iterable[str],
                     unit_names: Iterable[str]) -> dict[str, int]:
    """How many modules of each of the classes ``type_names`` (class names) ``model`` has,
    not counting those that contain a unit (an ``nn.Sequential`` model around its
    ``nn.Sequential`` blocks): a deeper model has more of them than the profiled one."""
    units = tuple(unit_names)
    counts = dict.fromkeys(sorted(set(type_names)), 0)
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in counts and not holds_a_unit(name, units):
            counts[kind] += 1
    return counts


def signature_numel(signature: str) -> int | None:
    """The parameter count in a signature, or ``None`` when it is not one of ours."""
    head = signature.split(":", 1)[0]
    return int(head) if head.isdigit() else None


def describe_mismatch(module: nn.Module, expected: str) -> str:
    """How ``module`` differs from the unit signature ``expected``, in words."""
    have = signature_numel(unit_signature(module))
    want = signature_numel(expected)
    if have is not None and want is not None and have != want:
        return (f"has {have:,} parameters in this model but {want:,} in the model the plan "
                "was made for (another width or size)")
    planned = signature_dtype(module, expected)
    if planned is not None:
        now = sorted({str(p.dtype) for p in module.parameters()})
        return (f"has parameters in {', '.join(now)} but the plan was made for {planned} ones "
                f"(the model was converted after it was profiled); convert it back "
                f"(model.to({planned})), or profile and solve again in this dtype")
    return ("has parameters of other shapes or dtypes than in the model the plan was made for "
            "(another configuration, or converted to another dtype)")

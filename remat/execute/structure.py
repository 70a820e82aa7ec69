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

from torch import nn

__all__ = ["describe_mismatch", "signature_numel", "unit_signature"]


def unit_signature(module: nn.Module) -> str:
    """``"<numel>:<hash>"`` of ``module``'s parameters (names, shapes, dtypes)."""
    params = list(module.named_parameters())
    numel = sum(p.numel() for _, p in params)
    text = ";".join(f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in params)
    return f"{numel}:{hashlib.sha256(text.encode()).hexdigest()[:12]}"


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
    return ("has parameters of other shapes or dtypes than in the model the plan was made for "
            "(another configuration, or converted to another dtype)")

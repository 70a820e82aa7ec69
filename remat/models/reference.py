"""What every reference model is: :class:`ReferenceModel`, its config base, its errors.

The builders (:mod:`remat.models.toy`, :mod:`remat.models.transformers_models`) return a
:class:`ReferenceModel`; the registry (:mod:`remat.models.registry`) resolves a
:class:`ModelConfig` for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.utils._pytree import tree_map

from remat.core.errors import RematError
from remat.measurement.runner import call_model

__all__ = ["ModelConfig", "ReferenceModel", "UnknownModelError", "param_count", "to_device"]


class UnknownModelError(RematError, ValueError):
    """A model name, size or config override that the registry does not know."""


@dataclass(frozen=True)
class ModelConfig:
    """Fields every reference model has. Subclasses add their own."""

    batch_size: int
    device: str = "cpu"


@dataclass
class ReferenceModel:
    """A model with random weights, one batch of inputs and how to get its loss.

    Attributes:
        name: registry name (``"gpt"``, ``"hf-bert"``...).
        model: the module, in train mode.
        batch: a Tensor (call ``model(batch)``), a tuple of positional inputs
            (``model(*batch)``) or a dict of keyword inputs (``model(**batch)``).
        loss_fn: ``loss_fn(output, batch) -> scalar Tensor``; ``None`` when the
            output carries its own ``.loss``.
        description: one line saying what the model is.
        config: the resolved config it was built from.
    """

    name: str
    model: nn.Module
    batch: Any
    loss_fn: Callable[[Any, Any], Tensor] | None
    description: str
    config: Any = None

    def forward(self) -> Any:
        """Run the model on its batch and return the output."""
        return call_model(self.model, self.batch)

    def loss(self, output: Any) -> Tensor:
        """The scalar loss of ``output`` (``loss_fn`` or the output's ``.loss``)."""
        if self.loss_fn is not None:
            return self.loss_fn(output, self.batch)
        return output.loss

    def step(self) -> Tensor:
        """One forward and backward pass (no optimizer); returns the detached loss."""
        loss = self.loss(self.forward())
        loss.backward()
        return loss.detach()


def param_count(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def to_device(model: nn.Module, batch: Any, device: str) -> tuple[nn.Module, Any]:
    """Move a model and a (nested) batch to ``device``."""
    if device == "cpu":
        return model, batch
    moved = tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, batch)
    return model.to(device), moved

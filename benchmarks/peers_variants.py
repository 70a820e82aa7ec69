"""The methods of the peers benchmark, each as a :class:`Variant`: a model copy ready to step.

remat's plans (applied with :func:`remat.apply_plan`, removed by the teardown), the
peers that apply (``checkpoint_sequential`` at k segments, Hugging Face's gradient
checkpointing) and the names of those that do not. Every variant is a deep copy of
one pristine model.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from peers_data import CHECKPOINT_SEQUENTIAL, EAGER, HF_CHECKPOINTING
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

import remat
from remat.models import ReferenceModel


@dataclass
class Variant:
    """One way of training one model, ready to step."""

    method: str
    setting: str
    family: str
    model: nn.Module
    budget_fraction: float | None = None
    predicted_peak_bytes: int | None = None
    teardown: Callable[[], None] = lambda: None


class CheckpointedSequential(nn.Module):
    """Run an ``nn.Sequential`` through ``checkpoint_sequential`` with ``segments`` segments.

    ``checkpoint_sequential`` checkpoints every segment but the last, which runs
    normally; so k = 1 is no checkpointing at all.
    """

    def __init__(self, seq: nn.Sequential, segments: int) -> None:
        super().__init__()
        self.seq = seq
        self.segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The wrapped sequence's forward, checkpointed segment by segment."""
        return checkpoint_sequential(self.seq, self.segments, x, use_reentrant=False)


def sequential_units(name: str, model: nn.Module) -> nn.Sequential | None:
    """The ``nn.Sequential`` of units, for the models whose units form one."""
    if name == "mlp" and isinstance(model, nn.Sequential):
        return model
    if name == "cnn" and isinstance(getattr(model, "blocks", None), nn.Sequential):
        return model.blocks
    return None


def segment_counts(n: int) -> list[int]:
    """k = 2, 4, 8, ... below n, then n (k = 1 would checkpoint nothing)."""
    ks, k = [], 2
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n] if n >= 2 else []


def checkpoint_sequential_variant(name: str, pristine: nn.Module, k: int) -> Variant:
    """A copy of the model whose sequential units run through ``checkpoint_sequential(k)``."""
    model = copy.deepcopy(pristine)
    if name == "mlp":
        wrapped: nn.Module = CheckpointedSequential(model, k)
    else:
        model.blocks = CheckpointedSequential(model.blocks, k)
        wrapped = model
    return Variant(CHECKPOINT_SEQUENTIAL, f"k={k}", EAGER, wrapped)


def hf_variant(pristine: nn.Module) -> Variant:
    """A copy of a Hugging Face model with gradient checkpointing on every block."""
    model = copy.deepcopy(pristine)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return Variant(HF_CHECKPOINTING, "every block", EAGER, model)


def overridden_forwards(model: nn.Module) -> set[str]:
    """Names of the submodules with an instance-level ``forward`` (what apply_plan installs)."""
    return {name for name, m in model.named_modules() if "forward" in vars(m)}


def remat_variant(pristine: nn.Module, plan: remat.Plan, method: str, setting: str,
                  fraction: float | None) -> Variant:
    """A copy of the model with ``plan`` applied; its teardown removes the plan."""
    model = copy.deepcopy(pristine)
    remat.apply_plan(model, plan)

    def teardown() -> None:
        remat.remove_plan(model)
        left = overridden_forwards(model) - overridden_forwards(pristine)
        if left:
            raise RuntimeError(f"remat.remove_plan left wrapped forwards on {sorted(left)}")

    return Variant(method, setting, EAGER, model, budget_fraction=fraction,
                   predicted_peak_bytes=plan.record.predicted_peak_bytes, teardown=teardown)


def peer_variants(ref: ReferenceModel, pristine: nn.Module) -> tuple[list[Variant], list[str]]:
    """The eager peers that apply to this model, and the names of those that do not."""
    variants: list[Variant] = []
    not_applicable: list[str] = []
    units = sequential_units(ref.name, pristine)
    if units is None:
        not_applicable.append(CHECKPOINT_SEQUENTIAL)
    else:
        variants += [checkpoint_sequential_variant(ref.name, pristine, k)
                     for k in segment_counts(len(units))]
    if hasattr(pristine, "gradient_checkpointing_enable"):
        variants.append(hf_variant(pristine))
    else:
        not_applicable.append(HF_CHECKPOINTING)
    return variants, not_applicable

"""Shared helpers for the runtime tests: reference models, one training step, comparisons."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from remat.core.plan import Plan, PlanTarget
from remat.models import ReferenceModel, build

# Where each reference model keeps its chain of units.
UNIT_PREFIX = {
    "mlp": "",
    "cnn": "blocks.",
    "gpt": "blocks.",
    "hf-gpt2": "transformer.h.",
    "hf-bert": "bert.encoder.layer.",
}
# Tiny models with enough units to mix options and segments.
OVERRIDES: dict[str, dict[str, Any]] = {
    "mlp": {"depth": 6, "width": 32, "batch_size": 8},
    "cnn": {"blocks_per_stage": 2},
    "gpt": {"depth": 4},
    "hf-gpt2": {"depth": 3, "width": 64, "heads": 4, "vocab_size": 256},
    "hf-bert": {"depth": 3, "width": 64, "heads": 4, "vocab_size": 256},
}


def build_model(name: str, **overrides: Any) -> ReferenceModel:
    """A tiny reference model (skipped when it needs transformers and it is missing)."""
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    return build(name, size="tiny", **{**OVERRIDES[name], **overrides})


def unit_names(name: str, model: nn.Module) -> list[str]:
    prefix = UNIT_PREFIX[name]
    chain = model.get_submodule(prefix.rstrip(".")) if prefix else model
    return [f"{prefix}{i}" for i in range(len(chain))]


def make_plan(
    model: nn.Module,
    names: list[str],
    options: dict[str, str],
    segments: tuple[tuple[int, int], ...] = (),
) -> Plan:
    """A manual plan that also carries unit types and device, as a solved plan does."""
    types = [type(model.get_submodule(n)).__name__ for n in names]
    return Plan.from_options(
        names, options, segments=segments, target=PlanTarget(unit_types=tuple(types), device="cpu")
    )


def run_forward(ref: ReferenceModel, model: nn.Module) -> Any:
    if isinstance(ref.batch, dict):
        return model(**ref.batch)
    return model(ref.batch)


def train_step(ref: ReferenceModel, model: nn.Module, *, seed: int = 0) -> Tensor:
    """One forward + backward from a fixed RNG state; returns the detached loss."""
    torch.manual_seed(seed)
    out = run_forward(ref, model)
    loss = ref.loss_fn(out, ref.batch) if ref.loss_fn is not None else out.loss
    loss.backward()
    return loss.detach()


def assert_bitwise_same(model: nn.Module, reference: nn.Module) -> None:
    """Every gradient, parameter and buffer of ``model`` equals ``reference``'s exactly."""
    params = dict(model.named_parameters())
    ref_params = dict(reference.named_parameters())
    assert params.keys() == ref_params.keys()
    for name, p in params.items():
        q = ref_params[name]
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=f"parameter {name}")
        if q.grad is None:
            assert p.grad is None, f"{name} has a gradient the reference lacks"
        else:
            assert p.grad is not None, f"{name} has no gradient"
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=f"grad of {name}")
    for (name, b), (_, c) in zip(model.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(b, c, rtol=0, atol=0, msg=f"buffer {name}")


def twin(model: nn.Module) -> nn.Module:
    """An independent copy to train as the unplanned reference."""
    return copy.deepcopy(model)


class CallCounter:
    """Counts calls of a module's forward through a forward pre-hook.

    Hooks fire on every ``module(...)`` call, recomputation included, so a
    checkpointed unit's child counts two calls per step and a kept one counts one.
    """

    def __init__(self, module: nn.Module) -> None:
        self.calls = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module: nn.Module, args: Any) -> None:
        self.calls += 1


def count_first_children(model: nn.Module, names: list[str]) -> list[CallCounter]:
    return [CallCounter(next(model.get_submodule(n).children())) for n in names]


# --------------------------------------------------------------------------- small models
class Block(nn.Module):
    """Linear + GELU + dropout, with optional keyword arguments and structured outputs."""

    def __init__(self, width: int, output: str = "tensor") -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.drop = nn.Dropout(0.2)
        self.output = output
        self.fail = False

    def forward(self, x: Tensor, scale: Tensor | None = None, *, shift: float = 0.0) -> Any:
        if self.fail:
            raise ValueError("block failed on purpose")
        y = self.drop(torch.nn.functional.gelu(self.lin(x))) + shift
        if scale is not None:
            y = y * scale
        if self.output == "tuple":
            return y, y.detach().sum()
        if self.output == "dict":
            return {"hidden": y, "aux": None}
        if self.output == "dataclass":
            return BlockOut(hidden=y, extra=y.detach().mean())
        return y


@dataclasses.dataclass
class BlockOut:
    hidden: Tensor
    extra: Tensor


class LoopModel(nn.Module):
    """Blocks in a ModuleList driven by the model's own loop, with kwargs and outputs.

    ``glue`` is what the loop does between blocks: ``"none"`` (a chain), ``"double"``
    (``x = block(x) * 2``: not a chain), ``"save"`` (keeps the chain but computes a
    side value that saves a tensor for backward), ``"rand"`` (draws a random number,
    as LayerDrop does), ``"raise"`` (raises after the second block), ``"keywords"``
    (passes every argument by keyword, the chained tensor after another tensor).
    """

    def __init__(
        self, width: int = 16, depth: int = 4, output: str = "tensor", glue: str = "none"
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, output) for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.glue = glue
        self.side: Tensor | None = None

    def forward(self, x: Tensor, scale: Tensor) -> Tensor:
        for i, block in enumerate(self.blocks):
            if self.glue == "keywords":  # the chained tensor is not the first one
                out = block(scale=scale, x=x, shift=0.1 * i)
            else:
                out = block(x, scale, shift=0.1 * i)
            x = _hidden(out)
            if self.glue == "double":
                x = x * 2
            elif self.glue == "save":
                self.side = (x * x).sum()
            elif self.glue == "rand":
                self.side = torch.rand(())
            elif self.glue == "raise" and i == 1:
                raise KeyError("the model's loop failed on purpose")
        return self.head(x).pow(2).mean()


def _hidden(out: Any) -> Tensor:
    if isinstance(out, tuple):
        return out[0]
    if isinstance(out, dict):
        return out["hidden"]
    if isinstance(out, BlockOut):
        return out.hidden
    return out


def loop_batch(width: int = 16, batch: int = 4) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(batch, width, generator=gen), torch.rand(width, generator=gen) + 0.5


def loop_step(model: nn.Module, x: Tensor, scale: Tensor, seed: int = 0) -> Tensor:
    torch.manual_seed(seed)
    loss = model(x, scale)
    loss.backward()
    return loss.detach()


Step = Callable[[nn.Module], Tensor]

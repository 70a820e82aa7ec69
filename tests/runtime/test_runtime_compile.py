"""A planned model under torch.compile: options and segments traced into one graph."""

from __future__ import annotations

import pytest
import rt_helpers as h
import torch
from torch import nn

from remat.core.plan import Plan
from remat.runtime import apply_plan


def _graphs_and_breaks() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _compile(model: nn.Module, backend: str) -> nn.Module:
    import torch._dynamo

    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    return torch.compile(model, backend=backend)


def _assert_trains_like(ref: h.ReferenceModel, compiled: nn.Module, model: nn.Module,
                        reference: nn.Module, steps: int = 2) -> None:
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        loss = h.train_step(ref, compiled, seed=step)
        ref_loss = h.train_step(ref, reference, seed=step)
        torch.testing.assert_close(loss, ref_loss)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.slow
def test_compiled_planned_mlp_matches_eager() -> None:
    ref = h.build_model("mlp")
    model = ref.model
    reference = h.twin(model)
    names = h.unit_names("mlp", model)
    options = {names[0]: "checkpoint", names[1]: "checkpoint", names[2]: "checkpoint",
               names[3]: "selective", names[4]: "keep", names[5]: "checkpoint"}
    apply_plan(model, h.make_plan(model, names, options, ((0, 1),)))
    compiled = _compile(model, "inductor")
    _assert_trains_like(ref, compiled, model, reference)
    # The segment runs ahead inside one traced checkpoint region: no graph breaks.
    assert _graphs_and_breaks() == (1, 0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "gpt", "hf-gpt2"])
def test_compiled_segments_are_one_graph(name: str) -> None:
    """Segments over ModuleList loops (HF GPT-2 with its masks and kwargs) trace fully."""
    ref = h.build_model(name)
    model = ref.model
    reference = h.twin(model)
    names = h.unit_names(name, model)
    n = len(names)
    options = dict.fromkeys(names, "checkpoint")
    options[names[-1]] = "keep"
    apply_plan(model, h.make_plan(model, names, options, ((0, n - 2),)))
    compiled = _compile(model, "aot_eager")
    _assert_trains_like(ref, compiled, model, reference)
    assert _graphs_and_breaks() == (1, 0)


@pytest.mark.slow
def test_compiled_plan_with_many_units_stays_compiled() -> None:
    """16 units in several segments: no per-unit recompilation (dynamo's limit is 8)."""
    ref = h.build_model("mlp", depth=16)
    model = ref.model
    reference = h.twin(model)
    names = h.unit_names("mlp", model)
    options = dict.fromkeys(names, "checkpoint")
    options[names[4]] = "keep"
    options[names[9]] = "selective"
    segments = ((0, 3), (5, 8), (10, 15))
    apply_plan(model, h.make_plan(model, names, options, segments))
    compiled = _compile(model, "aot_eager")
    _assert_trains_like(ref, compiled, model, reference, steps=3)
    assert _graphs_and_breaks() == (1, 0)


class _ScaledBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * scale


class _PerLayerArguments(nn.Module):
    """A loop that gives each unit a different argument: a segment cannot run ahead."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ScaledBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, scale=float(i + 1))
        return x.square().sum()


@pytest.mark.slow
def test_compiled_segment_with_per_unit_arguments_falls_back_to_eager() -> None:
    """Running ahead with the first unit's arguments would be wrong here; it is refused
    while tracing, so torch.compile runs the forward eagerly, and gradients stay exact."""
    torch.manual_seed(0)
    model = _PerLayerArguments()
    reference = h.twin(model)
    names = [f"blocks.{i}" for i in range(4)]
    apply_plan(model, Plan.from_options(names, dict.fromkeys(names, "checkpoint"),
                                        segments=((0, 3),)))
    compiled = _compile(model, "aot_eager")
    x = torch.randn(2, 8)
    compiled(x).backward()
    reference(x).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.slow
def test_compiled_batchnorm_cnn_updates_statistics_once() -> None:
    """Under torch.compile the graph recomputes; running statistics still update once."""
    ref = h.build_model("cnn")
    model = ref.model
    reference = h.twin(model)
    names = h.unit_names("cnn", model)
    options = dict.fromkeys(names, "checkpoint")
    options[names[-1]] = "selective"
    apply_plan(model, h.make_plan(model, names, options, ((0, 1),)))
    compiled = torch.compile(model, backend="aot_eager")  # inductor is covered above
    for step in range(2):
        h.train_step(ref, compiled, seed=step)
        h.train_step(ref, reference, seed=step)
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, msg=name)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)

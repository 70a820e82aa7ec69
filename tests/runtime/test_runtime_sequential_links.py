"""Segments a stock ``nn.Sequential`` drives skip the per-link checks, and only those.

The checks (a refusing saved-tensor hook between units, RNG states on both sides of
the link) are what keep a segment correct where the model's code runs between its
units; each test below puts something between two units and asserts the gradients
stay bitwise those of the unplanned model, with the checks run exactly where they
are needed (counted through ``_rng_states``).
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import remat.runtime.segments as segments
from remat import apply_plan, remove_plan
from remat.core.plan import Plan


def _layers(n: int = 8) -> list[nn.Module]:
    torch.manual_seed(0)
    out: list[nn.Module] = []
    for _ in range(n // 2):
        out += [nn.Linear(16, 16), nn.Dropout(0.3)]
    return out


class _Iterated(nn.Module):
    """The same layers, iterated by the model's own loop, drawing between them."""

    def __init__(self, draw: bool) -> None:
        super().__init__()
        self.seq = nn.Sequential(*_layers())
        self.draw = draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.seq:
            x = layer(x)
            if self.draw:
                torch.rand(())  # LayerDrop draws here
        return x


class _OwnForward(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x)
            torch.rand(())
        return x


def _plan(names: list[str]) -> Plan:
    return Plan.from_options(names, dict.fromkeys(names, "checkpoint"),
                             segments=[(0, len(names) - 1)])


@pytest.fixture
def rng_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    count = [0]
    real = segments._rng_states

    def counted(x: torch.Tensor) -> segments.RngStates:
        count[0] += 1
        return real(x)

    monkeypatch.setattr(segments, "_rng_states", counted)
    yield count


def _step(model: nn.Module, seed: int = 3) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.randn(4, 16, requires_grad=True)
    model(x).square().mean().backward()
    assert x.grad is not None
    return x.grad


def _same_training(model: nn.Module, reference: nn.Module) -> None:
    torch.testing.assert_close(_step(model), _step(reference), rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_a_stock_sequential_runs_its_segment_without_link_checks(rng_reads: list[int]) -> None:
    model = nn.Sequential(*_layers())
    reference = copy.deepcopy(model)
    apply_plan(model, _plan([str(i) for i in range(len(model))]))
    _same_training(model, reference)
    assert rng_reads[0] == 0


@pytest.mark.parametrize("make", [lambda: _Iterated(draw=True), lambda: _OwnForward(*_layers())],
                         ids=["model's loop draws between units", "Sequential subclass forward"])
def test_code_between_the_units_keeps_the_checks(make, rng_reads: list[int]) -> None:
    model = make()
    reference = copy.deepcopy(model)
    prefix = "seq." if isinstance(model, _Iterated) else ""
    apply_plan(model, _plan([f"{prefix}{i}" for i in range(8)]))
    _same_training(model, reference)
    assert rng_reads[0] > 0


@pytest.mark.parametrize("where", ["forward hook on a unit", "pre-hook on the next unit",
                                   "global forward hook"])
def test_a_hook_between_the_units_keeps_the_checks(where: str, rng_reads: list[int]) -> None:
    model = nn.Sequential(*_layers())

    def draw(*_: object) -> None:
        torch.rand(())

    if where == "forward hook on a unit":
        handle = model[2].register_forward_hook(draw)
    elif where == "pre-hook on the next unit":
        handle = model[3].register_forward_pre_hook(draw)
    else:
        handle = nn.modules.module.register_module_forward_hook(draw)
    reference = copy.deepcopy(model)  # a unit's hooks are copied with it
    try:
        apply_plan(model, _plan([str(i) for i in range(8)]))
        _same_training(model, reference)
    finally:
        handle.remove()
    assert rng_reads[0] > 0


def test_remove_plan_takes_the_counting_hooks_off() -> None:
    model = nn.Sequential(*_layers())
    apply_plan(model, _plan([str(i) for i in range(8)]))
    assert model._forward_pre_hooks
    remove_plan(model)
    assert not model._forward_pre_hooks and not model._forward_hooks


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_planned_sequential_skips_the_checks_too(how: str, rng_reads: list[int]) -> None:
    model = nn.Sequential(*_layers())
    reference = copy.deepcopy(model)
    apply_plan(model, _plan([str(i) for i in range(8)]))
    copied = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    _same_training(copied, reference)
    assert rng_reads[0] == 0

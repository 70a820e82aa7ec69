"""A planned segment runs what ``checkpoint_sequential`` runs for the same segments.

remat applying ``checkpoint_sequential(k)``'s own segments as a manual plan must add
no aten op to the step (no ``detach`` per unit, no copy of a boundary), forward or
backward, and give the unplanned model's gradients bitwise; the fast paths a stock
``nn.Sequential`` takes (a segment opened and continued by one-tensor calls) keep
the checks of the general path: a segment's first unit writing into the input the
segment holds is refused.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from remat import apply_plan
from remat.core.errors import RematError
from remat.core.plan import Plan
from remat.measurement import OpCounter


def _stack(layers: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    modules: list[nn.Module] = []
    for _ in range(layers):
        modules += [nn.Linear(8, 8), nn.ReLU(), nn.Dropout(0.2)]
    return nn.Sequential(*modules)


def _sequential_plan(n: int, k: int) -> Plan:
    """``checkpoint_sequential(k)``'s recomputation: k segments of ``n // k`` units (the
    last takes the rest), every one but the last recomputed."""
    size = n // k
    bounds = [(i * size, (i + 1) * size - 1) for i in range(k - 1)]
    names = [str(i) for i in range(n)]
    recomputed = {names[i]: "checkpoint" for a, b in bounds for i in range(a, b + 1)}
    return Plan.from_options(names, recomputed, segments=[s for s in bounds if s[1] > s[0]])


class _Peer(nn.Module):
    def __init__(self, seq: nn.Sequential, k: int) -> None:
        super().__init__()
        self.seq, self.k = seq, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(self.seq, self.k, x, use_reentrant=False)


def _counted_step(model: nn.Module, x: torch.Tensor) -> tuple[collections.Counter[str], ...]:
    torch.manual_seed(1)
    with OpCounter() as fwd:
        loss = model(x).pow(2).mean()
    with OpCounter() as bwd:
        loss.backward()
    return fwd.ops, bwd.ops


@pytest.mark.parametrize("k", [2, 3, 8])
def test_a_planned_segment_runs_the_ops_of_checkpoint_sequential(k: int) -> None:
    seq = _stack()
    x = torch.randn(4, 8, requires_grad=True)
    peer = _Peer(copy.deepcopy(seq), k)
    planned = apply_plan(copy.deepcopy(seq), _sequential_plan(len(seq), k))
    for model in (peer, planned):  # the first step probes; count a later one
        _counted_step(model, x)
    assert _counted_step(planned, x) == _counted_step(peer, x)


@pytest.mark.parametrize("k", [2, 8])
def test_a_planned_segment_keeps_the_unplanned_gradients(k: int) -> None:
    seq = _stack()
    x = torch.randn(4, 8)
    planned = apply_plan(copy.deepcopy(seq), _sequential_plan(len(seq), k))
    for _ in range(2):  # the first step and a later one (fast paths warmed up)
        grads = []
        for model in (seq, planned):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(2)
            model(x).pow(2).mean().backward()
            grads.append([p.grad for p in model.parameters()])
        for ours, theirs in zip(*grads):
            assert torch.equal(ours, theirs)


def test_a_first_unit_writing_into_the_held_input_is_refused() -> None:
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU())
    planned = apply_plan(seq, Plan.from_options(
        [str(i) for i in range(4)], {str(i): "checkpoint" for i in (1, 2)}, segments=[(1, 2)]))
    with pytest.raises(RematError, match="multi-unit segment"):
        planned(torch.randn(4, 8)).sum().backward()


def _assert_same_gradients(unplanned: nn.Module, planned: nn.Module, x: torch.Tensor) -> None:
    grads = []
    for model in (unplanned, planned):
        torch.manual_seed(2)
        model(x).pow(2).mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for ours, theirs in zip(*grads):
        assert torch.equal(ours, theirs)


def _planned_calls(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Counts of the units' planned forwards called, by the unit's position."""
    from remat.runtime import apply as apply_module

    calls: collections.Counter[str] = collections.Counter()
    original = apply_module._PlannedForward.__call__

    def counted(self, *args, **kwargs):
        calls[str(self._index)] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(apply_module._PlannedForward, "__call__", counted)
    return calls


def test_a_stock_sequential_runs_its_whole_segments_without_the_units_planned_forwards(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments inside a stock ``nn.Sequential`` run as one checkpoint call over the units'
    own forwards (runtime/sequential_segments.py): no planned forward of a segment unit
    is called, the units outside segments keep theirs, and the gradients stay bitwise."""
    seq = _stack()
    n, k = len(seq), 3
    plan = _sequential_plan(n, k)
    planned = apply_plan(copy.deepcopy(seq), plan)
    in_segments = {str(i) for a, b in plan.segments for i in range(a, b + 1)}
    calls = _planned_calls(monkeypatch)
    x = torch.randn(4, 8)
    _assert_same_gradients(seq, planned, x)
    assert calls and not (set(calls) & in_segments), calls
    assert set(calls) == {str(i) for i in range(n)} - in_segments


def test_a_hook_on_a_segment_unit_runs_and_the_segment_runs_unit_by_unit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit with a hook of its own takes the unit-by-unit path (its hook runs), with the
    same gradients; without the hook the Sequential runs the segment whole again."""
    seq = _stack()
    plan = _sequential_plan(len(seq), 2)
    planned = apply_plan(copy.deepcopy(seq), plan)
    seen = []
    handle = planned[4].register_forward_hook(lambda m, a, out: seen.append(out.shape))
    calls = _planned_calls(monkeypatch)
    x = torch.randn(4, 8)
    _assert_same_gradients(seq, planned, x)
    assert seen == [torch.Size([4, 8])] and calls["4"] == 1
    handle.remove()
    calls.clear()
    planned(x).sum().backward()
    assert "4" not in calls


def test_removing_the_plan_gives_the_sequential_its_own_forward_back() -> None:
    import pickle

    seq = _stack()
    planned = apply_plan(copy.deepcopy(seq), _sequential_plan(len(seq), 2))
    assert "forward" in vars(planned)
    x = torch.randn(4, 8)
    for clone in (copy.deepcopy(planned), pickle.loads(pickle.dumps(planned))):
        torch.manual_seed(3)
        clone(x).sum().backward()
        torch.manual_seed(3)
        planned(x).sum().backward()
        for ours, theirs in zip(clone.parameters(), planned.parameters()):
            assert torch.equal(ours.grad, theirs.grad)
        planned.zero_grad(set_to_none=True)
    from remat import remove_plan

    remove_plan(planned)
    assert "forward" not in vars(planned)


def test_a_forward_installed_over_a_segment_unit_after_the_plan_is_not_bypassed() -> None:
    """A forward someone installs on a unit after ``apply_plan`` takes the unit out of the
    plan: the Sequential does not run the segment whole past it (which would run the
    unit's old forward), and the unit-by-unit path says the segment is broken there."""
    seq = _stack()
    planned = apply_plan(copy.deepcopy(seq), _sequential_plan(len(seq), 2))
    unit = planned[3]
    own = type(unit).forward.__get__(unit)
    unit.forward = lambda x: own(x)
    with pytest.raises(RematError, match="not a chain"):
        planned(torch.randn(4, 8)).sum().backward()

"""Misuse of a planned model, table-driven: what is refused, what warns, what now works.

* ``REFUSED`` / ``WARNED`` / ``SILENT``: each case does one thing to a planned model
  and names the exception or warning it must raise (its type and a phrase of its
  message), or asserts that nothing is said.
* The loops that used to crash under a plan (``retain_graph`` twice, double
  backward, ``model.eval()`` before ``backward()``, a unit writing into its input)
  are compared bitwise (CPU float32) with the unplanned model: loss, every
  gradient, every parameter and buffer.
"""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import rt_helpers as h
import torch
from torch import Tensor, nn

import remat
from remat.core.bytesize import format_bytes
from remat.core.errors import PlanError, PlanMismatchError, RematError, RematWarning
from remat.core.plan import Plan, PlanRecord, PlanTarget
from remat.execute.structure import unit_signature
from remat.runtime import apply_plan, planned, remove_plan
from remat.runtime.guard import scaled_peak

WIDTH, BATCH, SEQ = 16, 4, 6
NAMES = [f"blocks.{i}" for i in range(4)]


# --------------------------------------------------------------------------- the model
class Block(nn.Module):
    """Linear, optional BatchNorm over features, tanh, dropout; optionally ``x += 1`` first."""

    def __init__(self, width: int = WIDTH, *, p: float = 0.25, bn: bool = False,
                 writes_input: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width) if bn else None
        self.drop = nn.Dropout(p)
        self.writes_input = writes_input

    def forward(self, x: Tensor) -> Tensor:
        if self.writes_input:
            x += 1.0
        y = self.lin(x)
        if self.norm is not None:
            y = self.norm(y.transpose(1, 2)).transpose(1, 2)
        return self.drop(torch.tanh(y))


class Net(nn.Module):
    """A stem and four blocks on ``(batch, sequence, width)`` inputs."""

    def __init__(self, width: int = WIDTH, **block: Any) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width, **block) for _ in NAMES)

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return h


class WritingNet(Net):
    """Blocks that write into their input, fed Linear outputs (which autograd does not
    save, so the unplanned model trains fine)."""

    def __init__(self) -> None:
        super().__init__(p=0.0, writes_input=True)
        self.mids = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in NAMES)

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        for mid, block in zip(self.mids, self.blocks):
            h = block(mid(h))
        return h


def loss_fn(out: Tensor, batch: Any = None) -> Tensor:
    return out.pow(2).mean()


def batch(b: int = BATCH, s: int = SEQ) -> Tensor:
    return torch.randn(b, s, WIDTH, generator=torch.Generator().manual_seed(b * 100 + s))


def net(**kw: Any) -> Net:
    torch.manual_seed(0)
    return Net(**kw)


def manual(kind: str = "checkpoint", model: nn.Module | None = None) -> Plan:
    """A manual plan (no signatures, no shapes) of one kind for the four blocks."""
    model = model if model is not None else net()
    options = {n: ("checkpoint" if kind == "chain" else kind) for n in NAMES}
    segments = ((0, 3),) if kind == "chain" else ()
    return h.make_plan(model, NAMES, options, segments)


@pytest.fixture(scope="module")
def solved() -> Plan:
    """A plan solved for ``net()`` on ``batch()`` (profiled: it carries shapes and signatures)."""
    model = net()
    return remat.solve(model, batch(), None, loss_fn=loss_fn, units=NAMES, method="all",
                       verify=False)


def step(model: nn.Module, x: Tensor, *, seed: int = 0) -> Tensor:
    """One step of a plain loop (``zero_grad()`` first, as the plans' ``Loop()`` says)."""
    torch.manual_seed(seed)
    model.zero_grad()
    loss = loss_fn(model(x))
    loss.backward()
    return loss.detach()


# --------------------------------------------------------------------------- the tables
@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[Plan], Any]
    expected: type[BaseException] | type[Warning]
    phrase: str


def _planned(plan: Plan, model: nn.Module | None = None, **kw: Any) -> nn.Module:
    model = model if model is not None else net()
    return apply_plan(model, plan, **kw)


def _replace_a_unit(plan: Plan) -> None:
    model = _planned(plan)
    model.blocks[1] = Block()
    step(model, batch())


def _wrong_signature_count(plan: Plan) -> None:
    Plan(tuple(NAMES), ("keep",) * 4, target=PlanTarget(unit_signatures=("1:abc",)))


def _writes_in_segment(plan: Plan) -> None:
    model = net()
    model.blocks[0].writes_input = True  # fed the stem's Linear output: fine unplanned
    step(copy.deepcopy(model), batch())
    apply_plan(model, manual("chain", model))  # a chain: one segment over the four blocks
    step(model, batch())


def _writes_after_its_first_call(plan: Plan) -> None:
    model = net()
    apply_plan(model, manual("checkpoint", model))
    step(model, batch())  # probed: writes nothing
    model.blocks[0].writes_input = True
    step(model, batch())


def _writes_in_checkpoint(plan: Plan) -> None:
    torch.manual_seed(0)
    model = WritingNet()
    apply_plan(model, manual("checkpoint", model))
    step(model, batch())


REFUSED = [
    Case("another width, same unit names", lambda p: _planned(p, net(width=2 * WIDTH)),
         PlanMismatchError, "parameters in this model but"),
    Case("another dtype", lambda p: _planned(p, net().double()),
         PlanMismatchError, "the plan was made for torch.float32 ones"),
    Case("a larger batch, strict",
         lambda p: step(_planned(p, strict_shapes=True), batch(2 * BATCH)),
         PlanMismatchError, "larger than the plan was made for"),
    Case("a longer sequence, strict",
         lambda p: step(_planned(p, strict_shapes=True), batch(s=SEQ + 1)),
         PlanMismatchError, "planned for [4, 6, 16]"),
    Case("a unit replaced after apply_plan", _replace_a_unit,
         PlanMismatchError, "replaced after apply_plan"),
    Case("signatures that do not match the units", _wrong_signature_count,
         PlanError, "one per unit"),
    Case("a segment unit writes into its input", _writes_in_segment,
         RematError, "multi-unit segment"),
    Case("a unit writes into its input after its first call", _writes_after_its_first_call,
         RematError, "which its earlier calls did not"),
]

WARNED = [
    Case("a larger batch", lambda p: step(_planned(p), batch(4 * BATCH)),
         RematWarning, "arg0 [16, 6, 16] (planned for [4, 6, 16])"),
    Case("a longer sequence", lambda p: step(_planned(p), batch(s=2 * SEQ)),
         RematWarning, "larger than the plan was made for"),
    Case("larger in one dimension, smaller in another", lambda p: step(_planned(p),
                                                                       batch(2, 2 * SEQ)),
         RematWarning, "x2.00"),
    Case("a checkpointed unit writes into its input", _writes_in_checkpoint,
         RematWarning, "writes into its argument 0"),
]


def _eval_forward(p: Plan) -> None:
    model = _planned(p, strict_shapes=True).eval()
    model(batch(4 * BATCH))


def _no_grad_forward(p: Plan) -> None:
    model = _planned(p, strict_shapes=True)
    with torch.no_grad():
        model(batch(4 * BATCH))


SILENT = [
    Case("the profiled shape", lambda p: step(_planned(p, strict_shapes=True), batch()),
         Warning, ""),
    Case("a smaller last batch", lambda p: step(_planned(p, strict_shapes=True), batch(1)),
         Warning, ""),
    Case("a shorter sequence", lambda p: step(_planned(p, strict_shapes=True), batch(s=2)),
         Warning, ""),
    Case("a larger batch in eval", _eval_forward, Warning, ""),
    Case("a larger batch under no_grad", _no_grad_forward, Warning, ""),
    Case("a manual plan on another width", lambda p: step(
        _planned(manual(), net(width=2 * WIDTH)), torch.randn(BATCH, 2 * SEQ, 2 * WIDTH)),
        Warning, ""),
]


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.name)
def test_refused(case: Case, solved: Plan) -> None:
    with pytest.raises(case.expected) as raised:  # type: ignore[call-overload]
        case.run(solved)
    assert case.phrase in str(raised.value)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@pytest.mark.parametrize("case", WARNED, ids=lambda c: c.name)
def test_warned(case: Case, solved: Plan) -> None:
    with pytest.warns(case.expected) as caught:  # type: ignore[call-overload]
        case.run(solved)
    assert any(case.phrase in str(w.message) for w in caught), [str(w.message) for w in caught]


@pytest.mark.parametrize("case", SILENT, ids=lambda c: c.name)
def test_silent(case: Case, solved: Plan) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematWarning)
        case.run(solved)


# --------------------------------------------------------------------------- details
def test_a_solved_plan_records_what_it_was_made_for(solved: Plan) -> None:
    model = net()
    assert dict(solved.target.input_shapes or ()) == {"arg0": (BATCH, SEQ, WIDTH)}
    assert solved.target.unit_signatures == tuple(unit_signature(model.get_submodule(n))
                                                  for n in NAMES)
    record = solved.record
    assert record.persistent_bytes is not None and record.activation_peak_bytes is not None
    assert 0 < record.activation_peak_bytes < (record.predicted_peak_bytes or 0)
    again = Plan.from_json(solved.to_json())
    assert again == solved
    assert json.loads(solved.to_json())["target"]["input_shapes"] == {"arg0": [BATCH, SEQ, WIDTH]}


def test_a_new_shape_warns_once(solved: Plan) -> None:
    model = _planned(solved)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b in (2 * BATCH, 2 * BATCH, BATCH, 3 * BATCH, 2 * BATCH):
            step(model, batch(b))
    shapes = [str(w.message).split(" (planned")[0].rsplit(": ", 1)[-1] for w in caught
              if issubclass(w.category, RematWarning)]
    assert shapes == ["arg0 [8, 6, 16]", "arg0 [12, 6, 16]"]


def test_the_warning_scales_the_activation_peak() -> None:
    plan = Plan(tuple(NAMES), ("checkpoint",) * 4, budget_bytes=10_000,
                record=PlanRecord(predicted_peak_bytes=10_000, persistent_bytes=6_000,
                                  activation_peak_bytes=5_000),
                target=PlanTarget(input_shapes={"arg0": (BATCH, SEQ, WIDTH)}))
    assert scaled_peak(plan, 1.0) == 11_000  # persistent + activations: at least the peak
    assert scaled_peak(plan, 4.0) == 26_000
    with pytest.warns(RematWarning) as caught:
        step(_planned(plan), batch(4 * BATCH))
    message = str(caught[0].message)
    assert format_bytes(26_000) in message and "above the budget" in message
    older = plan.with_record(activation_peak_bytes=None)  # a plan without the activation peak
    assert scaled_peak(older, 4.0) == 6_000 + 4 * 4_000


def test_positional_and_keyword_calls_are_matched() -> None:
    class Keyworded(Net):
        def forward(self, x: Tensor, scale: float = 1.0) -> Tensor:  # type: ignore[override]
            return super().forward(x) * scale

    torch.manual_seed(0)
    model = Keyworded()
    plan = manual(model=model).with_target(input_shapes={"x": (BATCH, SEQ, WIDTH)})
    apply_plan(model, plan, strict_shapes=True)
    with pytest.raises(PlanMismatchError, match=r"x \[8, 6, 16\]"):
        model(batch(2 * BATCH))  # profiled as model(**batch), called positionally
    plan = plan.with_target(input_shapes={"arg0": (BATCH, SEQ, WIDTH)})
    apply_plan(model, plan, strict_shapes=True)
    with pytest.raises(PlanMismatchError, match=r"arg0 \[8, 6, 16\]"):
        model(x=batch(2 * BATCH))


def test_a_replaced_unit_leaves_planned_and_comes_back_with_apply() -> None:
    model = net()
    plan = manual("chain", model).with_(segments=((0, 1),))
    apply_plan(model, plan)
    old = model.blocks[1]
    model.blocks[1] = Block()
    now = planned(model)
    assert now is not None
    assert now.unit_names == ("blocks.0", "blocks.2", "blocks.3")
    assert now.segments == ()  # its segment went with it
    with pytest.raises(PlanMismatchError, match="'blocks.1' \\(now Block"):
        step(model, batch())
    apply_plan(model, plan)  # the new module is checked and planned
    assert planned(model) == plan
    reference = h.twin(model)
    remove_plan(reference)
    assert torch.equal(step(model, batch()), step(reference, batch()))
    h.assert_bitwise_same(model, reference)
    assert old.forward is not model.blocks[1].forward


# --------------------------------------------------------------------------- loops that work
KINDS = ["checkpoint", "selective", "chain"]


def _retain_twice(model: nn.Module, x: Tensor) -> None:
    loss = loss_fn(model(x))
    loss.backward(retain_graph=True)
    loss.backward()


def _gradient_penalty(model: nn.Module, x: Tensor) -> None:
    x = x.clone().requires_grad_(True)
    loss = loss_fn(model(x))
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + g.pow(2).sum()).backward()


def _eval_before_backward(model: nn.Module, x: Tensor) -> None:
    loss = loss_fn(model(x))
    model.eval()
    loss.backward()
    model.train()


LOOPS: dict[str, Callable[[nn.Module, Tensor], None]] = {
    "retain_graph twice": _retain_twice,
    "double backward": _gradient_penalty,
    "eval before backward": _eval_before_backward,
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("bn", [False, True], ids=["dropout", "dropout+batchnorm"])
def test_loops_match_unplanned_bitwise(loop: str, kind: str, bn: bool) -> None:
    model = net(bn=bn)
    reference = copy.deepcopy(model)
    apply_plan(model, manual(kind, model))
    for m in (model, reference):
        torch.manual_seed(0)
        LOOPS[loop](m, batch())
    h.assert_bitwise_same(model, reference)  # gradients, parameters, BatchNorm statistics
    assert all(m.training for m in model.modules())
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@pytest.mark.parametrize("kind", ["checkpoint", "selective"])
def test_units_writing_their_input_run_as_keep(kind: str) -> None:
    torch.manual_seed(0)
    model = WritingNet()
    reference = copy.deepcopy(model)
    apply_plan(model, manual(kind, model))
    for s in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = step(model, batch(), seed=s)
        assert torch.equal(loss, step(reference, batch(), seed=s))
        found = sorted(str(w.message).split("'")[1] for w in caught
                       if issubclass(w.category, RematWarning))
        assert found == (NAMES if s == 0 else [])  # once per unit, on its first call
        h.assert_bitwise_same(model, reference)
    assert model.__dict__["_remat_state"].writes_input == [True] * 4


def test_clean_units_are_probed_once_then_run_their_option() -> None:
    model = net()
    apply_plan(model, manual("checkpoint", model))
    state = model.__dict__["_remat_state"]
    assert state.writes_input == [None] * 4
    step(model, batch())
    assert state.writes_input == [False] * 4
    counters = h.count_first_children(model, NAMES)
    step(model, batch())
    assert [c.calls for c in counters] == [2] * 4  # recomputed: the option is in force

"""A planned model checks that the loop and the model it runs in are those its plan was made for.

* The loop (``Plan.target.loop``): gradients alive when a forward starts, the output
  kept through backward, autocast; each warns once (``RematWarning``) with the bytes
  the plan did not count and the fix, or raises with ``apply_plan(..., strict=True)``.
* The model: parameters converted to another dtype, a block appended after
  ``apply_plan`` (warned), a deeper model than profiled (refused at ``apply_plan``).
* Units a forced option cannot run: ``selective`` over an in-place activation is
  refused at the first training forward; forwards that register tensor hooks, run
  ``torch.autograd.grad`` or their own ``checkpoint`` train bitwise as unplanned under
  every option.

Small models on CPU: a six-block ``nn.Sequential`` MLP.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import remat
from remat.core.bytesize import format_bytes
from remat.core.errors import PlanMismatchError, RematWarning
from remat.core.loop import Loop
from remat.core.plan import Plan, PlanRecord, PlanTarget

WIDTH, BATCH, DEPTH = 32, 64, 6
NAMES = [str(i) for i in range(DEPTH)]


def mlp(depth: int = DEPTH, *, inplace: bool = False) -> nn.Sequential:
    """``depth`` blocks ``Linear, GELU, Linear, Tanh`` (``ReLU(inplace=True)`` instead of the
    Tanh with ``inplace``: it writes the second Linear's output)."""
    torch.manual_seed(0)
    act: Callable[[], nn.Module] = (lambda: nn.ReLU(inplace=True)) if inplace else nn.Tanh
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                                         nn.Linear(2 * WIDTH, WIDTH), act())
                           for _ in range(depth)])


def batch() -> Tensor:
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))


def loss_fn(out: Any, b: Any = None) -> Tensor:
    return out.square().mean()


def train(model: nn.Module, steps: int = 2, *, accumulate: int = 1, set_to_none: bool = True,
          keep_output: bool = True) -> None:
    """``steps`` optimizer steps of a loop (no optimizer: the gradients are what counts)."""
    x = batch()
    for _ in range(steps):
        for _ in range(accumulate):
            out = model(x)
            loss = loss_fn(out)
            if not keep_output:
                del out
            loss.backward()
        model.zero_grad(set_to_none=set_to_none)


def messages_of(run: Callable[[], Any]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if issubclass(w.category, RematWarning)]


@pytest.fixture(scope="module")
def plain() -> Plan:
    """A verified plan for ``Loop()`` at 40%."""
    return remat.solve(mlp(), batch(), "40%", loss_fn=loss_fn)


@pytest.fixture(scope="module")
def dropping() -> Plan:
    """A plan for a loop that drops the output once the loss is taken."""
    return remat.solve(mlp(), batch(), "40%", loss_fn=loss_fn, loop=Loop(keep_output=False))


def manual(loop: Loop | None, **record: Any) -> Plan:
    """A manual plan (checkpoint every block) that records a loop, and figures if given."""
    return Plan.checkpoint_all(NAMES, target=PlanTarget(loop=loop),
                               record=PlanRecord(**record), budget_bytes=record.get(
                                   "predicted_peak_bytes"))


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# --------------------------------------------------------------------------- gradients
def test_the_loop_the_plan_was_made_for_is_silent(plain: Plan) -> None:
    model = remat.apply_plan(mlp(), plain, strict=True)
    assert messages_of(lambda: train(model, 3)) == []
    loop_plan = remat.apply_plan(mlp(), manual(Loop(accumulation_steps=4)), strict=True)
    assert messages_of(lambda: train(loop_plan, 2, accumulate=4)) == []


def test_accumulated_gradients_warn_once_with_the_bytes_and_the_fix(plain: Plan) -> None:
    model = remat.apply_plan(mlp(), plain)
    said = messages_of(lambda: train(model, 3, accumulate=4))
    assert len(said) == 1, said
    grads = param_bytes(model)
    peak = plain.record.predicted_peak_bytes
    assert peak is not None and plain.budget_bytes is not None
    over = 100 * ((peak + grads) / plain.budget_bytes - 1)
    for phrase in ("parameter gradients alive", f"up to {format_bytes(grads)} the plan did not "
                   "count", f"about {format_bytes(peak + grads)}", f"{over:+.0f}% against the "
                   "budget", "loop=remat.Loop(accumulation_steps=N)", "strict=True"):
        assert phrase in said[0], (phrase, said[0])
    # Said once, the figure (a pass over every gradient) is not worked out again.
    state = model.__dict__["_remat_state"]
    checks = model._forward_pre_hooks[state.plan_guard_id].loop_checks
    calls: list[int] = []
    checks.grads_alive = lambda m: calls.append(1)
    train(model, 2, accumulate=4)
    assert calls == []


def test_gradients_zeroed_in_place_name_set_to_none(plain: Plan) -> None:
    model = remat.apply_plan(mlp(), plain)
    said = messages_of(lambda: train(model, 3, set_to_none=False))
    assert len(said) == 1 and "loop=remat.Loop(set_to_none=False)" in said[0], said
    assert "zero_grad(set_to_none=False)" in said[0]


def test_strict_makes_a_loop_mismatch_an_error(plain: Plan) -> None:
    model = remat.apply_plan(mlp(), plain, strict=True)
    with pytest.raises(PlanMismatchError, match="gradients alive"):
        train(model, 1, accumulate=2)


def test_a_manual_plan_without_a_loop_checks_no_loop() -> None:
    model = remat.apply_plan(mlp(), Plan.checkpoint_all(NAMES), strict=True)
    train(model, 2, accumulate=3, keep_output=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(batch())


def test_a_copy_checks_its_own_loop(plain: Plan) -> None:
    model = remat.apply_plan(mlp(), plain)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        said = messages_of(lambda m=copied: train(m, 2, accumulate=2))
        assert len(said) == 1 and "gradients alive" in said[0]
    assert messages_of(lambda: train(model, 2)) == []


# --------------------------------------------------------------------------- the output
def test_an_output_kept_through_backward_warns_with_its_bytes(dropping: Plan) -> None:
    model = remat.apply_plan(mlp(), dropping)
    assert messages_of(lambda: train(model, 3, keep_output=False)) == []
    said = messages_of(lambda: train(model, 3, keep_output=True))
    assert len(said) == 1, said
    output = BATCH * WIDTH * 4
    assert f"up to {format_bytes(output)} the plan did not count" in said[0]
    assert "still alive during backward" in said[0] and "loop=remat.Loop())" in said[0]


def test_an_output_kept_is_an_error_in_backward_when_strict(dropping: Plan) -> None:
    model = remat.apply_plan(mlp(), dropping, strict=True)
    out = model(batch())
    with pytest.raises(PlanMismatchError, match="output is still alive"):
        loss_fn(out).backward()
    remat.remove_plan(model)
    assert not model._forward_hooks and not model._forward_pre_hooks
    train(model, 1, keep_output=True)


class WithLoss(nn.Module):
    """Returns ``{"loss": ..., "logits": ...}``, as Hugging Face models given labels do."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        logits = self.body(x)
        return {"loss": loss_fn(logits), "logits": logits}


def test_the_loss_in_the_output_is_not_the_output() -> None:
    model = WithLoss()
    names = [f"body.{n}" for n in NAMES]
    plan = Plan.checkpoint_all(names, target=PlanTarget(loop=Loop(keep_output=False)))
    remat.apply_plan(model, plan)

    def trainer_style() -> None:
        for _ in range(2):
            loss = model(batch())["loss"]  # the output is dropped, its loss kept
            loss.backward()
            model.zero_grad()

    def plain_style() -> None:
        out = model(batch())
        out["loss"].backward()
        model.zero_grad()

    assert messages_of(trainer_style) == []
    said = messages_of(plain_style)
    assert len(said) == 1 and "output is still alive" in said[0]


# --------------------------------------------------------------------------- autocast
@pytest.mark.parametrize(("planned", "around", "phrase"), [
    (None, torch.bfloat16, "loop=remat.Loop(autocast='bfloat16')"),
    ("bfloat16", None, "runs its training forward without autocast"),
    ("bfloat16", torch.float16, "dtype=torch.float16"),
])
def test_autocast_other_than_planned_warns(planned: str | None, around: torch.dtype | None,
                                           phrase: str) -> None:
    model = remat.apply_plan(mlp(), manual(Loop(autocast=planned)))

    def run() -> None:
        with torch.autocast("cpu", dtype=around or torch.bfloat16, enabled=around is not None):
            train(model, 2)

    said = messages_of(run)
    assert len(said) == 1 and phrase in said[0], said


def test_the_planned_autocast_is_silent() -> None:
    model = remat.apply_plan(mlp(), manual(Loop(autocast="bfloat16")), strict=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(batch())
    loss_fn(out.float()).backward()


# --------------------------------------------------------------------------- the model
def test_parameters_converted_after_apply_warn_with_the_scaled_peak(plain: Plan) -> None:
    model = remat.apply_plan(mlp(), plain)
    model.double()
    said = messages_of(lambda: model(batch().double()))
    assert len(said) == 1, said
    for phrase in ("parameters are torch.float64 now", "made for torch.float32 ones",
                   "scaled by x2.00", "model.to(torch.float32)"):
        assert phrase in said[0], (phrase, said[0])
    strict = remat.apply_plan(mlp(), plain, strict=True).double()
    with pytest.raises(PlanMismatchError, match="torch.float64 now"):
        strict(batch().double())


def test_a_converted_model_is_refused_at_apply(plain: Plan) -> None:
    with pytest.raises(PlanMismatchError, match=r"model.to\(torch.float32\)"):
        remat.apply_plan(mlp().to(torch.bfloat16), plain)


def test_a_deeper_model_is_refused_at_apply(plain: Plan) -> None:
    assert dict(plain.target.unit_type_counts or ()) == {"Sequential": DEPTH}
    assert Plan.from_json(plain.to_json()) == plain
    with pytest.raises(PlanMismatchError) as raised:
        remat.apply_plan(mlp(DEPTH + 2), plain)
    for phrase in ("deeper than the one the plan was made for", "it has 8 Sequential modules",
                   "had 6", "'6', '7' are not among the plan's units", "solve again"):
        assert phrase in str(raised.value), (phrase, str(raised.value))
    remat.apply_plan(mlp(), plain)  # the model it was made for


def test_a_plan_for_some_of_the_blocks_fits_its_model() -> None:
    # Blocks left out of the units on purpose were profiled: not a deeper model.
    model = mlp()
    plan = remat.solve(model, batch(), None, loss_fn=loss_fn, units=NAMES[:3], method="all",
                       verify=False)
    assert dict(plan.target.unit_type_counts or ()) == {"Sequential": DEPTH}
    remat.apply_plan(model, plan, strict=True)
    train(model, 1)


def test_a_block_appended_after_apply_warns(plain: Plan) -> None:
    model = remat.apply_plan(mlp(), plain)
    model.append(copy.deepcopy(model[0]))
    said = messages_of(lambda: train(model, 2))
    assert len(said) == 1 and "holds 7 modules now and held 6" in said[0], said
    strict = remat.apply_plan(mlp(), plain, strict=True)
    strict.append(nn.Identity())
    with pytest.raises(PlanMismatchError, match="added after apply_plan"):
        train(strict, 1)


def test_strict_shapes_and_strict_through_the_front_door(plain: Plan) -> None:
    model = remat.apply_plan(mlp(), plain, strict_shapes=True)
    with pytest.raises(PlanMismatchError, match="larger than the plan was made for"):
        model(torch.randn(2 * BATCH, WIDTH))
    model = remat.apply_plan(mlp(), plain, strict=True)
    with pytest.raises(PlanMismatchError, match="larger than the plan was made for"):
        model(torch.randn(2 * BATCH, WIDTH))


# --------------------------------------------------------------------------- forced options
def test_selective_over_an_inplace_activation_is_refused_at_the_first_forward() -> None:
    model = mlp(inplace=True)
    before = copy.deepcopy(model.state_dict())
    plan = Plan.from_options(NAMES, {"2": "selective"})
    remat.apply_plan(model, plan)  # a manual plan: the forward finds out
    with pytest.raises(PlanMismatchError) as raised:
        train(model, 1)
    message = str(raised.value)
    assert "unit '2' cannot run option 'selective'" in message
    assert "aten.relu_" in message and "'checkpoint' or 'keep'" in message
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    reference = mlp(inplace=True)
    remat.apply_plan(model, Plan.from_options(NAMES, {"2": "checkpoint"}))
    for m in (model, reference):
        train(m, 1)
        out = m(batch())
        loss_fn(out).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(),
                                                           reference.parameters()))


def test_an_inplace_activation_selective_does_not_keep_runs_selective() -> None:
    # Linear -> LayerNorm -> ReLU(inplace): the ReLU writes the norm's output, which
    # selective recomputes rather than keeps: nothing to refuse.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH),
                                          nn.ReLU(inplace=True)) for _ in range(DEPTH)])
    reference = copy.deepcopy(model)
    remat.apply_plan(model, Plan.from_options(NAMES, dict.fromkeys(NAMES, "selective")))
    assert messages_of(lambda: [train(m, 2, keep_output=False) for m in (model, reference)]) == []
    for m in (model, reference):
        loss_fn(m(batch())).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(),
                                                           reference.parameters()))


class HookBlock(nn.Module):
    """Clips its output's gradient with a tensor hook (per-block gradient clipping)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(WIDTH, WIDTH), nn.Dropout(0.2)

    def forward(self, x: Tensor) -> Tensor:
        y = self.drop(torch.tanh(self.lin(x)))
        if y.requires_grad:
            y.register_hook(lambda g: g.clamp(-1e-3, 1e-3))
        return y


class GradBlock(nn.Module):
    """Adds the gradient of a function of its output to it (``torch.autograd.grad``
    inside the forward, as physics-informed and gradient-penalty models do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(WIDTH, WIDTH), nn.Dropout(0.2)

    def forward(self, x: Tensor) -> Tensor:
        y = self.drop(torch.tanh(self.lin(x)))
        if x.requires_grad and torch.is_grad_enabled():
            (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
            y = y + 0.1 * g
        return y


class CheckpointBlock(nn.Module):
    """Checkpoints part of itself with ``torch.utils.checkpoint``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Dropout(0.2),
                                   nn.Linear(WIDTH, WIDTH))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(checkpoint(self.inner, x, use_reentrant=False))


BLOCKS = {"register_hook": HookBlock, "autograd.grad": GradBlock, "checkpoint": CheckpointBlock}
OPTIONS = ["keep", "checkpoint", "selective", "chain"]


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("block", list(BLOCKS))
def test_forwards_that_use_autograd_themselves_train_bitwise(block: str, option: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), *[BLOCKS[block]() for _ in range(4)])
    reference = copy.deepcopy(model)
    names = [str(i) for i in range(1, 5)]
    kind = "checkpoint" if option == "chain" else option
    plan = Plan.from_options(names, dict.fromkeys(names, kind),
                             segments=((0, 3),) if option == "chain" else ())
    remat.apply_plan(model, plan)

    def step(m: nn.Module, seed: int) -> Tensor:
        m.zero_grad()
        torch.manual_seed(seed)
        loss = loss_fn(m(batch()))
        loss.backward()
        return loss.detach()

    for s in range(2):
        said = messages_of(lambda s=s: step(model, s))
        assert torch.equal(step(reference, s), step(model, s))  # reference first: same RNG
        for a, b in zip(model.parameters(), reference.parameters()):
            assert torch.equal(a.grad, b.grad)
        # torch's selective cache cannot serve the forward's own backward: each such unit
        # runs as checkpoint, said once, on its first call.
        fallback = block == "autograd.grad" and option == "selective" and s == 0
        assert len(said) == (4 if fallback else 0), said
        assert all("runs as 'checkpoint'" in m for m in said)
    state = model.__dict__["_remat_state"]
    runs_as = "checkpoint" if block == "autograd.grad" and option == "selective" else None
    assert state.runs_as == [runs_as] * 4
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None

"""The optimizer stepped in backward (``Loop(optimizer_in_backward=True)``,
``remat.optimizer_in_backward``): training with it is training with the optimizer; its
budgets hold and its predictions match the measured step; it lowers the floor where the
gradients set it; what cannot hold is refused, naming the fix; remat's measurements
leave the model, the optimizer and the user's hooks as they were.
"""

from __future__ import annotations

import warnings

import loop_models as lm
import pytest
import torch
from torch import nn

import remat
from remat.core.errors import ArgumentError, LoopError
from remat.solver import min_peak_bytes_over_heads
from remat.solver.resolve import no_checkpoint_peak_bytes

PEAK_TOLERANCE = 0.01
RELEASED = remat.Loop(keep_output=False, optimizer_in_backward=True)
PLAIN = remat.Loop(keep_output=False)


def _adamw(params, **kw):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False, **kw)


def _train_plain(model: nn.Module, case: lm.Case, steps: int) -> None:
    opt = _adamw(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(steps):
        case.loss_fn(model(case.batch), case.batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()


def _train_released(model: nn.Module, case: lm.Case, steps: int) -> remat.Loop:
    handle = remat.optimizer_in_backward(model, _adamw(model.parameters()))
    sched = torch.optim.lr_scheduler.StepLR(handle.optimizer, step_size=1, gamma=0.5)
    try:
        for _ in range(steps):
            case.loss_fn(model(case.batch), case.batch).backward()
            assert all(p.grad is None for p in model.parameters())  # freed in backward
            sched.step()
    finally:
        handle.remove()
    return handle


def _measured_under(plan: remat.Plan, case: lm.Case, optimizer: torch.optim.Optimizer):
    """One step of the released loop, measured with ``plan`` applied (removed after)."""
    remat.apply_plan(case.model, plan)
    try:
        return remat.measure(case.model, case.batch, loss_fn=case.loss_fn, loop=RELEASED,
                             optimizer=optimizer, repeats=1)
    finally:
        remat.remove_plan(case.model)


def test_training_in_backward_is_training_with_the_optimizer() -> None:
    """Bitwise, on CPU float32 with the same (for-loop) AdamW kernel, an LR scheduler
    on the user's optimizer included: each parameter's step is the one the whole
    optimizer would have made, and the state is the user's optimizer's."""
    case = lm.causal_lm(batch=2, seq=16)
    twin = lm.causal_lm(batch=2, seq=16).model
    twin.load_state_dict(case.model.state_dict())
    torch.manual_seed(1)
    _train_plain(twin, case, steps=3)
    torch.manual_seed(1)
    handle = _train_released(case.model, case, steps=3)
    for (name, p), q in zip(case.model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
    state = handle.optimizer.state
    assert all(int(state[p]["step"]) == 3 for p in case.model.parameters())


def test_the_helper_takes_a_class_and_hyperparameters() -> None:
    case = lm.causal_lm(batch=2, seq=16)
    handle = remat.optimizer_in_backward(case.model, torch.optim.SGD, lr=0.1)
    try:
        before = [p.detach().clone() for p in case.model.parameters()]
        case.loss_fn(case.model(case.batch), case.batch).backward()
        assert isinstance(handle.optimizer, torch.optim.SGD)
        assert all(not torch.equal(b, p) for b, p in zip(before, case.model.parameters()))
    finally:
        handle.remove()
    case.loss_fn(case.model(case.batch), case.batch).backward()  # hooks gone: grads stay
    assert all(p.grad is not None for p in case.model.parameters())


# --------------------------------------------------------------------- budgets
@pytest.fixture(scope="module")
def lm_case():
    case = lm.causal_lm()
    optimizer = torch.optim.AdamW(case.model.parameters(), lr=1e-3)
    released = remat.profile(case.model, case.batch, loss_fn=case.loss_fn, loop=RELEASED,
                             optimizer=optimizer, repeats=1)
    plain = remat.profile(case.model, case.batch, loss_fn=case.loss_fn, loop=PLAIN,
                          optimizer=optimizer, repeats=1)
    return case, optimizer, released, plain


@pytest.mark.parametrize("fraction", (0.1, 0.6))
def test_budgets_hold_in_backward(lm_case, fraction: float) -> None:
    case, optimizer, profile, _ = lm_case
    lo, hi = min_peak_bytes_over_heads(profile), no_checkpoint_peak_bytes(profile)
    budget = lo + int(fraction * (hi - lo))
    plan = remat.solve(case.model, case.batch, budget, loss_fn=case.loss_fn, loop=RELEASED,
                       optimizer=optimizer, units=[u.name for u in profile.units])
    assert plan.target.loop == RELEASED
    assert plan.verification is not None and plan.verification.measured_peak_bytes <= budget
    measured = _measured_under(plan, case, optimizer)
    assert measured.worst_peak_bytes <= budget
    error = abs(plan.record.predicted_peak_bytes - measured.worst_peak_bytes)
    assert error <= PEAK_TOLERANCE * measured.worst_peak_bytes, (
        plan.summary(), plan.record.predicted_peak_bytes, measured)


def test_releasing_the_gradients_lowers_the_floor(lm_case) -> None:
    """With AdamW the smallest plan of the plain loop peaks once every gradient exists
    (the end of backward, the optimizer step); stepped in backward, no gradient
    outlives its phase, and the floor is lower. The plain profile's remedy predicts it:
    one profile carries the figures of both loops."""
    case, optimizer, released, plain = lm_case
    floor_released = min_peak_bytes_over_heads(released)
    floor_plain = min_peak_bytes_over_heads(plain)
    assert floor_released < floor_plain
    est = remat.estimate(plain)
    remedy = {r.name: r for r in est.remedies}["gradients released"]
    assert remedy.peak_bytes is not None and "optimizer_in_backward" in remedy.note
    assert abs(remedy.peak_bytes - floor_released) <= PEAK_TOLERANCE * floor_released
    # And it is what the step measures at that floor.
    plan = remat.solve(released, floor_released)
    measured = _measured_under(plan, case, optimizer)
    assert abs(measured.worst_peak_bytes - remedy.peak_bytes) <= PEAK_TOLERANCE * floor_released
    assert measured.worst_peak_bytes < floor_plain
    in_use = {r.name: r for r in remat.estimate(released).remedies}["gradients released"]
    assert in_use.note.startswith("in use")


def test_the_remedy_says_why_it_is_not_there() -> None:
    case = lm.causal_lm(batch=2, seq=16)
    no_opt = remat.profile(case.model, case.batch, loss_fn=case.loss_fn, repeats=1)
    remedy = {r.name: r for r in remat.estimate(no_opt).remedies}["gradients released"]
    assert remedy.peak_bytes is None and "optimizer=" in remedy.note
    accumulating = remat.profile(
        case.model, case.batch, loss_fn=case.loss_fn, repeats=1,
        optimizer=torch.optim.AdamW(case.model.parameters()),
        loop=remat.Loop(accumulation_steps=2))
    remedy = {r.name: r for r in remat.estimate(accumulating).remedies}["gradients released"]
    assert remedy.peak_bytes is None and "accumulation_steps=1" in remedy.note


def test_both_remedies_together_are_predicted_and_measured() -> None:
    """A chunked head lowers the head's part of the floor, gradients released the
    gradients' part: together the estimate predicts the floor of the released loop's
    profile with its head chunked, and the plan there measures it."""
    case = lm.causal_lm_head_loss()
    optimizer = torch.optim.AdamW(case.model.parameters())
    kw = {"loss_fn": case.loss_fn, "optimizer": optimizer, "repeats": 1}
    plain = remat.profile(case.model, case.batch, loop=PLAIN, **kw)
    remedies = {r.name: r for r in remat.estimate(plain).remedies}
    both = remedies["chunked head + gradients released"]
    assert both.peak_bytes is not None
    assert both.peak_bytes <= min(remedies["chunked head"].peak_bytes,
                                  remedies["gradients released"].peak_bytes)
    released = remat.profile(case.model, case.batch, loop=RELEASED, **kw)
    floor = min_peak_bytes_over_heads(released)
    assert abs(both.peak_bytes - floor) <= PEAK_TOLERANCE * floor
    plan = remat.solve(released, floor)
    assert plan.head is not None
    measured = _measured_under(plan, case, optimizer)
    assert measured.worst_peak_bytes <= floor


# --------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("loop", "fix"), [
    (dict(accumulation_steps=2), "accumulation_steps=1"),
    (dict(set_to_none=False), "set_to_none=True"),
    (dict(autocast="float16", grad_scaler=True), "without a scaler"),
])
def test_a_loop_it_cannot_hold_is_refused(loop, fix: str) -> None:
    with pytest.raises(LoopError, match="optimizer_in_backward") as err:
        remat.Loop(optimizer_in_backward=True, **loop)
    assert fix in str(err.value)


class _OwnOptimizer(torch.optim.Optimizer):
    """An optimizer from outside torch.optim: remat does not know its constructor."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        return None


def test_an_optimizer_it_cannot_split_is_refused() -> None:
    case = lm.causal_lm(batch=2, seq=16)
    with pytest.raises(ArgumentError, match="LBFGS.*closure.*loop=remat.Loop()"):
        remat.optimizer_in_backward(case.model, torch.optim.LBFGS)
    with pytest.raises(ArgumentError, match="_OwnOptimizer is not one of torch.optim's"):
        remat.optimizer_in_backward(case.model, _OwnOptimizer(case.model.parameters()))
    with pytest.raises(ArgumentError, match="hyperparameters .*lr.* give them to its"):
        remat.optimizer_in_backward(case.model, torch.optim.SGD(case.model.parameters(),
                                                                lr=0.1), lr=0.2)
    with pytest.raises(ArgumentError, match="LBFGS"):
        remat.solve(case.model, case.batch, "90%", loss_fn=case.loss_fn, loop=RELEASED,
                    optimizer=torch.optim.LBFGS(case.model.parameters()))


def test_parameters_outside_the_optimizer_are_refused() -> None:
    case = lm.causal_lm(batch=2, seq=16)
    partial = torch.optim.AdamW(case.model.blocks.parameters())
    with pytest.raises(ArgumentError, match=r"\['embed.weight'.*not in the optimizer.*"
                                            "requires_grad=False"):
        remat.optimizer_in_backward(case.model, partial)
    with pytest.raises(LoopError, match=r"\['embed.weight'.*add them to the optimizer"):
        remat.solve(case.model, case.batch, "90%", loss_fn=case.loss_fn, loop=RELEASED,
                    optimizer=partial)


def test_the_loop_needs_the_optimizer() -> None:
    case = lm.causal_lm(batch=2, seq=16)
    with pytest.raises(LoopError, match="no optimizer was given: pass optimizer="):
        remat.solve(case.model, case.batch, "90%", loss_fn=case.loss_fn, loop=RELEASED)


def test_hooks_under_a_loop_that_steps_after_backward_are_refused() -> None:
    case = lm.causal_lm(batch=2, seq=16)
    handle = remat.optimizer_in_backward(case.model, torch.optim.AdamW)
    try:
        with pytest.raises(ArgumentError, match=r"stepped in backward already.*\.remove\(\)"):
            remat.optimizer_in_backward(case.model, torch.optim.AdamW)
        with pytest.raises(LoopError, match="optimizer_in_backward=True"):
            remat.profile(case.model, case.batch, loss_fn=case.loss_fn, repeats=1,
                          optimizer=handle.optimizer, loop=PLAIN)
    finally:
        handle.remove()


# --------------------------------------------------------------------- no trace left
def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer):
    return ([p.detach().clone() for p in model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            {id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v
                     for k, v in optimizer.state[p].items()} for p in model.parameters()})


def test_measuring_leaves_the_model_and_the_users_hooks_as_they_were() -> None:
    """After a few steps of training in backward (so the optimizer has state), profiling,
    solving (with verification) and measuring under the loop neither step the model
    through the user's hooks nor leave remat's own: parameters, gradients, optimizer
    state and the RNG are as they were, and training goes on through the user's hooks."""
    case = lm.causal_lm(batch=2, seq=16)
    handle = remat.optimizer_in_backward(case.model, torch.optim.AdamW, lr=1e-2)
    try:
        for _ in range(2):
            case.loss_fn(case.model(case.batch), case.batch).backward()
        params, grads, state = _snapshot(case.model, handle.optimizer)
        rng = torch.get_rng_state()
        stepped = []  # what the user's hooks step (suspended while remat measures)
        own_step = handle.step
        handle.step = lambda p: (stepped.append(p), own_step(p))[1]
        plan = remat.solve(case.model, case.batch, "90%", loss_fn=case.loss_fn, loop=RELEASED,
                           optimizer=handle.optimizer)
        remat.apply_plan(case.model, plan)
        remat.measure(case.model, case.batch, loss_fn=case.loss_fn, loop=RELEASED,
                      optimizer=handle.optimizer, repeats=1)
        after_params, after_grads, after_state = _snapshot(case.model, handle.optimizer)
        assert all(torch.equal(a, b) for a, b in zip(params, after_params))
        assert grads == after_grads == [None] * len(grads)
        for pid, s in state.items():
            assert s.keys() == after_state[pid].keys()
            assert all(torch.equal(v, after_state[pid][k]) for k, v in s.items())
        assert torch.equal(rng, torch.get_rng_state())
        assert not stepped
        assert handle.installed and handle.active
        # Training goes on, planned, through the user's hooks, without a word from the
        # planned model's loop checks.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            case.loss_fn(case.model(case.batch), case.batch).backward()
        assert all(p.grad is None for p in case.model.parameters())
        assert len(stepped) == len(params)
        assert not all(torch.equal(a, b) for a, b in zip(params, case.model.parameters()))
        assert int(handle.optimizer.state[next(case.model.parameters())]["step"]) == 3
    finally:
        handle.remove()
        remat.remove_plan(case.model)


def test_a_plan_for_the_loop_trained_without_the_hooks_is_noticed() -> None:
    """Every gradient then lives to the end of backward and an optimizer step runs after
    it: the plan's loop checks say so, naming the set-up."""
    case = lm.causal_lm(batch=2, seq=16)
    optimizer = torch.optim.AdamW(case.model.parameters())
    plan = remat.solve(case.model, case.batch, "90%", loss_fn=case.loss_fn, loop=RELEASED,
                       optimizer=optimizer, verify=False)
    remat.apply_plan(case.model, plan)
    try:
        with pytest.warns(remat.RematWarning, match=r"not stepped in backward.*"
                                                    r"remat.optimizer_in_backward\(model"):
            case.loss_fn(case.model(case.batch), case.batch).backward()
    finally:
        remat.remove_plan(case.model)
    remat.apply_plan(case.model, plan, strict=True)
    try:
        with pytest.raises(remat.PlanMismatchError, match=r"gradients alive.*steps each "
                                                          r"parameter in backward.*remat"
                                                          r".optimizer_in_backward\(model"):
            case.model(case.batch)  # the last backward's gradients, never freed
        case.model.zero_grad(set_to_none=True)
        with pytest.raises(remat.PlanMismatchError, match="not stepped in backward"):
            case.model(case.batch)
    finally:
        remat.remove_plan(case.model)

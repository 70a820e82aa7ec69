"""The budget holds for the loop the user runs: measured peak <= budget, prediction within 1%.

On models written for it (tests/loop_models.py) and in the loops that made budgets
fail before: the output kept alive through backward, gradient accumulation with
AdamW, bf16 autocast, a position bias shared by every block, a CNN with code
between its stages. At five budgets from the smallest feasible peak to no
checkpointing, ``remat.solve`` (which verifies its plan by measuring it) returns a
plan whose step, measured again with both instruments (the dispatch-level meter
and the allocator's view), is at or under the budget, and whose predicted peak is
within 1% of the higher of the two; or, at the very bottom, it says the budget is
infeasible and names a larger smallest budget.
"""

from __future__ import annotations

from collections.abc import Callable

import loop_models as lm
import pytest
import torch

import remat
from remat.solver import min_peak_bytes, min_peak_bytes_over_heads
from remat.solver.resolve import no_checkpoint_peak_bytes
from remat.tune.profile_cache import forget_profiles

PEAK_TOLERANCE = 0.01
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)

CASES: dict[str, tuple[Callable[[], lm.Case], remat.Loop, bool]] = {
    # name: (model, loop, with AdamW)
    "causal LM, loop keeps the logits": (lm.causal_lm, remat.Loop(), False),
    "causal LM, 2 micro-batches, AdamW": (lm.causal_lm, remat.Loop(accumulation_steps=2), True),
    "causal LM, bf16 autocast": (lm.causal_lm, remat.Loop(autocast="bfloat16"), False),
    "encoder-decoder, shared position bias": (lm.encoder_decoder, remat.Loop(), False),
    "encoder-decoder, Trainer-style loop": (
        lm.encoder_decoder, remat.Loop(keep_output=False, set_to_none=False), True),
    "CNN, downsampling between stages": (lm.staged_cnn, remat.Loop(), False),
    "encoder-decoder, encoder's last block output to every decoder block": (
        lambda: lm.encoder_decoder(enc_norm=False), remat.Loop(), False),
    # A chunked head is offered (the loop drops the output): at the low budgets the
    # plans compute the head and the loss over chunks.
    "causal LM with remat.head_loss, loop drops the output, AdamW": (
        lm.causal_lm_head_loss, remat.Loop(keep_output=False), True),
    "Hugging Face GPT-2 on labels, loop drops the output": (
        lm.hf_gpt2, remat.Loop(keep_output=False), False),
    # Each parameter stepped with AdamW as its gradient is complete, the gradient freed.
    "causal LM, optimizer stepped in backward": (
        lm.causal_lm, remat.Loop(keep_output=False, optimizer_in_backward=True), True),
    # Both remedies: the head chunked where the budget needs it, gradients freed in backward.
    "causal LM with remat.head_loss, optimizer stepped in backward": (
        lm.causal_lm_head_loss, remat.Loop(keep_output=False, optimizer_in_backward=True),
        True),
}


@pytest.fixture(scope="module", params=list(CASES))
def profiled(request):
    make, loop, adamw = CASES[request.param]
    case = make()
    optimizer = torch.optim.AdamW(case.model.parameters(), lr=1e-3) if adamw else None
    profile = remat.profile(case.model, case.batch, loss_fn=case.loss_fn, loop=loop,
                            optimizer=optimizer, repeats=1)
    return case, loop, optimizer, profile


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_measured_peak_stays_within_the_budget(profiled, fraction: float) -> None:
    case, loop, optimizer, profile = profiled
    lo, hi = min_peak_bytes_over_heads(profile), no_checkpoint_peak_bytes(profile)
    assert lo < hi, "the test model leaves no room to plan"
    budget = lo + int(fraction * (hi - lo))
    try:
        plan = remat.solve(case.model, case.batch, budget, loss_fn=case.loss_fn, loop=loop,
                           optimizer=optimizer, units=[u.name for u in profile.units])
    except remat.InfeasibleBudgetError as err:
        # Only at the very bottom: the measured step runs a little above the prediction.
        assert fraction == 0.0 and err.min_feasible_bytes > budget
        assert err.min_feasible_bytes <= budget * (1 + PEAK_TOLERANCE)
        return
    assert plan.verification is not None and plan.verification.measured_peak_bytes <= budget
    assert plan.target.loop == loop
    remat.apply_plan(case.model, plan)
    try:
        measured = remat.measure(case.model, case.batch, loss_fn=case.loss_fn, loop=loop,
                                 optimizer=optimizer, repeats=1)
    finally:
        remat.remove_plan(case.model)
    assert measured.peak_bytes <= budget and measured.allocator_peak_bytes <= budget
    # Against the higher of the two readings (what a budget must hold): on CPU the
    # profiler behind the allocator's view now and then misses a few allocations of a
    # step (seen once in a full suite run: 1.3% under the meter, never over it).
    error = abs(plan.record.predicted_peak_bytes - measured.worst_peak_bytes)
    assert error <= PEAK_TOLERANCE * measured.worst_peak_bytes, (
        plan.summary(), plan.record.predicted_peak_bytes, measured)


def test_the_loop_changes_the_peak() -> None:
    """Keeping the logits, accumulating gradients: each loop's peak is its own, and the
    plain loop's is not the Trainer-style one's."""
    case = lm.causal_lm()
    peaks = {}
    for name, loop in {"drop": remat.Loop(keep_output=False), "keep": remat.Loop(),
                       "accumulate": remat.Loop(accumulation_steps=2)}.items():
        p = remat.profile(case.model, case.batch, loss_fn=case.loss_fn, loop=loop, repeats=1)
        peaks[name] = no_checkpoint_peak_bytes(p)
        assert p.loop == loop
    assert peaks["drop"] < peaks["keep"] < peaks["accumulate"]


def test_a_units_output_handed_to_later_units_is_counted_once() -> None:
    """BART-style: the decoder blocks all take the last encoder block's output. It is a
    shared tensor and that block's output at once; counted as both, the keep-all
    prediction was one encoder output (0.5% on BART) above the measured step: more
    than the same model's error with a norm between encoder and decoder."""
    errors = {}
    for enc_norm in (True, False):
        case = lm.encoder_decoder(enc_norm=enc_norm)
        p = remat.profile(case.model, case.batch, loss_fn=case.loss_fn, repeats=1)
        measured = remat.measure(case.model, case.batch, loss_fn=case.loss_fn, repeats=1)
        errors[enc_norm] = no_checkpoint_peak_bytes(p) - measured.worst_peak_bytes
    memory = [t for t in p.shared if t.maker_output]
    assert len(memory) == 1 and memory[0].born_after == 2  # the third encoder block's
    assert memory[0].nbytes == p.units[2].output_bytes
    assert abs(errors[False] - errors[True]) < memory[0].nbytes // 4, errors


class _Branches(torch.nn.Module):
    """Inception-style: every branch takes the same input (off a chain)."""

    def __init__(self, d: int = 256, branches: int = 4) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(d, d)
        self.branches = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(),
                                torch.nn.Linear(2 * d, d)) for _ in range(branches))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        return sum(branch(x) for branch in self.branches)


def test_an_input_several_units_take_is_counted_once() -> None:
    """Four branches each save the one input they share: one storage, not four (it
    was counted once per branch, 3 inputs too many at keep-all)."""
    torch.manual_seed(0)
    model, x = _Branches(), torch.randn(512, 256)
    p = remat.profile(model, x, loss_fn=lambda out, _b: out.square().mean(), repeats=1,
                      units=[f"branches.{i}" for i in range(4)])
    assert not p.is_chain
    (shared,) = [t for t in p.shared if t.first_user == 0]
    assert shared.nbytes == 512 * 256 * 4 and shared.last_user == 3
    assert all(u.input_bytes == 0 for u in p.units)  # counted there only
    measured = remat.measure(model, x, loss_fn=lambda out, _b: out.square().mean(), repeats=1)
    assert abs(no_checkpoint_peak_bytes(p) - measured.worst_peak_bytes) < shared.nbytes // 4


class _InPlaceUnit(torch.nn.Module):
    """An in-place activation as a unit of its own (children of a block), off a chain."""

    def __init__(self, d: int = 256) -> None:
        super().__init__()
        self.a, self.act, self.b = torch.nn.Linear(d, d), torch.nn.ReLU(inplace=True), \
            torch.nn.Linear(d, d)
        self.c = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.b(self.act(self.a(x)))
        return self.c(x * 2.0)  # code between units: not a chain


def test_an_in_place_units_output_is_counted_once() -> None:
    """The activation's output is the storage the next unit takes too: counted once
    (as the activation's output as well, it was one activation too many)."""
    torch.manual_seed(0)
    model, x = _InPlaceUnit(), torch.randn(512, 256)
    p = remat.profile(model, x, loss_fn=lambda out, _b: out.square().mean(), repeats=1,
                      units=["a", "act", "b", "c"])
    assert not p.is_chain
    (shared,) = [t for t in p.shared if t.first_user == 1]
    assert shared.maker_output and shared.last_user == 2
    assert p.units[1].output_bytes == 0  # the in-place output: the shared storage
    measured = remat.measure(model, x, loss_fn=lambda out, _b: out.square().mean(), repeats=1)
    assert abs(no_checkpoint_peak_bytes(p) - measured.worst_peak_bytes) < shared.nbytes // 4


class _Concat(torch.nn.Module):
    """DenseNet-style: the units' outputs are concatenated for the next unit, whose
    input gradient the concatenation's backward then hands out as views."""

    def __init__(self, d: int = 128, branches: int = 3) -> None:
        super().__init__()
        self.branches = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                torch.nn.Linear(4 * d, d)) for _ in range(branches))
        self.head = torch.nn.Linear(branches * d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([branch(x * 1.0) for branch in self.branches], 1))


def test_a_concatenations_gradient_lives_while_its_views_are_used() -> None:
    """The head's input gradient lives until the first branch's backward has used its
    view: counted so, the prediction is not under the measurement (it was 10% under at
    the smallest peak). Each branch's output gradient, a view of it, is counted too:
    over by up to one branch output (2.6% here), never under."""
    torch.manual_seed(0)
    model, x = _Concat(), torch.randn(1024, 128, requires_grad=True)
    loss_fn = lambda out, _b: out.square().mean()  # noqa: E731
    p = remat.profile(model, x, loss_fn=loss_fn, repeats=1,
                      units=["branches.0", "branches.1", "branches.2", "head"])
    assert not p.is_chain and p.units[3].input_grad_kept_until is not None
    for budget in (min_peak_bytes(p), no_checkpoint_peak_bytes(p)):
        plan = remat.solve(p, memory_budget=budget)
        remat.apply_plan(model, plan)
        try:
            measured = remat.measure(model, x, loss_fn=loss_fn, repeats=1)
        finally:
            remat.remove_plan(model)
        error = plan.record.predicted_peak_bytes - measured.allocator_peak_bytes
        assert -PEAK_TOLERANCE < error / measured.allocator_peak_bytes < 0.05, (
            plan.summary(), error)


def test_a_verified_plan_records_both_figures_and_round_trips() -> None:
    case = lm.causal_lm()
    plan = remat.solve(case.model, case.batch, "60%", loss_fn=case.loss_fn,
                       loop=remat.Loop(accumulation_steps=2))
    verified = plan.verification
    assert verified is not None and verified.rounds >= 1
    assert verified.measured_peak_bytes <= plan.budget_bytes
    again = remat.Plan.from_json(plan.to_json())
    assert again == plan and again.target.loop.accumulation_steps == 2


def test_verification_solves_again_for_the_excess(monkeypatch) -> None:
    """A measurement above the budget lowers the budget solved for by the excess."""
    from remat.tune import verify

    case = lm.causal_lm()
    profile = remat.profile(case.model, case.batch, loss_fn=case.loss_fn, repeats=1)
    budget = (min_peak_bytes(profile) + no_checkpoint_peak_bytes(profile)) // 2
    first = remat.solve(profile, memory_budget=budget)
    solved_for: list[int] = []

    def solve_at(target: int):
        solved_for.append(target)
        return remat.solve(profile, memory_budget=target).with_(budget_bytes=budget)

    class Measured:  # the first plan measures 1000 B over its budget, the next fits
        def __init__(self, peak: int) -> None:
            self.worst_peak_bytes, self.time_ms = peak, 1.0

    readings = iter([budget + 1000, budget - 1])
    plan = verify.verified(first, budget, solve_at, lambda _p: Measured(next(readings)))
    assert solved_for == [budget - 1000]
    assert plan.verification.rounds == 2 and plan.verification.solved_budget_bytes == budget - 1000
    assert plan.verification.measured_peak_bytes == budget - 1


def test_plans_that_stay_over_give_up_with_an_error() -> None:
    from remat.tune import verify

    case = lm.causal_lm()
    profile = remat.profile(case.model, case.batch, loss_fn=case.loss_fn, repeats=1)
    budget = no_checkpoint_peak_bytes(profile)
    plan = remat.solve(profile, memory_budget=budget)

    class Over:
        worst_peak_bytes, time_ms = budget + 1, 1.0

    with pytest.raises(verify.BudgetNotMetError, match="all measured above it"):
        verify.verified(plan, budget, lambda b: remat.solve(profile, memory_budget=b),
                        lambda _p: Over(), rounds=2)


# --------------------------------------------------------------------------- over the steps
class LateBranch(torch.nn.Module):
    """Six blocks, and from its ``turn_on``-th training forward on a side branch: memory
    that changes after the first steps (a curriculum, an auxiliary loss switched on)."""

    def __init__(self, width: int = 32, turn_on: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        nn = torch.nn
        self.blocks = nn.Sequential(*[nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width), nn.Tanh())
            for _ in range(6)])
        self.side = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.calls, self.turn_on = 0, turn_on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.calls += 1
        h = self.blocks(x)
        return h + self.side(h) if self.calls > self.turn_on else h


def _square(out: torch.Tensor, batch: object = None) -> torch.Tensor:
    return out.square().mean()


def test_verify_steps_catches_memory_that_grows_after_the_first_steps() -> None:
    model, x = LateBranch(), torch.randn(128, 32, generator=torch.Generator().manual_seed(0))
    units = [f"blocks.{i}" for i in range(6)]

    def over_twelve_steps(plan: remat.Plan) -> int:
        remat.apply_plan(model, plan)
        try:
            return remat.measure(model, x, loss_fn=_square, steps=12, repeats=0).worst_peak_bytes
        finally:
            remat.remove_plan(model)

    one = remat.solve(model, x, "70%", loss_fn=_square, units=units)
    assert model.calls == 0  # verification leaves the model as it was
    assert one.verification.measured_peak_bytes <= one.budget_bytes
    assert over_twelve_steps(one) > one.budget_bytes  # the branch: one step did not see it
    twelve = remat.solve(model, x, "70%", loss_fn=_square, units=units, verify_steps=12)
    assert twelve.budget_bytes == one.budget_bytes
    assert twelve.verification.measured_peak_bytes <= twelve.budget_bytes
    assert over_twelve_steps(twelve) <= twelve.budget_bytes


def test_measure_steps_keeps_one_step_as_it_was() -> None:
    model, x = LateBranch(turn_on=10**9), torch.randn(64, 32)
    one = remat.measure(model, x, loss_fn=_square, repeats=0)
    assert remat.measure(model, x, loss_fn=_square, repeats=0, steps=1) == one
    several = remat.measure(model, x, loss_fn=_square, repeats=0, steps=3)
    assert several.worst_peak_bytes == one.worst_peak_bytes  # nothing changes over the steps


# --------------------------------------------------------------------------- ambient autocast
def _blocks() -> torch.nn.Module:
    return LateBranch(turn_on=10**9).blocks


def test_planning_inside_autocast_plans_for_that_loop(caplog: pytest.LogCaptureFixture) -> None:
    model, x = _blocks(), torch.randn(128, 32)
    bf16 = remat.Loop(autocast="bfloat16")
    declared = remat.profile(model, x, loss_fn=_square, loop=bf16, repeats=1)
    forget_profiles()  # the profile inside the autocast is measured, not the cached one
    with caplog.at_level("INFO", logger="remat"), torch.autocast("cpu", dtype=torch.bfloat16):
        around = remat.profile(model, x, loss_fn=_square, repeats=1)
        plan = remat.solve(model, x, "50%", loss_fn=_square)
        estimate = remat.estimate(model, x, loss_fn=_square)
        frontier = remat.pareto(model, x, loss_fn=_square, points=3)
        # The user's autocast is as it was, and still casts.
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert model(x).dtype == torch.bfloat16
    said = [r.getMessage() for r in caplog.records if "planning for loop=" in r.getMessage()]
    assert len(said) == 4 and "remat.Loop(autocast='bfloat16')" in said[0]
    assert around.loop == bf16 and plan.target.loop == bf16 and estimate.loop == bf16
    assert around is not declared
    assert no_checkpoint_peak_bytes(around) == no_checkpoint_peak_bytes(declared)
    assert plan.verification.measured_peak_bytes <= plan.budget_bytes
    assert len(frontier) > 0
    assert not torch.is_autocast_enabled("cpu")

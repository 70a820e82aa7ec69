"""solve(..., compiled=True): the fastest frontier plan whose compiled step fits, measured."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import remat
from remat.core.errors import InfeasibleBudgetError, RematError
from remat.core.plan import CompiledChoice
from remat.solver.pareto import frontier_plans
from remat.tune.compiled import CompiledStep, compile_planned, measure_compiled, search_compiled

sys.path.insert(0, str(Path(__file__).parent / "solver"))
from solver_testlib import transformer_like  # noqa: E402


@pytest.fixture(scope="module")
def prof() -> remat.Profile:
    return transformer_like(6, seed=1, varied=True)


def _scaled(factor: float, calls: list, *, slower: float = 1.0, shrink: float = 1.0):
    """A stand-in for compiling: the compiled peak is the eager prediction times
    ``factor`` (times ``shrink`` below partitioner budget 1), the time the eager
    prediction (times ``slower`` below partitioner budget 1)."""
    def measure(plan: remat.Plan, fraction: float, within: int) -> CompiledStep:
        calls.append((plan, fraction))
        peak = int(plan.record.predicted_peak_bytes * factor * (shrink if fraction < 1 else 1.0))
        ms = plan.record.predicted_time_ms * (slower if fraction < 1 else 1.0)
        return CompiledStep(peak, ms if peak <= within else None)
    return measure


def test_frontier_is_fastest_first_with_falling_peaks(prof: remat.Profile) -> None:
    plans = frontier_plans(prof, points=20)
    assert len(plans) > 3
    times = [p.record.predicted_time_ms for p in plans]
    peaks = [p.record.predicted_peak_bytes for p in plans]
    assert times == sorted(times)
    assert peaks == sorted(peaks, reverse=True)  # more time buys less memory, never more
    assert len({(p.options, p.segments) for p in plans}) == len(plans)


@pytest.mark.parametrize("factor", [0.6, 0.85, 1.0, 1.15])
def test_search_finds_the_fastest_candidate_that_fits(prof: remat.Profile, factor: float) -> None:
    plans = frontier_plans(prof, points=20)
    lo, hi = plans[-1].record.predicted_peak_bytes, plans[0].record.predicted_peak_bytes
    for budget in [int(lo * factor) + k * (hi - lo) // 7 for k in range(8)]:
        fitting = [p for p in plans if int(p.record.predicted_peak_bytes * factor) <= budget]
        calls: list = []
        if not fitting:
            with pytest.raises(InfeasibleBudgetError) as info:
                search_compiled(None, None, prof, budget, measure=_scaled(factor, calls),
                               max_compiles=len(plans), partitioner_budgets=(1.0,))
            assert info.value.min_feasible_bytes == int(lo * factor)
            continue
        plan = search_compiled(None, None, prof, budget, measure=_scaled(factor, calls),
                              max_compiles=len(plans), partitioner_budgets=(1.0,))
        assert (plan.options, plan.segments) == (fitting[0].options, fitting[0].segments)
        assert plan.compiled.peak_bytes == int(fitting[0].record.predicted_peak_bytes * factor)
        assert plan.compiled.peak_bytes <= budget
        assert plan.record.status == "feasible" and plan.record.algorithm.endswith("+compiled")
        assert plan.budget_bytes == budget and plan.compiled.activation_memory_budget == 1.0
        assert plan.compiled.time_ms == fitting[0].record.predicted_time_ms
        # A binary search: far fewer compiles than candidates.
        assert len(calls) <= len(plans).bit_length() + 1
        assert remat.Plan.from_json(plan.to_json()) == plan


def test_search_respects_max_compiles(prof: remat.Profile) -> None:
    plans = frontier_plans(prof, points=20)
    budget = plans[len(plans) // 2].record.predicted_peak_bytes
    calls: list = []
    plan = search_compiled(None, None, prof, budget, measure=_scaled(0.9, calls), max_compiles=2,
                          partitioner_budgets=(1.0,))
    assert len(calls) <= 2 and plan.compiled.peak_bytes <= budget


@pytest.mark.parametrize("slower", [1.01, 1.5])
def test_search_weighs_the_partitioner_budget_by_measured_time(prof: remat.Profile,
                                                               slower: float) -> None:
    """Below budget 1 inductor recomputes on its own: less memory, some time. The
    search takes whichever winner measures faster."""
    plans = frontier_plans(prof, points=20)
    budget = plans[len(plans) // 2].record.predicted_peak_bytes
    calls: list = []
    plan = search_compiled(None, None, prof, budget, max_compiles=len(plans),
                          partitioner_budgets=(0.5, 1.0),  # searched from 1.0 down
                          measure=_scaled(1.0, calls, slower=slower, shrink=0.7))
    index = {f: next(i for i, p in enumerate(plans)
                     if int(p.record.predicted_peak_bytes * (0.7 if f < 1 else 1)) <= budget)
             for f in (1.0, 0.5)}
    assert index[0.5] < index[1.0]  # budget 0.5 lets a faster plan fit
    times = {f: plans[i].record.predicted_time_ms * (slower if f < 1 else 1.0)
             for f, i in index.items()}
    fraction = min(times, key=times.get)
    assert plan.compiled.activation_memory_budget == fraction
    chosen = plans[index[fraction]]
    assert (plan.options, plan.segments) == (chosen.options, chosen.segments)
    assert plan.compiled.time_ms == pytest.approx(times[fraction])
    # Budget 0.5 only searched the plans faster than budget 1.0's winner.
    position = {(p.options, p.segments): i for i, p in enumerate(plans)}
    assert all(position[(p.options, p.segments)] < index[1.0] for p, f in calls if f == 0.5)
    assert {f for _, f in calls} == {1.0, 0.5}


def test_search_stops_once_keeping_everything_fits(prof: remat.Profile) -> None:
    plans = frontier_plans(prof, points=20)
    calls: list = []
    plan = search_compiled(None, None, prof, plans[0].record.predicted_peak_bytes,
                          measure=_scaled(1.0, calls))
    assert plan.options == plans[0].options and plan.compiled.activation_memory_budget == 1.0
    assert {f for _, f in calls} == {1.0}


def test_bad_arguments_name_the_fix(prof: remat.Profile) -> None:
    with pytest.raises(RematError, match="method must be one of"):
        search_compiled(None, None, prof, 10**9, method="chen", measure=lambda p: 0)
    with pytest.raises(RematError, match="needs the model"):
        remat.solve(prof, memory_budget=10**9, compiled=True)


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)])
    return model, torch.randn(1024, 64)  # activations, not scratch, dominate the peak


def _loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def test_compiled_peak_leaves_the_model_as_it_was() -> None:
    model, x = _mlp()
    model.eval()
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    plan = remat.Plan.keep_all(["0", "1", "2", "3"])
    step = measure_compiled(model, x, plan, loss_fn=_loss, time_if_within=10**12,
                            compile_options={"backend": "aot_eager"})
    peak = step.peak_bytes
    assert step.time_ms is not None and step.time_ms > 0
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert peak > 2 * params  # parameters and their gradients, at least
    assert not model.training
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert getattr(model, "_remat_state", None) is None


def test_solve_compiled_end_to_end() -> None:
    model, x = _mlp()
    prof = remat.profile(model, x, loss_fn=_loss, repeats=1)
    keep_peak = remat.simulate(prof, remat.Plan.keep_all([u.name for u in prof.units])).peak_bytes
    budget = int(0.9 * keep_peak)
    plan = remat.solve(model, x, budget, loss_fn=_loss, compiled=True,
                       compile_options={"backend": "aot_eager"})
    assert plan.compiled.peak_bytes <= budget
    # The plan it returns compiles and trains like the model without it.
    ref = copy.deepcopy(model)
    _loss(ref(x), x).backward()
    assert remat.compile_planned is compile_planned
    compiled = compile_planned(model, plan, backend="aot_eager")
    assert list(compiled.state_dict()) == [f"model.{k}" for k in model.state_dict()]
    _loss(compiled(x), x).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    torch._dynamo.reset()


def test_compile_planned_compiles_under_the_plans_partitioner_budget() -> None:
    seen: list[float] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.append(torch._functorch.config.activation_memory_budget)
        return gm.forward

    model, x = _mlp()
    plan = remat.Plan.keep_all(["0", "1", "2", "3"]).with_(
        compiled=CompiledChoice(peak_bytes=0, activation_memory_budget=0.5))
    torch._dynamo.reset()
    compiled = compile_planned(model, plan, backend=backend)
    compiled(x)
    assert seen and set(seen) == {0.5}
    assert torch._functorch.config.activation_memory_budget == 1.0  # only while it runs
    remat.remove_plan(model)
    torch._dynamo.reset()


def test_the_compiled_step_counts_the_batch() -> None:
    # The batch is alive through the step, compiled or not: the compiled measurement is
    # remat.measure's step (allocator only), so both count it. Here the batch is most
    # of the step, so leaving it out would read far below the eager figure.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4), nn.Linear(4, 4))
    batch = torch.randn(2048, 1024)  # 8 MiB; the parameters are 16 KiB
    torch._dynamo.reset()
    compiled = measure_compiled(model, batch, None, loss_fn=_loss,
                                compile_options={"backend": "eager"}, repeats=1)
    eager = remat.measure(model, batch, loss_fn=_loss, repeats=1).allocator_peak_bytes
    assert compiled.peak_bytes > batch.numel() * batch.element_size()
    assert abs(compiled.peak_bytes - eager) <= 0.05 * eager

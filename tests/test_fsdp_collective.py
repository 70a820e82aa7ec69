"""``remat.solve`` on the FSDP2-sharded model itself, called on every rank (2 gloo ranks on CPU).

Every rank calls ``remat.solve(model, batch, memory_budget=..., optimizer=opt)`` on its
``fully_shard``-ed model (blocks, then the root): the ranks agree on the call, profile,
take the worst rank's figures and get one plan (:mod:`remat.tune.sharded`). The planned
sharded model then trains exactly as the unplanned sharded one, within the budget and the
prediction on every rank; ranks that call with another budget or batch shape get a
``RematError`` naming the rank, not a hang; a plan for 2 ranks is refused on 1.

Each multi-rank test runs under a deadline (:func:`_spawn`): a hang fails, it does not
block the suite.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

fsdp_api = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp_api, "fully_shard") or not dist.is_available():
    pytest.skip("needs torch.distributed.fsdp.fully_shard (FSDP2)", allow_module_level=True)

WORLD = 2
DEADLINE_S = 240.0


def _spawn(check: Callable[[int], None], port: int) -> None:
    """Run ``check(rank)`` on ``WORLD`` gloo ranks; fail (and end them) past the deadline."""
    ctx = mp.start_processes(_worker, args=(port, check), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"the ranks did not finish within {DEADLINE_S:.0f} s (a hang)")


def _worker(rank: int, port: int, check: Callable[[int], None]) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        check(rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # As test_fsdp: leave without C++ static destructors (gloo threads at exit).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _sharded_gpt(seed: int = 0, reshard_after_forward: bool = True) -> tuple[torch.nn.Module,
                                                                               dict]:
    from torch.distributed.fsdp import fully_shard

    from remat.models import build

    ref = build("gpt", size="tiny", depth=4, width=64, seq_len=64, batch_size=8, dropout=0.0,
                seed=seed)
    for block in ref.model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(ref.model, reshard_after_forward=reshard_after_forward)
    return ref.model, ref.batch


def _floor_and_keep(model: torch.nn.Module, batch: dict, opt: torch.optim.Optimizer
                    ) -> tuple[int, int]:
    import remat
    from remat.core.errors import InfeasibleBudgetError

    keep = remat.solve(model, batch, memory_budget=None, optimizer=opt, verify=False)
    try:
        remat.solve(model, batch, memory_budget=1, optimizer=opt, verify=False)
    except InfeasibleBudgetError as err:
        return err.min_feasible_bytes, keep.record.predicted_peak_bytes
    raise AssertionError("a budget of 1 byte should be infeasible")


def _check_plan_trains_within(rank: int, reshard_after_forward: bool) -> None:
    import remat
    from remat.integrations import fsdp
    from remat.measurement.simulated_device import SimulatedDevice
    from remat.measurement.storage import resident_bytes

    planned, batch = _sharded_gpt(reshard_after_forward=reshard_after_forward)
    unplanned, _ = _sharded_gpt(reshard_after_forward=reshard_after_forward)
    opts = [torch.optim.AdamW(m.parameters()) for m in (planned, unplanned)]
    floor, keep = _floor_and_keep(planned, batch, opts[0])
    budget = (floor + keep) // 2
    plan = remat.solve(planned, batch, memory_budget=budget, optimizer=opts[0])
    assert plan.target.world_size == WORLD
    assert set(plan.options) != {"keep"}, plan.summary()
    assert plan.verification is not None and plan.verification.measured_peak_bytes <= budget
    plans: list = [None] * WORLD
    dist.all_gather_object(plans, plan.to_json())
    assert all(p == plans[0] for p in plans), "every rank has the same plan"

    remat.apply_plan(planned, plan)
    for model in (planned, unplanned):
        model(**batch).loss.backward()
    for (name, p), q in zip(planned.named_parameters(), unplanned.parameters()):
        assert torch.equal(p.grad.to_local(), q.grad.to_local()), name
    for opt in opts:
        opt.step()
        opt.zero_grad()

    predicted = plan.record.predicted_peak_bytes
    measured = fsdp.measure_rank_step(planned, batch, optimizer=opts[0])
    # Inside a device of the budget: a byte over raises torch.OutOfMemoryError.
    with SimulatedDevice(budget, resident_bytes=resident_bytes(planned, opts[0])) as device:
        planned(**batch).loss.backward()
        opts[0].step()
        opts[0].zero_grad()
    assert measured <= predicted <= budget, (measured, predicted, budget)
    assert device.peak_bytes <= predicted, (device.peak_bytes, predicted)
    print(f"\nrank {rank} reshard_after_forward={reshard_after_forward}: budget {budget} B, "
          f"predicted {predicted} B, measured {measured} B (allocator), {device.peak_bytes} B "
          f"(live tensors)", flush=True)


def _check_raf_true(rank: int) -> None:
    _check_plan_trains_within(rank, True)


def _check_raf_false(rank: int) -> None:
    _check_plan_trains_within(rank, False)


@pytest.mark.slow
@pytest.mark.parametrize("check", [_check_raf_true, _check_raf_false],
                         ids=["reshard_after_forward", "kept_gathered"])
def test_solve_on_the_sharded_model_one_plan_within_budget_same_gradients(
        free_port: int, check: Callable[[int], None]) -> None:
    _spawn(check, free_port)


def _check_disagreeing_ranks(rank: int) -> None:
    import remat
    from remat.core.errors import RematError

    model, batch = _sharded_gpt()
    opt = torch.optim.AdamW(model.parameters())
    budget = "8MB" if rank == 0 else "9MB"
    with pytest.raises(RematError, match=r"rank 1 differs from rank 0 in memory_budget"):
        remat.solve(model, batch, memory_budget=budget, optimizer=opt, verify=False)
    shorter = {k: v[:, :32] if rank == 1 else v for k, v in batch.items()}
    with pytest.raises(RematError, match=r"rank 1 differs from rank 0 in batch shapes"):
        remat.solve(model, shorter, memory_budget="8MB", optimizer=opt, verify=False)


@pytest.mark.slow
def test_ranks_that_disagree_get_an_error_naming_the_rank(free_port: int) -> None:
    _spawn(_check_disagreeing_ranks, free_port)


def test_a_plan_for_two_ranks_is_refused_on_one() -> None:
    import dataclasses

    import remat
    from remat.core.errors import PlanMismatchError
    from remat.models import build

    ref = build("gpt", size="tiny", depth=2, width=32, seq_len=16, batch_size=2)
    names = [f"blocks.{i}" for i in range(2)]
    plan = remat.Plan.keep_all(names)
    plan = plan.with_(target=dataclasses.replace(plan.target, world_size=2))
    assert remat.Plan.from_json(plan.to_json()).target.world_size == 2
    assert "world_size" not in remat.Plan.keep_all(names).to_dict()["target"]
    with pytest.raises(PlanMismatchError, match="sharded over 2 rank"):
        remat.apply_plan(ref.model, plan)


def test_the_ranks_compare_every_profiling_setting() -> None:
    # Read from the fields: a setting added to ProfilingSettings is compared across ranks
    # without a change to remat.tune.sharded (ranks timing with other warmup, repeats or
    # tolerance would run other numbers of steps, so other collectives, and hang).
    import dataclasses

    from remat.core.settings import ProfilingSettings
    from remat.tune.ranks import describe_settings
    from tests.test_settings import OTHER_VALUES

    base = ProfilingSettings()
    for f in dataclasses.fields(ProfilingSettings):
        changed = base.replace(**{f.name: OTHER_VALUES[f.name]})
        if f.name == "progress":  # a terminal on one rank only; this route draws none
            assert describe_settings(changed) == describe_settings(base)
        else:
            assert describe_settings(changed)[f.name] != describe_settings(base)[f.name], f.name
    # Equal settings describe equally in another process: no addresses in the text.
    assert "0x" not in repr(describe_settings(base.replace(**{
        k: v for k, v in OTHER_VALUES.items() if k != "progress"})))


def _check_estimate_and_pareto(rank: int) -> None:
    import remat
    from remat.core.errors import RematError
    from remat.execute.sharding import sharded_unit
    from remat.profiler.sharded import IN_FLIGHT

    model, batch = _sharded_gpt()
    opt = torch.optim.AdamW(model.parameters())
    prof = remat.profile(model, batch, optimizer=opt)
    est = remat.estimate(model, batch, optimizer=opt, memory_budget=prof.persistent_bytes)
    frontier = remat.pareto(model, batch, optimizer=opt, points=4, baselines=False)
    # FSDP2's hooks run between the blocks: no chain, so no plan spans blocks (segments).
    assert not prof.is_chain
    # The sharded profile's figures: this rank's shard of the parameters, not all of them.
    assert est.parameters == prof.param_bytes < sum(p.numel() * 4 for p in model.parameters())
    assert est.verdict is not None and est.verdict.status == "does not fit"
    answers: list = [None] * WORLD
    dist.all_gather_object(answers, (str(est), frontier.drop(columns="plan").to_json()))
    assert all(a == answers[0] for a in answers), "the same estimate and frontier on every rank"
    # Each call profiles the sharded step anew, and two profiles of it differ by whole
    # units' gathered parameters (frees on gloo's worker threads, which the predictions
    # cover with IN_FLIGHT units: profiler/sharded.py; CI once saw 30 KB of 12 MB). So
    # the frontier's ends are the estimate's extremes within that envelope, not exactly.
    envelope = IN_FLIGHT * max(sharded_unit(b).gathered_bytes for b in model.blocks)
    peaks = list(frontier["peak_bytes"])
    assert len(peaks) and peaks == sorted(peaks), peaks
    assert abs(peaks[0] - est.lowest_bytes) <= envelope, (peaks, est.lowest_bytes)
    assert abs(peaks[-1] - est.no_checkpoint.bytes) <= envelope, (peaks, est.no_checkpoint)
    # Ranks that would time with other settings run other numbers of steps: refused.
    with pytest.raises(RematError, match=r"rank 1 differs from rank 0 in repeats"):
        remat.profile(model, batch, optimizer=opt, repeats=3 + 2 * rank)


@pytest.mark.slow
def test_estimate_and_pareto_on_the_sharded_model_agree_on_every_rank(free_port: int) -> None:
    _spawn(_check_estimate_and_pareto, free_port)

"""A plan under FSDP2 (fully_shard) on 2 CPU processes (gloo): same training, per-rank budget.

The plan is solved on rank 0 from the unsharded model's profile turned into one rank's
(remat.integrations.fsdp.per_rank_profile), sent to every rank, applied *before*
fully_shard, and the sharded planned model trains exactly as the sharded unplanned
one. Its per-rank predicted peak is checked against the allocator's view of a real
sharded step on each rank.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

fsdp_api = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp_api, "fully_shard") or not dist.is_available():
    pytest.skip("needs torch.distributed.fsdp.fully_shard (FSDP2)", allow_module_level=True)

WORLD = 2
STEPS = 2


def _worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        _check(rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # See test_runtime_ddp: leave without C++ static destructors (a gloo thread still
    # joinable at exit can abort the process after the checks passed).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _check(rank: int) -> None:
    from torch.distributed.fsdp import fully_shard

    import remat
    from remat.core.errors import PlanMismatchError
    from remat.integrations import fsdp
    from remat.models import build
    from remat.solver.min_peak import min_peak_bytes
    from remat.solver.simulate import simulate

    ref = build("gpt", size="tiny", depth=4, width=64, seq_len=64, batch_size=8, dropout=0.0)
    planned_model = ref.model
    unplanned = copy.deepcopy(planned_model)
    names = [f"blocks.{i}" for i in range(4)]
    plan = None
    if rank == 0:
        optimizer = torch.optim.AdamW(planned_model.parameters())
        unsharded = remat.profile(planned_model, ref.batch, optimizer=optimizer)
        per_rank = fsdp.per_rank_profile(unsharded, WORLD)
        assert not per_rank.is_chain  # per-unit options only
        assert per_rank.param_bytes == -(-unsharded.param_bytes // WORLD)
        floor = min_peak_bytes(per_rank)
        keep = simulate(per_rank, remat.Plan.keep_all(names)).peak_bytes
        plan = remat.solve(per_rank, memory_budget=(floor + keep) // 2)
        assert not plan.segments and set(plan.options) != {"keep"}
    plan = fsdp.broadcast_plan(plan)
    predicted = simulate_rank = None
    if rank == 0:
        predicted = plan.record.predicted_peak_bytes
        simulate_rank = simulate(per_rank, plan).peak_bytes
        assert predicted == simulate_rank

    remat.apply_plan(planned_model, plan)  # first the plan, then the sharding
    for model in (planned_model, unplanned):
        for name in names:
            fully_shard(model.get_submodule(name))
        fully_shard(model)
    # The other order does not fit: fully_shard renamed the units' classes.
    late = build("gpt", size="tiny", depth=4, width=64, seq_len=64, batch_size=8).model
    for name in names:
        fully_shard(late.get_submodule(name))
    try:
        remat.apply_plan(late, plan)
    except PlanMismatchError as err:
        assert "FSDPGPTBlock" in str(err)
    else:
        raise AssertionError("apply_plan after fully_shard should not fit")

    optimizers = [torch.optim.AdamW(m.parameters()) for m in (planned_model, unplanned)]
    for _ in range(STEPS):
        for model, opt in zip((planned_model, unplanned), optimizers):
            model(**ref.batch).loss.backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(planned_model.named_parameters(), unplanned.parameters()):
        torch.testing.assert_close(p.to_local(), q.to_local(), rtol=0, atol=0, msg=name)

    measured = fsdp.measure_rank_step(planned_model, ref.batch, optimizer=optimizers[0])
    box = [measured]
    dist.broadcast_object_list(box, src=1)  # rank 1's figure too: every rank fits
    if rank == 0:
        worst = max(measured, box[0])
        # The per-rank model errs high (by up to a unit's parameters), never low by more
        # than the allocator's noise.
        assert worst <= predicted * 1.02, (worst, predicted)
        assert predicted <= worst * 1.15, (worst, predicted)
        print(f"\nFSDP2 rank peak: predicted {predicted} B, measured {worst} B", flush=True)


@pytest.mark.slow
def test_plan_composes_with_fully_shard_and_the_budget_is_per_rank(free_port: int) -> None:
    mp.spawn(_worker, args=(free_port,), nprocs=WORLD, join=True)

"""Plan activation checkpointing for an FSDP2-sharded model, per rank, and train it.

Run on CPU (gloo), two ranks::

    torchrun --nproc_per_node=2 examples/fsdp_train.py

Every rank shards the model (each block, then the root), calls ``remat.solve`` on the
sharded model with a per-rank budget (the ranks agree on the call, profile their own
micro-batch and get one plan), applies the plan and trains a few steps; each rank then
prints its predicted peak and the peak it measured against the budget.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import remat
from remat import InfeasibleBudgetError
from remat.integrations.fsdp import measure_rank_step
from remat.models import build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fraction", type=float, default=0.5,
                        help="the budget between the smallest feasible peak (0) and no "
                             "checkpointing (1)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        ref = build("gpt", size="tiny", depth=4, width=64, seq_len=64, batch_size=8,
                    dropout=0.0, seed=rank)  # each rank its own micro-batch
        model = ref.model
        torch.manual_seed(0)
        model.load_state_dict(build("gpt", size="tiny", depth=4, width=64, seq_len=64,
                                    batch_size=8, dropout=0.0, seed=0).model.state_dict())
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        # A budget between the smallest peak any plan reaches and no checkpointing (per rank).
        keep = remat.solve(model, ref.batch, memory_budget=None, optimizer=opt, verify=False)
        try:
            remat.solve(model, ref.batch, memory_budget=1, optimizer=opt, verify=False)
        except InfeasibleBudgetError as err:
            floor = err.min_feasible_bytes
        budget = int(floor + args.fraction * (keep.record.predicted_peak_bytes - floor))

        plan = remat.solve(model, ref.batch, memory_budget=budget, optimizer=opt)
        remat.apply_plan(model, plan)
        for _ in range(args.steps):
            model(**ref.batch).loss.backward()
            opt.step()
            opt.zero_grad()
        measured = measure_rank_step(model, ref.batch, optimizer=opt)
        predicted = plan.record.predicted_peak_bytes
        for r in range(world):  # one rank at a time, in order
            if r == rank:
                print(f"rank {rank}/{world}: plan {plan.summary()}; budget {budget:,} B, "
                      f"predicted peak {predicted:,} B, measured {measured:,} B "
                      f"({'within' if measured <= budget else 'OVER'} the budget)", flush=True)
            dist.barrier()
    finally:
        dist.destroy_process_group()
        sys.stdout.flush()


if __name__ == "__main__":
    main()

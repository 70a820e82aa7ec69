"""A planned model under DistributedDataParallel (2 CPU processes, gloo)."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from remat.core.plan import Plan
from remat.models import build
from remat.runtime import apply_plan

WORLD = 2
STEPS = 2


def _plan(names: list[str], last: str = "selective") -> Plan:
    options = dict.fromkeys(names, "checkpoint")
    options[names[-1]] = last
    return Plan.from_options(names, options, segments=[(0, 1)])


def _gpt_batch(rank: int, vocab: int, seq: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, vocab, (2, seq + 1), generator=gen)
    return {"idx": tokens[:, :-1], "targets": tokens[:, 1:]}


def _mlp_batch(rank: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + rank)
    return torch.randn(4, width, generator=gen), torch.randn(4, width, generator=gen)


def _same(a: nn.Module, b: nn.Module, what: str) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=f"{what}: {name}")


def _worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        _check_gpt(rank)
        _check_mlp(rank)
        dist.barrier()  # neither rank tears down while the other still talks to it
    finally:
        dist.destroy_process_group()
    # Every check passed. Leave without running C++ static destructors: about one run
    # in four under load, a gloo thread still joinable at interpreter exit aborted the
    # process ("terminate called without an active exception", SIGABRT) after the
    # test had passed. A failed check raises above and is reported by mp.spawn.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _check_gpt(rank: int) -> None:
    """Planned and unplanned DDP runs (dropout on) agree bitwise, on every rank."""
    ref = build("gpt", size="tiny", depth=3)
    planned_model = ref.model
    unplanned = copy.deepcopy(planned_model)
    names = [f"blocks.{i}" for i in range(3)]
    apply_plan(planned_model, _plan(names))
    recomputed: list[int] = []  # ln1 of the segment's first unit: forward + recomputation
    planned_model.blocks[0].ln1.register_forward_pre_hook(lambda m, a: recomputed.append(1))
    cfg = ref.config
    batch = _gpt_batch(rank, cfg.vocab_size, cfg.seq_len)
    models = [DDP(planned_model), DDP(unplanned)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step in range(STEPS):
        for m, opt in zip(models, opts):
            opt.zero_grad()
            torch.manual_seed(10 * step + rank)  # same dropout masks for both runs
            m(**batch).loss.backward()
            opt.step()
        _same(planned_model, unplanned, f"gpt step {step}")
    assert len(recomputed) == 2 * STEPS
    flat = torch.cat([p.detach().flatten() for p in planned_model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat)
    torch.testing.assert_close(gathered[0], gathered[1], rtol=0, atol=0)


def _check_mlp(rank: int) -> None:
    """DDP on shards equals one process on the concatenated batch (no dropout)."""
    ref = build("mlp", size="tiny", depth=4, width=16)
    model = ref.model
    single = copy.deepcopy(model)
    apply_plan(model, _plan([str(i) for i in range(4)], last="checkpoint"))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    single_opt = torch.optim.SGD(single.parameters(), lr=0.1)
    x, y = _mlp_batch(rank, 16)
    shards = [_mlp_batch(r, 16) for r in range(WORLD)]
    full_x = torch.cat([s[0] for s in shards])
    full_y = torch.cat([s[1] for s in shards])
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        single_opt.zero_grad()
        F.mse_loss(single(full_x), full_y).backward()
        single_opt.step()
    for (name, p), q in zip(model.named_parameters(), single.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"mlp {name}")


@pytest.mark.slow
def test_ddp_two_cpu_processes(free_port: int) -> None:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    mp.spawn(_worker, args=(free_port,), nprocs=WORLD, join=True)

"""Gloo ranks on the CPU for the distributed benchmarks (``fsdp.py``, ``fsdp_unseen.py``).

:func:`on_gloo_ranks` spawns the ranks, runs one function on each inside a gloo process
group and hands back rank 0's answer. Each rank runs one thread (two ranks share this
machine's two cores) and leaves with ``os._exit``, as the tests' ranks do: gloo's threads
are still alive at exit, and C++ static destructors would crash on them.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def on_gloo_ranks(fn: Callable[..., Any], world: int, *args: Any) -> Any:
    """``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; rank 0's return value.
    ``fn`` must be a module-level function (the ranks are spawned)."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = mp.start_processes(_worker, args=(world, _free_port(), fn, args, out),
                               nprocs=world, join=False, start_method="spawn")
    while out.empty():
        # A rank that raised ends the wait with its traceback (join raises it) instead of
        # leaving this process waiting for an answer that will not come. Ranks that all
        # ended well may have done so since the answer was looked for: look once more.
        if procs.join(timeout=1) and out.empty():
            raise RuntimeError("the ranks ended without handing back an answer")
    result = out.get()
    procs.join()
    return result


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
            out: Any) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            out.put(result)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

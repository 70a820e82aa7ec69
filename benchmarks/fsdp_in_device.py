"""``remat.solve`` itself inside a device of the per-rank budget, on models remat was not
written for, sharded with FSDP2 or replicated with DDP.

A budget is a promise from the first byte: planning a model that does not fit must fit
itself, on every rank, and leave the model as it found it. Spawns ``--ranks`` gloo ranks
on the CPU. For each of ``benchmarks/fsdp_unseen.py``'s cases (the same models, wrapped
alike, each rank its own micro-batch), the per-rank budgets are taken from a profile
made outside any device: the smallest feasible peak and ``--fractions`` of the way from
it to no checkpointing. Then, on a fresh copy, every rank calls
``remat.solve(model, batch, memory_budget=budget, optimizer=AdamW)`` (profiling and
verification included) inside a
:class:`~remat.measurement.simulated_device.SimulatedDevice` of that budget, the rank's
shards, gradients' and optimizer's state resident: a byte over raises
``torch.OutOfMemoryError``, as a CUDA device does. Profiling may run out of memory where
it is allowed to (the head as written, on a device sized for a chunked head) and go on.

Per case and budget: what ``solve`` returned (a plan, or the error it raised), the
highest bytes in use on any rank while it ran, how many allocations the device refused
(caught by ``solve``), and whether the model then trains as an untouched copy does (one
step with no plan applied: every gradient bitwise equal, each still the rank's shard).

Prints a table and writes it to benchmarks/results/fsdp_in_device.md.

    nice -n 10 .venv/bin/python benchmarks/fsdp_in_device.py
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see peers.py

import fsdp_unseen as unseen  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import RESULTS, machine_line, markdown_table, write_result  # noqa: E402
from _ranks import on_gloo_ranks  # noqa: E402

FRACTIONS = (0.0, 0.5)
MiB = 2**20


@dataclass
class Row:
    wrapper: str
    case: str
    fraction: float
    budget: int
    outcome: str  # the plan's summary, or the error solve raised
    planned: bool
    peak: int  # the most bytes in use on any rank while solve ran
    refused_allocations: int  # the most on any rank
    trains_as_untouched: bool


def _fresh(name: str, rank: int, wrapper: str) -> tuple[unseen.Case, torch.optim.Optimizer]:
    """The case wrapped, with AdamW's state made by a step (as in training); under DDP
    two, so that its Reducer has rebuilt its buckets before the device is entered: the
    Reducer lends no view of its buckets, so the device cannot see the old ones go at a
    rebuild inside it and would count both (an over-count of the buckets' bytes)."""
    case = unseen._wrapped(name, rank, wrapper)
    opt = torch.optim.AdamW([p for p in case.model.parameters() if p.requires_grad])
    for _ in range(2 if wrapper == "DDP" else 1):
        unseen._step(case, opt)
    return case, opt


def _budgets(name: str, rank: int, wrapper: str, fractions: Sequence[float]) -> list[int]:
    """The per-rank budgets, from a profile taken outside any device."""
    import remat

    case, opt = _fresh(name, rank, wrapper)
    profile = remat.profile(case.model, case.batch, optimizer=opt, loop=case.loop,
                            loss_fn=case.loss_fn)
    keep = remat.solve(profile, None).record.predicted_peak_bytes
    try:
        remat.solve(profile, 1)
    except remat.InfeasibleBudgetError as err:
        floor = err.min_feasible_bytes
    else:
        raise AssertionError("a budget of 1 byte should be infeasible")
    return [int(floor + f * (keep - floor)) for f in fractions]


def _trains_as_untouched(case: unseen.Case, untouched: unseen.Case) -> bool:
    """One step of each, no plan applied: every gradient bitwise equal and of one kind
    (an FSDP2 shard stays a shard)."""
    for c in (case, untouched):
        unseen._loss(c).backward()
    for p, q in zip(case.model.parameters(), untouched.model.parameters(), strict=True):
        if (p.grad is None) != (q.grad is None):
            return False
        if p.grad is None:
            continue
        if type(p.grad) is not type(q.grad) or p.grad.shape != q.grad.shape:
            return False
        if not torch.equal(unseen._local(p.grad), unseen._local(q.grad)):
            return False
    return True


def _rank_rows(rank: int, world: int, cases: list[str], wrappers: list[str],
               fractions: list[float]) -> list[Row]:
    import remat
    from remat.measurement import SimulatedDevice, resident_bytes

    rows = []
    for wrapper in wrappers:
        for name in cases:
            for fraction, budget in zip(fractions, _budgets(name, rank, wrapper, fractions),
                                        strict=True):
                case, opt = _fresh(name, rank, wrapper)
                untouched, _ = _fresh(name, rank, wrapper)
                planned = False
                with SimulatedDevice(budget, resident_bytes=resident_bytes(case.model, opt)
                                     ) as device:
                    try:
                        plan = remat.solve(case.model, case.batch, memory_budget=budget,
                                           optimizer=opt, loop=case.loop,
                                           loss_fn=case.loss_fn)
                        outcome, planned = plan.summary().split(" (")[0], True
                    except (remat.RematError, torch.OutOfMemoryError) as err:
                        # torch's error is one solve let escape: a failure of its own.
                        outcome = f"{type(err).__name__}: {' '.join(str(err).split())[:160]}"
                trains = _trains_as_untouched(case, untouched)
                figures = [None] * world
                dist.all_gather_object(figures, (device.peak_bytes, device.out_of_memory,
                                                 planned, trains))
                rows.append(Row(
                    wrapper, name, fraction, budget, outcome,
                    all(f[2] for f in figures), max(f[0] for f in figures),
                    max(f[1] for f in figures), all(f[3] for f in figures)))
    return rows


def report(rows: Sequence[Row], world: int, minutes: float, command: str) -> str:
    header = ["wrapper", "model", "budget", "budget MiB", "what solve returned",
              "most in use while solving MiB", "of the budget %",
              "allocations refused (caught)", "then trains as untouched"]
    table = [[r.wrapper, r.case,
              "smallest feasible" if r.fraction == 0 else f"{r.fraction:.0%} to none",
              f"{r.budget / MiB:.2f}", r.outcome if r.planned else f"**{r.outcome}**",
              f"{r.peak / MiB:.2f}", f"{100 * r.peak / r.budget:.1f}",
              str(r.refused_allocations), "yes" if r.trains_as_untouched else "**no**"]
             for r in rows]
    planned = sum(r.planned for r in rows)
    lines = [
        "# `remat.solve` inside a device of the per-rank budget (FSDP2 and DDP)",
        "",
        f"Run {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC on {machine_line(1)}, {world} gloo "
        f"ranks (1 thread each); {minutes:.1f} min. Command: `{command}`.",
        "",
        "Each rank calls `remat.solve` (profiling and verification) inside a simulated "
        "device of the per-rank budget, its shards, gradients and optimizer state resident; "
        "budgets from a profile taken outside any device. Models: "
        "`benchmarks/fsdp_unseen.py`'s docstring; method: `benchmarks/fsdp_in_device.py`'s.",
        "",
        *markdown_table(header, table),
        "",
        f"{planned} of {len(rows)} calls returned a plan; "
        f"{sum(r.peak > r.budget for r in rows)} used more than the budget (the device "
        "refuses a byte over, so this counts only what it could not see); "
        f"{sum(not r.trains_as_untouched for r in rows)} left a model that trains "
        "differently from an untouched one.",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--cases", nargs="+", default=list(unseen.CASES),
                        choices=list(unseen.CASES))
    parser.add_argument("--wrappers", nargs="+", default=list(unseen.WRAPPERS),
                        choices=unseen.WRAPPERS)
    parser.add_argument("--fractions", nargs="+", type=float, default=list(FRACTIONS))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = on_gloo_ranks(_rank_rows, args.ranks, args.cases, args.wrappers, args.fractions)
    whole = (args.cases == list(unseen.CASES) and args.wrappers == list(unseen.WRAPPERS)
             and args.fractions == list(FRACTIONS))
    command = "python benchmarks/fsdp_in_device.py" + (
        f" --ranks {args.ranks}" if args.ranks != 2 else "") + (
        f" --cases {' '.join(args.cases)}" if args.cases != list(unseen.CASES) else "") + (
        f" --wrappers {' '.join(args.wrappers)}"
        if args.wrappers != list(unseen.WRAPPERS) else "") + (
        f" --fractions {' '.join(map(str, args.fractions))}"
        if args.fractions != list(FRACTIONS) else "")
    text = report(rows, args.ranks, (time.perf_counter() - start) / 60, command)
    write_result(RESULTS / ("fsdp_in_device.md" if whole else "fsdp_in_device-partial.md"),
                 text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GPT-2 124M at ``"50%"`` of activations: the defaults' plan against the unplanned step,
where a ``selective`` plan's extra time goes, and the floor of that cost.

First, what a user gets: ``remat.solve(model, batch, "50%", optimizer=adamw,
loop=remat.Loop(keep_output=False))`` with every other setting left at its default
(``transformers``' default config, random weights, dropout 0.1; batch 1 x 512; a
Trainer-style step: forward, backward, AdamW, ``zero_grad``), its planned step against
the unplanned one in ABAB rounds, under two host allocators:

* **glibc as it comes**: large buffers are mapped fresh and returned to the kernel, so
  every step page-faults its activations in again (``ru_minflt`` counts them) and a step
  that holds less memory faults less: what a CPU user's step costs;
* **glibc keeping its memory** (``GLIBC_TUNABLES`` ``mmap_max=0``, a trim threshold no
  step reaches; run in a child process, set before it starts): no faults after the first
  steps, as on a GPU, whose caching allocator keeps what it reserved. This isolates the
  compute the plan adds.

Then, the breakdown, in the child whose allocator keeps its memory (page faults would
land in whichever op touches fresh memory first): every block planned ``selective``
(matmul and attention outputs and dropout's masks kept, everything else recomputed in
backward), measured in one run, on one thread pinned to one core:

* the unplanned and the planned step (ABAB rounds, median ratio and spread);
* the per-block figures the solver saw: forward time, and what ``selective`` and
  ``checkpoint`` add and hold;
* the planned step's backward against the unplanned one's, op by op (``torch.profiler``
  self CPU time): the difference is the recomputation, grouped into what it recomputes
  (dropout masks, softmax, layer norms, GELU, residual adds, other);
* the same with dropout off (``resid_pdrop = embd_pdrop = attn_pdrop = 0``).

The floor: the recomputed ops' time over the unplanned step is the least any plan
pays that frees those activations by recomputing them (faster kernels aside); what the
measured ratio adds above it is remat's own cost.

Prints markdown and writes it to benchmarks/results/selective_cost.md.

    .venv/bin/python benchmarks/selective_cost.py [--rounds 5] [--half-rounds 11]
"""

from __future__ import annotations

import argparse
import collections
import copy
import datetime as dt
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see peers.py

import torch  # noqa: E402
from _common import RESULTS, machine_line, markdown_table, write_result  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import remat  # noqa: E402

# What each recomputed aten op belongs to (CPU kernels; GPT-2's attention under
# dropout runs the math path: bmm, softmax, dropout, bmm).
GROUPS = {
    # Drawn again (bernoulli_), or copied back from the bool masks selective keeps.
    "dropout masks": ("aten::bernoulli_", "aten::div_", "aten::empty_like", "aten::copy_"),
    "softmax": ("aten::_softmax",),
    "layer norms": ("aten::native_layer_norm",),
    "GELU (tanh form)": ("aten::tanh", "aten::pow"),
    "elementwise (mul, add)": ("aten::mul", "aten::add"),
}


def gpt2(tokens: int, dropout: bool) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    extra = {} if dropout else {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    config = GPT2Config(use_cache=False, **extra)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, config.vocab_size, (1, tokens))
    return model, {"input_ids": ids, "labels": ids}


# glibc's malloc keeping what it takes: nothing mapped on its own (so nothing unmapped
# after a step), and a trim threshold (64 GiB) no step reaches.
KEEPING_ALLOCATOR = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def half_budget(tokens: int, rounds: int) -> dict[str, Any]:
    """The defaults' plan at ``"50%"`` in a Trainer-style loop, against the unplanned step:
    ABAB rounds of whole steps (optimizer included), the ratio per round, page faults per
    step, and the profile's predicted ratio."""
    base, batch = gpt2(tokens, dropout=True)
    planned = copy.deepcopy(base)
    optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (base, planned)}
    loop = remat.Loop(keep_output=False)
    opt = optimizers[id(planned)]
    # The profile solve() will use (its cache); profiled first to read its predictions.
    prof = remat.profile(planned, batch, optimizer=opt, loop=loop)
    t0 = time.perf_counter()
    plan = remat.solve(planned, batch, "50%", optimizer=opt, loop=loop)
    solve_s = time.perf_counter() - t0
    remat.apply_plan(planned, plan)
    names = [u.name for u in prof.units]
    predicted = (remat.simulate(prof, plan).time_ms
                 / remat.simulate(prof, remat.Plan.keep_all(names)).time_ms)

    def train_step(model: nn.Module) -> tuple[float, int]:
        optimizer = optimizers[id(model)]
        faults, start = _faults(), time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start, _faults() - faults

    for model in (base, planned, base, planned):  # warm-up: the allocator settles
        train_step(model)
    runs: dict[int, list[tuple[float, int]]] = {id(base): [], id(planned): []}
    ratios = []
    for r in range(rounds):
        pair = [base, planned] if r % 2 == 0 else [planned, base]
        for model in pair:
            runs[id(model)].append(train_step(model))
        ratios.append(runs[id(planned)][-1][0] / runs[id(base)][-1][0])

    def med(model: nn.Module, i: int) -> float:
        return statistics.median(run[i] for run in runs[id(model)])

    return {
        "plan": plan.summary(), "solve_s": solve_s, "predicted_ratio": predicted,
        "budget_mib": plan.budget_bytes / 2**20, "ratios": ratios,
        "plain_ms": med(base, 0) * 1e3, "planned_ms": med(planned, 0) * 1e3,
        "plain_faults": med(base, 1), "planned_faults": med(planned, 1),
    }


def keeping_memory(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`half_budget` and the breakdown (:func:`one_setting`) in a child process
    whose glibc keeps its memory (the tunables are read when a process starts)."""
    env = {**os.environ, "GLIBC_TUNABLES": KEEPING_ALLOCATOR}
    out = subprocess.run(
        [sys.executable, __file__, "--child", "--tokens", str(args.tokens),
         "--half-rounds", str(args.half_rounds), "--rounds", str(args.rounds),
         "--core", str(args.core)],
        env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def step(model: nn.Module, batch: dict[str, torch.Tensor]) -> float:
    for p in model.parameters():
        p.grad = None
    start = time.perf_counter()
    model(**batch).loss.backward()
    return time.perf_counter() - start


def backward_ops(models: Sequence[nn.Module], batch: dict[str, torch.Tensor],
                 repeats: int) -> list[dict[str, float]]:
    """Per model, self CPU ms per aten op in its backward pass: the median of ``repeats``
    profiled passes, taken in turns (ABAB) so that both see the same machine."""
    samples: list[collections.defaultdict[str, list[float]]] = [
        collections.defaultdict(list) for _ in models]
    for _ in range(repeats):
        for model, sample in zip(models, samples):
            for p in model.parameters():
                p.grad = None
            loss = model(**batch).loss
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                loss.backward()
            for e in prof.key_averages():
                if e.key.startswith("aten::"):
                    sample[e.key].append(e.self_cpu_time_total / 1e3)
    return [{op: statistics.median(ms + [0.0] * (repeats - len(ms))) for op, ms in s.items()}
            for s in samples]


def one_setting(tokens: int, dropout: bool, rounds: int, option: str = "selective"
                ) -> dict[str, Any]:
    base, batch = gpt2(tokens, dropout)
    prof = remat.profile(base, batch, head="none")
    names = [u.name for u in prof.units]
    plan = remat.Plan.from_options(names, dict.fromkeys(names, option))
    predicted = remat.simulate(prof, plan)
    planned = remat.apply_plan(copy.deepcopy(base), plan)
    for model in (base, planned):
        step(model, batch)
    plain_t, plan_t, ratios = [], [], []
    for r in range(rounds):
        pair = [(base, plain_t), (planned, plan_t)]
        for model, times in pair if r % 2 == 0 else pair[::-1]:
            times.append(step(model, batch))
        ratios.append(plan_t[-1] / plain_t[-1])
    plain_ops, plan_ops = backward_ops([base, planned], batch, rounds)
    extra = {op: plan_ops.get(op, 0.0) - plain_ops.get(op, 0.0)
             for op in set(plain_ops) | set(plan_ops)}
    grouped: collections.Counter[str] = collections.Counter()
    for op, ms in extra.items():
        group = next((g for g, ops in GROUPS.items() if op in ops), "other")
        grouped[group] += ms
    unit = prof.units[len(prof.units) // 2]
    block = {"fwd_ms": unit.fwd_ms,
             **{f"{o}_extra_ms": unit.options[o].extra_ms
                for o in ("selective", "derive", "checkpoint")},
             **{f"{o}_held_mib": unit.options[o].held_bytes / 2**20
                for o in ("keep", "selective", "derive", "checkpoint")}}
    plain_ms = statistics.median(plain_t) * 1e3
    return {
        "dropout": dropout, "plan": plan.summary(), "plain_ms": plain_ms,
        "planned_ms": statistics.median(plan_t) * 1e3, "ratios": ratios,
        "predicted_ratio": predicted.time_ms / prof.step_ms,
        "grouped": dict(grouped), "recomputed_ms": sum(grouped.values()),
        "block": block,
    }


def half_report(halves: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    lines = [
        "## The `\"50%\"` plan with the defaults",
        "",
        "`remat.solve(model, batch, \"50%\", optimizer=adamw, "
        "loop=remat.Loop(keep_output=False))`, dropout 0.1, batch 1 x 512; a Trainer-style "
        "step (forward, backward, AdamW, `zero_grad`). Ratio: planned / unplanned step per "
        "ABAB round, median (spread); faults: minor page faults per step (median).",
        "",
    ]
    rows = []
    for allocator, h in halves:
        rows.append([
            allocator, h["plan"], f"{h['budget_mib']:.0f}", f"{h['plain_ms']:.0f}",
            f"{h['planned_ms']:.0f}",
            f"**{statistics.median(h['ratios']):.3f}** "
            f"({min(h['ratios']):.3f}-{max(h['ratios']):.3f}, {len(h['ratios'])} rounds)",
            f"{h['predicted_ratio']:.3f}",
            f"{h['plain_faults']:,.0f} / {h['planned_faults']:,.0f}",
        ])
    lines += markdown_table(
        ["host allocator", "plan", "budget MiB", "unplanned ms", "planned ms",
         "planned / unplanned", "predicted", "faults, unplanned / planned"], rows)
    lines.append("")
    return lines


def report(results: Sequence[dict[str, Any]], halves: Sequence[tuple[str, dict[str, Any]]],
           command: str, started: dt.datetime, seconds: float) -> str:
    lines = [
        "# GPT-2 124M at `\"50%\"`: the plan's step, and where `selective`'s and `derive`'s "
        "time goes",
        "",
        f"Run {started:%Y-%m-%d %H:%M} UTC on {machine_line(threads=1)}, pinned to one core; "
        f"{seconds / 60:.1f} min. Command: `{command}`.",
        "",
        *half_report(halves),
        "## Every block `selective`, or every block `derive`: where the time goes",
        "",
        "Measured with glibc keeping its memory. The plan: one option on every block, the "
        "head as written. Ratio: "
        "planned / unplanned step per ABAB round (median, spread). Recomputed: the planned "
        "backward's self CPU time minus the unplanned one's, per op group (`torch.profiler`); "
        "its sum over the unplanned step is the floor of any plan that frees these "
        "activations by recomputing them (for `derive`, what its backward remakes; its "
        "forward's dispatch mode is in the ratio, not in the floor).",
        "",
    ]
    rows = []
    for r in results:
        ratio = statistics.median(r["ratios"])
        floor = 1 + r["recomputed_ms"] / r["plain_ms"]
        rows.append([
            "0.1" if r["dropout"] else "0", r["plan"], f"{r['plain_ms']:.0f}",
            f"{r['planned_ms']:.0f}",
            f"**{ratio:.3f}** ({min(r['ratios']):.3f}-{max(r['ratios']):.3f})",
            f"{r['predicted_ratio']:.3f}", f"{floor:.3f}",
            *(f"{r['grouped'].get(g, 0.0):.0f}" for g in (*GROUPS, "other")),
        ])
    lines += markdown_table(
        ["dropout", "plan", "unplanned ms", "planned ms", "planned / unplanned",
         "predicted", "floor (recomputed ops)", *(f"{g} ms" for g in GROUPS), "other ms"],
        rows)
    lines += ["", "Per block (the middle one), as profiled:", ""]
    block_rows = []
    for r in {r["dropout"]: r for r in reversed(results)}.values():  # one per setting
        b = r["block"]
        block_rows.append([
            "0.1" if r["dropout"] else "0", f"{b['fwd_ms']:.0f}",
            f"{b['selective_extra_ms']:.0f}", f"{b['derive_extra_ms']:.0f}",
            f"{b['checkpoint_extra_ms']:.0f}",
            f"{b['keep_held_mib']:.1f}", f"{b['selective_held_mib']:.1f}",
            f"{b['derive_held_mib']:.1f}", f"{b['checkpoint_held_mib']:.2f}",
        ])
    lines += markdown_table(
        ["dropout", "forward ms", "selective adds ms", "derive adds ms", "checkpoint adds ms",
         "keep holds MiB", "selective holds MiB", "derive holds MiB", "checkpoint holds MiB"],
        block_rows)
    lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5,
                        help="ABAB rounds of the every-block selective plan")
    parser.add_argument("--half-rounds", type=int, default=11,
                        help="ABAB rounds of the defaults' \"50%%\" plan")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--core", type=int, default=0)
    parser.add_argument("--child", action="store_true",
                        help="the child's job: the \"50%%\" plan and the breakdown, as one "
                             "JSON line")
    args = parser.parse_args(argv)
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    if args.child:
        print(json.dumps({
            "half": half_budget(args.tokens, args.half_rounds),
            "breakdown": [one_setting(args.tokens, dropout, args.rounds, option)
                          for dropout, option in ((True, "selective"), (False, "selective"),
                                                  (True, "derive"))],
        }))
        return 0
    started, t0 = dt.datetime.now(dt.UTC), time.perf_counter()
    as_it_comes = half_budget(args.tokens, args.half_rounds)
    kept = keeping_memory(args)
    halves = [("glibc as it comes", as_it_comes), ("glibc keeping its memory", kept["half"])]
    results = kept["breakdown"]
    command = "python benchmarks/selective_cost.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    write_result(RESULTS / "selective_cost.md",
                 report(results, halves, command.strip(), started, time.perf_counter() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())

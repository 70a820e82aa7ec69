"""Where a ``selective`` plan's extra time goes on GPT-2 124M, and the floor of that cost.

At ``"50%"`` of activations ``remat.solve`` plans GPT-2 124M's blocks ``selective``
(matmul and attention outputs kept, everything else recomputed in backward). This
script plans every block ``selective`` (``transformers``' default config, random
weights, dropout 0.1 as configured; batch 1 x 512, the head as written) and measures,
in one run, on one thread pinned to one core:

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

    .venv/bin/python benchmarks/selective_cost.py [--rounds 5] [--tokens 512]
"""

from __future__ import annotations

import argparse
import collections
import copy
import datetime as dt
import os
import statistics
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
    "dropout masks": ("aten::bernoulli_", "aten::div_", "aten::empty_like"),
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


def one_setting(tokens: int, dropout: bool, rounds: int) -> dict[str, Any]:
    base, batch = gpt2(tokens, dropout)
    prof = remat.profile(base, batch, head="none")
    names = [u.name for u in prof.units]
    plan = remat.Plan.from_options(names, dict.fromkeys(names, "selective"))
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
    block = prof.units[len(prof.units) // 2]
    plain_ms = statistics.median(plain_t) * 1e3
    return {
        "dropout": dropout, "plan": plan.summary(), "plain_ms": plain_ms,
        "planned_ms": statistics.median(plan_t) * 1e3, "ratios": ratios,
        "predicted_ratio": predicted.time_ms / prof.step_ms,
        "grouped": grouped, "recomputed_ms": sum(grouped.values()),
        "block": block,
    }


def report(results: Sequence[dict[str, Any]], command: str, started: dt.datetime,
           seconds: float) -> str:
    lines = [
        "# Where a `selective` plan's time goes on GPT-2 124M",
        "",
        f"Run {started:%Y-%m-%d %H:%M} UTC on {machine_line(threads=1)}, pinned to one core; "
        f"{seconds / 60:.1f} min. Command: `{command}`.",
        "",
        "The plan: `selective` on every block, the head as written. Ratio: "
        "planned / unplanned step per ABAB round (median, spread). Recomputed: the planned "
        "backward's self CPU time minus the unplanned one's, per op group (`torch.profiler`); "
        "its sum over the unplanned step is the floor of any plan that frees these "
        "activations by recomputing them.",
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
            *(f"{r['grouped'][g]:.0f}" for g in (*GROUPS, "other")),
        ])
    lines += markdown_table(
        ["dropout", "plan", "unplanned ms", "planned ms", "planned / unplanned",
         "predicted", "floor (recomputed ops)", *(f"{g} ms" for g in GROUPS), "other ms"],
        rows)
    lines += ["", "Per block (the middle one), as profiled:", ""]
    block_rows = []
    for r in results:
        b = r["block"]
        sel, ckpt = b.options["selective"], b.options["checkpoint"]
        keep = b.options["keep"]
        block_rows.append([
            "0.1" if r["dropout"] else "0", f"{b.fwd_ms:.0f}", f"{sel.extra_ms:.0f}",
            f"{ckpt.extra_ms:.0f}", f"{keep.held_bytes / 2**20:.1f}",
            f"{sel.held_bytes / 2**20:.1f}", f"{ckpt.held_bytes / 2**20:.2f}",
        ])
    lines += markdown_table(
        ["dropout", "forward ms", "selective adds ms", "checkpoint adds ms", "keep holds MiB",
         "selective holds MiB", "checkpoint holds MiB"], block_rows)
    lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--core", type=int, default=0)
    args = parser.parse_args(argv)
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    started, t0 = dt.datetime.now(dt.UTC), time.perf_counter()
    results = [one_setting(args.tokens, dropout, args.rounds) for dropout in (True, False)]
    command = "python benchmarks/selective_cost.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    write_result(RESULTS / "selective_cost.md",
                 report(results, command.strip(), started, time.perf_counter() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())

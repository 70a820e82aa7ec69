"""The floor: the smallest peak each way of training a language model reaches, side by side.

With every block checkpointed, a causal LM's step peaks in its head and loss (the
logits, their float32 log-softmax and their gradient) and in its gradients and optimizer
state, which no recomputation of the blocks removes. For each model, in one run, with
AdamW (fused, the Trainer's default) in a loop that drops the output
(``Loop(keep_output=False)``, as Hugging Face's Trainer), this measures the peak of one
training step as the allocator saw it
(:func:`remat.measure`: on CPU the allocation events of ``torch.profiler``, on CUDA
``max_memory_allocated``) and its median step time, for:

* **no checkpointing**;
* **Hugging Face gradient checkpointing** (``gradient_checkpointing_enable()``: every
  block recomputed, the head as it is);
* **remat**, at the smallest peak it predicts with checkpointing alone (the blocks'
  options, the head as the model computes it), then with each remedy: a **chunked head**
  (the head and the loss over chunks of the tokens, chosen by the solver), **gradients
  released** in backward (``Loop(optimizer_in_backward=True)``: each parameter's AdamW
  step runs as soon as its gradient is accumulated, and the gradient is freed), and both.

Each remat row is the plan the solver returns for a budget equal to the smallest peak it
predicts for that configuration, applied to the model and measured; "predicted" is that
plan's ``simulate()`` peak. The rows "at HF GC's peak -N%" are the fastest plan at the
issue's goal (N = 25 on GPT-2, 60 on the large vocabulary) below Hugging Face gradient
checkpointing's measured peak, to compare step times at that peak. The models: GPT-2
124M (``GPT2Config()``, batch 4 x 256) and a Qwen2-style causal LM with Qwen2's
151,936-token vocabulary (hidden 512, 8 layers, tied embeddings, batch 2 x 1024),
random weights. Hugging Face's checkpointing is ``gradient_checkpointing_enable`` with
``use_reentrant=False`` (transformers 5 warns that the name is deprecated).

Prints a markdown table and writes it to benchmarks/results/floor.md.

    .venv/bin/python benchmarks/floor.py [--models gpt2 qwen2] [--repeats 3] [--no-optimizer]
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see peers.py

import torch  # noqa: E402
from _common import RESULTS, machine_line, markdown_table, write_result  # noqa: E402
from torch import nn  # noqa: E402

import remat  # noqa: E402
from remat.core import mib  # noqa: E402
from remat.solver import min_peak_bytes_over_heads, solve_profile  # noqa: E402
from remat.tune import checkpointing_only  # noqa: E402

log = logging.getLogger("floor")

DROP = remat.Loop(keep_output=False)
RELEASED = remat.Loop(keep_output=False, optimizer_in_backward=True)


@dataclass(frozen=True)
class Row:
    configuration: str
    plan: str
    predicted_bytes: int | None
    peak_bytes: int
    time_ms: float


def gpt2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(use_cache=False))
    ids = torch.randint(0, model.config.vocab_size, (4, 256))
    return model, {"input_ids": ids, "labels": ids}


def qwen2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151_936, hidden_size=512, intermediate_size=1408,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         use_cache=False)
    model = Qwen2ForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (2, 1024))
    return model, {"input_ids": ids, "labels": ids}


MODELS: dict[str, tuple[str, Callable[[], tuple[nn.Module, dict[str, torch.Tensor]]]]] = {
    "gpt2": ("GPT-2 124M, batch 4 x 256", gpt2),
    "qwen2": ("Qwen2-style, vocabulary 151,936, hidden 512, batch 2 x 1024", qwen2),
}
# The goal per model: remat's peak this far below Hugging Face gradient
# checkpointing's, at a step time within 5% of it.
GOALS = {"gpt2": 0.25, "qwen2": 0.60}


def _measure(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer | None,
             loop: remat.Loop,
             repeats: int) -> tuple[int, float]:
    m = remat.measure(model, batch, optimizer=optimizer, loop=loop, warmup=1, repeats=repeats)
    assert m.allocator_peak_bytes is not None and m.time_ms is not None
    return m.allocator_peak_bytes, m.time_ms


def _planned(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer | None,
             plan: remat.Plan,
             loop: remat.Loop, repeats: int) -> tuple[int, float]:
    remat.apply_plan(model, plan)
    try:
        return _measure(model, batch, optimizer, loop, repeats)
    finally:
        remat.remove_plan(model)


def _remat_rows(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer | None,
                repeats: int, goal_bytes: int, goal: str) -> list[Row]:
    """remat at its smallest predicted peak, without and with each remedy; then, with the
    remedies, the fastest plan at the goal's budget (``goal_bytes``)."""
    rows = []

    def planned(name: str, prof: remat.Profile, budget: int, loop: remat.Loop) -> None:
        try:
            plan = solve_profile(prof, budget)
        except remat.InfeasibleBudgetError as err:
            log.info("%s: infeasible (%s)", name, err)
            return
        peak, ms = _planned(model, batch, optimizer, plan, loop, repeats)
        rows.append(Row(name, plan.summary(), plan.record.predicted_peak_bytes, peak, ms))
        log.info("%s: %s, predicted %s MiB, measured %s MiB, %.0f ms", name,
                 plan.summary(), mib(plan.record.predicted_peak_bytes or 0), mib(peak), ms)

    # Gradients are released by the optimizer's steps in backward: none without one.
    loops = ((DROP, False), (RELEASED, True)) if optimizer is not None else ((DROP, False),)
    for loop, released in loops:
        profile = remat.profile(model, batch, optimizer=optimizer, loop=loop)
        alone = checkpointing_only(profile)
        choices = [(alone, False)]
        if profile.head is not None:
            choices.append((replace(alone, head=profile.head), True))
        for prof, chunked in choices:
            name = " + ".join(["remat"] + ["chunked head"] * chunked
                              + ["gradients released"] * released)
            planned(name, prof, min_peak_bytes_over_heads(prof), loop)
            if chunked:
                planned(f"{name}, at {goal}", prof, goal_bytes, loop)
    return rows


def run_model(key: str, repeats: int, adamw: bool = True) -> list[Row]:
    _, build = MODELS[key]
    model, batch = build()
    model.train()
    # Fused AdamW: Hugging Face Trainer's default optimizer with torch >= 2.8
    # ("adamw_torch_fused"); it steps a parameter without temporaries of its size, where
    # the for-loop implementation makes two (GPT-2's 147 MiB embedding: 294 MiB).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True) if adamw else None
    rows = []
    peak, ms = _measure(model, batch, optimizer, DROP, repeats)
    rows.append(Row("no checkpointing", "", None, peak, ms))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        peak, ms = _measure(model, batch, optimizer, DROP, repeats)
    finally:
        model.gradient_checkpointing_disable()
    rows.append(Row("Hugging Face gradient checkpointing", "every block", None, peak, ms))
    goal = GOALS.get(key, 0.25)
    rows += _remat_rows(model, batch, optimizer, repeats, int(peak * (1 - goal)),
                        f"HF GC's peak -{100 * goal:.0f}%")
    return rows


def _table(results: dict[str, list[Row]]) -> list[str]:
    out = []
    for key, rows in results.items():
        gc = next(r for r in rows if r.configuration.startswith("Hugging Face"))
        table = []
        for r in rows:
            table.append([
                r.configuration, r.plan or "-",
                "-" if r.predicted_bytes is None else mib(r.predicted_bytes),
                mib(r.peak_bytes), f"{100 * (r.peak_bytes / gc.peak_bytes - 1):+.1f}%",
                f"{r.time_ms:.0f}", f"{100 * (r.time_ms / gc.time_ms - 1):+.1f}%",
            ])
        out += [f"### {MODELS[key][0]}", ""]
        out += markdown_table(
            ["configuration", "plan", "predicted peak (MiB)", "measured peak (MiB)",
             "peak vs HF GC", "step (ms)", "time vs HF GC"], table,
            ["---", "---", "---:", "---:", "---:", "---:", "---:"])
        out.append("")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per row (median)")
    parser.add_argument("--no-optimizer", action="store_true",
                        help="forward and backward only (no gradients released then); "
                             "written to floor-no-optimizer.md")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("remat").setLevel(logging.WARNING)
    started = time.perf_counter()
    results = {key: run_model(key, args.repeats, not args.no_optimizer) for key in args.models}
    what = "no optimizer" if args.no_optimizer else "AdamW (fused)"
    lines = [
        "# The floor: the smallest peak of one training step, side by side",
        "",
        f"{dt.date.today()}, {machine_line(torch.get_num_threads())}; {what}, a loop that "
        f"drops the output; peaks as the allocator saw them, step times the median of "
        f"{args.repeats} after a warm-up step; {time.perf_counter() - started:.0f} s.",
        "",
        f"    .venv/bin/python benchmarks/floor.py{' --no-optimizer' * args.no_optimizer}"
        f"{'' if args.models == list(MODELS) else ' --models ' + ' '.join(args.models)}",
        "",
        *_table(results),
    ]
    name = "floor-no-optimizer.md" if args.no_optimizer else "floor.md"
    write_result(RESULTS / name, "\n".join(lines))


if __name__ == "__main__":
    main()

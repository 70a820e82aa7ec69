"""What planning costs, in time and in memory: ``remat.profile()`` and ``remat.solve()``
measured against the model's own unplanned training step.

For each model (the reference models' "small" presets, a Hugging Face Qwen2 causal LM
in a Trainer-style loop, and a 24-layer GPT), at a budget near the bottom of its range
(the smallest feasible peak plus 10% of the range up to the no-checkpoint peak):

* **time**: the median plain training step (forward + backward, no optimizer, after a
  warm-up step), the median wall time of ``remat.profile()`` and of ``remat.solve()``
  end to end (profile, solve, verify) with their defaults, each after one discarded call
  (one-off costs: lazy imports, kernel selection) and with the profile cache emptied, in
  plain steps;
* **memory**: the peak of live tensor bytes while ``remat.solve()`` ran (a
  :class:`~remat.measurement.simulated_device.SimulatedDevice` without a capacity around
  it, the model and batch counted as resident), as a multiple of the budget and of the
  unplanned step's peak; and whether ``solve()`` plans the model on a simulated device
  whose capacity is the budget (the unplanned step's peak over that capacity given).

Prints a markdown table and writes it to benchmarks/results/profile_cost.md.

    .venv/bin/python benchmarks/profile_cost.py [--models mlp gpt] [--runs 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see peers.py

import torch  # noqa: E402
from _common import RESULTS, machine_line, markdown_table, write_result  # noqa: E402
from torch import nn  # noqa: E402

import remat  # noqa: E402
from remat import models  # noqa: E402
from remat.core import mib  # noqa: E402
from remat.measurement import (
    SimulatedDevice,  # noqa: E402
    Stopwatch,  # noqa: E402
    clear_grads,  # noqa: E402
    model_device,  # noqa: E402
    resident_bytes,  # noqa: E402
)
from remat.solver import min_peak_bytes_over_heads, no_checkpoint_peak_bytes  # noqa: E402
from remat.tune import forget_profiles  # noqa: E402


@dataclass
class Case:
    """A model to plan: the module, one batch, its loss and its loop."""

    name: str
    model: nn.Module
    batch: Any
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    loop: remat.Loop
    step: Callable[[], None]
    optimizer: torch.optim.Optimizer | None = None


def _reference(name: str, **overrides: Any) -> Case:
    ref = models.build(name, size="small", seed=0, **overrides)
    return Case(name, ref.model, ref.batch, ref.loss_fn, remat.Loop(), ref.step)


def _qwen2() -> Case:
    """The issue's model: a Qwen2 config (8 layers, hidden 256, vocabulary 2000, batch
    4 x 512 tokens, random weights) in a Trainer-style loop (output dropped)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=2000, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, use_cache=False)
    model = Qwen2ForCausalLM(config)
    ids = torch.randint(0, 2000, (4, 512))
    batch = {"input_ids": ids, "labels": ids}

    def step() -> None:
        model(**batch).loss.backward()

    return Case("hf-qwen2 (8 layers, 4x512)", model, batch, None,
                remat.Loop(keep_output=False), step)


def _gpt2_124m() -> Case:
    """GPT-2 124M (``transformers``' default config, random weights, batch 1 x 512) in a
    Trainer-style loop: AdamW, the output dropped."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(use_cache=False)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, config.vocab_size, (1, 512))
    batch = {"input_ids": ids, "labels": ids}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Case("hf-gpt2 124M (1x512, AdamW)", model, batch, None,
                remat.Loop(keep_output=False), step, optimizer)


CASES: dict[str, Callable[[], Case]] = {
    "mlp": lambda: _reference("mlp"),
    "cnn": lambda: _reference("cnn"),
    "gpt": lambda: _reference("gpt"),
    "hf-gpt2": lambda: _reference("hf-gpt2"),
    "hf-qwen2": _qwen2,
    "gpt-24": lambda: _reference("gpt", depth=24),
    "gpt2-124m": _gpt2_124m,
}


def plain_step_ms(case: Case, warmup: int, repeats: int) -> float:
    """Median wall time of a plain training step, in milliseconds."""
    times = []
    params = list(case.model.parameters())
    watch = Stopwatch(model_device(case.model))
    for r in range(warmup + repeats):
        clear_grads(params)
        _, ms = watch.time(case.step)
        if r >= warmup:
            times.append(ms)
    clear_grads(params)
    return statistics.median(times)


def _resident(case: Case) -> int:
    return resident_bytes(case.model, batch=case.batch, device=model_device(case.model))


def _on_device(case: Case, kw: dict[str, Any], capacity: int, unplanned: int) -> str:
    """Whether ``remat.solve()`` plans ``case`` for ``capacity`` on a simulated device of
    that capacity (with the unplanned step's peak over it), or what stopped it."""
    forget_profiles()
    try:
        with SimulatedDevice(capacity, resident_bytes=_resident(case)) as device:
            remat.solve(case.model, case.batch, capacity, **kw)
    except (torch.OutOfMemoryError, remat.RematError) as err:
        return f"no: {type(err).__name__}"
    return f"yes ({unplanned / capacity:.2f}x, held {device.peak_bytes / capacity:.3f})"


def row_for(key: str, runs: int, repeats: int) -> dict[str, str]:
    case = CASES[key]()
    kw = {"loss_fn": case.loss_fn, "loop": case.loop, "optimizer": case.optimizer}
    unplanned = remat.measure(case.model, case.batch, repeats=1, **kw).worst_peak_bytes
    profile = remat.profile(case.model, case.batch, progress=False, **kw)  # discarded
    lo, hi = min_peak_bytes_over_heads(profile), no_checkpoint_peak_bytes(profile)
    budget = int(lo + 0.1 * (hi - lo))
    second = int(lo + 0.3 * (hi - lo))
    steps, profiles, solves, warm = [], [], [], []
    for _ in range(runs):
        steps.append(plain_step_ms(case, warmup=1, repeats=repeats))
        forget_profiles()
        start = time.perf_counter()
        remat.profile(case.model, case.batch, progress=False, **kw)
        profiles.append(time.perf_counter() - start)
        forget_profiles()
        start = time.perf_counter()
        remat.solve(case.model, case.batch, budget, **kw)
        solves.append(time.perf_counter() - start)
        start = time.perf_counter()  # a second budget, the profile cached
        remat.solve(case.model, case.batch, second, **kw)
        warm.append(time.perf_counter() - start)
    step_s = statistics.median(steps) / 1e3
    forget_profiles()
    with SimulatedDevice(None, resident_bytes=_resident(case)) as meter:
        plan = remat.solve(case.model, case.batch, budget, **kw)
    on_device = [_on_device(case, kw, capacity, unplanned)
                 for capacity in (budget, int(lo * 1.01))]
    assert plan.verification is not None
    row = {
        "model": case.name,
        "units": str(profile.n),
        "step ms": f"{step_s * 1e3:.0f}",
        "profile / step": f"{statistics.median(profiles) / step_s:.1f}",
        "solve / step": f"{statistics.median(solves) / step_s:.1f}",
        "second budget / step": f"{statistics.median(warm) / step_s:.1f}",
        "budget MiB": mib(budget),
        "unplanned MiB": mib(unplanned),
        "held in solve MiB": mib(meter.peak_bytes),
        "held / budget": f"{meter.peak_bytes / budget:.3f}",
        "held / unplanned": f"{meter.peak_bytes / unplanned:.2f}",
        "plan measured / budget": f"{plan.verification.measured_peak_bytes / budget:.3f}",
        "planned on a device of the budget": on_device[0],
        "... of the floor + 1%": on_device[1],
    }
    print(" | ".join(row.values()), flush=True)
    return row


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--runs", type=int, default=3, help="timed calls per model")
    parser.add_argument("--repeats", type=int, default=5, help="timed plain steps per run")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "profile_cost.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    rows: list[dict[str, str]] = []
    for key in args.models:
        rows.append(row_for(key, args.runs, args.repeats))
        # Written after every model, so that a run cut short keeps the rows it measured.
        _write(args, rows, time.perf_counter() - start, done=len(rows) == len(args.models))


def _write(args: argparse.Namespace, rows: list[dict[str, str]], seconds: float,
           done: bool) -> None:
    """The table of ``rows`` and its header, to ``args.out``."""
    models = "" if args.models == list(CASES) else " --models " + " ".join(args.models)
    partial = "" if done else f"; cut short: {len(rows)} of {len(args.models)} models"
    header = (
        "# What planning costs\n\n"
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; machine: "
        f"{machine_line(args.threads)}\n"
        f"- command: `.venv/bin/python benchmarks/profile_cost.py --runs {args.runs} "
        f"--repeats {args.repeats}{models}` ({seconds:.0f} s{partial})\n"
        "- budget: the smallest feasible peak plus 10% of the range up to the no-checkpoint "
        "peak; unplanned: the peak of the model's own step (both instruments, measured "
        "apart); the reference models in a plain loop, Qwen2 in a Trainer-style loop\n"
        "- step ms: median plain training step (forward + backward) after a warm-up step; "
        "profile / step and solve / step: median wall time of `remat.profile()` and of "
        "`remat.solve()` end to end (profile, solve, verify), defaults, after one discarded "
        "call, the profile cache emptied before each, in plain steps; second budget / step: "
        "`remat.solve()` right after, for the smallest feasible peak plus 30% of the range "
        "(the profile cached)\n"
        "- held in solve: the peak of live tensor bytes while `remat.solve()` ran, model and "
        "batch included (a `SimulatedDevice` without a capacity); planned on a device of the "
        "budget (and of the smallest feasible peak + 1%): `remat.solve()` for that budget on "
        "a `SimulatedDevice` of that capacity (in brackets: the unplanned step's peak over "
        "the capacity, and the peak held while solve() ran over it)\n"
    )
    table = markdown_table(list(rows[0]), [list(r.values()) for r in rows])
    write_result(args.out, "\n".join([header, *table]) + "\n")


if __name__ == "__main__":
    main()

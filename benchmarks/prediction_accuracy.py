"""How well remat's predictions hold, in the loops people train with: solve, apply, measure.

For each case (a model and a training loop: the output kept through backward or
dropped, gradient accumulation with AdamW, bf16 autocast) and five budgets from the
smallest feasible peak to no checkpointing, solve the optimal plan from one
profile, apply it and measure one optimizer step of the loop with both instruments:
the dispatch-level meter and the allocator's view (``torch.profiler`` memory events
on CPU). The prediction is compared with the allocator's view. Then the closed loop
``remat.solve`` runs by default (:mod:`remat.tune.verify`: measure, and solve again below
the budget by any excess) is applied to the same plan, and its result recorded.
Prints a markdown table and writes it to benchmarks/results/prediction_accuracy.md.

    .venv/bin/python benchmarks/prediction_accuracy.py [--cases gpt2-plain ...] [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see peers_run.py

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import RESULTS, machine_line, markdown_table, write_result  # noqa: E402

import remat  # noqa: E402
from remat import models  # noqa: E402
from remat.core import mib  # noqa: E402
from remat.measurement import call_model, compute_loss  # noqa: E402
from remat.solver import min_peak_bytes_over_heads, no_checkpoint_peak_bytes  # noqa: E402
from remat.tune import measure_plan, verified  # noqa: E402

COLUMNS = ("case", "loop", "budget", "plan", "pred MiB", "disp MiB", "alloc MiB",
           "err % (alloc)", "fits", "verified", "pred ms", "meas ms", "loss Δ")
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class Case:
    model: torch.nn.Module
    batch: object
    loss_fn: Callable | None
    loop: remat.Loop
    adamw: bool = False
    profile_options: dict = field(default_factory=dict)  # units=, granularity=, ...


def _reference(name: str, loop: remat.Loop, adamw: bool = False, size: str = "small",
               **overrides) -> Callable[[], Case]:
    def make() -> Case:
        ref = models.build(name, size=size, seed=0, **overrides)
        return Case(ref.model, ref.batch, ref.loss_fn, loop, adamw)

    return make


def _t5(loop: remat.Loop) -> Callable[[], Case]:
    """Hugging Face T5 from a small config: a relative position bias shared by the blocks
    of each stack, and every decoder block takes the encoder's output."""

    def make() -> Case:
        import transformers

        torch.manual_seed(0)
        config = transformers.T5Config(
            d_model=256, d_ff=1024, num_layers=4, num_decoder_layers=4, num_heads=4, d_kv=64,
            vocab_size=4096, decoder_start_token_id=0, pad_token_id=0, use_cache=False)
        model = transformers.T5ForConditionalGeneration(config)
        model.train()
        src = torch.randint(1, 4096, (8, 128))
        labels = torch.randint(1, 4096, (8, 64))
        return Case(model, {"input_ids": src, "labels": labels}, None, loop)

    return make


def _logits_loop_gpt2() -> Case:
    """GPT-2 returning logits to a hand-written loop that keeps them and computes the loss."""
    ref = models.build("hf-gpt2", size="small", seed=0)
    ids = ref.batch["input_ids"]

    def loss_fn(out, _batch) -> torch.Tensor:
        return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    return Case(ref.model, {"input_ids": ids}, loss_fn, remat.Loop())


CASES: dict[str, Callable[[], Case]] = {
    "gpt2-logits": _logits_loop_gpt2,
    "gpt2-trainer-accum2-adamw": _reference(
        "hf-gpt2", remat.Loop(keep_output=False, accumulation_steps=2), adamw=True),
    "gpt2-bf16": _reference("hf-gpt2", remat.Loop(autocast="bfloat16")),
    "llama-plain": _reference("hf-llama", remat.Loop()),
    "llama-bf16-zero-grad-in-place": _reference(
        "hf-llama", remat.Loop(autocast="bfloat16", set_to_none=False), adamw=True),
    "t5-plain": _t5(remat.Loop()),
    "resnet-cnn-plain": _reference("cnn", remat.Loop()),
    # float16 matmuls are slow on CPUs: a smaller GPT.
    "gpt-fp16-scaler": _reference("gpt", remat.Loop(autocast="float16", grad_scaler=True),
                                  adamw=True, size="tiny", batch_size=8, seq_len=128),
}


def rows_for(name: str, repeats: int, make: Callable[[], Case] | None = None
             ) -> list[dict[str, str]]:
    """Profile case ``name`` (built by ``make``, by default ``CASES[name]``) once; solve,
    apply and measure it at each budget."""
    case = (make or CASES[name])()
    optimizer = torch.optim.AdamW(case.model.parameters(), lr=1e-4) if case.adamw else None
    profile = remat.profile(case.model, case.batch, loss_fn=case.loss_fn, loop=case.loop,
                            optimizer=optimizer, **case.profile_options)
    lo, hi = min_peak_bytes_over_heads(profile), no_checkpoint_peak_bytes(profile)
    as_written = _loss(case)
    rows = []
    for fraction in FRACTIONS:
        budget = lo + int(fraction * (hi - lo))
        row = {"case": name, "loop": case.loop.describe(),
               "budget": f"min+{int(100 * fraction)}% ({mib(budget)})"}
        plan = remat.solve(profile, memory_budget=budget)
        remat.apply_plan(case.model, plan)
        try:
            m = remat.measure(case.model, case.batch, loss_fn=case.loss_fn, loop=case.loop,
                              optimizer=optimizer, repeats=repeats)
            planned_loss = _loss(case)
        finally:
            remat.remove_plan(case.model)
        error = (plan.record.predicted_peak_bytes - m.allocator_peak_bytes) / m.allocator_peak_bytes
        row.update({
            "plan": plan.summary(),
            "pred MiB": mib(plan.record.predicted_peak_bytes, 2),
            "disp MiB": mib(m.peak_bytes, 2),
            "alloc MiB": mib(m.allocator_peak_bytes, 2),
            "err % (alloc)": f"{100 * error:+.2f}",
            "fits": "yes" if m.worst_peak_bytes <= budget else "NO",
            "pred ms": f"{plan.record.predicted_time_ms:.0f}",
            "meas ms": f"{m.time_ms:.0f}",
            # The planned step's loss against the model's as written (same seed): 0 where
            # the plan changes no numerics, a summation-order difference with a chunked head.
            "loss Δ": f"{abs(planned_loss - as_written) / max(abs(as_written), 1e-12):.1e}",
        })
        row["verified"], row["_outcome"] = _verify(case, optimizer, profile, plan, budget, m)
        rows.append(row)
        print(" | ".join(rows[-1].values()), flush=True)
    return rows


def _loss(case: Case) -> float:
    """The loss of one forward of ``case``'s loop under grad (a chunked head computes its
    loss only under grad), dropout seeded; the RNG is left as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=getattr(torch, case.loop.autocast or "float32"),
                            enabled=case.loop.autocast is not None):
            loss = compute_loss(call_model(case.model, case.batch), case.batch, case.loss_fn)
    return float(loss.detach())


def _verify(case: Case, optimizer, profile: remat.Profile, plan: remat.Plan, budget: int,
            first: remat.profiler.StepMeasurement) -> tuple[str, str]:
    """What ``remat.solve``'s closed loop makes of ``plan``: a cell (rounds and the measured
    peak) and the outcome: ``"fits"``, ``"over"`` or ``"infeasible"``."""
    readings = iter([first])  # the first plan is measured already

    def measure(candidate: remat.Plan):
        return next(readings, None) or measure_plan(
            case.model, case.batch, candidate, loss_fn=case.loss_fn, optimizer=optimizer,
            loop=case.loop)

    try:
        checked = verified(plan, budget, lambda b: remat.solve(profile, memory_budget=b)
                           .with_(budget_bytes=budget), measure)
    except remat.InfeasibleBudgetError as err:
        return f"infeasible: min {mib(err.min_feasible_bytes, 2)}", "infeasible"
    done = checked.verification
    outcome = "fits" if done.measured_peak_bytes <= budget else "over"
    return f"{done.rounds} round(s), {mib(done.measured_peak_bytes, 2)}", outcome


def report(rows: list[dict[str, str]], *, title: str, command: str, threads: int,
           seconds: float, out: Path) -> None:
    """Write the table of ``rows`` with its summary line to ``out`` (and print it)."""
    errors = [float(r["err % (alloc)"]) for r in rows]
    time_errors = [abs(float(r["pred ms"]) / float(r["meas ms"]) - 1) * 100 for r in rows]
    raw_over = sum(r["fits"] != "yes" for r in rows)
    over_after = sum(r["_outcome"] == "over" for r in rows)
    refused = sum(r["_outcome"] == "infeasible" for r in rows)
    header = (
        f"# {title}\n\n"
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; machine: "
        f"{machine_line(threads)}\n"
        f"- command: `{command}` ({seconds:.0f} s)\n"
        "- peak: one optimizer step of the loop, everything included (parameters, "
        "gradients, optimizer state, activations, what the loop keeps); `disp`: the "
        "dispatch-level meter, `alloc`: the allocator's view (`torch.profiler` memory events), "
        "which the prediction is compared with; `fits`: the higher of the two is within the "
        "budget without verification; `verified`: what `remat.solve`'s closed loop returns "
        "(rounds measured, measured peak), or the smallest feasible budget it reports\n"
        f"- **{len(rows)} plans: predicted peak from {min(errors):+.2f}% to {max(errors):+.2f}% "
        "of the allocator's view; "
        f"{raw_over} above the budget before verification, {over_after} after it (which "
        f"reported {refused} budget(s) infeasible instead); worst step-time error "
        f"{max(time_errors):.1f}%**\n"
        f"- **loss** (`loss Δ`, the planned step's loss against the model's as written, same "
        f"seed, relative): {_loss_line(rows)}\n"
    )
    table = markdown_table(COLUMNS, [[r.get(c, "") for c in COLUMNS] for r in rows])
    write_result(out, "\n".join([header, *table]) + "\n")


def _loss_line(rows: list[dict[str, str]]) -> str:
    exact = [r for r in rows if " head " not in f" {r['plan']} "]
    chunked = [r for r in rows if r not in exact]
    worst = max((float(r["loss Δ"]) for r in chunked), default=0.0)
    equal = sum(float(r["loss Δ"]) == 0 for r in exact)
    return (f"{equal} of {len(exact)} plans without a chunked head equal bitwise; "
            f"{len(chunked)} with one within {worst:.1e}")


def run_cli(cases: dict[str, Callable[[], Case]], *, description: str, title: str,
            script: str) -> None:
    """Parse the command line, measure the chosen ``cases``, write their table."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--cases", nargs="+", default=list(cases), choices=list(cases))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / f"{script}.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    rows = [row for name in args.cases for row in rows_for(name, args.repeats, cases[name])]
    # The command as run, flags included: a figure is reproduced with its flags.
    command = " ".join([f".venv/bin/python benchmarks/{script}.py", *sys.argv[1:]])
    report(rows, title=title, command=command,
           threads=args.threads, seconds=time.perf_counter() - start, out=args.out)


def main() -> None:
    run_cli(CASES, description=__doc__.split("\n\n")[0],
            title="Prediction accuracy in real training loops", script="prediction_accuracy")


if __name__ == "__main__":
    main()

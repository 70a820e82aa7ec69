"""Predictions against the CUDA caching allocator, and planning under the device's limit.

Issue 24, items 2 and 3, in one call of the device (prepared and checked on the CPU with
``--smoke``; the CUDA figures are only ever written from a CUDA run):

* **Predictions.** For Hugging Face GPT-2 (124M) and a Llama-style model of about 1.1B
  parameters built from configs (random weights), bf16 autocast, fused AdamW (the
  Trainer's default), a loop that drops the output, at a batch where activations
  dominate: one profile, five budgets from the smallest feasible peak to no
  checkpointing; each plan applied and one optimizer step measured by ``remat.measure``:
  the predicted peak against ``torch.cuda.max_memory_allocated`` and
  ``max_memory_reserved`` (after ``torch.cuda.empty_cache()``, so what earlier plans left
  cached is not counted), reserved - allocated (the caching allocator's rounding and
  fragmentation), and the predicted step time against CUDA-event timing (median).
* **Under the device's limit.** ``torch.cuda.set_per_process_memory_fraction`` caps the
  process below the unplanned step's predicted peak; the unplanned step is run once to
  show it does not fit, then ``remat.solve`` (profile cache emptied: everything measured
  under the cap) plans for the capacity and the planned loop trains three steps. On the
  CPU (``--smoke``) a :class:`~remat.measurement.simulated_device.SimulatedDevice` plays
  the cap.

Run the allocator's two configurations as two processes (the variable is read when CUDA
starts): ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` is the other. Prints a
markdown table and writes it to benchmarks/results/gpu_predictions-<device>[-expandable].md.

    python3 benchmarks/gpu_predictions.py [--models gpt2 llama-1b] [--repeats 5]
    .venv/bin/python benchmarks/gpu_predictions.py --smoke      # the script itself, on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see peers_run.py

import torch  # noqa: E402
from _common import RESULTS, machine_line, markdown_table, write_result  # noqa: E402

import remat  # noqa: E402
from remat.core import mib  # noqa: E402
from remat.measurement import (
    SimulatedDevice,  # noqa: E402
    resident_bytes,  # noqa: E402
)
from remat.solver import min_peak_bytes_over_heads, no_checkpoint_peak_bytes  # noqa: E402
from remat.tune import forget_profiles  # noqa: E402

COLUMNS = ("model", "budget", "plan", "pred MiB", "alloc MiB", "err % (alloc)",
           "reserved MiB", "reserved - alloc MiB", "reserved / budget", "pred ms", "meas ms",
           "time err %")
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
LOOP = remat.Loop(autocast="bfloat16", keep_output=False)


@dataclass
class Case:
    """A model on the device with its batch and optimizer, and what it is."""

    model: torch.nn.Module
    batch: dict[str, torch.Tensor]
    optimizer: torch.optim.Optimizer
    note: str


def _build(make_config: Callable[[object], object], model_class: str, batch: int, seq: int,
           device: torch.device) -> Case:
    import transformers

    config = make_config(transformers)
    torch.manual_seed(0)
    with torch.device(device):  # made on the device: a 1B model is slow to move there
        model = getattr(transformers, model_class)(config)
    model.train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    params = sum(p.numel() for p in model.parameters())
    note = f"{params / 1e6:.0f}M parameters, batch {batch} x {seq} tokens"
    return Case(model, {"input_ids": ids, "labels": ids}, optimizer, note)


def gpt2(device: torch.device, smoke: bool) -> Case:
    """Hugging Face GPT-2 124M (its default config); ``smoke``: 2 layers of 128."""
    size = dict(n_layer=2, n_embd=128, n_head=4, vocab_size=1000) if smoke else {}
    return _build(lambda t: t.GPT2Config(use_cache=False, **size), "GPT2LMHeadModel",
                  *((4, 128) if smoke else (16, 1024)), device)


def llama_1b(device: torch.device, smoke: bool) -> Case:
    """A Llama-style model of about 1.1B parameters (TinyLlama's shape: 22 layers of 2048,
    grouped-query attention, 4 key/value heads); ``smoke``: 2 layers of 128."""
    shape = (dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000) if smoke else
             dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                  num_attention_heads=32, num_key_value_heads=4, vocab_size=32000))
    return _build(lambda t: t.LlamaConfig(max_position_embeddings=2048, use_cache=False,
                                          **shape),
                  "LlamaForCausalLM", *((4, 128) if smoke else (4, 2048)), device)


MODELS: dict[str, Callable[[torch.device, bool], Case]] = {"gpt2": gpt2, "llama-1b": llama_1b}


def empty_cache(device: torch.device) -> None:
    """Give the caching allocator's free blocks back (CUDA): what a step reserves is then
    its own, not what earlier steps left cached."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def prediction_rows(name: str, case: Case, device: torch.device, repeats: int
                    ) -> tuple[list[dict[str, str]], remat.Profile]:
    """Profile ``case`` once; solve, apply and measure it at each of the five budgets."""
    profile = remat.profile(case.model, case.batch, optimizer=case.optimizer, loop=LOOP)
    lo, hi = min_peak_bytes_over_heads(profile), no_checkpoint_peak_bytes(profile)
    rows = []
    for fraction in FRACTIONS:
        budget = lo + int(fraction * (hi - lo))
        plan = remat.solve(profile, memory_budget=budget)
        remat.apply_plan(case.model, plan)
        empty_cache(device)  # reserved as a training run of this plan alone would see it
        try:
            m = remat.measure(case.model, case.batch, optimizer=case.optimizer, loop=LOOP,
                              repeats=repeats)
        finally:
            remat.remove_plan(case.model)
        predicted, alloc = plan.record.predicted_peak_bytes, m.allocator_peak_bytes
        reserved = m.reserved_peak_bytes
        rows.append({
            "model": name, "budget": f"min+{int(100 * fraction)}% ({mib(budget)})",
            "plan": plan.summary(), "pred MiB": mib(predicted, 1), "alloc MiB": mib(alloc, 1),
            "err % (alloc)": f"{100 * (predicted / alloc - 1):+.2f}",
            "reserved MiB": "n/a" if reserved is None else mib(reserved, 1),
            "reserved - alloc MiB": "n/a" if reserved is None else mib(reserved - alloc, 1),
            "reserved / budget": "n/a" if reserved is None else f"{reserved / budget:.3f}",
            "pred ms": f"{plan.record.predicted_time_ms:.1f}", "meas ms": f"{m.time_ms:.1f}",
            "time err %": f"{100 * (plan.record.predicted_time_ms / m.time_ms - 1):+.1f}",
        })
        print(" | ".join(rows[-1].values()), flush=True)
    return rows, profile


@contextlib.contextmanager
def _device_cap(device: torch.device, cap: int, resident: int):
    """The device holds at most ``cap`` bytes: the per-process fraction on CUDA, a
    :class:`SimulatedDevice` on the CPU. Yields what reads the peak afterwards."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        empty_cache(device)
        torch.cuda.set_per_process_memory_fraction(cap / total, device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            yield lambda: (torch.cuda.max_memory_allocated(device),
                           torch.cuda.max_memory_reserved(device))
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    else:
        with SimulatedDevice(cap, resident_bytes=resident) as simulated:
            yield lambda: (simulated.peak_bytes, None)


def _train(case: Case, steps: int) -> list[float]:
    """``steps`` optimizer steps of LOOP: autocast forward, backward, step, zero_grad."""
    losses = []
    for _ in range(steps):
        with torch.autocast(case.batch["input_ids"].device.type, dtype=torch.bfloat16):
            loss = case.model(**case.batch).loss
        loss.backward()
        case.optimizer.step()
        case.optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
        del loss
    return losses


def under_the_cap(name: str, case: Case, profile: remat.Profile, device: torch.device,
                  at: float) -> dict[str, str]:
    """Cap the device at the smallest feasible peak plus ``at`` of the range up to the
    unplanned step's predicted peak (below it, so the unplanned step cannot fit); run the
    unplanned step (expected: out of memory), then solve for the cap and train."""
    lo, unplanned = min_peak_bytes_over_heads(profile), no_checkpoint_peak_bytes(profile)
    cap = lo + int(at * (unplanned - lo))
    row = {"model": name, "cap MiB": mib(cap, 1), "unplanned (predicted) MiB": mib(unplanned, 1)}
    resident = resident_bytes(case.model, case.optimizer, batch=case.batch, device=device)
    with _device_cap(device, cap, resident):
        try:
            _train(case, 1)
            row["unplanned step"] = "ran (did not need the cap)"
        except torch.OutOfMemoryError:
            row["unplanned step"] = "out of memory"
        case.model.zero_grad(set_to_none=True)
    forget_profiles()  # everything solve() measures, it measures under the cap
    empty_cache(device)
    with _device_cap(device, cap, resident) as peaks:
        start = time.perf_counter()
        try:
            plan = remat.solve(case.model, case.batch, memory_budget=cap,
                               optimizer=case.optimizer, loop=LOOP)
        except remat.RematError as err:
            row.update({"solve": f"{type(err).__name__}: {err}"[:200]})
            return row
        row["solve s"] = f"{time.perf_counter() - start:.1f}"
        solve_peak = peaks()[0]
    row["plan"] = plan.summary()
    row["predicted MiB"] = mib(plan.record.predicted_peak_bytes, 1)
    row["held in solve MiB"] = mib(solve_peak, 1)
    remat.apply_plan(case.model, plan)
    try:
        with _device_cap(device, cap, resident) as peaks:
            try:
                losses = _train(case, 3)
                alloc, reserved = peaks()
                row["planned loop, 3 steps"] = "trained: loss " + " ".join(
                    f"{v:.3f}" for v in losses)
                row["peak MiB (alloc / reserved)"] = (
                    f"{mib(alloc, 1)} / {'n/a' if reserved is None else mib(reserved, 1)}")
            except torch.OutOfMemoryError as err:
                row["planned loop, 3 steps"] = f"OUT OF MEMORY: {str(err)[:160]}"
    finally:
        remat.remove_plan(case.model)
    print(row, flush=True)
    return row


def script_parser(description: str, models: list[str]) -> argparse.ArgumentParser:
    """The options both GPU scripts take: models, repeats, ``--smoke``, ``--out``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--models", nargs="+", default=models, choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny configs, any device: checks the script, writes no result")
    parser.add_argument("--out", type=Path, default=None)
    return parser


def script_device(script: str, smoke: bool) -> torch.device:
    """CUDA, or the CPU for ``--smoke`` (a real run without CUDA stops here)."""
    logging.basicConfig(level=logging.WARNING)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not smoke:
        sys.exit(f"{script}: no CUDA device; --smoke checks the script on the CPU")
    return device


def alloc_conf() -> str:
    """The caching allocator's configuration this process runs with ('' by default)."""
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")


def command_line(script: str) -> str:
    """The command as run, the allocator's configuration and the flags included."""
    conf = alloc_conf()
    return " ".join([*([f"PYTORCH_CUDA_ALLOC_CONF={conf}"] if conf else []),
                     f"python3 benchmarks/{script}", *sys.argv[1:]])


def device_slug() -> str:
    """``h100`` for an 'NVIDIA H100 80GB HBM3': the results' file names."""
    return torch.cuda.get_device_name().replace("NVIDIA ", "").split()[0].lower()


def main() -> None:
    parser = script_parser(__doc__.split("\n\n")[0], list(MODELS))
    parser.add_argument("--cap-at", type=float, default=0.25,
                        help="the device cap: the smallest feasible peak plus this share of "
                             "the range up to the unplanned step's predicted peak")
    args = parser.parse_args()
    device = script_device("gpu_predictions", args.smoke)
    start = time.perf_counter()
    rows, capped = [], []
    for name in args.models:
        case = MODELS[name](device, args.smoke)
        print(f"== {name}: {case.note}", flush=True)
        case_rows, profile = prediction_rows(name, case, device, args.repeats)
        rows += [{**r, "model": f"{name} ({case.note})"} for r in case_rows]
        capped.append(under_the_cap(name, case, profile, device, args.cap_at))
        del case, profile
        empty_cache(device)
    conf, command = alloc_conf(), command_line("gpu_predictions.py")
    errors = [float(r["err % (alloc)"]) for r in rows]
    header = (
        "# Predictions against the CUDA allocator\n\n"
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; machine: "
        f"{machine_line()}; allocator config: `{conf or 'default'}`\n"
        f"- command: `{command}` ({time.perf_counter() - start:.0f} s)\n"
        "- loop: bf16 autocast, fused AdamW, output dropped; peak: one optimizer step, "
        "everything included; `alloc`: `torch.cuda.max_memory_allocated`, `reserved`: "
        "`torch.cuda.max_memory_reserved` after `empty_cache()`; times: CUDA events, median "
        f"of {args.repeats} steps\n"
        f"- **{len(rows)} plans: predicted peak from {min(errors):+.2f}% to "
        f"{max(errors):+.2f}% of max_memory_allocated**\n")
    table = markdown_table(COLUMNS, [[r[c] for c in COLUMNS] for r in rows])
    cap_columns = sorted({k for row in capped for k in row}, key=_cap_order)
    cap_table = markdown_table(cap_columns, [[row.get(c, "") for c in cap_columns]
                                             for row in capped])
    cap_title = ("## Under a device cap below the unplanned step: the smallest feasible "
                 f"peak + {args.cap_at:.0%} of the range")
    text = "\n".join([header, *table, "", cap_title, "", *cap_table]) + "\n"
    if args.smoke:
        print(text)
        return
    suffix = "-expandable" if "expandable_segments:True" in conf else ""
    write_result(args.out or RESULTS / f"gpu_predictions-{device_slug()}{suffix}.md", text)


_CAP_ORDER = ("model", "cap MiB", "unplanned (predicted) MiB", "unplanned step", "solve",
              "solve s", "plan", "predicted MiB", "held in solve MiB", "planned loop, 3 steps",
              "peak MiB (alloc / reserved)")


def _cap_order(column: str) -> int:
    return _CAP_ORDER.index(column) if column in _CAP_ORDER else len(_CAP_ORDER)


if __name__ == "__main__":
    main()

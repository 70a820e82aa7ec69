"""remat against its peers, side by side in one run: peak memory and step time per budget.

For each reference model and each budget fraction f of the no-checkpoint
activation memory (``remat.api.activation_budget(profile, f)``: persistent bytes
+ f x (no-checkpoint peak - persistent); budgets are absolute step peaks), this
script measures:

* no checkpointing (the eager reference),
* remat optimal at each budget and remat chen (no budget), applied with
  ``remat.apply_plan`` and removed afterwards,
* ``torch.utils.checkpoint.checkpoint_sequential(use_reentrant=False)`` at
  k = 2, 4, ..., n segments, where the units are an ``nn.Sequential`` (mlp, cnn),
* Hugging Face ``gradient_checkpointing_enable`` (every block; hf-gpt2),
* ``torch.compile`` with ``torch._functorch.config.activation_memory_budget`` = f
  and 1.0 (the compiled reference), one compile per budget,
* remat optimal + torch.compile: at each budget, the plan ``solve(...,
  compiled=True)`` picks (the fastest optimal-frontier plan and inductor
  activation_memory_budget whose compiled step fits, found by compiling a few
  candidates), applied to a copy that is then compiled at that budget.

Every method runs on its own deep copy of one pristine model, with the same batch.
Peaks include the persistent bytes (parameters, buffers and, allocated in the
step, gradients). Two instruments: the dispatch-level meter
(:class:`remat.meter.MemoryMeter`, remat's own; blind to compiled code) and the
allocator view (``remat/allocator.py``). "Budget met" uses the dispatch
figure for eager methods and the allocator figure for compiled ones (both
torch.compile and remat optimal + torch.compile).

Usage::

    .venv/bin/python benchmarks/peers.py                # full run: 8-12 min on 2 cores, cold cache
    .venv/bin/python benchmarks/peers.py --no-remat-compile  # without remat + torch.compile
    .venv/bin/python benchmarks/peers.py --quick        # tiny models, a smoke test
    .venv/bin/python benchmarks/peers.py --models mlp,cnn --budgets 0.5 --no-compile
"""

# ruff: noqa: E402  (the environment must be set before torch is imported)
from __future__ import annotations

import os

# On a shared 2-core machine, spinning OpenMP workers (torch's pool and the compiled
# kernels' own) starve each other: with the default active wait, eager steps ran 3-5x
# slower and a tiny compiled MLP took ~700 ms a step instead of ~1 ms. Passive waiting
# is fair to every method.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import copy
import datetime as dt
import logging
import platform
import shlex
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch._functorch.config  # must be imported before activation_memory_budget is set
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

import remat
from remat.allocator import allocator_peak
from remat.api import activation_budget
from remat.compiled import solve_compiled
from remat.errors import InfeasibleBudgetError
from remat.meter import MemoryMeter, storage_bytes
from remat.models import ReferenceModel, build

MIB = 2**20
RESULTS = Path(__file__).resolve().parent / "results"
REPO = str(Path(__file__).resolve().parent.parent)
DEFAULT_MODELS = ("mlp", "cnn", "gpt", "hf-gpt2")
DEFAULT_BUDGETS = (0.3, 0.5, 0.7)

# Model sizes for the full run, tuned so that the whole script (4 models, 3 budgets,
# 4 torch.compile compiles per model plus one per feasible remat optimal plan) finishes
# within ~15 minutes on 2 CPU cores.
FULL_SIZES: dict[str, dict[str, Any]] = {
    # width 256, batch 4096: activations (~8 MiB a block) dwarf the weights, so there is
    # something to checkpoint (at width 1024, batch 512 the gradients set the peak).
    "mlp": {"size": "small", "depth": 16, "width": 256, "batch_size": 4096},
    "cnn": {"size": "small", "batch_size": 32},
    "gpt": {"size": "small", "depth": 4, "batch_size": 8, "dropout": 0.0},
    "hf-gpt2": {"size": "small", "depth": 4, "batch_size": 8, "dropout": 0.0},
}
QUICK_SIZES: dict[str, dict[str, Any]] = {name: {"size": "tiny"} for name in DEFAULT_MODELS}

# Families of methods; the ratio table compares remat optimal with the peers.
EAGER, COMPILED = "eager", "compiled"
PEER_METHODS = ("checkpoint_sequential", "HF gradient checkpointing", "torch.compile")
# remat's plan for compiled training (solve(..., compiled=True)), applied and then compiled.
REMAT_COMPILED = "remat optimal + torch.compile"
METHOD_ORDER = ("none", "remat optimal", "remat chen", *PEER_METHODS, REMAT_COMPILED)
NOT_APPLICABLE = {
    "checkpoint_sequential": (
        "n/a: the blocks are an nn.ModuleList driven by the model's own forward loop; "
        "checkpoint_sequential needs the units to be one nn.Sequential it can call in order"
    ),
    "HF gradient checkpointing": "n/a: only Hugging Face models have gradient_checkpointing_enable",
}


# --------------------------------------------------------------------------- data
@dataclass
class Variant:
    """One way of training one model, ready to step."""

    method: str
    setting: str
    family: str
    model: nn.Module
    budget_fraction: float | None = None
    predicted_peak_bytes: int | None = None
    teardown: Callable[[], None] = lambda: None
    plan: remat.Plan | None = None


@dataclass
class Row:
    """The measured result of one variant (or why there is none)."""

    model: str
    method: str
    setting: str
    family: str
    budget_fraction: float | None = None
    budget_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    peak_dispatch_bytes: int | None = None
    peak_allocator_bytes: int | None = None
    step_ms: float | None = None
    step_ms_all: list[float] = field(default_factory=list)
    step_cpu_ms: float | None = None
    step_cpu_ms_all: list[float] = field(default_factory=list)
    overhead_pct: float | None = None
    met_instrument: str = ""
    met: dict[float, bool] = field(default_factory=dict)
    compile_s: float | None = None
    note: str = ""

    @property
    def judged_peak(self) -> int | None:
        """The peak that decides "budget met": dispatch (eager) or allocator (compiled)."""
        if self.family == COMPILED:
            return self.peak_allocator_bytes
        return self.peak_dispatch_bytes


@dataclass
class ModelResult:
    """Everything measured for one model."""

    name: str
    description: str
    n_units: int
    fixed_bytes: int
    grad_bytes: int
    budgets: dict[float, int]
    predicted_no_ckpt_peak: int
    profile_s: float
    rows: list[Row]
    not_applicable: dict[str, str]


# --------------------------------------------------------------------------- stepping
def call_model(model: nn.Module, batch: Any) -> Any:
    """``model(batch)``, ``model(*batch)`` or ``model(**batch)`` by the batch's type."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, tuple):
        return model(*batch)
    return model(batch)


def make_step(ref: ReferenceModel, model: nn.Module) -> Callable[[], None]:
    """One forward and backward pass of ``model`` on ``ref``'s batch (no optimizer).

    Like an ordinary training loop (and ``remat.measure``), only the loss outlives
    the forward: the output (logits...) is not held through the backward pass.
    """

    def loss_of(out: Any) -> torch.Tensor:
        return ref.loss_fn(out, ref.batch) if ref.loss_fn is not None else out.loss

    def step() -> None:
        loss = loss_of(call_model(model, ref.batch))
        loss.backward()

    return step


def clear_grads(model: nn.Module) -> None:
    """Drop the gradients so that every measured step allocates them afresh."""
    for p in model.parameters():
        p.grad = None


def persistent_bytes(model: nn.Module) -> int:
    """Bytes of the distinct parameter and buffer storages (tied weights once)."""
    return storage_bytes(list(model.parameters()) + list(model.buffers()))


def dispatch_peak(model: nn.Module, step: Callable[[], None]) -> int:
    """Peak of one step on the dispatch-level meter, persistent bytes included."""
    clear_grads(model)
    with MemoryMeter() as meter:
        step()
    return persistent_bytes(model) + meter.peak_bytes


def allocator_step_peak(model: nn.Module, step: Callable[[], None]) -> int:
    """Peak of one step on the allocator view, persistent bytes included."""
    clear_grads(model)
    device = next(model.parameters()).device.type
    return persistent_bytes(model) + allocator_peak(step, device_type=device)


def timed_step(model: nn.Module, step: Callable[[], None]) -> tuple[float, float]:
    """Wall and process CPU time of one step, in ms (gradients dropped first, untimed).

    The CPU time (all threads of this process) is less sensitive than the wall time
    to other processes sharing the cores; it is recorded beside it.
    """
    clear_grads(model)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start, cpu_start = time.perf_counter(), time.process_time()
    step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3, (time.process_time() - cpu_start) * 1e3


def record_times(row: Row, times: Sequence[tuple[float, float]]) -> None:
    """Store the timed steps of a row and their medians."""
    row.step_ms_all = [wall for wall, _ in times]
    row.step_cpu_ms_all = [cpu for _, cpu in times]
    row.step_ms = statistics.median(row.step_ms_all)
    row.step_cpu_ms = statistics.median(row.step_cpu_ms_all)


# --------------------------------------------------------------------------- peers
class CheckpointedSequential(nn.Module):
    """Run an ``nn.Sequential`` through ``checkpoint_sequential`` with ``segments`` segments.

    Note ``checkpoint_sequential`` checkpoints every segment but the last, which
    runs normally; so k = 1 is no checkpointing at all.
    """

    def __init__(self, seq: nn.Sequential, segments: int) -> None:
        super().__init__()
        self.seq = seq
        self.segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The wrapped sequence's forward, checkpointed segment by segment."""
        return checkpoint_sequential(self.seq, self.segments, x, use_reentrant=False)


def sequential_units(name: str, model: nn.Module) -> tuple[nn.Module, nn.Sequential] | None:
    """``(owner, sequential)`` for the models whose units form one ``nn.Sequential``."""
    if name == "mlp" and isinstance(model, nn.Sequential):
        return model, model
    if name == "cnn" and isinstance(getattr(model, "blocks", None), nn.Sequential):
        return model, model.blocks
    return None


def segment_counts(n: int) -> list[int]:
    """k = 2, 4, 8, ... below n, then n (k = 1 would checkpoint nothing)."""
    ks, k = [], 2
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n] if n >= 2 else []


def checkpoint_sequential_variant(name: str, pristine: nn.Module, k: int) -> Variant:
    """A copy of the model whose sequential units run through ``checkpoint_sequential(k)``."""
    model = copy.deepcopy(pristine)
    if name == "mlp":
        wrapped: nn.Module = CheckpointedSequential(model, k)
    else:
        model.blocks = CheckpointedSequential(model.blocks, k)
        wrapped = model
    return Variant("checkpoint_sequential", f"k={k}", EAGER, wrapped)


def hf_variant(pristine: nn.Module) -> Variant:
    """A copy of a Hugging Face model with gradient checkpointing on every block."""
    model = copy.deepcopy(pristine)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return Variant("HF gradient checkpointing", "every block", EAGER, model)


def remat_variant(pristine: nn.Module, plan: remat.Plan, method: str, setting: str,
                  fraction: float | None) -> Variant:
    """A copy of the model with ``plan`` applied; its teardown removes the plan."""
    model = copy.deepcopy(pristine)
    remat.apply_plan(model, plan)

    def teardown() -> None:
        remat.remove_plan(model)
        left = overridden_forwards(model) - overridden_forwards(pristine)
        if left:
            raise RuntimeError(f"remat.remove_plan left wrapped forwards on {sorted(left)}")

    return Variant(method, setting, EAGER, model, budget_fraction=fraction,
                   predicted_peak_bytes=plan.predicted_peak_bytes, teardown=teardown, plan=plan)


def overridden_forwards(model: nn.Module) -> set[str]:
    """Names of the submodules with an instance-level ``forward`` (what apply_plan installs)."""
    return {name for name, m in model.named_modules() if "forward" in vars(m)}


@contextmanager
def activation_memory_budget(fraction: float) -> Iterator[None]:
    """Set ``torch._functorch.config.activation_memory_budget`` for the block."""
    previous = torch._functorch.config.activation_memory_budget
    torch._functorch.config.activation_memory_budget = fraction
    try:
        yield
    finally:
        torch._functorch.config.activation_memory_budget = previous


# --------------------------------------------------------------------------- measuring
def measure_memory(v: Variant, step: Callable[[], None], row: Row, warmup: int) -> None:
    """Warm a variant up, then read its peak on both instruments into ``row``."""
    for _ in range(warmup):
        timed_step(v.model, step)
    row.peak_dispatch_bytes = dispatch_peak(v.model, step)
    row.peak_allocator_bytes = allocator_step_peak(v.model, step)
    print(f"  {v.method} {v.setting}: dispatch {mib(row.peak_dispatch_bytes)} MiB, "
          f"allocator {mib(row.peak_allocator_bytes)} MiB", flush=True)


def measure_eager(variants: Sequence[Variant], ref: ReferenceModel, repeats: int, warmup: int,
                  failures: list[str]) -> list[Row]:
    """Memory of each eager variant, then step times taken round-robin across them.

    A variant whose step raises is reported in ``failures`` and left out of the timing.
    """
    steps = [make_step(ref, v.model) for v in variants]
    rows = [Row(ref.name, v.method, v.setting, v.family, budget_fraction=v.budget_fraction,
                predicted_peak_bytes=v.predicted_peak_bytes) for v in variants]
    ok: list[int] = []
    for i, (v, step, row) in enumerate(zip(variants, steps, rows)):
        run_guarded(f"{ref.name} {v.method} {v.setting}",
                    lambda v=v, step=step, row=row: measure_memory(v, step, row, warmup), failures)
        if row.peak_allocator_bytes is None:
            row.note = "the step failed (see Failures)"
            continue
        ok.append(i)
    times: dict[int, list[tuple[float, float]]] = {i: [] for i in ok}
    for r in range(repeats):
        rotated = ok[r % len(ok):] + ok[: r % len(ok)] if ok else []  # no position bias
        for i in rotated:
            times[i].append(timed_step(variants[i].model, steps[i]))
    for i in ok:
        record_times(rows[i], times[i])
    return rows


DISPATCH_NA = "dispatch meter n/a: compiled code runs eagerly under a dispatch mode"


def dynamo_counts() -> tuple[int, int]:
    """Dynamo's running totals: graphs compiled and graph breaks."""
    counters = torch._dynamo.utils.counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


class RecompileLimitHits(logging.Handler):
    """Collects dynamo's "hit config.recompile_limit" warnings.

    Past the limit, dynamo runs the named function eagerly from then on, which is
    how a compiled model can end up with no graph at all; the note says so.
    """

    LOGGER = "torch._dynamo.convert_frame"

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if str(record.msg).startswith("torch._dynamo hit config.") and len(args) >= 3:
            limit, value, function = args[:3]
            hit = f"{limit} ({value}) in {str(function).replace(f'{REPO}/', '')}"
            if hit not in self.hits:
                self.hits.append(hit)

    def __enter__(self) -> RecompileLimitHits:
        logging.getLogger(self.LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger(self.LOGGER).removeHandler(self)


def compile_note(compile_s: float, graphs: int, breaks: int, limit_hits: Sequence[str]) -> str:
    """The note of a compiled row: compile time, graphs, and recompile limits hit."""
    note = (f"{DISPATCH_NA}; first step (compile) {compile_s:.0f} s; "
            f"{graphs} graph{'s' if graphs != 1 else ''}, {breaks} graph breaks")
    if graphs == 0:
        note += " (ran eagerly)"
    if limit_hits:
        note += "; dynamo hit " + ", ".join(limit_hits) + ": later calls ran eagerly"
    return note


def run_compiled(row: Row, ref: ReferenceModel, model: nn.Module, repeats: int,
                 warmup: int) -> None:
    """``torch.compile(model)``: compile time, allocator peak and step times into ``row``.

    Dynamo is reset before and after, so each compile starts from nothing and the
    next one does not find this one's guards. The note says how many graphs (and
    graph breaks) the model compiled to, and which recompile limits it hit.
    """
    torch._dynamo.reset()
    graphs0, breaks0 = dynamo_counts()
    try:
        with RecompileLimitHits() as limits:
            step = make_step(ref, torch.compile(model))
            row.compile_s = timed_step(model, step)[0] / 1e3  # the first step compiles
            for _ in range(max(warmup, 1)):
                timed_step(model, step)
            row.peak_allocator_bytes = allocator_step_peak(model, step)
            record_times(row, [timed_step(model, step) for _ in range(repeats)])
        graphs, breaks = (now - then for now, then in zip(dynamo_counts(), (graphs0, breaks0)))
    finally:
        torch._dynamo.reset()
    row.note = compile_note(row.compile_s, graphs, breaks, limits.hits)
    print(f"  {row.method} {row.setting}: allocator {mib(row.peak_allocator_bytes)} MiB, "
          f"{row.step_ms:.0f} ms, compile {row.compile_s:.0f} s, {graphs} graphs", flush=True)


def measure_compiled(ref: ReferenceModel, pristine: nn.Module, fraction: float, repeats: int,
                     warmup: int) -> Row:
    """Compile a copy at ``activation_memory_budget=fraction``; its allocator peak and times."""
    row = Row(ref.name, "torch.compile", f"budget={fraction:g}", COMPILED,
              budget_fraction=fraction if fraction < 1.0 else None)
    with activation_memory_budget(fraction):
        run_compiled(row, ref, copy.deepcopy(pristine), repeats, warmup)
    return row


def measure_remat_compiled(ref: ReferenceModel, pristine: nn.Module, profile: remat.Profile,
                           budget: int, fraction: float, repeats: int, warmup: int) -> Row:
    """remat's plan for compiled training at ``fraction``, applied to a copy, then compiled.

    The plan comes from ``solve(..., compiled=True)`` (:mod:`remat.compiled`): the
    fastest (frontier plan, inductor ``activation_memory_budget``) whose compiled
    step fits the budget, measured. It is compiled at that partitioner budget, as
    :func:`remat.compiled.compile_planned` would. A search that finds no fitting
    plan, or a plan that does not compile, becomes a row whose note says why.
    """
    def fresh(setting: str, plan: remat.Plan | None = None) -> Row:
        return Row(ref.name, REMAT_COMPILED, setting, COMPILED, budget_fraction=fraction,
                   predicted_peak_bytes=plan.compiled_peak_bytes if plan else None)

    try:
        t0 = time.perf_counter()
        plan = solve_compiled(copy.deepcopy(pristine), ref.batch, profile, budget,
                              loss_fn=ref.loss_fn)
        search_s = time.perf_counter() - t0
    except InfeasibleBudgetError as exc:
        row = fresh(f"f={fraction:g}: compiled search")
        row.note = f"no plan fits compiled: smallest measured {mib(exc.min_feasible_bytes)} MiB"
        return row
    setting = f"f={fraction:g}: {plan.summary()}; amb={plan.activation_memory_budget:g}"
    row = fresh(setting, plan)
    model = remat.apply_plan(copy.deepcopy(pristine), plan)
    try:
        with activation_memory_budget(plan.activation_memory_budget):
            run_compiled(row, ref, model, repeats, warmup)
    # Dynamo and inductor can raise almost anything (Unsupported, BackendCompilerFailed,
    # InternalTorchDynamoError, RuntimeError from a generated kernel...): whichever it
    # is, it is this row's result, recorded in its note, and the benchmark goes on.
    except Exception as exc:
        print(f"!! {ref.name} {REMAT_COMPILED} f={fraction:g} failed:\n"
              f"{traceback.format_exc()}", flush=True)
        row = fresh(setting, plan)
        row.note = f"compile failed: {exception_text(exc)}"
        return row
    row.note = f"compiled search {search_s:.0f} s; " + row.note
    return row


def exception_text(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, shortened and safe in a markdown table cell."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_guarded(label: str, fn: Callable[[], Any], failures: list[str]) -> Any:
    """``fn()``; on an exception print its traceback, note it in ``failures``, return None."""
    try:
        return fn()
    except Exception:  # a broken method must not stop the others; it is reported
        text = traceback.format_exc()
        print(f"!! {label} failed:\n{text}", flush=True)
        failures.append(f"{label}:\n{text}")
        return None


# --------------------------------------------------------------------------- one model
def solve_optimal(profile: remat.Profile, budget: int) -> remat.Plan | InfeasibleBudgetError:
    """remat's optimal plan for ``budget``, or the infeasibility error (it carries the floor)."""
    try:
        return remat.solve(profile, memory_budget=budget)
    except InfeasibleBudgetError as exc:
        return exc


def remat_variants(
    ref: ReferenceModel, pristine: nn.Module, profile: remat.Profile, budgets: dict[float, int],
    failures: list[str],
) -> tuple[list[Variant], list[Row]]:
    """remat optimal at each budget and remat chen; unmeasurable ones become rows with a note."""
    variants: list[Variant] = []
    rows: list[Row] = []
    jobs: list[tuple[str, str, float | None, Callable[[], Any]]] = [
        ("remat optimal", f"f={f:g}", f, lambda b=b: solve_optimal(profile, b))
        for f, b in budgets.items()
    ]
    jobs.append(("remat chen", "", None, lambda: remat.solve(profile, method="chen")))
    for method, setting, f, solve in jobs:
        label = f"{ref.name} {method} {setting}".rstrip()
        plan = run_guarded(f"{label}: solve", solve, failures)
        if plan is None or isinstance(plan, InfeasibleBudgetError):
            note = ("solve failed (see Failures)" if plan is None else
                    f"infeasible: min feasible peak {mib(plan.min_feasible_bytes)} MiB")
            rows.append(Row(ref.name, method, setting, EAGER, budget_fraction=f, note=note))
            continue
        full = f"{setting}: {plan.summary()}" if setting else plan.summary()
        v = run_guarded(f"{label}: apply_plan",
                        lambda plan=plan, full=full, f=f, method=method:
                        remat_variant(pristine, plan, method, full, f), failures)
        if v is None:
            rows.append(Row(ref.name, method, full, EAGER, budget_fraction=f,
                            note="apply_plan failed (see Failures)"))
        else:
            variants.append(v)
    return variants, rows


def peer_variants(ref: ReferenceModel, pristine: nn.Module) -> tuple[list[Variant], dict[str, str]]:
    """The eager peers that apply to this model, and why the others do not."""
    variants: list[Variant] = []
    not_applicable: dict[str, str] = {}
    units = sequential_units(ref.name, pristine)
    if units is None:
        not_applicable["checkpoint_sequential"] = NOT_APPLICABLE["checkpoint_sequential"]
    else:
        for k in segment_counts(len(units[1])):
            variants.append(checkpoint_sequential_variant(ref.name, pristine, k))
    if hasattr(pristine, "gradient_checkpointing_enable"):
        variants.append(hf_variant(pristine))
    else:
        not_applicable["HF gradient checkpointing"] = NOT_APPLICABLE["HF gradient checkpointing"]
    return variants, not_applicable


def compiled_rows(ref: ReferenceModel, pristine: nn.Module, fractions: Sequence[float],
                  profile: remat.Profile, budgets: dict[float, int], repeats: int, warmup: int,
                  remat_compile: bool, failures: list[str]) -> list[Row]:
    """torch.compile at budget 1.0 and each fraction, then remat's compiled plan at each."""
    jobs: list[tuple[str, Callable[[], Row]]] = [
        (f"torch.compile budget={f:g}",
         lambda f=f: measure_compiled(ref, pristine, f, repeats, warmup))
        for f in (1.0, *fractions)
    ]
    if remat_compile:
        jobs += [(f"{REMAT_COMPILED} f={f:g}",
                  lambda f=f: measure_remat_compiled(ref, pristine, profile, budgets[f], f,
                                                     repeats, warmup))
                 for f in fractions]
    rows = [run_guarded(f"{ref.name} {label}", job, failures) for label, job in jobs]
    return [row for row in rows if row is not None]


def run_model(name: str, sizes: dict[str, Any], fractions: Sequence[float], repeats: int,
              warmup: int, compile_: bool, remat_compile: bool,
              failures: list[str]) -> ModelResult:
    """Measure every method on one model."""
    overrides = dict(sizes)
    size = overrides.pop("size", "small")
    ref = build(name, size=size, seed=0, **overrides)
    pristine = copy.deepcopy(ref.model)
    print(f"\n== {name}: {ref.description}", flush=True)

    t0 = time.perf_counter()
    profile = remat.profile(copy.deepcopy(pristine), ref.batch, loss_fn=ref.loss_fn)
    profile_s = time.perf_counter() - t0
    budgets = {f: activation_budget(profile, f) for f in fractions}
    no_ckpt = remat.simulate(profile, remat.Plan.keep_all([u.name for u in profile.units]))
    print(f"  profiled {profile.n} units in {profile_s:.1f} s; budgets "
          + ", ".join(f"{f:.0%}={mib(b)} MiB" for f, b in budgets.items()), flush=True)

    eager = [Variant("none", "no checkpointing", EAGER, copy.deepcopy(pristine))]
    ours, rows = remat_variants(ref, pristine, profile, budgets, failures)
    peers, not_applicable = peer_variants(ref, pristine)
    eager += ours + peers
    measured = run_guarded(f"{name} eager methods",
                           lambda: measure_eager(eager, ref, repeats, warmup, failures),
                           failures) or []
    for v in eager:
        run_guarded(f"{name} {v.method} teardown", v.teardown, failures)
    rows = measured + rows
    if compile_:
        rows += compiled_rows(ref, pristine, fractions, profile, budgets, repeats, warmup,
                              remat_compile, failures)
    rows.sort(key=lambda r: METHOD_ORDER.index(r.method))  # stable: settings keep their order
    finish_rows(rows, budgets)
    return ModelResult(name, ref.description, profile.n, profile.fixed_bytes,
                       profile.grad_bytes, budgets, no_ckpt.peak_bytes, profile_s, rows,
                       not_applicable)


def finish_rows(rows: list[Row], budgets: dict[float, int]) -> None:
    """Fill in budgets, overheads and which budgets each row meets."""
    eager_ref = next((r.step_ms for r in rows if r.method == "none"), None)
    compiled_ref = next((r.step_ms for r in rows
                         if r.method == "torch.compile" and r.budget_fraction is None), None)
    for row in rows:
        if row.budget_fraction is not None:
            row.budget_bytes = budgets.get(row.budget_fraction)
        ref_ms = compiled_ref if row.family == COMPILED else eager_ref
        if row.step_ms is not None and ref_ms:
            row.overhead_pct = 100.0 * (row.step_ms / ref_ms - 1.0)
        row.met_instrument = "allocator" if row.family == COMPILED else "dispatch"
        if row.judged_peak is not None:
            row.met = {f: row.judged_peak <= b for f, b in budgets.items()}


# --------------------------------------------------------------------------- reporting
def mib(n: int | None) -> str:
    """Bytes as MiB (one decimal; three below 10 MiB), or a dash."""
    if n is None:
        return "—"
    return f"{n / MIB:.1f}" if abs(n) >= 10 * MIB else f"{n / MIB:.3f}"


def met_text(row: Row) -> str:
    """"yes"/"no" against the row's own budget, else the budgets it meets."""
    if not row.met:
        return "—"
    if row.budget_fraction is not None:
        return "yes" if row.met.get(row.budget_fraction) else "no"
    ok = [f"{f:.0%}" for f, met in row.met.items() if met]
    return "meets " + (", ".join(ok) if ok else "none")


def budget_text(row: Row) -> str:
    """The row's budget as "50% (123.4 MiB)", or a dash."""
    if row.budget_fraction is None:
        return "—"
    return f"{row.budget_fraction:.0%} ({mib(row.budget_bytes)} MiB)"


def model_table(res: ModelResult) -> list[str]:
    """The markdown table of one model."""
    lines = [
        "| method | setting | budget | peak MiB (dispatch) | peak MiB (allocator) | "
        "predicted MiB | step ms | cpu ms | overhead % | met (instrument) | note |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in res.rows:
        overhead = "—" if r.overhead_pct is None else f"{r.overhead_pct:+.1f}"
        step = "—" if r.step_ms is None else f"{r.step_ms:.0f}"
        cpu = "—" if r.step_cpu_ms is None else f"{r.step_cpu_ms:.0f}"
        met = f"{met_text(r)} ({r.met_instrument})" if r.met else met_text(r)
        lines.append(
            f"| {r.method} | {r.setting} | {budget_text(r)} | {mib(r.peak_dispatch_bytes)} | "
            f"{mib(r.peak_allocator_bytes)} | {mib(r.predicted_peak_bytes)} | {step} | {cpu} | "
            f"{overhead} | {met} | {r.note} |"
        )
    for method, why in res.not_applicable.items():
        lines.append(f"| {method} | — | — | — | — | — | — | — | — | — | {why} |")
    return lines


@dataclass(frozen=True)
class Ratio:
    """remat optimal's step time against the fastest peer meeting the same budget.

    ``best`` is the faster of remat optimal (eager) and remat optimal + torch.compile
    among those that meet the budget.
    """

    model: str
    fraction: float
    budget_bytes: int
    ours: Row | None
    peer: Row | None
    eager_peer: Row | None
    best: Row | None = None

    @property
    def remat_ms(self) -> float | None:
        return self.ours.step_ms if self.ours else None

    @property
    def remat_met(self) -> bool | None:
        return self.ours.met.get(self.fraction) if self.ours and self.ours.met else None

    @property
    def ratio(self) -> float | None:
        return _ratio(self.ours, self.peer, "step_ms")

    @property
    def eager_ratio(self) -> float | None:
        return _ratio(self.ours, self.eager_peer, "step_ms")

    @property
    def cpu_ratio(self) -> float | None:
        return _ratio(self.ours, self.peer, "step_cpu_ms")

    @property
    def eager_cpu_ratio(self) -> float | None:
        return _ratio(self.ours, self.eager_peer, "step_cpu_ms")

    @property
    def best_ratio(self) -> float | None:
        return _ratio(self.best, self.peer, "step_ms")

    @property
    def best_cpu_ratio(self) -> float | None:
        return _ratio(self.best, self.peer, "step_cpu_ms")


def _ratio(a: Row | None, b: Row | None, column: str) -> float | None:
    """``a.column / b.column``, or None when either is missing."""
    x = getattr(a, column, None) if a else None
    y = getattr(b, column, None) if b else None
    return None if x is None or not y else x / y


def fastest(rows: Sequence[Row], fraction: float) -> Row | None:
    """The fastest (median wall time) of ``rows`` that meets budget ``fraction``."""
    ok = [r for r in rows if r.met.get(fraction) and r.step_ms is not None]
    return min(ok, key=lambda r: r.step_ms, default=None)


def ratios(res: ModelResult) -> list[Ratio]:
    """One :class:`Ratio` per budget of a model."""
    peers = [r for r in res.rows if r.method in PEER_METHODS]
    eager_peers = [r for r in peers if r.family == EAGER]
    out = []
    for f, budget in res.budgets.items():
        ours, ours_compiled = (next((r for r in res.rows
                                     if r.method == method and r.budget_fraction == f), None)
                               for method in ("remat optimal", REMAT_COMPILED))
        best = fastest([r for r in (ours, ours_compiled) if r is not None], f)
        out.append(Ratio(res.name, f, budget, ours, fastest(peers, f), fastest(eager_peers, f),
                         best))
    return out


NO_EAGER = "no eager peer meets it"
NO_REMAT = "neither meets it"


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def _peer_cells(peer: Row | None, wall: float | None, cpu: float | None, none_text: str,
                name: Callable[[Row], str] = lambda r: f"{r.method} {r.setting}") -> str:
    """``name | ms | ratio (cpu ratio)`` cells for one peer column group."""
    if peer is None:
        return f"{none_text} | — | —"
    return (f"{name(peer)} | {_fmt(peer.step_ms, '.0f')} | "
            f"{_fmt(wall, '.2f')} ({_fmt(cpu, '.2f')})")


def _best_name(row: Row) -> str:
    """Which of remat optimal's two forms was the faster: eager or compiled."""
    return "+ torch.compile" if row.method == REMAT_COMPILED else "eager"


def ratio_table(all_ratios: Sequence[Ratio]) -> list[str]:
    """The markdown table of remat optimal / fastest peer meeting the same budget."""
    lines = [
        "| model | budget | remat optimal ms (met) | fastest peer meeting it | peer ms | "
        "remat / peer: wall (cpu) | fastest eager peer meeting it | eager peer ms | "
        "remat / eager peer: wall (cpu) | faster remat optimal meeting it (eager or + "
        "torch.compile) | its ms | it / fastest peer: wall (cpu) |",
        "|---|---|---:|---|---:|---:|---|---:|---:|---|---:|---:|",
    ]
    for q in all_ratios:
        if q.remat_ms is None:
            ours = q.ours.note if q.ours else "not measured"
        else:
            ours = f"{q.remat_ms:.0f} ({'yes' if q.remat_met else 'no'})"
        lines.append(
            f"| {q.model} | {q.fraction:.0%} ({mib(q.budget_bytes)} MiB) | {ours} | "
            f"{_peer_cells(q.peer, q.ratio, q.cpu_ratio, 'no peer meets it')} | "
            f"{_peer_cells(q.eager_peer, q.eager_ratio, q.eager_cpu_ratio, NO_EAGER)} | "
            f"{_peer_cells(q.best, q.best_ratio, q.best_cpu_ratio, NO_REMAT, _best_name)} |"
        )
    return lines


def header(argv: Sequence[str], started: dt.datetime, elapsed_s: float,
           loads: tuple[tuple[float, ...], tuple[float, ...]]) -> list[str]:
    """Date, machine, versions and the exact command."""
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = "not installed"
    return [
        "# remat against its peers",
        "",
        f"- date: {started.isoformat(timespec='seconds')}",
        f"- machine: {platform.platform()}, {os.cpu_count()} CPU cores "
        f"(torch threads {torch.get_num_threads()}), "
        f"{'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}",
        f"- OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} (set by the script unless "
        "given; spinning OpenMP workers starve each other on a shared 2-core machine)",
        f"- TORCHINDUCTOR_CACHE_DIR={os.environ.get('TORCHINDUCTOR_CACHE_DIR', '(default)')} "
        "(compile times below are cold when it starts empty)",
        f"- torch {torch.__version__}, transformers {tf_version}, "
        f"Python {platform.python_version()}",
        f"- command: `{shlex.join(argv)}`",
        f"- total run time: {elapsed_s / 60:.1f} min",
        f"- load average (1/5/15 min) at start {loads[0]}, at end {loads[1]} "
        "(other processes share these cores: step times carry their noise)",
    ]


METHOD_NOTES = [
    "## How to read this",
    "",
    "- **Budgets** are absolute step peaks, everything included: "
    "`remat.api.activation_budget(profile, f)` = persistent (parameters + buffers + "
    "gradients) + f x (no-checkpoint peak - persistent), from remat's profile.",
    "- **Peaks** include the persistent bytes: parameters and buffers (held before the "
    "step) plus everything the step allocates, gradients included (they are dropped "
    "before each measured step). *dispatch*: remat's `MemoryMeter` (live tensor "
    "storages); *allocator*: `torch.profiler` allocation/free events summed in time order "
    "(`remat/allocator.py`), which also sees kernel scratch buffers and compiled code. "
    "The allocator figure is what a GPU's `max_memory_allocated` corresponds to; it is "
    "usually a little higher than the dispatch figure.",
    "- **met**: eager methods are judged on the dispatch figure (the instrument remat "
    "plans with); compiled ones (torch.compile, remat optimal + torch.compile) on the "
    "allocator figure, because the dispatch meter "
    "cannot see compiled code (under a dispatch mode a compiled model runs eagerly). "
    "Methods without a budget of their own list the budgets they meet.",
    "- **Overhead** is against the same family's reference: eager methods against eager "
    "no checkpointing, compiled ones (remat optimal + torch.compile included) against "
    "torch.compile at budget 1.0.",
    "- **Step ms**: median wall time of the timed steps after warm-up (forward + backward, "
    "no optimizer), with torch's intra-op threads set by `--threads` (default 1: on a "
    "shared 2-core machine a 2-thread step runs at half speed whenever another process "
    "holds a core, which made the timings bimodal); *cpu ms*: median "
    "process CPU time of the same steps (all threads), which other processes on the cores "
    "disturb less; `peers.csv` has every step. *predicted*: remat's `simulate()` figure "
    "for its plan. Eager methods are "
    "timed round-robin in one loop; each compiled model "
    "right after its compile (dynamo is reset between budgets).",
    "- **checkpoint_sequential(k)** checkpoints every segment but the last, which runs "
    "normally; k = 1 is therefore no checkpointing and is not listed.",
    "- **torch.compile budget=f** is `torch._functorch.config.activation_memory_budget`: a "
    "fraction of the compiled graph's own saved activations, not of remat's budget; its "
    "row is judged against remat's budget at the same f.",
    "- **remat optimal + torch.compile f** is the plan `remat.solve(model, batch, budget, "
    "compiled=True)` returns for the same f: remat searches two knobs, its plan (the "
    "optimal frontier's plans) and inductor's `activation_memory_budget` (amb, 1.0 and "
    "0.5), with a binary search per amb that compiles a few candidates and measures "
    "their step with the allocator; of the fastest fitting plan per amb, the faster by "
    "measured step time wins (the search's time is in the note). It is applied with "
    "`remat.apply_plan` to a fresh copy which is then `torch.compile`d at its amb "
    "(`remat.compiled.compile_planned` does the same), and measured like the "
    "torch.compile rows (allocator peak, compile time in the note, dynamo reset before "
    "each compile). *predicted* is "
    "the compiled peak the search measured for the plan. A budget no candidate fits "
    "compiled gets a row whose note gives the smallest compiled peak measured; a plan "
    "that fails to compile, one whose note gives the exception.",
]


def write_markdown(path: Path, head: list[str], results: Sequence[ModelResult],
                   all_ratios: Sequence[Ratio], failures: Sequence[str]) -> str:
    """Write ``peers.md`` and return its text."""
    lines = head + [""] + METHOD_NOTES + [""]
    for res in results:
        lines += [
            f"## {res.name}",
            "",
            f"{res.description}; {res.n_units} units; persistent {mib(res.fixed_bytes)} MiB "
            f"parameters+buffers + {mib(res.grad_bytes)} MiB gradients; predicted "
            f"no-checkpoint peak {mib(res.predicted_no_ckpt_peak)} MiB; remat profile "
            f"{res.profile_s:.1f} s; budgets "
            + ", ".join(f"{f:.0%} = {mib(b)} MiB" for f, b in res.budgets.items()),
            "",
            *model_table(res),
            "",
        ]
    lines += ["## remat optimal against the fastest peer meeting the same budget", "",
              "Peers: checkpoint_sequential (every k), HF gradient checkpointing, "
              "torch.compile (every activation_memory_budget, 1.0 included). A ratio below 1 "
              "means remat optimal is faster; the fastest peer is picked by median wall time, "
              "and the ratio of median CPU times is given in brackets. Compiled and eager "
              "steps run "
              "different kernels "
              "(faster or slower, by model), so the eager-only column is the like-for-like "
              "comparison of checkpointing plans. The last column group is the compiled "
              "counterpart: the faster of remat optimal (eager) and remat optimal + "
              "torch.compile, each counted only if it meets the budget (compiled: on the "
              "allocator figure), against the fastest peer meeting it (any peer), so a "
              "compiled torch.compile peer faces a compiled remat plan.", "",
              *ratio_table(all_ratios), ""]
    if failures:
        lines += ["## Failures", "", "```", *"\n".join(failures).splitlines(), "```", ""]
    text = "\n".join(lines)
    path.write_text(text)
    return text


def write_csv(path: Path, results: Sequence[ModelResult]) -> None:
    """One line per measured row, with a met_<f> column per budget."""
    import pandas as pd

    records = []
    for res in results:
        for r in res.rows:
            d = asdict(r)
            met = d.pop("met")
            d["step_ms_all"] = " ".join(f"{x:.1f}" for x in r.step_ms_all)
            d["step_cpu_ms_all"] = " ".join(f"{x:.1f}" for x in r.step_cpu_ms_all)
            for f in res.budgets:
                d[f"budget_{f:g}_bytes"] = res.budgets[f]
                d[f"met_{f:g}"] = met.get(f)
            records.append(d)
    pd.DataFrame.from_records(records).to_csv(path, index=False)


MARKERS = {"none": ("s", "tab:gray"), "remat optimal": ("*", "tab:blue"),
           "remat chen": ("P", "tab:cyan"), "checkpoint_sequential": ("o", "tab:red"),
           "HF gradient checkpointing": ("D", "tab:orange"), "torch.compile": ("^", "tab:purple"),
           REMAT_COMPILED: ("X", "tab:green")}


def point_label(row: Row) -> str:
    """A short label for a plotted point."""
    if row.method == "remat optimal":
        return row.setting.split(":")[0]
    if row.method == REMAT_COMPILED:
        return "c " + row.setting.split(":")[0]
    if row.method == "torch.compile":
        return "c " + row.setting.removeprefix("budget=")
    return {"none": "none", "remat chen": "chen", "HF gradient checkpointing": "HF"}.get(
        row.method, row.setting)


def plot_model(ax: Any, res: ModelResult) -> None:
    """One model's panel: peak (judging instrument) against step time, budgets as lines."""
    for method, (marker, color) in MARKERS.items():
        pts = [r for r in res.rows if r.method == method and r.judged_peak and r.step_ms]
        if not pts:
            continue
        ax.scatter([r.step_ms for r in pts], [r.judged_peak / MIB for r in pts],
                   marker=marker, color=color, s=110 if marker == "*" else 40, label=method,
                   zorder=3)
        for r in pts:
            ax.annotate(point_label(r), (r.step_ms, r.judged_peak / MIB), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
    for f, b in res.budgets.items():
        ax.axhline(b / MIB, linestyle="--", linewidth=0.8, color="grey", zorder=1)
        ax.annotate(f"budget {f:.0%}", (1.0, b / MIB), xycoords=("axes fraction", "data"),
                    fontsize=7, ha="right", va="bottom", color="grey")
    ax.set_title(f"{res.name}: {res.description}", fontsize=8)
    ax.set_xlabel("step time, median (ms)")
    ax.set_ylabel("peak MiB (eager: dispatch; compile: allocator)")
    ax.legend(fontsize=7)


def write_plot(path: Path, results: Sequence[ModelResult]) -> None:
    """Per model: peak against step time, budgets as lines, in a grid of panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(2, len(results))
    rows = -(-len(results) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 5 * rows), squeeze=False)
    for ax, res in zip(axes.flat, results):
        plot_model(ax, res)
    for ax in list(axes.flat)[len(results):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help="comma-separated reference models (default: %(default)s)")
    p.add_argument("--budgets", default=",".join(f"{f:g}" for f in DEFAULT_BUDGETS),
                   help="comma-separated fractions of the activation memory (default: "
                        "%(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="tiny models, 3 timed steps; writes to a temporary folder unless --out")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per method (>= 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps per method")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default %(default)s: on a shared 2-core machine "
                        "a 2-thread step runs at half speed whenever another process holds a "
                        "core, which made timings bimodal; one thread is steadier)")
    p.add_argument("--no-compile", action="store_true",
                   help="skip torch.compile (the peer and remat optimal + torch.compile)")
    p.add_argument("--no-remat-compile", action="store_true",
                   help="skip remat optimal + torch.compile (one compile per feasible budget)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: "
                   "benchmarks/results)")
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.budgets = [float(f) for f in args.budgets.split(",") if f.strip()]
    if args.repeats is None:
        args.repeats = 3 if args.quick else 7
    if args.repeats < 3:
        p.error("--repeats must be at least 3")
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "remat-peers-quick" if args.quick else RESULTS
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 1 when some method failed (the rest is still written)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*use_reentrant.*")
    started, t0, load0 = dt.datetime.now(dt.timezone.utc), time.perf_counter(), os.getloadavg()
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    failures: list[str] = []
    results = []
    for name in args.models:
        res = run_guarded(name, lambda name=name: run_model(
            name, sizes.get(name, {"size": "small"}), args.budgets, args.repeats, args.warmup,
            not args.no_compile, not args.no_remat_compile, failures), failures)
        if res is not None:
            results.append(res)
    all_ratios = [q for res in results for q in ratios(res)]
    elapsed = time.perf_counter() - t0
    command = [".venv/bin/python", "benchmarks/peers.py", *argv]
    head = header(command, started, elapsed, (load0, os.getloadavg()))
    args.out.mkdir(parents=True, exist_ok=True)
    text = write_markdown(args.out / "peers.md", head, results, all_ratios, failures)
    write_csv(args.out / "peers.csv", results)
    if results:
        write_plot(args.out / "peers.png", results)
    print("\n" + text)
    print(f"wrote {args.out / 'peers.md'}, peers.csv, peers.png in {elapsed / 60:.1f} min")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

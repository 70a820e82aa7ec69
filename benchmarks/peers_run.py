"""The peers benchmark's runner: measure every method on every model, write CSV and JSON.

For each reference model and each budget fraction f of the no-checkpoint
activation memory (``remat.api.activation_budget``), it measures no
checkpointing, remat optimal (at each budget) and remat chen, the peers that apply
(``checkpoint_sequential`` at k = 2, 4, ..., n segments; Hugging Face's
``gradient_checkpointing_enable``), ``torch.compile`` at inductor's
``activation_memory_budget`` 1.0 and f, and remat's plan for compiled training
(``solve(..., compiled=True)``) compiled at its budget. Every method runs on its
own deep copy of one pristine model, with the same batch.

Eager methods: both peaks are :func:`remat.measure`'s (the dispatch-level meter's
and the allocator's, on the same loop), and the
step times (wall and process CPU) are taken round-robin across the methods.
Compiled ones are measured by :func:`remat.tune.compiled.measure_compiled`.
``peers.py`` runs this and then the reporter; see it for the command line. It
sets ``OMP_WAIT_POLICY`` before anything imports torch (and says why).
"""

from __future__ import annotations

import copy
import datetime as dt
import inspect
import os
import platform
import statistics
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from peers_compiled import remat_compiled_row, torch_compile_row
from peers_data import (
    COMPILED,
    DEFAULT_MODELS,
    EAGER,
    METHOD_ORDER,
    NONE,
    REMAT_CHEN,
    REMAT_COMPILED,
    REMAT_OPTIMAL,
    TORCH_COMPILE,
    ModelFacts,
    Results,
    Row,
    RunFacts,
    mib_cell,
)
from peers_variants import Variant, peer_variants, remat_variant
from torch import nn

import remat
from remat import activation_budget, solve_compiled
from remat.measurement import Stopwatch, clear_grads, forward_loss, model_device
from remat.models import ReferenceModel, build
from remat.solver import no_checkpoint_peak_bytes
from remat.tune import DEFAULT_PARTITIONER_BUDGETS

# Model sizes for the full run, tuned so that the whole run (4 models, 3 budgets,
# 4 torch.compile compiles per model plus remat's compiled search) takes about
# 10 minutes on 2 CPU cores.
FULL_SIZES: dict[str, dict[str, Any]] = {
    # width 256, batch 4096: activations (~8 MiB a block) dwarf the weights, so there is
    # something to checkpoint (at width 1024, batch 512 the gradients set the peak).
    "mlp": {"size": "small", "depth": 16, "width": 256, "batch_size": 4096},
    "cnn": {"size": "small", "batch_size": 32},
    "gpt": {"size": "small", "depth": 4, "batch_size": 8, "dropout": 0.0},
    "hf-gpt2": {"size": "small", "depth": 4, "batch_size": 8, "dropout": 0.0},
}
QUICK_SIZES: dict[str, dict[str, Any]] = {name: {"size": "tiny"} for name in DEFAULT_MODELS}


@dataclass
class Settings:
    """What to measure, and how much."""

    models: Sequence[str]
    fractions: Sequence[float]
    sizes: dict[str, dict[str, Any]]
    repeats: int
    warmup: int
    threads: int
    compile: bool = True
    remat_compile: bool = True


# --------------------------------------------------------------------------- stepping
def make_step(ref: ReferenceModel, model: nn.Module) -> Callable[[], None]:
    """One forward and backward pass of ``model`` on ``ref``'s batch (no optimizer).

    As in a training loop (and :func:`remat.measure`), only the loss outlives the
    forward: the output is not held through the backward pass.
    """
    return lambda: forward_loss(model, ref.batch, ref.loss_fn).backward()


def timed_step(model: nn.Module, step: Callable[[], None]) -> tuple[float, float]:
    """Wall and process CPU time of one step, in ms (gradients dropped first, untimed).

    The CPU time (all threads of this process) is less sensitive than the wall time
    to other processes sharing the cores; it is recorded beside it.
    """
    clear_grads(list(model.parameters()))
    watch = Stopwatch(model_device(model))
    watch.sync()
    start, cpu_start = time.perf_counter(), time.process_time()
    step()
    watch.sync()
    return (time.perf_counter() - start) * 1e3, (time.process_time() - cpu_start) * 1e3


def record_times(row: Row, times: Sequence[tuple[float, float]]) -> None:
    """Store the timed steps of a row and their medians."""
    row.step_ms_all = [wall for wall, _ in times]
    row.step_cpu_ms_all = [cpu for _, cpu in times]
    row.step_ms = statistics.median(row.step_ms_all)
    row.step_cpu_ms = statistics.median(row.step_cpu_ms_all)


# --------------------------------------------------------------------------- eager
def measure_memory(v: Variant, ref: ReferenceModel, step: Callable[[], None], row: Row,
                   warmup: int) -> None:
    """Warm a variant up, then read its peak on both instruments into ``row``."""
    for _ in range(warmup):
        timed_step(v.model, step)
    # Both instruments on the same loop (remat.Loop(): the plain loop that keeps its
    # output), two steps each, so the second sees what the first carries into it.
    measured = remat.measure(v.model, ref.batch, loss_fn=ref.loss_fn, warmup=0, repeats=1)
    row.peak_dispatch_bytes = measured.peak_bytes
    row.peak_allocator_bytes = measured.allocator_peak_bytes
    print(f"  {v.method} {v.setting}: dispatch {mib_cell(row.peak_dispatch_bytes)} MiB, "
          f"allocator {mib_cell(row.peak_allocator_bytes)} MiB", flush=True)


def measure_eager(variants: Sequence[Variant], ref: ReferenceModel, repeats: int, warmup: int,
                  failures: list[str]) -> list[Row]:
    """Memory of each eager variant, then step times taken round-robin across them.

    A variant whose step raises is reported in ``failures`` and left out of the timing.
    """
    steps = [make_step(ref, v.model) for v in variants]
    rows = [Row(ref.name, v.method, v.setting, v.family, budget_fraction=v.budget_fraction,
                predicted_peak_bytes=v.record.predicted_peak_bytes) for v in variants]
    ok: list[int] = []
    for i, (v, step, row) in enumerate(zip(variants, steps, rows)):
        run_guarded(f"{ref.name} {v.method} {v.setting}",
                    lambda v=v, step=step, row=row: measure_memory(v, ref, step, row, warmup),
                    failures)
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


# --------------------------------------------------------------------------- guarding
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
def solve_optimal(profile: remat.Profile, budget: int) -> remat.Plan | remat.InfeasibleBudgetError:
    """remat's optimal plan for ``budget``, or the infeasibility error (it carries the floor)."""
    try:
        return remat.solve(profile, memory_budget=budget)
    except remat.InfeasibleBudgetError as exc:
        return exc


def remat_variants(
    ref: ReferenceModel, pristine: nn.Module, profile: remat.Profile, budgets: dict[float, int],
    failures: list[str],
) -> tuple[list[Variant], list[Row]]:
    """remat optimal at each budget and remat chen; unmeasurable ones become rows with a note."""
    variants: list[Variant] = []
    rows: list[Row] = []
    jobs: list[tuple[str, str, float | None, Callable[[], Any]]] = [
        (REMAT_OPTIMAL, f"f={f:g}", f, lambda b=b: solve_optimal(profile, b))
        for f, b in budgets.items()
    ]
    jobs.append((REMAT_CHEN, "", None, lambda: remat.solve(profile, method="chen")))
    for method, setting, f, solve in jobs:
        label = f"{ref.name} {method} {setting}".rstrip()
        plan = run_guarded(f"{label}: solve", solve, failures)
        if plan is None or isinstance(plan, remat.InfeasibleBudgetError):
            note = ("solve failed (see Failures)" if plan is None else
                    f"infeasible: min feasible peak {mib_cell(plan.min_feasible_bytes)} MiB")
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


def compiled_rows(ref: ReferenceModel, pristine: nn.Module, profile: remat.Profile,
                  budgets: dict[float, int], settings: Settings,
                  failures: list[str]) -> list[Row]:
    """torch.compile at budget 1.0 and each fraction, then remat's compiled plan at each."""
    repeats = settings.repeats
    jobs: list[tuple[str, Callable[[], Row]]] = [
        (f"{TORCH_COMPILE} budget={f:g}",
         lambda f=f: torch_compile_row(ref, pristine, f, repeats))
        for f in (1.0, *settings.fractions)
    ]
    if settings.remat_compile:
        jobs += [(f"{REMAT_COMPILED} f={f:g}",
                  lambda f=f: remat_compiled_row(ref, pristine, profile, budgets[f], f, repeats))
                 for f in settings.fractions]
    rows = [run_guarded(f"{ref.name} {label}", job, failures) for label, job in jobs]
    return [row for row in rows if row is not None]


def run_model(name: str, settings: Settings,
              failures: list[str]) -> tuple[ModelFacts, dict[float, int], list[Row]]:
    """Measure every method on one model: its facts, budgets and rows."""
    overrides = dict(settings.sizes.get(name, {"size": "small"}))
    size = overrides.pop("size", "small")
    ref = build(name, size=size, seed=0, **overrides)
    pristine = copy.deepcopy(ref.model)
    print(f"\n== {name}: {ref.description}", flush=True)

    t0 = time.perf_counter()
    profile = remat.profile(copy.deepcopy(pristine), ref.batch, loss_fn=ref.loss_fn)
    profile_s = time.perf_counter() - t0
    budgets = {f: activation_budget(profile, f) for f in settings.fractions}
    print(f"  profiled {profile.n} units in {profile_s:.1f} s; budgets "
          + ", ".join(f"{f:.0%}={mib_cell(b)} MiB" for f, b in budgets.items()), flush=True)

    eager = [Variant(NONE, "no checkpointing", EAGER, copy.deepcopy(pristine))]
    ours, rows = remat_variants(ref, pristine, profile, budgets, failures)
    peers, not_applicable = peer_variants(ref, pristine)
    eager += ours + peers
    measured = run_guarded(
        f"{name} eager methods",
        lambda: measure_eager(eager, ref, settings.repeats, settings.warmup, failures),
        failures) or []
    for v in eager:
        run_guarded(f"{name} {v.method} teardown", v.teardown, failures)
    rows = measured + rows
    if settings.compile:
        rows += compiled_rows(ref, pristine, profile, budgets, settings, failures)
    rows.sort(key=lambda r: METHOD_ORDER.index(r.method))  # stable: settings keep their order
    finish_rows(rows, budgets)
    facts = ModelFacts(name, ref.description, profile.n, profile.fixed_bytes, profile.grad_bytes,
                       no_checkpoint_peak_bytes(profile), profile_s, not_applicable)
    return facts, budgets, rows


def finish_rows(rows: list[Row], budgets: dict[float, int]) -> None:
    """Fill in budgets, overheads and which budgets each row meets."""
    eager_ref = next((r.step_ms for r in rows if r.method == NONE), None)
    compiled_ref = next((r.step_ms for r in rows
                         if r.method == TORCH_COMPILE and r.budget_fraction is None), None)
    for row in rows:
        if row.budget_fraction is not None:
            row.budget_bytes = budgets.get(row.budget_fraction)
        ref_ms = compiled_ref if row.family == COMPILED else eager_ref
        if row.step_ms is not None and ref_ms:
            row.overhead_pct = 100.0 * (row.step_ms / ref_ms - 1.0)
        row.met_instrument = "allocator" if row.family == COMPILED else "dispatch"
        if row.judged_peak is not None:
            row.met = {f: row.judged_peak <= b for f, b in budgets.items()}


# --------------------------------------------------------------------------- the run
def run_facts(settings: Settings, command: Sequence[str], started: dt.datetime,
              elapsed_s: float, loads: tuple[Sequence[float], Sequence[float]]) -> RunFacts:
    """Date, machine, versions, the command, and the settings the report cites."""
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = "not installed"
    max_compiles = inspect.signature(solve_compiled).parameters["max_compiles"].default
    return RunFacts(
        date=started.isoformat(timespec="seconds"),
        platform=platform.platform(),
        cpu_count=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
        inductor_cache_dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        torch_version=torch.__version__,
        transformers_version=tf_version,
        python_version=platform.python_version(),
        command=list(command),
        elapsed_s=elapsed_s,
        load_start=list(loads[0]),
        load_end=list(loads[1]),
        warmup=settings.warmup,
        repeats=settings.repeats,
        partitioner_budgets=list(DEFAULT_PARTITIONER_BUDGETS),
        max_compiles=max_compiles,
    )


def run(settings: Settings, command: Sequence[str]) -> Results:
    """Measure every model; a model or method that fails is listed in the failures."""
    torch.set_num_threads(settings.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*use_reentrant.*")
    started, t0, load0 = dt.datetime.now(dt.timezone.utc), time.perf_counter(), os.getloadavg()
    failures: list[str] = []
    models, budgets, rows = [], {}, []
    for name in settings.models:
        done = run_guarded(name, lambda name=name: run_model(name, settings, failures), failures)
        if done is not None:
            models.append(done[0])
            budgets[name] = done[1]
            rows += done[2]
    facts = run_facts(settings, command, started, time.perf_counter() - t0,
                      (load0, os.getloadavg()))
    return Results(facts, models, rows, budgets, failures)

"""The prose of ``peers.md``: templates whose every number and claim about the run is filled in.

Nothing here states a setting or a measured fact itself: what the run used
(partitioner budgets, compiles per budget, steps, threads, how compiled steps were
measured) comes from ``peers.json``, what it measured from ``peers.csv``, and the
method names from :mod:`peers_data`. So the prose cannot drift from the code or
the data the way hand-written prose did.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from string import Template

from peers_data import (
    CHECKPOINT_SEQUENTIAL,
    DEFAULT_THREADS,
    EAGER,
    HF_CHECKPOINTING,
    MEASURE_COMPILED,
    REMAT_COMPILED,
    TORCH_COMPILE,
    Results,
    RunFacts,
    mib_cell,
)


def listing(items: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def steps(n: int, what: str = "step") -> str:
    """``1 step``, ``3 steps``."""
    return f"{n} {what}{'s' if n != 1 else ''}"


def header(run: RunFacts) -> list[str]:
    """Date, machine, versions, the exact command, run time and load."""
    gpu = f"CUDA {run.gpu}" if run.gpu else "no GPU"
    return [
        "# remat against its peers",
        "",
        f"- date: {run.date}",
        f"- machine: {run.platform}, {run.cpu_count} CPU cores "
        f"(torch threads {run.torch_threads}), {gpu}",
        f"- OMP_WAIT_POLICY={run.omp_wait_policy} (set by the script unless "
        "given; spinning OpenMP workers starve each other on a shared 2-core machine)",
        f"- TORCHINDUCTOR_CACHE_DIR={run.inductor_cache_dir or '(default)'} "
        "(compile times below are cold when it starts empty)",
        f"- torch {run.torch_version}, transformers {run.transformers_version}, "
        f"Python {run.python_version}",
        f"- command: `{shlex.join(run.command)}`",
        f"- total run time: {run.elapsed_s / 60:.1f} min",
        f"- load average (1/5/15 min) at start {tuple(run.load_start)}, at end "
        f"{tuple(run.load_end)} (other processes share these cores: step times carry "
        "their noise)",
        *([f"- {run.note}"] if run.note else []),
    ]


HOW_TO_READ = Template("""\
## How to read this

- **Budgets** are absolute step peaks, everything included: \
`remat.api.activation_budget(profile, f)` = persistent (parameters + buffers + gradients) + \
f x (no-checkpoint peak - persistent), from remat's profile.
- **Peaks** include the persistent bytes: parameters and buffers (held before the step) plus \
everything the step allocates, gradients included (they are dropped before each measured step). \
*dispatch*: remat's `MemoryMeter` (live tensor storages, as `remat.measure` reports it); \
*allocator*: `torch.profiler` allocation/free events summed in time order \
(`remat/measurement/allocator.py`), which also sees kernel scratch buffers and compiled code. \
The allocator figure is what a GPU's `max_memory_allocated` corresponds to; $allocator_vs_dispatch.
- **met**: eager methods are judged on the dispatch figure (the instrument remat plans with); \
compiled ones ($torch_compile, $remat_compiled) on the allocator figure, because the dispatch \
meter cannot see compiled code (under a dispatch mode a compiled model runs eagerly). Methods \
without a budget of their own list the budgets they meet.
- **Overhead** is against the same family's reference: eager methods against eager no \
checkpointing, compiled ones ($remat_compiled included) against $torch_compile at budget 1.0.
- **Step ms**: median wall time of the $repeats after $warmup (forward + backward, no \
optimizer), with torch's intra-op threads set to $threads by `--threads` (default \
$default_threads: on a shared 2-core machine a 2-thread step runs at half speed whenever \
another process holds a core, which made the timings bimodal); *cpu ms*: median process CPU \
time of the same steps (all threads), which other processes on the cores disturb less; \
`peers.csv` has every step. *predicted*: remat's `simulate()` figure for its plan. Eager \
methods are timed round-robin in one loop; $compiled_timing
- **$checkpoint_sequential(k)** checkpoints every segment but the last, which runs normally; \
k = 1 is therefore no checkpointing and is not listed.
- **$torch_compile budget=f** is `torch._functorch.config.activation_memory_budget`: a fraction \
of the compiled graph's own saved activations, not of remat's budget; its row is judged against \
remat's budget at the same f.
- **$remat_compiled f** is the plan `remat.solve(model, batch, budget, compiled=True)` returns \
for the same f: remat searches two knobs, its plan (the optimal frontier's plans) and \
inductor's `activation_memory_budget` (amb, $partitioner_budgets, in that order), with a binary \
search per amb that compiles at most $max_compiles candidates (one more when none of them fits) \
and measures their step with the allocator; a lower amb only searches the plans faster than the \
best found so far. Of the fastest fitting plan per amb, the faster by measured step time wins \
(the search's time is in the note). $compiled_plan_measured *predicted* is the compiled peak \
the search measured for the plan. A budget no candidate fits compiled gets a row whose note \
gives the smallest compiled peak measured; a plan that fails to compile, one whose note gives \
the exception.""")

# How the compiled rows were measured, as the run recorded it (RunFacts.compiled_measurement).
COMPILED_TIMING = {
    MEASURE_COMPILED: (
        "compiled ones by `remat.tune.compiled.measure_compiled`: its first step compiles, the "
        "next is metered with the allocator, then $repeats_n more are timed (wall time only: "
        "compiled rows have no cpu ms and no per-step times in `peers.csv`); dynamo is reset "
        "before and after each, and the note gives the whole measurement's time, compile included."
    ),
    "own loop": (
        "each compiled model right after its compile, after $compiled_warmup (dynamo is reset "
        "between "
        "budgets)."
    ),
}
COMPILED_PLAN_MEASURED = {
    MEASURE_COMPILED: (
        "It is measured like the $torch_compile rows, by `measure_compiled` at its amb, which "
        "applies the plan to a fresh copy with `remat.apply_plan` and compiles it as "
        "`remat.tune.compiled.compile_planned` does."
    ),
    "own loop": (
        "It is applied with `remat.apply_plan` to a fresh copy which is then `torch.compile`d "
        "at its amb (`remat.tune.compiled.compile_planned` does the same), and measured like the "
        "$torch_compile rows (allocator peak, compile time in the note, dynamo reset before "
        "each compile)."
    ),
}


def allocator_vs_dispatch(results: Results) -> str:
    """How the two instruments compared in this run, on the rows measured by both."""
    pairs = [(r.peak_allocator_bytes, r.peak_dispatch_bytes) for r in results.rows
             if r.family == EAGER and r.peak_allocator_bytes is not None
             and r.peak_dispatch_bytes is not None]
    if not pairs:
        return "no row of this run was measured on both"
    higher = [a - d for a, d in pairs if a > d]
    lower = [d - a for a, d in pairs if a < d]
    text = (f"in this run it is higher than the dispatch figure in {len(higher)} of the "
            f"{len(pairs)} rows measured on both")
    if higher:
        text += f" (by at most {mib_cell(max(higher))} MiB)"
    text += f", equal in {len(pairs) - len(higher) - len(lower)} and lower in {len(lower)}"
    if lower:
        text += f" (by at most {mib_cell(max(lower))} MiB)"
    return text


def how_to_read(results: Results) -> list[str]:
    """The "How to read this" section, filled in from the run and its rows."""
    run = results.run
    values = {
        "repeats": steps(run.repeats, "timed step"),
        "repeats_n": str(run.repeats),
        "warmup": steps(run.warmup, "warm-up step"),
        "compiled_warmup": steps(max(run.warmup, 1), "warm-up step"),  # that loop's minimum
        "threads": str(run.torch_threads),
        "default_threads": str(DEFAULT_THREADS),
        "partitioner_budgets": listing([f"{f:.1f}" for f in run.partitioner_budgets]),
        "max_compiles": str(run.max_compiles),
        "allocator_vs_dispatch": allocator_vs_dispatch(results),
        "checkpoint_sequential": CHECKPOINT_SEQUENTIAL,
        "torch_compile": TORCH_COMPILE,
        "remat_compiled": REMAT_COMPILED,
    }
    values["compiled_timing"] = Template(
        COMPILED_TIMING[run.compiled_measurement]).substitute(values)
    values["compiled_plan_measured"] = Template(
        COMPILED_PLAN_MEASURED[run.compiled_measurement]).substitute(values)
    return HOW_TO_READ.substitute(values).splitlines()


def ratio_intro(results: Results) -> str:
    """What the ratio table compares; the peers and their settings come from the rows."""
    compile_settings = list(dict.fromkeys(
        r.setting.removeprefix("budget=") for r in results.rows if r.method == TORCH_COMPILE))
    peers = [f"{CHECKPOINT_SEQUENTIAL} (every k above)", HF_CHECKPOINTING]
    if compile_settings:
        peers.append(f"{TORCH_COMPILE} (activation_memory_budget {listing(compile_settings)})")
    return (
        f"Peers: {', '.join(peers)}. A ratio below 1 means remat optimal is faster; the "
        "fastest peer is picked by median wall time, and the ratio of median CPU times is given "
        "in brackets (— where a row has none). Compiled and eager steps run different kernels "
        "(faster or slower, by model), so the eager-only column is the like-for-like comparison "
        "of checkpointing plans. The last column group is the compiled counterpart: the faster "
        f"of remat optimal (eager) and {REMAT_COMPILED}, each counted only if it meets the "
        "budget (compiled: on the allocator figure), against the fastest peer meeting it (any "
        f"peer), so a compiled {TORCH_COMPILE} peer faces a compiled remat plan."
    )

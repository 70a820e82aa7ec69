"""The compiled rows of the peers benchmark: ``torch.compile`` and remat's compiled plan.

Both are measured by :func:`remat.tune.compiled.measure_compiled` (one step compiles,
the next is metered with the allocator, then the timed steps); this module adds
what a row's note says: the measurement's wall time, the graphs and graph breaks
dynamo produced, and the recompile limits it hit.
"""

from __future__ import annotations

import copy
import logging
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch
from peers_data import COMPILED, REMAT_COMPILED, TORCH_COMPILE, Row, mib_cell
from torch import nn

import remat
from remat.models import ReferenceModel
from remat.tune import measure_compiled, search_compiled

REPO = str(Path(__file__).resolve().parent.parent)
# measure_compiled times its steps only when the peak is within a bound: here, always.
ALWAYS = sys.maxsize
DISPATCH_NA = "dispatch meter n/a: compiled code runs eagerly under a dispatch mode"


def dynamo_counts() -> tuple[int, int]:
    """Dynamo's running totals (``torch._dynamo.reset()`` keeps them): graphs, graph breaks."""
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


def compile_note(seconds: float, repeats: int, graphs: int, breaks: int,
                 limit_hits: Sequence[str]) -> str:
    """The note of a compiled row: measuring time, graphs, and recompile limits hit."""
    note = (f"{DISPATCH_NA}; measure_compiled {seconds:.0f} s (compile, 1 metered and "
            f"{repeats} timed steps); {graphs} graph{'s' if graphs != 1 else ''}, "
            f"{breaks} graph breaks")
    if graphs == 0:
        note += " (ran eagerly)"
    if limit_hits:
        note += "; dynamo hit " + ", ".join(limit_hits) + ": later calls ran eagerly"
    return note


def run_compiled(row: Row, ref: ReferenceModel, model: nn.Module, plan: remat.Plan | None,
                 fraction: float, repeats: int) -> None:
    """``measure_compiled``: the compiled step's allocator peak and median time into ``row``.

    It resets dynamo before and after, so each compile starts from nothing. The note
    says how many graphs (and graph breaks) the model compiled to, and which
    recompile limits it hit.
    """
    graphs0, breaks0 = dynamo_counts()
    with RecompileLimitHits() as limits:
        t0 = time.perf_counter()
        step = measure_compiled(model, ref.batch, plan, loss_fn=ref.loss_fn,
                                activation_memory_budget=fraction, time_if_within=ALWAYS,
                                repeats=repeats)
        row.compiled_measure_s = time.perf_counter() - t0
    graphs, breaks = (now - then for now, then in zip(dynamo_counts(), (graphs0, breaks0)))
    row.peak_allocator_bytes, row.step_ms = step.peak_bytes, step.time_ms
    row.note = compile_note(row.compiled_measure_s, repeats, graphs, breaks, limits.hits)
    print(f"  {row.method} {row.setting}: allocator {mib_cell(row.peak_allocator_bytes)} MiB, "
          f"{row.step_ms:.0f} ms, {row.compiled_measure_s:.0f} s, {graphs} graphs", flush=True)


def torch_compile_row(ref: ReferenceModel, pristine: nn.Module, fraction: float,
                      repeats: int) -> Row:
    """A copy compiled at ``activation_memory_budget=fraction``: allocator peak and time."""
    row = Row(ref.name, TORCH_COMPILE, f"budget={fraction:g}", COMPILED,
              budget_fraction=fraction if fraction < 1.0 else None)
    run_compiled(row, ref, copy.deepcopy(pristine), None, fraction, repeats)
    return row


def remat_compiled_row(ref: ReferenceModel, pristine: nn.Module, profile: remat.Profile,
                       budget: int, fraction: float, repeats: int) -> Row:
    """remat's plan for compiled training at ``fraction``, compiled and measured.

    The plan comes from ``solve(..., compiled=True)`` (:func:`remat.tune.search_compiled`):
    the fastest (frontier plan, inductor ``activation_memory_budget``) whose compiled
    step fits the budget. It is measured at that partitioner budget, as
    :func:`remat.tune.compiled.compile_planned` would compile it. A search that finds no
    fitting plan, or a plan that does not compile, becomes a row whose note says why.
    """
    def fresh(setting: str, plan: remat.Plan | None = None) -> Row:
        return Row(ref.name, REMAT_COMPILED, setting, COMPILED, budget_fraction=fraction,
                   predicted_peak_bytes=plan.compiled.peak_bytes if plan else None)

    try:
        t0 = time.perf_counter()
        plan = search_compiled(copy.deepcopy(pristine), ref.batch, profile, budget,
                              loss_fn=ref.loss_fn)
        search_s = time.perf_counter() - t0
    except remat.InfeasibleBudgetError as exc:
        row = fresh(f"f={fraction:g}: compiled search")
        smallest = mib_cell(exc.min_feasible_bytes)
        row.note = f"no plan fits compiled: smallest measured {smallest} MiB"
        return row
    amb = plan.compiled.activation_memory_budget
    setting = f"f={fraction:g}: {plan.summary()}; amb={amb:g}"
    row = fresh(setting, plan)
    try:
        run_compiled(row, ref, copy.deepcopy(pristine), plan, amb, repeats)
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

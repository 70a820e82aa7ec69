"""The peers benchmark's reporter: ``peers.md`` and ``peers.png`` from ``peers.csv`` + ``.json``.

It measures nothing and imports no torch, so a committed run can be re-rendered
at any time (``python benchmarks/peers.py --report-only``). The tables come from
the rows; the prose from :mod:`peers_prose`, filled in from the same files.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from _common import markdown_table
from peers_data import (
    DASH,
    EAGER,
    NOT_APPLICABLE,
    PEER_METHODS,
    REMAT_COMPILED,
    REMAT_OPTIMAL,
    ModelFacts,
    Results,
    Row,
    mib_cell,
    read_results,
)
from peers_plot import write_plot
from peers_prose import header, how_to_read, ratio_intro


def number(x: float | None, spec: str) -> str:
    """``format(x, spec)``, or a dash."""
    return DASH if x is None else format(x, spec)


# --------------------------------------------------------------------------- one model
def met_text(row: Row) -> str:
    """"yes"/"no" against the row's own budget, else the budgets it meets."""
    if not row.met:
        return DASH
    if row.budget_fraction is not None:
        return "yes" if row.met.get(row.budget_fraction) else "no"
    ok = [f"{f:.0%}" for f, met in row.met.items() if met]
    return "meets " + (", ".join(ok) if ok else "none")


def budget_text(row: Row) -> str:
    """The row's budget as "50% (123.4 MiB)", or a dash."""
    if row.budget_fraction is None:
        return DASH
    return f"{row.budget_fraction:.0%} ({mib_cell(row.budget_bytes)} MiB)"


MODEL_COLUMNS = ("method", "setting", "budget", "peak MiB (dispatch)", "peak MiB (allocator)",
                 "predicted MiB", "step ms", "cpu ms", "overhead %", "met (instrument)", "note")
MODEL_ALIGN = ("---", "---", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---", "---")


def model_table(rows: Sequence[Row], not_applicable: Sequence[str]) -> list[str]:
    """The markdown table of one model: its rows, then the peers that do not apply."""
    cells = [
        [r.method, r.setting, budget_text(r), mib_cell(r.peak_dispatch_bytes),
         mib_cell(r.peak_allocator_bytes), mib_cell(r.predicted_peak_bytes),
         number(r.step_ms, ".0f"), number(r.step_cpu_ms, ".0f"), number(r.overhead_pct, "+.1f"),
         f"{met_text(r)} ({r.met_instrument})" if r.met else met_text(r), r.note]
        for r in rows
    ]
    cells += [[method, *[DASH] * 9, NOT_APPLICABLE[method]] for method in not_applicable]
    return markdown_table(MODEL_COLUMNS, cells, MODEL_ALIGN)


def model_section(facts: ModelFacts, budgets: dict[float, int], rows: Sequence[Row]) -> list[str]:
    """Heading, one paragraph of facts, and the table of one model."""
    return [
        f"## {facts.name}",
        "",
        f"{facts.description}; {facts.n_units} units; persistent {mib_cell(facts.fixed_bytes)} "
        f"MiB parameters+buffers + {mib_cell(facts.grad_bytes)} MiB gradients; predicted "
        f"no-checkpoint peak {mib_cell(facts.predicted_no_ckpt_peak)} MiB; remat profile "
        f"{facts.profile_s:.1f} s; budgets "
        + ", ".join(f"{f:.0%} = {mib_cell(b)} MiB" for f, b in budgets.items()),
        "",
        *model_table(rows, facts.not_applicable),
        "",
    ]


# --------------------------------------------------------------------------- ratios
def _ratio(a: Row | None, b: Row | None, column: str) -> float | None:
    """``a.column / b.column``, or None when either is missing."""
    x = getattr(a, column, None) if a else None
    y = getattr(b, column, None) if b else None
    return None if x is None or not y else x / y


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

    def against(self, mine: Row | None, peer: Row | None) -> tuple[float | None, float | None]:
        """Wall and CPU time ratios of ``mine`` to ``peer``."""
        return _ratio(mine, peer, "step_ms"), _ratio(mine, peer, "step_cpu_ms")


def fastest(rows: Sequence[Row], fraction: float) -> Row | None:
    """The fastest (median wall time) of ``rows`` that meets budget ``fraction``."""
    ok = [r for r in rows if r.met.get(fraction) and r.step_ms is not None]
    return min(ok, key=lambda r: r.step_ms, default=None)


def ratios(model: str, budgets: dict[float, int], rows: Sequence[Row]) -> list[Ratio]:
    """One :class:`Ratio` per budget of a model."""
    peers = [r for r in rows if r.method in PEER_METHODS]
    eager_peers = [r for r in peers if r.family == EAGER]
    out = []
    for f, budget in budgets.items():
        ours, ours_compiled = (next((r for r in rows
                                     if r.method == method and r.budget_fraction == f), None)
                               for method in (REMAT_OPTIMAL, REMAT_COMPILED))
        best = fastest([r for r in (ours, ours_compiled) if r is not None], f)
        out.append(Ratio(model, f, budget, ours, fastest(peers, f), fastest(eager_peers, f),
                         best))
    return out


NO_PEER = "no peer meets it"
NO_EAGER = "no eager peer meets it"
NO_REMAT = "neither meets it"


def _peer_cells(peer: Row | None, ratio: tuple[float | None, float | None], none_text: str,
                name: Callable[[Row], str] = lambda r: f"{r.method} {r.setting}") -> list[str]:
    """``name``, ``ms``, ``ratio (cpu ratio)`` cells for one peer column group."""
    if peer is None:
        return [none_text, DASH, DASH]
    wall, cpu = ratio
    return [name(peer), number(peer.step_ms, ".0f"),
            f"{number(wall, '.2f')} ({number(cpu, '.2f')})"]


def _best_name(row: Row) -> str:
    """Which of remat optimal's two forms was the faster: eager or compiled."""
    return "+ torch.compile" if row.method == REMAT_COMPILED else "eager"


RATIO_COLUMNS = (
    "model", "budget", "remat optimal ms (met)", "fastest peer meeting it", "peer ms",
    "remat / peer: wall (cpu)", "fastest eager peer meeting it", "eager peer ms",
    "remat / eager peer: wall (cpu)",
    "faster remat optimal meeting it (eager or + torch.compile)", "its ms",
    "it / fastest peer: wall (cpu)",
)
RATIO_ALIGN = ("---", "---", "---:", "---", "---:", "---:", "---", "---:", "---:", "---", "---:",
               "---:")


def ratio_table(all_ratios: Sequence[Ratio]) -> list[str]:
    """The markdown table of remat optimal / fastest peer meeting the same budget."""
    cells = []
    for q in all_ratios:
        if q.remat_ms is None:
            ours = q.ours.note if q.ours else "not measured"
        else:
            ours = f"{q.remat_ms:.0f} ({'yes' if q.remat_met else 'no'})"
        cells.append([
            q.model, f"{q.fraction:.0%} ({mib_cell(q.budget_bytes)} MiB)", ours,
            *_peer_cells(q.peer, q.against(q.ours, q.peer), NO_PEER),
            *_peer_cells(q.eager_peer, q.against(q.ours, q.eager_peer), NO_EAGER),
            *_peer_cells(q.best, q.against(q.best, q.peer), NO_REMAT, _best_name),
        ])
    return markdown_table(RATIO_COLUMNS, cells, RATIO_ALIGN)


# --------------------------------------------------------------------------- the document
def markdown(results: Results) -> str:
    """The whole of ``peers.md``."""
    lines = header(results.run) + [""] + how_to_read(results) + [""]
    all_ratios = []
    for facts in results.models:
        budgets, rows = results.budgets.get(facts.name, {}), results.rows_of(facts.name)
        lines += model_section(facts, budgets, rows)
        all_ratios += ratios(facts.name, budgets, rows)
    lines += ["## remat optimal against the fastest peer meeting the same budget", "",
              ratio_intro(results), "", *ratio_table(all_ratios), ""]
    if results.failures:
        lines += ["## Failures", "", "```", *"\n".join(results.failures).splitlines(), "```", ""]
    return "\n".join(lines)


def write_report(results: Results, folder: Path) -> str:
    """Write ``peers.md`` and (with any model) ``peers.png`` into ``folder``; the markdown."""
    text = markdown(results)
    (folder / "peers.md").write_text(text)
    if results.models:
        write_plot(folder / "peers.png", results)
    return text


def report(folder: Path) -> str:
    """Re-render ``peers.md`` and ``peers.png`` from ``folder``'s CSV and JSON."""
    return write_report(read_results(folder), folder)

"""The peers benchmark's data, shared by its runner and its reporter.

The runner (``peers_run.py``) writes two files, the reporter (``peers_report.py``)
reads them back:

* ``peers.csv``: one line per measured :class:`Row` (every method, setting and
  model), with ``budget_<f>_bytes`` and ``met_<f>`` columns per budget fraction;
* ``peers.json``: what the rows do not hold: the run (:class:`RunFacts`: machine,
  versions, command, the settings the prose cites) and each model
  (:class:`ModelFacts`: description, units, persistent bytes, profile time).

Method names, families and the reasons a peer does not apply live here too, so
that both sides spell them the same way.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from remat.core import MIB, mib

DEFAULT_MODELS = ("mlp", "cnn", "gpt", "hf-gpt2")
DEFAULT_BUDGETS = (0.3, 0.5, 0.7)  # fractions of the no-checkpoint activation memory

EAGER, COMPILED = "eager", "compiled"
NONE = "none"
REMAT_OPTIMAL = "remat optimal"
REMAT_CHEN = "remat chen"
CHECKPOINT_SEQUENTIAL = "checkpoint_sequential"
HF_CHECKPOINTING = "HF gradient checkpointing"
TORCH_COMPILE = "torch.compile"
# remat's plan for compiled training (solve(..., compiled=True)), applied and then compiled.
REMAT_COMPILED = "remat optimal + torch.compile"
# The ratio table compares remat optimal with these.
PEER_METHODS = (CHECKPOINT_SEQUENTIAL, HF_CHECKPOINTING, TORCH_COMPILE)
METHOD_ORDER = (NONE, REMAT_OPTIMAL, REMAT_CHEN, *PEER_METHODS, REMAT_COMPILED)
NOT_APPLICABLE = {
    CHECKPOINT_SEQUENTIAL: (
        "n/a: the blocks are an nn.ModuleList driven by the model's own forward loop; "
        "checkpoint_sequential needs the units to be one nn.Sequential it can call in order"
    ),
    HF_CHECKPOINTING: "n/a: only Hugging Face models have gradient_checkpointing_enable",
}
# torch's intra-op threads: on a shared 2-core machine a 2-thread step runs at half
# speed whenever another process holds a core, which made the timings bimodal.
DEFAULT_THREADS = 1
# How the compiled rows were measured (RunFacts.compiled_measurement): by
# remat.tune.compiled.measure_compiled, or (runs before it was used) by the benchmark's own
# loop: warm-up steps, then the allocator peak, then timed steps with their CPU time.
MEASURE_COMPILED, OWN_LOOP = "measure_compiled", "own loop"


@dataclass
class Row:
    """The measured result of one method on one model (or, in ``note``, why there is none)."""

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
    compiled_measure_s: float | None = None  # measure_compiled's wall time, compile included
    note: str = ""

    @property
    def judged_peak(self) -> int | None:
        """The peak that decides "budget met": dispatch (eager) or allocator (compiled)."""
        if self.family == COMPILED:
            return self.peak_allocator_bytes
        return self.peak_dispatch_bytes


@dataclass
class ModelFacts:
    """What the report says about one model besides its rows."""

    name: str
    description: str
    n_units: int
    fixed_bytes: int  # parameters and buffers
    grad_bytes: int
    predicted_no_ckpt_peak: int
    profile_s: float
    not_applicable: list[str] = field(default_factory=list)  # keys of NOT_APPLICABLE


@dataclass
class RunFacts:
    """The run: where, with what, how long, and the settings the report's prose cites."""

    date: str
    platform: str
    cpu_count: int | None
    torch_threads: int
    gpu: str | None
    omp_wait_policy: str | None
    inductor_cache_dir: str | None
    torch_version: str
    transformers_version: str
    python_version: str
    command: list[str]
    elapsed_s: float
    load_start: list[float]
    load_end: list[float]
    warmup: int
    repeats: int
    partitioner_budgets: list[float]  # what remat's compiled search tried
    max_compiles: int  # per partitioner budget, at most
    compiled_measurement: str = MEASURE_COMPILED
    note: str = ""  # how these facts were obtained, when not by the run itself


@dataclass
class Results:
    """Everything one run produced: the rows, each model's budgets and facts, the run."""

    run: RunFacts
    models: list[ModelFacts]
    rows: list[Row]
    budgets: dict[str, dict[float, int]]  # model -> budget fraction -> bytes
    failures: list[str] = field(default_factory=list)

    def rows_of(self, model: str) -> list[Row]:
        """The rows of ``model``, in the order measured (methods in METHOD_ORDER)."""
        return [r for r in self.rows if r.model == model]


DASH = "—"


def mib_cell(n: int | None) -> str:
    """Bytes as MiB for the report and the notes: one decimal, three below 10 MiB (small
    models), or a dash."""
    if n is None:
        return DASH
    return mib(n, 1 if abs(n) >= 10 * MIB else 3)


# --------------------------------------------------------------------------- writing
def write_csv(path: Path, results: Results) -> None:
    """One line per row, with ``budget_<f>_bytes`` and ``met_<f>`` per budget fraction."""
    import pandas as pd

    records = []
    for r in results.rows:
        d = asdict(r)
        met = d.pop("met")
        d["step_ms_all"] = " ".join(f"{x:.1f}" for x in r.step_ms_all)
        d["step_cpu_ms_all"] = " ".join(f"{x:.1f}" for x in r.step_cpu_ms_all)
        for f, b in results.budgets.get(r.model, {}).items():
            d[f"budget_{f:g}_bytes"] = b
            d[f"met_{f:g}"] = met.get(f)
        records.append(d)
    pd.DataFrame.from_records(records).to_csv(path, index=False)


def write_json(path: Path, results: Results) -> None:
    """The run's and the models' facts, and the failures."""
    data = {"run": asdict(results.run), "models": [asdict(m) for m in results.models],
            "failures": results.failures}
    path.write_text(json.dumps(data, indent=2) + "\n")


# --------------------------------------------------------------------------- reading
def _value(x: Any) -> Any:
    """A CSV cell as Python: NaN (an empty cell) -> None."""
    return None if isinstance(x, float) and math.isnan(x) else x


def _int(x: Any) -> int | None:
    x = _value(x)
    return None if x is None else int(x)


def _float(x: Any) -> float | None:
    x = _value(x)
    return None if x is None else float(x)


def _floats(x: Any) -> list[float]:
    x = _value(x)
    return [] if x is None else [float(v) for v in str(x).split()]


def _bool(x: Any) -> bool | None:
    x = _value(x)
    return None if x is None else x in (True, "True", "true", 1)


_STR_FIELDS = ("model", "method", "setting", "family", "met_instrument", "note")
_INT_FIELDS = ("budget_bytes", "predicted_peak_bytes", "peak_dispatch_bytes",
               "peak_allocator_bytes")
_FLOAT_FIELDS = ("budget_fraction", "step_ms", "step_cpu_ms", "overhead_pct",
                 "compiled_measure_s")


def read_csv(path: Path) -> tuple[list[Row], dict[str, dict[float, int]]]:
    """The rows of ``peers.csv`` and each model's budgets (fraction -> bytes).

    Columns a run did not write (older files) are left at their defaults.
    """
    import pandas as pd

    frame = pd.read_csv(path, dtype={"setting": str, "note": str})
    fractions = [float(m[1]) for c in frame.columns
                 if (m := re.fullmatch(r"budget_([0-9.]+)_bytes", c))]
    rows, budgets = [], {}
    for record in frame.to_dict("records"):
        row = Row(**{k: ("" if _value(record.get(k)) is None else str(record[k]))
                     for k in _STR_FIELDS})
        for k in _INT_FIELDS:
            setattr(row, k, _int(record.get(k)))
        for k in _FLOAT_FIELDS:
            setattr(row, k, _float(record.get(k)))
        row.step_ms_all = _floats(record.get("step_ms_all"))
        row.step_cpu_ms_all = _floats(record.get("step_cpu_ms_all"))
        row.met = {f: met for f in fractions
                   if (met := _bool(record.get(f"met_{f:g}"))) is not None}
        budgets.setdefault(row.model, {f: int(record[f"budget_{f:g}_bytes"])
                                       for f in fractions})
        rows.append(row)
    return rows, budgets


def read_results(folder: Path) -> Results:
    """``peers.csv`` and ``peers.json`` of ``folder``."""
    rows, budgets = read_csv(folder / "peers.csv")
    data = json.loads((folder / "peers.json").read_text())
    return Results(run=RunFacts(**data["run"]), models=[ModelFacts(**m) for m in data["models"]],
                   rows=rows, budgets=budgets, failures=data.get("failures", []))

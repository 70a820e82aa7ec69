"""Per-rank predictions against measured FSDP2 steps, and what per-unit options cost.

Spawns ``--ranks`` gloo ranks on the CPU. For each model (a Llama-style ``transformers``
model from a ``LlamaConfig``, random weights, also sharded under a bf16
``MixedPrecisionPolicy`` and with a vocabulary whose logits set the floor; remat's own
GPT), ``reshard_after_forward``
True, False and None (FSDP2's default: the blocks reshard after their forward, the root
does not), every rank shards the model (each block, then the root), profiles it
collectively (``remat.profile`` on the sharded model: the worst rank's step, the same
on every rank; each rank its own micro-batch), and solves at 4 budgets from the smallest
feasible per-rank peak to no checkpointing, with the head as written (``head="none"``)
and, where remat measured a chunked head for the model and chunking lowers the smallest
feasible peak, at 4 budgets only a chunked head meets (``head="chunked"``). Each plan is
applied and its step run ``--runs`` times on every rank, each run measured by live tensor bytes
(:class:`~remat.measurement.simulated_device.SimulatedDevice` without a capacity:
everything the step holds, the rank's shards included). The table gives, per plan, the
worst and the least run over every rank, and how far the prediction is above the worst.

Rank 0 also profiles each model in full precision unsharded (one process, the whole
model: its step's peak without checkpointing) for the largest ratio of unsharded step to
per-rank budget that was planned, and, on the profiles of the Llama-style model and the
GPT, solves the same budgets twice: with multi-unit
checkpoint segments allowed, and with per-unit options only (every plan of
``keep``/``checkpoint`` per unit, simulated): what FSDP2's per-block hooks cost by
preventing segments (pure solver).

Prints the tables and writes them to benchmarks/results/fsdp.md.

    nice -n 10 taskset -c 0 .venv/bin/python benchmarks/fsdp.py --ranks 4 --runs 10
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import itertools
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see peers.py

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import RESULTS, machine_line, markdown_table, write_result  # noqa: E402
from _ranks import on_gloo_ranks  # noqa: E402

FRACTIONS = (0.0, 1 / 3, 2 / 3, 1.0)  # budgets between the smallest feasible peak and none
# reshard_after_forward for every block and the root; None is FSDP2's default: the blocks
# reshard after their forward, the root keeps its parameters for the backward.
RESHARD = (True, False, None)


@dataclasses.dataclass(frozen=True)
class Case:
    """One model as the ranks shard it."""

    build: dict[str, Any]  # remat.models.build's arguments
    blocks: str  # the attribute path of the blocks (each its own FSDP2 unit)
    mixed_precision: bool = False  # FSDP2 gathers in bf16 and reduce-scatters in fp32
    segments: bool = True  # also in the segments table (unsharded, pure solver)

    def describe(self) -> str:
        args = ", ".join(f"{k} {v}" for k, v in self.build.items() if k != "name")
        return args + (", `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`"
                       if self.mixed_precision else "")


_LLAMA = {"name": "hf-llama", "depth": 6, "width": 256, "heads": 4, "seq_len": 64,
          "vocab_size": 2048, "batch_size": 2}
MODELS: dict[str, Case] = {
    "llama": Case(_LLAMA, "model.layers"),
    "gpt": Case({"name": "gpt", "size": "tiny", "depth": 8, "width": 128, "seq_len": 64,
                 "batch_size": 2}, "blocks"),
    # What most FSDP2 runs train with: parameters gathered in bf16, gradients reduced in fp32.
    "llama-bf16": Case(_LLAMA, "model.layers", mixed_precision=True, segments=False),
    # A head whose logits set the floor (8192 x 512 tokens), so a chunked head has budgets
    # of its own.
    "llama-vocab": Case({**_LLAMA, "seq_len": 256, "vocab_size": 8192}, "model.layers",
                        segments=False),
}
SEGMENT_OPTIONS = ("keep", "checkpoint")
NO_CHUNKED_HEAD = (
    "No plan with the head chunked: no model here had a budget that only a chunked head "
    "meets (remat's GPT computes no loss of its own from `labels`, so its head is not "
    "measured; a model opts in with `remat.head_loss`).")
# Where the head is chunked: between its smallest feasible peak and the head as written's.
CHUNKED_FRACTIONS = (0.0, 0.25, 0.5, 0.75)
# The segments table also at a batch where activations, not the AdamW step, set the peak.
ACTIVATION_HEAVY = {"batch_size": 8, "seq_len": 256}


@dataclasses.dataclass(frozen=True)
class Row:
    """One plan: its budget and prediction, and every rank's measured runs."""

    model: str
    ranks: int
    reshard: bool | None  # reshard_after_forward; None: FSDP2's default
    head: str
    budget: int
    predicted: int
    runs: tuple[int, ...]  # every run on every rank, live bytes
    allocator_runs: tuple[int, ...]  # the same runs, the allocator's view
    plan: str = ""  # the plan's summary (its options per unit)

    @property
    def worst(self) -> int:
        return max(self.runs)

    @property
    def least(self) -> int:
        return min(self.runs)

    @property
    def allocator_worst(self) -> int:
        return max(self.allocator_runs)

    @property
    def allocator_least(self) -> int:
        return min(self.allocator_runs)

    @property
    def allocator_spread(self) -> float:
        """How much one plan's step varied as the allocator saw it, % of the worst run."""
        return 100 * (self.allocator_worst - self.allocator_least) / self.allocator_worst


# --------------------------------------------------------------------------- the ranks
def _blocks(model: torch.nn.Module, path: str) -> torch.nn.Module:
    for attr in path.split("."):
        model = getattr(model, attr)
    return model


def _build(name: str, seed: int, **overrides: Any) -> tuple[torch.nn.Module, Any]:
    from remat.models import build

    ref = build(**{**MODELS[name].build, **overrides}, dropout=0.0, seed=seed)
    return ref.model, ref.batch


def _sharded(name: str, rank: int, reshard: bool | None) -> tuple[torch.nn.Module, Any]:
    """The model with the same weights on every rank, sharded; this rank's own batch."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    case = MODELS[name]
    model, _ = _build(name, 0)
    _, batch = _build(name, rank)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if case.mixed_precision else MixedPrecisionPolicy()
    for block in _blocks(model, case.blocks):
        fully_shard(block, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)
    return model, batch


def _floor(prof: Any, head: str) -> int:
    """The smallest feasible peak of ``prof`` with ``head``."""
    import remat
    from remat import InfeasibleBudgetError

    try:
        remat.solve(prof, 1, head=head)
    except InfeasibleBudgetError as err:
        return err.min_feasible_bytes
    raise AssertionError("a budget of 1 byte should be infeasible")


def _budgets(prof: Any, head: str) -> list[int]:
    """With the head as written: from the smallest feasible peak to no checkpointing. With
    the head chunked: the budgets only a chunked head meets, from its smallest feasible
    peak up to (not at) the head as written's; none where chunking lowers no peak."""
    import remat

    floor = _floor(prof, head)
    if head == "none":
        keep = remat.solve(prof, None, head=head).record.predicted_peak_bytes
        return [int(floor + f * (keep - floor)) for f in FRACTIONS]
    written = _floor(prof, "none")
    return [int(floor + f * (written - floor)) for f in CHUNKED_FRACTIONS] \
        if floor < written else []


def _runs(model: torch.nn.Module, batch: Any, opt: torch.optim.Optimizer,
          runs: int) -> tuple[list[int], list[int]]:
    """``runs`` measurements of the training step, each the peak of two steps: by live
    tensor bytes (resident included) and as the allocator saw it
    (:func:`remat.integrations.fsdp.measure_rank_step`)."""
    from remat.integrations.fsdp import measure_rank_step
    from remat.measurement import SimulatedDevice, resident_bytes

    live, allocator = [], []
    for _ in range(runs):
        with SimulatedDevice(None, resident_bytes=resident_bytes(model, opt)) as device:
            allocator.append(measure_rank_step(model, batch, optimizer=opt, loop=_loop(),
                                               warmup=0))
        live.append(device.peak_bytes)
    return live, allocator


def _loop() -> Any:
    """The loop measured and planned: the step drops the model's output before backward
    (``model(**batch).loss.backward()``), which also lets remat measure a chunked head."""
    import remat

    return remat.Loop(keep_output=False)


def _rank_rows(rank: int, world: int, name: str, reshard: bool | None, runs: int
               ) -> list[Row]:
    """Every plan of one model and ``reshard_after_forward`` setting, measured."""
    import remat

    model, batch = _sharded(name, rank, reshard)
    opt = torch.optim.AdamW(model.parameters())
    _runs(model, batch, opt, 1)  # the optimizer's state exists, as in training
    prof = remat.profile(model, batch, optimizer=opt, loop=_loop())
    heads = ["none"] + (["chunked"] if prof.head is not None else [])
    rows = []
    for head in heads:
        for budget in _budgets(prof, head):
            plan = remat.solve(prof, budget, head=head)
            remat.apply_plan(model, plan)
            _runs(model, batch, opt, 1)  # one step under the plan before the measured ones
            mine = _runs(model, batch, opt, runs)
            remat.remove_plan(model)
            every: list[Any] = [None] * world
            dist.all_gather_object(every, mine)
            rows.append(Row(name, world, reshard, "chunked" if plan.head else "as written",
                            budget, plan.record.predicted_peak_bytes,
                            tuple(itertools.chain.from_iterable(e[0] for e in every)),
                            tuple(itertools.chain.from_iterable(e[1] for e in every)),
                            plan.summary()))
    return rows


def _all_rows(rank: int, world: int, runs: int) -> list[Row]:
    """Every model's rows on this rank (rank 0's are handed back)."""
    return [row for name in MODELS for reshard in RESHARD
            for row in _rank_rows(rank, world, name, reshard, runs)]


def measure_ranks(world: int, runs: int) -> list[Row]:
    """Spawn ``world`` gloo ranks; rank 0 hands back every row."""
    return on_gloo_ranks(_all_rows, world, runs)


# --------------------------------------------------------------------------- unsharded
def unsharded_peak(name: str) -> int:
    """The unsharded model's step without checkpointing, AdamW included (one process)."""
    import remat

    model, batch = _build(name, 0)
    opt = torch.optim.AdamW(model.parameters())
    prof = remat.profile(model, batch, optimizer=opt, options=SEGMENT_OPTIONS, head="none",
                         loop=_loop())
    return remat.solve(prof, None).record.predicted_peak_bytes


def segment_rows(name: str, overrides: dict[str, Any]) -> list[list[object]]:
    """On the unsharded profile: the optimal plan's predicted time with multi-unit
    segments and with per-unit options only, at 4 budgets (see the module docstring)."""
    import remat
    from remat import InfeasibleBudgetError, simulate

    model, batch = _build(name, 0, **overrides)
    opt = torch.optim.AdamW(model.parameters())
    prof = remat.profile(model, batch, optimizer=opt, options=SEGMENT_OPTIONS, head="none",
                         loop=_loop())
    config = "as above" if not overrides else ", ".join(f"{k} {v}" for k, v in overrides.items())
    names = tuple(u.name for u in prof.units)
    per_unit = [simulate(prof, remat.Plan(names, combo))
                for combo in itertools.product(SEGMENT_OPTIONS, repeat=len(names))]
    budgets = _budgets(prof, "none")
    keep_ms = simulate(prof, remat.Plan.keep_all(names)).time_ms
    rows = []
    for budget in sorted(set(budgets)):  # a peak set outside the units: one budget
        try:
            plan = remat.solve(prof, budget, head="none")
        except InfeasibleBudgetError:
            continue
        fits = [s.time_ms for s in per_unit if s.peak_bytes <= budget]
        alone = min(fits) if fits else None
        seg_ms = plan.record.predicted_time_ms
        rows.append([name, config, f"{budget / 2**20:.2f}", f"{seg_ms / keep_ms:.3f}",
                     len(plan.segments),
                     "infeasible" if alone is None else f"{alone / keep_ms:.3f}",
                     "-" if alone is None else f"{100 * (alone / seg_ms - 1):+.1f}%"])
    return rows


# --------------------------------------------------------------------------- the report
def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def table_rows(rows: Sequence[Row]) -> list[list[object]]:
    return [[r.model, r.ranks, "None (default)" if r.reshard is None else r.reshard, r.head,
             _mib(r.budget), r.plan, _mib(r.predicted),
             _mib(r.worst), _mib(r.least), f"{100 * (r.worst - r.least) / r.worst:.1f}",
             f"{100 * (r.predicted - r.worst) / r.worst:+.1f}",
             "yes" if max(r.worst, r.allocator_worst) <= r.budget else "**no**",
             _mib(r.allocator_worst), _mib(r.allocator_least), f"{r.allocator_spread:.1f}",
             f"{100 * (r.predicted - r.allocator_worst) / r.allocator_worst:+.1f}"]
            for r in rows]


def report(rows: Sequence[Row], unsharded: dict[str, int], segments: list[list[str]],
           command: str, started: dt.datetime, seconds: float, runs: int) -> str:
    over = [100 * (r.predicted - r.worst) / r.worst for r in rows]
    spread = [100 * (r.worst - r.least) / r.worst for r in rows]
    which = max((r for r in rows if r.model in unsharded),
                key=lambda r: unsharded[r.model] / r.budget)  # rows may tie
    ratio = unsharded[which.model] / which.budget
    over_allocator = [100 * (r.predicted - r.allocator_worst) / r.allocator_worst for r in rows]
    below = [r for r in rows if r.predicted < max(r.worst, r.allocator_worst)]
    lines = [
        "# FSDP2: per-rank predictions against measured sharded steps",
        "",
        f"Run {started:%Y-%m-%d %H:%M} UTC on {machine_line(threads=1)}, {rows[0].ranks} "
        f"gloo ranks (1 thread each); {seconds / 60:.1f} min. Command: `{command}`.",
        "",
        "Every rank calls `remat.profile` on its `fully_shard`-ed model (each block, then "
        "the root, with `reshard_after_forward` True, False or None: FSDP2's default, the "
        "blocks reshard after their forward and the root does not; the worst rank's "
        "step, the same profile on every rank), plans 4 per-rank budgets from the smallest "
        "feasible peak to no checkpointing, applies each plan and runs its training step "
        f"{runs} times (AdamW, the output dropped before backward: "
        "`Loop(keep_output=False)`). Measured: each run is two training steps, their peak "
        "by live tensor bytes (everything the step holds on the rank, its shards included) "
        "and as the allocator saw it (`remat.integrations.fsdp.measure_rank_step`); worst "
        "and min over every run of every rank. Models: " + "; ".join(
            f"{n} ({case.describe()})" for n, case in MODELS.items()) + ".",
        "",
        *markdown_table(
            ["model", "ranks", "reshard", "head", "budget MiB", "plan", "predicted MiB",
             "measured worst-run MiB", "min run MiB", "spread %",
             "(predicted - worst)/worst %", "fits budget", "allocator worst-run MiB",
             "allocator min run MiB", "allocator spread %",
             "(predicted - allocator worst)/allocator worst %"],
            table_rows(rows)),
        "",
        f"Predicted - worst: {min(over):+.1f}% to {max(over):+.1f}% of the live bytes, "
        f"{min(over_allocator):+.1f}% to {max(over_allocator):+.1f}% of the allocator's "
        f"view; run-to-run spread {min(spread):.1f}% to {max(spread):.1f}% of the live "
        f"bytes, {min(r.allocator_spread for r in rows):.1f}% to "
        f"{max(r.allocator_spread for r in rows):.1f}% of the allocator's view (one plan's "
        "step, (worst - min) / worst over every run of every rank). "
        + ("The prediction was below the worst run nowhere." if not below else
           f"**The prediction was below the worst run in {len(below)} of {len(rows)} "
           "plans** (see the rows with a negative figure)."),
        "",
        *([] if any(r.head == "chunked" for r in rows) else [NO_CHUNKED_HEAD, ""]),
        f"Largest ratio planned, unsharded step peak / per-rank budget: **{ratio:.2f}** "
        f"({which.model}: unsharded step without checkpointing {_mib(unsharded[which.model])} "
        f"MiB, one process, AdamW; per-rank budget {_mib(which.budget)} MiB on "
        f"{which.ranks} ranks).",
        "",
        "## Segments across units: what per-unit options cost",
        "",
        "FSDP2's per-block hooks (all-gather before a block's forward, reshard after it, "
        "and again around its backward) run inside any checkpoint that spans two blocks, "
        "so on this route plans use per-unit options only. On the unsharded profile "
        f"(options {', '.join(SEGMENT_OPTIONS)}), the optimal plan with multi-unit "
        "segments against the best plan of per-unit options, at 4 budgets from the "
        "smallest feasible peak (with segments) to no checkpointing; step time predicted, "
        "relative to no checkpointing (pure solver).",
        "",
        *markdown_table(["model", "batch", "budget MiB", "with segments (time / keep)",
                         "segments",
                         "per-unit only (time / keep)", "per-unit slower by"], segments),
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, choices=(2, 4), default=2)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started, t0 = dt.datetime.now(dt.UTC), time.perf_counter()
    rows = measure_ranks(args.ranks, args.runs)
    # A mixed-precision case's unsharded step would be another step (fp32 here): no ratio.
    unsharded = {name: unsharded_peak(name) for name, case in MODELS.items()
                 if not case.mixed_precision}
    segments = [row for overrides in ({}, ACTIVATION_HEAVY)
                for name, case in MODELS.items() if case.segments
                for row in segment_rows(name, overrides)]
    command = "python benchmarks/fsdp.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write_result(RESULTS / "fsdp.md", report(rows, unsharded, segments, command.strip(),
                                             started, time.perf_counter() - t0, args.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

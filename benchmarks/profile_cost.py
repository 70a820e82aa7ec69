"""What ``remat.profile()`` costs, in plain training steps of the same model.

For each reference model (the "small" presets): the median time of a plain
training step (forward + backward, no optimizer, no meter, no hooks, after one
warm-up step), the wall time of ``remat.profile()`` with its defaults, and their
ratio. The first ``profile()`` call of each model is discarded (it pays one-off
costs: lazy imports, kernel selection, allocator growth); the figure is the
median of the ``--runs`` calls after it, each preceded by its own plain steps so
that slow drifts of the machine hit both. The phase column is the time each of
profile()'s phases took in the last timed call (``Progress.durations()``, logged
at debug level), per-unit phases summed, in steps.

Prints a markdown table and writes it to benchmarks/results/profile_cost.md.

    .venv/bin/python benchmarks/profile_cost.py [--models mlp gpt] [--runs 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see peers.py

import torch  # noqa: E402
from _common import RESULTS, machine_line, markdown_table, write_result  # noqa: E402

import remat  # noqa: E402
from remat import models  # noqa: E402
from remat.measurement.runner import model_device  # noqa: E402
from remat.measurement.state import clear_grads  # noqa: E402
from remat.measurement.timing import Stopwatch  # noqa: E402


class _PhaseLog(logging.Handler):
    """Keeps the phase durations that profile() logs at debug level."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.phases: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        # A single mapping argument becomes record.args itself (logging's rule).
        if str(record.msg).startswith("profile phases") and isinstance(record.args, dict):
            self.phases = dict(record.args)


def plain_step_ms(ref: models.ReferenceModel, warmup: int, repeats: int) -> float:
    """Median wall time of a plain training step (grads cleared first, after ``warmup``
    untimed ones), in milliseconds."""
    times = []
    params = list(ref.model.parameters())
    watch = Stopwatch(model_device(ref.model))
    for r in range(warmup + repeats):
        clear_grads(params)
        _, ms = watch.time(ref.step)
        if r >= warmup:
            times.append(ms)
    clear_grads(params)
    return statistics.median(times)


def phase_summary(phases: dict[str, float], step_s: float) -> str:
    """``baseline step 1.2 · step time 3.0 · units 2.5 · ...`` (in steps): per-unit
    phases (``unit NAME``) summed as ``units``."""
    groups: dict[str, float] = {}
    for label, seconds in phases.items():
        key = "units" if label.startswith("unit ") else label
        groups[key] = groups.get(key, 0.0) + seconds
    return " · ".join(f"{k} {v / step_s:.1f}" for k, v in groups.items())


def row_for(name: str, runs: int, repeats: int, phase_log: _PhaseLog) -> dict[str, str]:
    """Plain steps and profile() calls of ``name``, alternating: one row of cells."""
    ref = models.build(name, size="small", seed=0)
    remat.profile(ref.model, ref.batch, loss_fn=ref.loss_fn, progress=False)  # discarded
    # Plain steps and profile() calls alternate, so slow drifts of the machine hit both.
    steps, walls, profile = [], [], None
    for _ in range(runs):
        steps.append(plain_step_ms(ref, warmup=1, repeats=repeats))
        t0 = time.perf_counter()
        profile = remat.profile(ref.model, ref.batch, loss_fn=ref.loss_fn, progress=False)
        walls.append(time.perf_counter() - t0)
    step_ms = statistics.median(steps)
    wall_s = statistics.median(walls)
    assert profile is not None
    row = {
        "model": name,
        "units": str(profile.n),
        "step ms": f"{step_ms:.0f}",
        "profile step_ms": f"{profile.step_ms:.0f}",
        "profile s": f"{wall_s:.2f}",
        "profile / step": f"{wall_s * 1e3 / step_ms:.1f}",
        "phases (steps)": phase_summary(phase_log.phases, step_ms / 1e3),
    }
    print(" | ".join(row.values()), flush=True)
    return row


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "gpt", "hf-gpt2"])
    parser.add_argument("--runs", type=int, default=3, help="timed profile() calls per model")
    parser.add_argument("--repeats", type=int, default=5, help="timed plain steps per model")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "profile_cost.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    phase_log = _PhaseLog()
    logger = logging.getLogger("remat")
    level = logger.level
    logger.addHandler(phase_log)
    logger.setLevel(logging.DEBUG)
    start = time.perf_counter()
    try:
        rows = [row_for(name, args.runs, args.repeats, phase_log) for name in args.models]
    finally:
        logger.removeHandler(phase_log)
        logger.setLevel(level)
    header = (
        "# Profile cost\n\n"
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; machine: "
        f"{machine_line(args.threads)}\n"
        f"- command: `.venv/bin/python benchmarks/profile_cost.py --runs {args.runs} "
        f"--repeats {args.repeats}` ({time.perf_counter() - start:.0f} s)\n"
        "- step ms: median of plain training steps (forward + backward, no optimizer) after one "
        "warm-up step; profile s: median wall time of `remat.profile()` with its defaults "
        "(warmup=1, repeats=3), after one discarded call (one-off costs not counted); "
        "plain steps and profile() calls alternate, `--runs` of each; "
        "profile step_ms: the step time the last profile reports\n"
        "- phases: time of each of profile()'s phases in the last call, in steps "
        "(`units`: all per-unit phases: metered and timed replays)\n"
    )
    table = markdown_table(list(rows[0]), [list(r.values()) for r in rows])
    write_result(args.out, "\n".join([header, *table]) + "\n")


if __name__ == "__main__":
    main()

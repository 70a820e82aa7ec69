"""What running recomputed regions without autocast's weight cache saves.

Under ``torch.autocast`` every weight a forward uses is cast once and the cast is
cached until the outermost autocast region ends. remat runs checkpointed units
without that cache (:func:`remat.execute.options.autocast_without_cache`), so the
casts of a checkpointed unit die with the op that used them. This script measures
what that is worth: for each model, in a bf16 autocast loop, the plan at the
smallest feasible peak, at the model's "small" batch and at batch 1 (where the
weights, and so their casts, weigh most against the activations), is applied to a
fresh copy and its step measured twice,
once as remat runs it and once with the weight cache kept in checkpointed units
(the context manager replaced by a no-op). Both instruments are reported: the
dispatch-level meter and the allocator's view.

Prints a markdown table and writes it to benchmarks/results/autocast_cache.md.

    .venv/bin/python benchmarks/autocast_cache.py [--models gpt hf-gpt2 hf-llama]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as dt
import os
from collections.abc import Iterator

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see peers_run.py

import torch  # noqa: E402
from _common import RESULTS, machine_line, markdown_table, write_result  # noqa: E402

import remat  # noqa: E402
import remat.execute.options as runtime_options  # noqa: E402
import remat.runtime.segments as runtime_segments  # noqa: E402
from remat import models  # noqa: E402
from remat.core import mib  # noqa: E402
from remat.solver import min_peak_bytes  # noqa: E402

LOOP = remat.Loop(autocast="bfloat16")


@contextlib.contextmanager
def _weight_cache_kept() -> Iterator[None]:
    """Checkpointed units run under the caller's autocast, weight cache included."""
    homes = (runtime_options, runtime_segments)
    saved = [home.autocast_without_cache for home in homes]
    for home in homes:
        home.autocast_without_cache = contextlib.nullcontext
    try:
        yield
    finally:
        for home, original in zip(homes, saved, strict=True):
            home.autocast_without_cache = original


def _measure(ref: models.ReferenceModel, plan: remat.Plan) -> tuple[int, int]:
    model = copy.deepcopy(ref.model)
    remat.apply_plan(model, plan)
    step = remat.measure(model, ref.batch, loss_fn=ref.loss_fn, loop=LOOP)
    return step.peak_bytes, step.allocator_peak_bytes or 0


def row(name: str, batch_size: int | None) -> list[object]:
    overrides = {} if batch_size is None else {"batch_size": batch_size}
    ref = models.build(name, size="small", seed=0, **overrides)
    profile = remat.profile(ref.model, ref.batch, loss_fn=ref.loss_fn, loop=LOOP)
    plan = remat.solve(ref.model, ref.batch, min_peak_bytes(profile), loss_fn=ref.loss_fn,
                       loop=LOOP, verify=False, units=[u.name for u in profile.units])
    fixed_dispatch, fixed_allocator = _measure(ref, plan)
    with _weight_cache_kept():
        cached_dispatch, cached_allocator = _measure(ref, plan)
    return [
        name, models.config_for(name, size="small", **overrides).batch_size,
        plan.summary(), mib(plan.record.predicted_peak_bytes, 2),
        f"{mib(fixed_dispatch, 2)} / {mib(fixed_allocator, 2)}",
        f"{mib(cached_dispatch, 2)} / {mib(cached_allocator, 2)}",
        f"{100 * (1 - fixed_allocator / cached_allocator):.1f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "hf-gpt2", "hf-llama"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [row(name, batch) for name in args.models for batch in (None, 1)]
    header = ["model", "batch", "plan at the smallest feasible peak", "predicted MiB",
              "remat (no cache in recomputed units): dispatch / allocator MiB",
              "weight cache kept: dispatch / allocator MiB", "saved %"]
    lines = [
        "# Recomputed units without autocast's weight cache",
        "",
        f"- date: {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}",
        f"- machine: {machine_line(threads=1)}",
        "- loop: bf16 autocast (`remat.Loop(autocast='bfloat16')`), \"small\" reference models",
        "- command: `.venv/bin/python benchmarks/autocast_cache.py`",
        "",
        *markdown_table(header, rows, ["---", "---:", "---", "---:", "---:", "---:", "---:"]),
        "",
    ]
    write_result(RESULTS / "autocast_cache.md", "\n".join(lines))


if __name__ == "__main__":
    main()

"""What default discovery covers, before (the longest uniform list) and after (issue 13).

For the layouts of ``tests/zoo.py`` (ResNet-50/18, ConvNeXt, Hugging Face T5,
EfficientNet, U-Net, ViT, at their test sizes) and the reference models (``small``
presets): the units each discovery finds, the share of the step's activation memory
they hold (``Profile.coverage``), whether they are a chain, and the smallest peak any
plan of them reaches (``remat.solver.min_peak_bytes``, everything included:
parameters, gradients, activations).

Prints a markdown table and writes it to benchmarks/results/coverage.md.

    .venv/bin/python benchmarks/coverage.py [--models resnet50 cnn]
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see peers.py

import torch  # noqa: E402
from _common import RESULTS, machine_line, markdown_table, write_result  # noqa: E402

from remat import models  # noqa: E402
from remat.core import format_bytes  # noqa: E402
from remat.profiler import (
    longest_list,  # noqa: E402
    profile,  # noqa: E402
)
from remat.solver import min_peak_bytes  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import zoo  # noqa: E402

REFERENCE = ["mlp", "cnn", "gpt", "hf-gpt2"]
FAST = {"repeats": 1, "warmup": 0, "progress": False}  # bytes do not depend on timing


def _model(name: str) -> tuple[Any, Any, Any, list[str]]:
    """(model, batch, loss_fn, the longest list's unit names)."""
    if name in zoo.ZOO:
        z = zoo.build(name)
        return z.model, z.batch, z.loss_fn, z.longest_list
    ref = models.build(name, size="small")
    return ref.model, ref.batch, ref.loss_fn, [n for n, _ in longest_list(ref.model)]


def _row(name: str) -> list[object]:
    model, batch, loss_fn, longest = _model(name)
    before = profile(model, batch, loss_fn=loss_fn, units=longest, **FAST)
    after = profile(model, batch, loss_fn=loss_fn, **FAST)
    low_before, low_after = min_peak_bytes(before), min_peak_bytes(after)
    joined = after.meta.get("joined_units", {})
    return [
        name,
        f"{before.n} ({before.units[0].name} ..)",
        f"{before.coverage:.0%}",
        format_bytes(low_before),
        f"{after.n}" + (f" (+{', '.join(joined)})" if joined else ""),
        f"{after.coverage:.0%}",
        "yes" if after.is_chain else "no",
        format_bytes(low_after),
        f"{100 * (low_after / low_before - 1):+.1f}%",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[*zoo.ZOO, *REFERENCE])
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    rows = [_row(name) for name in args.models]
    header = ["model", "before: units", "coverage", "min peak", "after: units (joined)",
              "coverage", "chain", "min peak", "change"]
    lines = [
        "# Coverage of default unit discovery",
        "",
        f"{dt.date.today()}, {machine_line(1)}. `python benchmarks/coverage.py`.",
        "",
        "Before: the longest uniform `ModuleList`/`Sequential` (discovery until issue 13). "
        "After: the measured discovery (`remat.profiler.find_units`). Coverage: the share "
        "of the step's activation memory (bytes saved for backward) the units hold. "
        "Min peak: `remat.solver.min_peak_bytes`, the smallest peak any plan reaches, "
        "parameters and gradients included.",
        "",
        *markdown_table(header, rows, ["---", "---", "---:", "---:", "---", "---:", "---",
                                       "---:", "---:"]),
        "",
    ]
    write_result(RESULTS / "coverage.md", "\n".join(lines))


if __name__ == "__main__":
    main()

"""The GPU session's scripts, run on the CPU (``--smoke``): a lent device's 30 minutes
must not go into finding that a script has rotted. They also check, on tiny Hugging Face
configs, what they will measure there: predictions within 1% of the measured peak, and
a model planned under a device cap its unplanned step does not fit."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, f"benchmarks/{script}", "--smoke", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _rows(text: str, first_cell: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith(f"| {first_cell}")]


def test_gpu_predictions_smoke() -> None:
    out = _run("gpu_predictions.py", "--models", "llama-1b", "--repeats", "1")
    rows = _rows(out, "llama-1b (")
    assert len(rows) == 5  # five budgets
    errors = [float(r[5]) for r in rows]  # err % (alloc)
    assert all(-1.0 <= e <= 1.0 for e in errors), errors
    (capped,) = _rows(out, "llama-1b |")
    assert "out of memory" in capped  # the unplanned step does not fit the cap
    assert any(cell.startswith("trained: loss") for cell in capped), capped
    cap = float(capped[1])
    peak = float(capped[-1].split("/")[0])
    assert peak <= cap


def test_gpu_peers_smoke() -> None:
    out = _run("gpu_peers.py", "--repeats", "1", "--compile-budgets")
    rows = _rows(out, "gpt2 (")
    peers = [r[1] for r in rows]
    assert peers[:2] == ["no checkpointing", "HF checkpointing, every layer"]
    assert any(p.startswith("save_on_cpu") for p in peers)
    by_peer = {r[1]: r for r in rows}
    hf = by_peer["HF checkpointing, every layer"]
    # remat solved for HF's measured peak fits it (within the 0.1 MiB of the rounding)
    assert float(hf[6]) <= float(hf[2]) + 0.1
    assert re.fullmatch(r"\d+\.\d\d", hf[9])

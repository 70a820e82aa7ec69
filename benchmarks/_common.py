"""What the benchmark scripts share: where results go, the machine line, markdown tables.

Bytes are formatted by :mod:`remat.core.bytesize`, models called by
:func:`remat.measurement.runner.call_model`: the scripts import those, not copies.
Each script still sets ``OMP_WAIT_POLICY`` itself, before it imports torch (see
``peers_run.py`` for why); importing this module imports no torch.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine_line(threads: int | None = None) -> str:
    """``x86_64, 2 cores, torch 2.13.0+cpu (1 thread), no GPU, Python 3.11.7``; torch and
    the GPU only when the script imported torch."""
    parts = [f"{platform.machine()}, {os.cpu_count()} cores"]
    torch = sys.modules.get("torch")
    if torch is not None:
        used = "" if threads is None else f" ({threads} thread{'s' if threads != 1 else ''})"
        parts.append(f"torch {torch.__version__}{used}")
        parts.append(f"CUDA {torch.cuda.get_device_name()}" if torch.cuda.is_available()
                     else "no GPU")
    parts.append(f"Python {platform.python_version()}")
    return ", ".join(parts)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]],
                   align: str | Sequence[str] = "---") -> list[str]:
    """The lines of a markdown table; ``align`` is one rule for every column
    (``"---"``, ``"---:"``) or one per column."""
    rules = [align] * len(header) if isinstance(align, str) else list(align)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rules) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def write_result(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (folders created) and print it: the scripts report on stdout."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)

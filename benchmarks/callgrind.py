"""CPU instructions per training step, counted by callgrind: a figure load does not move.

On a shared two-core machine one step's time varies by 10% or more from round to round,
so a median over 25 ABAB rounds still moves by about 1% from run to run: too coarse to
tell whether what remat adds around a unit costs more than the peer's own bookkeeping.
Instructions executed are the same from run to run (within about 0.1% here), so
:func:`count_steps` runs the steps under ``valgrind --tool=callgrind`` in a child
process and counts only them: a tiny C library (built here with ``gcc``, from
``valgrind/callgrind.h``) starts the instrumentation before the counted steps and dumps
the count after them, so the import of torch and the warm-up steps run uncounted.

The price: callgrind runs the counted code about 50x slower than natively, so it counts
small models (a step of a few milliseconds); and instructions are not time (a cache
miss costs more than an add), so this is a figure of overhead, beside the timed one.
Where valgrind, gcc or the header is missing, :func:`available` says why and the
caller reports that nothing was counted.

Child: ``python benchmarks/callgrind.py SPEC.json`` under valgrind, SPEC naming the
model and the configurations (see :func:`_child`).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_SOURCE = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void cg_stop(const char *name) { CALLGRIND_DUMP_STATS_AT(name); CALLGRIND_STOP_INSTRUMENTATION; }
"""
_HEADER = Path("/usr/include/valgrind/callgrind.h")
WARMUP = 3  # uncounted steps before each count (the first ones allocate and cache)
STEPS = 3  # counted steps per count
REPEATS = 3  # counts per configuration, in ABAB order; the median is reported


def available() -> str | None:
    """``None`` where instructions can be counted here, else why not."""
    missing = [tool for tool in ("valgrind", "gcc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed"
    if not _HEADER.exists():
        return f"{_HEADER} not found (valgrind's development header)"
    return None


def _build(directory: Path) -> Path:
    source, library = directory / "cg.c", directory / "libcg.so"
    source.write_text(_SOURCE)
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(library), str(source)],
                   check=True)
    return library


def count_steps(spec: dict[str, Any], names: Sequence[str]) -> dict[str, int]:
    """Instructions per step of each configuration in ``names`` (the median of
    :data:`REPEATS` counts of :data:`STEPS` steps), run by the child on ``spec``."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        library = _build(directory)
        spec_path = directory / "spec.json"
        spec_path.write_text(json.dumps({**spec, "library": str(library),
                                         "names": list(names)}))
        out = directory / "callgrind.out"
        env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        run = subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                              f"--callgrind-out-file={out}", sys.executable, __file__,
                              str(spec_path)], env=env, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"the counting child failed ({run.returncode}):\n"
                               + "\n".join(run.stderr.splitlines()[-15:]))
        counts: dict[str, list[int]] = {name: [] for name in names}
        for dump in directory.glob("callgrind.out.*"):
            text = dump.read_text(errors="replace")
            trigger = re.search(r"^desc: Trigger: Client Request: (.+)$", text, re.M)
            total = re.search(r"^totals: (\d+)$", text, re.M)
            if trigger and total:
                counts[trigger.group(1).split("#")[0]].append(int(total.group(1)))
    if any(len(c) != REPEATS for c in counts.values()):
        raise RuntimeError(f"callgrind dumps missing: {({n: len(c) for n, c in counts.items()})}")
    return {name: round(statistics.median(c) / STEPS) for name, c in counts.items()}


def _child(spec_path: str) -> None:
    """Build the model and each configuration of the spec, then count their steps."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    import overhead  # the models and the step are the timed benchmark's own

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    lib = ctypes.CDLL(spec["library"])
    lib.cg_stop.argtypes = [ctypes.c_char_p]
    models, batch = overhead.instruction_configs(spec)
    names = spec["names"]
    for r in range(REPEATS):
        for name in names if r % 2 == 0 else names[::-1]:
            model = models[name]
            for _ in range(WARMUP):
                overhead.step(model, batch, overhead.conv_loss)
            lib.cg_start()
            for _ in range(STEPS):
                overhead.step(model, batch, overhead.conv_loss)
            lib.cg_stop(f"{name}#{r}".encode())


if __name__ == "__main__":
    _child(sys.argv[1])
